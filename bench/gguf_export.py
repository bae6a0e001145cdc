"""GGUF export: `lmforge ckpt convert --to gguf` vs llama.cpp's own `convert_hf_to_gguf.py`.

Sides: `llama.cpp` (its converter), `lmforge` (the CLI command a user runs; it also stages the
output, writes a sha256 manifest of it and fsyncs, for `ckpt verify`), `core` (lmforge's converter
function alone: the same work as llama.cpp's script). Same input: a randomly initialised Llama (bf16 safetensors, untied head) built from a config,
with a byte-level BPE tokenizer trained by lmforge on a built-in corpus. Same output type on
both sides (--dtype / --outtype f16 and q8_0). Each conversion runs as its own command in a fresh
spawned child; the figures are that command's wall time and peak RSS (ru_maxrss of the child's
only child). The input is built in a spawned child too, so no parent's peak is counted. Runs alternate.

llama.cpp's converter ships in the llama-cpp-python sdist:

    .venv/bin/pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d /tmp/sdist
    tar xzf /tmp/sdist/llama_cpp_python-0.3.36.tar.gz -C /tmp/sdist
    .venv/bin/python bench/gguf_export.py --llama-cpp /tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp

It uses the gguf-py package from its own tree and needs `sentencepiece` importable (it imports
it for every Llama); put it on PYTHONPATH (`pip install --target DIR sentencepiece`) or in the venv. It refuses lmforge's tokenizer as shipped (its
pre-tokenizer is recognised by hashing the token ids of a test string against a table of known
hub models), so the run patches that one lookup to "gpt-2", the name lmforge writes for the same
GPT-2 split; nothing on the weights path is touched.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sft_prepare import measure

# Runs llama.cpp's converter with its pre-tokenizer hash lookup answered (see the docstring).
LLAMA_CPP_WRAPPER = """
import runpy, sys
from pathlib import Path
script = sys.argv[1]
sys.argv = [script, *sys.argv[2:]]
root = Path(script).parent
sys.path[:0] = [str(root / "gguf-py"), str(root)]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
runpy.run_path(script, run_name="__main__")
"""


def run_command(argv: list[str], queue) -> None:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"{argv[:4]} failed:\n{done.stderr[-3000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    queue.put({"seconds": seconds, "peak_rss_mib": peak})


def make_model(root: str, hidden: int, layers: int, vocab: int, queue) -> None:  # type: ignore[no-untyped-def]
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lmforge.config.schema import TokenizerTrainConfig
    from lmforge.data.corpus import builtin_names, iter_builtin_documents
    from lmforge.data.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(
        iter_builtin_documents(builtin_names()[0]),
        TokenizerTrainConfig(vocab_size=vocab, max_chars=5_000_000),
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 256,
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(Path(root) / "model", max_shard_size="500MB")
    tokenizer.save_pretrained(Path(root) / "model")
    queue.put({"parameters": sum(p.numel() for p in model.parameters()), "vocab": len(tokenizer)})


# The converter alone, without the CLI's staging directory, sha256 manifest and fsyncs.
CORE = (
    "import sys; from pathlib import Path; from lmforge.ckpt.to_gguf import convert_to_gguf; "
    "convert_to_gguf(Path(sys.argv[1]), Path(sys.argv[2]), dtype=sys.argv[3])"
)


def commands(model: Path, out: Path, outtype: str, llama_cpp: Path) -> dict[str, list[str]]:
    lmforge = [sys.executable, "-m", "lmforge.cli.main", "ckpt", "convert", str(model), "--to", "gguf"]
    reference = [
        sys.executable,
        "-c",
        LLAMA_CPP_WRAPPER,
        str(llama_cpp / "convert_hf_to_gguf.py"),
        str(model),
    ]
    return {
        "llama.cpp": [*reference, "--outtype", outtype, "--outfile", str(out / f"llama-cpp-{outtype}.gguf")],
        "lmforge": [*lmforge, "--dtype", outtype, "--out", str(out / "lmforge")],
        "core": [sys.executable, "-c", CORE, str(model), str(out / "core"), outtype],
    }


def clear(out: Path, outtype: str) -> None:
    """Earlier outputs go before a run starts, so no side pays for deleting them."""
    (out / f"llama-cpp-{outtype}.gguf").unlink(missing_ok=True)
    shutil.rmtree(out / "lmforge", ignore_errors=True)
    shutil.rmtree(out / "core", ignore_errors=True)


def same_tensors(root: Path, outtype: str) -> str:
    """How many tensors the two files hold with the same name, type and bytes."""
    import gguf
    import numpy as np

    ours = {t.name: t for t in gguf.GGUFReader(root / "lmforge" / f"model-{outtype}.gguf").tensors}
    theirs = {t.name: t for t in gguf.GGUFReader(root / f"llama-cpp-{outtype}.gguf").tensors}
    same = sum(
        name in ours
        and ours[name].tensor_type == tensor.tensor_type
        and np.array_equal(np.asarray(ours[name].data), np.asarray(tensor.data))
        for name, tensor in theirs.items()
    )
    return f"{same}/{len(theirs)} (lmforge wrote {len(ours)})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-cpp", type=Path, required=True, help="vendor/llama.cpp of the sdist")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--types", default="f16,q8_0")
    parser.add_argument("--repeats", type=int, default=2)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        made = measure(make_model, str(root), opts.hidden, opts.layers, opts.vocab)
        model = root / "model"
        size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        print(
            f"input: Llama {made['parameters'] / 1e6:.0f}M parameters, vocab {made['vocab']}, bf16 safetensors "
            f"{size / 2**20:,.0f} MiB"
        )
        for outtype in opts.types.split(","):
            runs: dict[str, list[dict]] = {"llama.cpp": [], "lmforge": [], "core": []}
            for _ in range(opts.repeats):
                for side, argv in commands(model, root, outtype, opts.llama_cpp).items():
                    clear(root, outtype)
                    runs[side].append(measure(run_command, argv))
            for side, argv in commands(model, root, outtype, opts.llama_cpp).items():
                if side != "core":  # outputs of both to compare
                    subprocess.run(argv, capture_output=True, check=True)
            sizes = {
                "llama.cpp": (root / f"llama-cpp-{outtype}.gguf").stat().st_size,
                "lmforge": (root / "lmforge" / f"model-{outtype}.gguf").stat().st_size,
            }
            sizes["core"] = sizes["lmforge"]
            medians = {}
            for side, results in runs.items():
                seconds = statistics.median(r["seconds"] for r in results)
                rss = statistics.median(r["peak_rss_mib"] for r in results)
                medians[side] = (seconds, rss)
                print(
                    f"{outtype:5} {side:9}: {seconds:6.1f} s  runs={[round(r['seconds'], 1) for r in results]}  "
                    f"peak RSS {rss:,.0f} MiB  runs={[round(r['peak_rss_mib']) for r in results]}  "
                    f"file {sizes[side] / 2**20:,.1f} MiB"
                )
            print(f"{outtype:5} tensors byte-identical: {same_tensors(root, outtype)}")
            for side in ("lmforge", "core"):
                print(
                    f"{outtype:5} {side} / llama.cpp: time {medians[side][0] / medians['llama.cpp'][0]:.2f}x, "
                    f"peak RSS {medians[side][1] / medians['llama.cpp'][1]:.2f}x (goals <= 1.0x)"
                )


if __name__ == "__main__":
    main()
