"""GGUF export: `lmforge ckpt convert --to gguf` vs llama.cpp's own `convert_hf_to_gguf.py`.

Sides: `llama.cpp` (its converter), `lmforge` (the CLI command a user runs; it also stages the
output and writes a sha256 manifest of it, for `ckpt verify`), `core` (lmforge's converter
function alone: the same work as llama.cpp's script). Same input on both sides, a randomly
initialised Llama (bf16 safetensors, untied head) built from a config, in two cases (`--cases`):

- `bpe`: 213M parameters (hidden 1024, 16 layers), one shard, a byte-level BPE tokenizer trained
  by lmforge on a built-in corpus (vocab 16,000);
- `spm`: 322M parameters (hidden 1024, 24 layers) in 200 MB shards with a Llama 2 style
  SentencePiece tokenizer: a BPE `tokenizer.model` trained here by the sentencepiece trainer on
  the built-in corpus with Llama 2's options (byte fallback, split digits, dummy prefix; vocab
  25,000), loaded by transformers' LlamaTokenizer, saved as tokenizer.json next to it (as Llama 2
  repos ship both; llama.cpp reads tokenizer.model, lmforge tokenizer.json).

Same output type on both sides (--dtype / --outtype f16 and q8_0). Each conversion runs as its
own command in a fresh spawned child; the figures are that command's wall time and peak RSS
(ru_maxrss of the child's only child). The input is built in a spawned child too, so no parent's
peak is counted. Runs alternate. Both files are compared: tensors byte for byte, and the
tokenizer's model, tokens and token types.

llama.cpp's converter ships in the llama-cpp-python sdist:

    .venv/bin/pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d /tmp/sdist
    tar xzf /tmp/sdist/llama_cpp_python-0.3.36.tar.gz -C /tmp/sdist
    .venv/bin/pip install --target /tmp/sp sentencepiece==0.2.1
    PYTHONPATH=/tmp/sp .venv/bin/python bench/gguf_export.py \
        --llama-cpp /tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp

It uses the gguf-py package from its own tree and needs `sentencepiece` importable (it imports
it for every Llama); the `spm` case trains its tokenizer with it and transformers converts that
with it. sentencepiece 0.2.1, not the newest: 0.2.3's protobuf module needs protobuf 7 and
transformers' conversion then fails against the venv's protobuf 6. llama.cpp refuses lmforge's
BPE tokenizer as shipped (its pre-tokenizer is recognised by hashing the token ids of a test
string against a table of known hub models), so the run patches that one lookup to "gpt-2", the
name lmforge writes for the same GPT-2 split; nothing on the weights path is touched, and the
SentencePiece case does not reach that lookup.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from sft_prepare import measure
from side_by_side import medians_by_side


@dataclass(frozen=True)
class Case:
    """One input model (see the module docstring)."""

    layers: int
    vocab: int
    shard: str  # save_pretrained's max_shard_size
    sentencepiece: bool  # else lmforge's byte-level BPE
    hidden: int = 1024


CASES = {
    "bpe": Case(layers=16, vocab=16000, shard="500MB", sentencepiece=False),
    "spm": Case(layers=24, vocab=25000, shard="200MB", sentencepiece=True),
}

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


def make_model(root: str, case: str, queue) -> None:  # type: ignore[no-untyped-def]
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = CASES[case]
    model_dir = Path(root) / case
    tokenizer = _spm_tokenizer(model_dir, spec.vocab) if spec.sentencepiece else _bpe_tokenizer(spec.vocab)
    torch.manual_seed(0)
    hidden = spec.hidden
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=spec.layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 256,
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(model_dir, max_shard_size=spec.shard)
    tokenizer.save_pretrained(model_dir)
    queue.put({"parameters": sum(p.numel() for p in model.parameters()), "vocab": len(tokenizer)})


def _bpe_tokenizer(vocab: int):  # type: ignore[no-untyped-def]
    from lmforge.config.schema import TokenizerTrainConfig
    from lmforge.data.corpus import builtin_names, iter_builtin_documents
    from lmforge.data.tokenizer import train_tokenizer

    return train_tokenizer(
        iter_builtin_documents(builtin_names()[0]),
        TokenizerTrainConfig(vocab_size=vocab, max_chars=5_000_000),
    )


def _spm_tokenizer(model_dir: Path, vocab: int):  # type: ignore[no-untyped-def]
    """A Llama 2 style tokenizer: a SentencePiece BPE model (byte fallback, split digits, no
    normalisation, dummy prefix; Llama 2's trainer options) trained on the built-in corpus, saved as
    tokenizer.model next to the tokenizer.json transformers converts it to, as Llama 2 repos ship."""
    import io

    import sentencepiece
    from transformers import LlamaTokenizer

    from lmforge.data.corpus import builtin_names, iter_builtin_documents

    lines = (
        line
        for doc in iter_builtin_documents(builtin_names()[0])
        for line in doc.splitlines()
        if line.strip()
    )
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=lines,
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        character_coverage=0.9995,
        input_sentence_size=200_000,
        shuffle_input_sentence=True,
        max_sentence_length=4192,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    model_dir.mkdir(parents=True)
    (model_dir / "tokenizer.model").write_bytes(model.getvalue())
    return LlamaTokenizer.from_pretrained(model_dir, add_bos_token=True)


# The converter alone, without the CLI's staging directory and sha256 manifest.
CORE = (
    "import sys; from pathlib import Path; from lmforge.export.to_gguf import convert_to_gguf; "
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


def same_vocabulary(root: Path, outtype: str) -> str:
    """Whether both files hold the same tokenizer model, tokens and token types."""
    import gguf

    def vocabulary(path: Path) -> list[object]:
        fields = gguf.GGUFReader(path).fields
        keys = ("model", "tokens", "token_type")
        return [fields[f"tokenizer.ggml.{key}"].contents() for key in keys]

    ours = vocabulary(root / "lmforge" / f"model-{outtype}.gguf")
    theirs = vocabulary(root / f"llama-cpp-{outtype}.gguf")
    same = [name for name, a, b in zip(("model", "tokens", "types"), ours, theirs, strict=True) if a == b]
    return f"same {', '.join(same) or 'nothing'} ({ours[0]}, {len(ours[1])} tokens)"  # type: ignore[arg-type]


def load_average() -> str:
    """Timings on a shared machine need the load next to them (peak RSS does not)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_case(case: str, root: Path, opts: argparse.Namespace) -> None:
    made = measure(make_model, str(root), case)
    model = root / case
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    spec = CASES[case]
    tokenizer = "SentencePiece" if spec.sentencepiece else "byte-level BPE"
    shards = len(list(model.glob("*.safetensors")))
    print(
        f"[{case}] input: Llama {made['parameters'] / 1e6:.0f}M parameters, {tokenizer} vocab {made['vocab']}, "
        f"bf16 safetensors {size / 2**20:,.0f} MiB in {shards} shard(s) of <= {spec.shard}; "
        f"load average {load_average()}"
    )
    out = root / "out"
    out.mkdir(exist_ok=True)
    for outtype in opts.types.split(","):
        runs: dict[str, list[dict]] = {"llama.cpp": [], "lmforge": [], "core": []}
        for _ in range(opts.repeats):
            for side, argv in commands(model, out, outtype, opts.llama_cpp).items():
                clear(out, outtype)
                runs[side].append(measure(run_command, argv))
        for side, argv in commands(model, out, outtype, opts.llama_cpp).items():
            if side != "core":  # outputs of both to compare
                subprocess.run(argv, capture_output=True, check=True)
        sizes = {
            "llama.cpp": (out / f"llama-cpp-{outtype}.gguf").stat().st_size,
            "lmforge": (out / "lmforge" / f"model-{outtype}.gguf").stat().st_size,
        }
        sizes["core"] = sizes["lmforge"]
        medians = medians_by_side(
            runs,
            prefix=f"[{case}] {outtype:5} ",
            notes={side: f"file {size / 2**20:,.1f} MiB" for side, size in sizes.items()},
        )
        print(f"[{case}] {outtype:5} tensors byte-identical: {same_tensors(out, outtype)}")
        print(f"[{case}] {outtype:5} tokenizer: {same_vocabulary(out, outtype)}")
        for side in ("lmforge", "core"):
            print(
                f"[{case}] {outtype:5} {side} / llama.cpp: time {medians[side][0] / medians['llama.cpp'][0]:.2f}x, "
                f"peak RSS {medians[side][1] / medians['llama.cpp'][1]:.2f}x (goals <= 1.0x)"
            )
        print(f"[{case}] {outtype:5} load average after: {load_average()}")
    shutil.rmtree(model)
    shutil.rmtree(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-cpp", type=Path, required=True, help="vendor/llama.cpp of the sdist")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--types", default="f16,q8_0")
    parser.add_argument("--repeats", type=int, default=2)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for case in opts.cases.split(","):
            run_case(case, Path(tmp), opts)


if __name__ == "__main__":
    main()
