"""The GGUF files `ckpt convert --to gguf` writes, run in llama.cpp itself (llama-cpp-python), against
the source HF model. Not in CI: llama-cpp-python compiles llama.cpp; `make test-integration` installs it.

What llama.cpp does differently from the float32 PyTorch reference, and so the tolerances
(relative: max|diff| / max|logits_src| over all positions of a chat prompt):
- f32 file: llama.cpp sums in another order; its default f16 KV cache alone moved logits by
  8e-5 to 1.1e-4 across llama, qwen2, mistral and the SentencePiece llama, so LlamaCppModel
  keeps the cache in f32 (about 3e-7) -> 1e-3 leaves room for other builds' kernels.
- q8_0 file: weights rounded as in the CI test, plus activations quantized to 8 bits for the
  q8_0 dot products -> 3e-2 (measured 7.1e-3 to 7.3e-3).
Greedy decoding (12 tokens) must give the same ids for f32; for q8_0 the first 3 must agree
(ties between near-equal logits of a random model may flip later; measured: all 12 agreed).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmforge.export.convert import convert
from lmforge.export.gguf_runtime import LlamaCppModel, greedy_decode
from tests.test_convert_gguf import CHAT, SAMPLES, TEXTS, make_spm_tokenizer, save_model

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _llama_cpp_installed() -> None:
    """`make test-integration` installs llama-cpp-python; without it these tests fail, not skip."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        pytest.fail("llama-cpp-python is not installed: run `make test-integration`, which installs it")


TOLERANCE = {"f32": 1e-3, "q8_0": 3e-2}
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def bpe_tokenizer():  # type: ignore[no-untyped-def]
    from lmforge.config.schema import TokenizerTrainConfig
    from lmforge.data.tokenizer import train_tokenizer

    return train_tokenizer(TEXTS * 50, TokenizerTrainConfig(vocab_size=300))


@pytest.fixture(scope="module")
def spm_tokenizer():  # type: ignore[no-untyped-def]
    return make_spm_tokenizer()


@pytest.fixture(scope="module")
def sources(bpe_tokenizer, spm_tokenizer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("sources")
    out = {
        "llama": save_model(bpe_tokenizer, root / "llama", "llama-tiny"),
        "qwen2": save_model(bpe_tokenizer, root / "qwen2", "qwen2-tiny"),
        "mistral": save_model(bpe_tokenizer, root / "mistral", "mistral-tiny"),
        "llama-spm": save_model(spm_tokenizer, root / "llama-spm", "llama-tiny"),
    }
    for path in out.values():  # sharper logits, so greedy picks are not near-ties
        model = AutoModelForCausalLM.from_pretrained(str(path))
        with torch.no_grad():
            model.model.norm.weight.mul_(4.0)
        model.save_pretrained(path, max_shard_size="200KB")
    return out


def prompt_ids(source: Path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    return list(
        tokenizer.apply_chat_template(CHAT[:2], tokenize=True, add_generation_prompt=True)["input_ids"]
    )


@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "llama-spm"])
def test_llama_cpp_logits_and_greedy_match_hf(
    sources: dict[str, Path], tmp_path: Path, name: str, dtype: str
) -> None:
    convert(sources[name], "gguf", tmp_path, dtype=dtype)
    runtime = LlamaCppModel(tmp_path / f"model-{dtype}.gguf")
    hf = AutoModelForCausalLM.from_pretrained(str(sources[name]), dtype=torch.float32).eval()
    ids = prompt_ids(sources[name])
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
    got = runtime.logits(ids)
    relative = float(np.abs(got - expected).max() / np.abs(expected).max())
    print(f"{name} {dtype}: logits max rel diff {relative:.2e}")
    assert relative <= TOLERANCE[dtype]
    assert (got[-1].argmax() == expected[-1].argmax()) or dtype == "q8_0"

    want = greedy_decode(hf, ids, NEW_TOKENS)
    generated = runtime.greedy(ids, NEW_TOKENS)
    same = sum(a == b for a, b in zip(generated, want, strict=True))
    print(f"{name} {dtype}: greedy {same}/{NEW_TOKENS} ids equal")
    if dtype == "f32":
        assert generated == want
    else:
        assert generated[:3] == want[:3]


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama-spm"])
def test_llama_cpp_tokenizer_matches_hf(sources: dict[str, Path], tmp_path: Path, name: str) -> None:
    convert(sources[name], "gguf", tmp_path, dtype="q8_0")
    llm = LlamaCppModel(tmp_path / "model-q8_0.gguf").llm
    tokenizer = AutoTokenizer.from_pretrained(str(sources[name]))
    prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    reference = tokenizer
    if name == "llama-spm":
        # llama.cpp tokenizes a SentencePiece vocabulary as Llama 2's "legacy" tokenizer did: the
        # dummy-prefix space goes before every text segment after a special token, not only before
        # the first (HF's Metaspace prepend_scheme "first"). No GGUF key selects HF's variant, so
        # chat prompts tokenize differently; compare with HF configured the legacy way.
        reference = copy.deepcopy(tokenizer)
        reference.backend_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            prepend_scheme="always", split=False
        )
    for text in [*SAMPLES, prompt]:
        expected = reference(text)["input_ids"]
        if name == "llama-spm" and text.startswith(" "):
            # and SentencePiece (and llama.cpp) add that space even before a space; HF does not.
            expected = [tokenizer.convert_tokens_to_ids("\u2581"), *expected]
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == expected, text
        # llama-cpp-python joins the pieces of a SentencePiece vocabulary without dropping the
        # space the leading "\u2581" stands for, which HF's Metaspace decoder drops.
        pieces = llm.detokenize(expected, special=True).decode()
        assert pieces.removeprefix(" " if name == "llama-spm" else "") == tokenizer.decode(expected), text
    assert llm.metadata["tokenizer.chat_template"] == tokenizer.chat_template
    assert llm.token_eos() == tokenizer.eos_token_id


