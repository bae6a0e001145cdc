"""`lmforge ckpt verify`: integrity (hash manifest, structure) and behavioural parity verdicts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lmforge.ckpt.atomic import commit_checkpoint
from lmforge.config.schema import ModelConfig, TokenizerTrainConfig
from lmforge.data.tokenizer import train_tokenizer
from lmforge.export.verify import verify
from lmforge.models.build import build_model
from tests.conftest import SMALL_ARCH, run_cli

TEXTS = ["the cat sat on the mat and the dog sat on the log\n", "one two three four five six seven\n"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("verify") / "model"
    tokenizer = train_tokenizer(TEXTS * 50, TokenizerTrainConfig(vocab_size=300))
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="llama-tiny", config=SMALL_ARCH), tokenizer, max_length=64)
    with torch.no_grad():  # larger weights than init: logits with a real spread, as after training
        for param in model.parameters():
            param.mul_(4.0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def copy_model(src: Path, dst: Path, *, dtype: torch.dtype | None = None, noise: float = 0.0) -> Path:
    model = AutoModelForCausalLM.from_pretrained(str(src))
    if noise:
        torch.manual_seed(1)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param) * noise)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return dst


def test_identical_copy_passes_with_exact_numbers(model_dir: Path, tmp_path: Path) -> None:
    copy = copy_model(model_dir, tmp_path / "copy")
    verdict = verify(copy, against=model_dir)
    assert verdict.passed, verdict.failures
    assert verdict.precision == "f32" and verdict.runtime == "transformers"
    assert verdict.parity["logits_max_abs_diff"] == 0.0
    assert verdict.parity["top1_agreement"] == 1.0 and verdict.parity["greedy_identical"] == 1.0
    assert verdict.parity["ppl_artifact"] == pytest.approx(verdict.parity["ppl_reference"], rel=1e-12)
    assert verdict.integrity["checked"].startswith("structure only")


def test_bf16_copy_is_judged_at_half_precision(model_dir: Path, tmp_path: Path) -> None:
    copy = copy_model(model_dir, tmp_path / "bf16", dtype=torch.bfloat16)
    verdict = verify(copy, against=model_dir)
    assert verdict.passed, verdict.failures
    assert verdict.precision == "f16/bf16"
    assert verdict.tolerances["max_ppl_increase"] == 1e-2
    assert verdict.parity["logits_max_abs_diff"] > 0
    # The same numbers fail the fp32 limits: the tolerance really is what decides.
    strict = verify(copy, against=model_dir, tolerances={"max_logit_diff": 1e-6})
    assert not strict.passed
    assert any(f.startswith("logits max diff") for f in strict.failures)


def test_a_different_model_fails_through_the_cli_with_its_numbers(model_dir: Path, tmp_path: Path) -> None:
    other = copy_model(model_dir, tmp_path / "other", noise=0.05)
    result = run_cli("ckpt", "verify", str(other), "--against", str(model_dir), "--json")
    assert result.returncode == 1, result.stderr
    verdict = json.loads(result.stdout)
    assert verdict["passed"] is False
    assert verdict["parity"]["logits_rel_diff"] > 1e-4
    assert any("logits max diff" in f and "needs <= 0.0001" in f for f in verdict["failures"])


def test_tampered_file_in_a_sealed_directory_fails_integrity(model_dir: Path, tmp_path: Path) -> None:
    staging = tmp_path / "sealed.partial"
    shutil.copytree(model_dir, staging)
    sealed = commit_checkpoint(staging, tmp_path / "sealed", step=0)
    assert verify(sealed).passed  # no reference: integrity alone
    weights = sealed / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte in the last tensor
    weights.write_bytes(bytes(data))
    result = run_cli("ckpt", "verify", str(sealed), "--against", str(model_dir))
    assert result.returncode == 1
    assert "hash mismatch in model.safetensors" in result.stdout


def test_truncated_safetensors_without_manifest_fails(model_dir: Path, tmp_path: Path) -> None:
    copy = copy_model(model_dir, tmp_path / "cut")
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    verdict = verify(copy, against=model_dir)
    assert not verdict.passed
    assert "truncated" in verdict.failures[0]
    assert verdict.parity == {}  # a damaged artifact is not run


def test_verify_on_a_data_file_of_qa_rows(model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "qa.jsonl"
    rows = [
        {"question": "the cat sat on", "answer": " the mat"},
        {"question": "one two", "answer": " three four"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    verdict = verify(copy_model(model_dir, tmp_path / "copy"), against=model_dir, data=data, prompts=2)
    assert verdict.passed
    assert verdict.parity["sequences"] == 2 and len(verdict.parity["greedy"]) == 2
    # QA rows add the task-accuracy gate: the same model answers the same.
    accuracy = verdict.parity["accuracy"]
    assert accuracy["questions"] == 2 and accuracy["drop"] == 0.0
    assert accuracy["artifact"] == accuracy["reference"]


def test_convert_refuses_to_write_over_its_source(model_dir: Path) -> None:
    result = run_cli("ckpt", "convert", str(model_dir), "--to", "safetensors", "--out", str(model_dir))
    assert result.returncode == 2 and "would replace the input" in result.stderr
    assert (model_dir / "model.safetensors").is_file()
    result = run_cli("ckpt", "convert", str(model_dir), "--to", "gguf", "--out", str(model_dir.parent))
    assert result.returncode == 2 and (model_dir / "config.json").is_file()