def test_k_quants_of_a_trained_model_pass_their_gates_and_a_missed_gate_removes_the_export(
    tmp_path: Path,
) -> None:
    """An SFT run exports q4_k_m through llama.cpp's quantizer, verified in llama.cpp on the run's
    QA rows against the trained model (perplexity, top-1, task accuracy); then q2_k held to a top-1
    agreement it cannot reach is removed, its numbers in export.json."""
    import json

    import yaml

    from lmforge.config.schema import ExportConfig, TokenizerTrainConfig
    from lmforge.data.tokenizer import train_tokenizer
    from lmforge.errors import ExportVerificationFailed
    from lmforge.export.run_export import run_export
    from tests.conftest import ROOT, run_cli, save_tiny_llama

    alpaca = ROOT / "examples" / "data" / "arithmetic_alpaca.jsonl"
    tokenizer = train_tokenizer(alpaca.read_text().splitlines() * 2, TokenizerTrainConfig(vocab_size=400))
    base = save_tiny_llama(tokenizer, tmp_path / "base")
    config = {
        "run": {"name": "kq", "output_dir": str(tmp_path / "runs"), "seed": 0},
        "model": {"path": str(base)},
        "data": {"train": [{"path": str(alpaca)}], "eval": [{"path": str(alpaca)}], "max_length": 128},
        "train": {"stage": "sft", "max_steps": 30, "micro_batch_size": 8, "lr": 3e-3, "precision": "fp32"},
        "export": {"formats": ["gguf"], "gguf_dtype": "q4_k_m"},
    }
    path = tmp_path / "kq.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run_cli("train", str(path))
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "kq"
    artifact = json.loads((run / "export" / "export.json").read_text())["artifacts"]["gguf"]
    verdict = artifact["verification"]
    assert verdict["passed"], verdict["failures"]
    # Rows of 64 (SMALL_ARCH) are no multiple of the k-quant block (256): llama.cpp falls back to
    # q5_0 for those tensors, so the file is judged as 5-6 bit.
    assert verdict["runtime"] == "llama.cpp" and verdict["precision"] in ("5-6 bit", "4-bit or less")
    parity = verdict["parity"]
    assert parity["data"] == str(alpaca)  # the run's eval file, not built-in texts
    assert parity["accuracy"]["questions"] == 32 and parity["ppl_increase"] < 0.15
    assert "accuracy" in result.stdout and verdict["precision"] in result.stdout

    strict = ExportConfig(formats=["gguf"], gguf_dtype="q2_k", gates={"min_top1_agreement": 0.999})
    with pytest.raises(ExportVerificationFailed, match="top-1 agreement"):
        run_export(strict, run / "final", run / "export", held_out=alpaca)
    assert not (run / "export" / "gguf").exists() and not list((run / "export").glob("*.partial"))
    rejected = json.loads((run / "export" / "export.json").read_text())["artifacts"]["gguf"]
    assert rejected["dir"] is None and rejected["verification"]["parity"]["top1_agreement"] < 0.999
