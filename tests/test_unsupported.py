"""Every known unsupported combination ends in exit 2 and one short paragraph that says what to do
instead, never in a traceback: each row is the CLI command a user typed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

from tests.conftest import SMALL_ARCH, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2-MoE (routed and shared experts)."""
    config = Qwen2MoeConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("moe") / "model"
    Qwen2MoeForCausalLM(config).save_pretrained(out)
    return out


def _with_config(model: Path, out: Path, **changes: object) -> Path:
    """A copy of `model` whose config.json has `changes`."""
    import json
    import shutil

    shutil.copytree(model, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


def _train_config(tmp_path: Path, model_path: Path | None = None, **model: object) -> str:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("plain text to pretrain on\n" * 50)
    config = {
        "run": {"name": "unsupported", "output_dir": str(tmp_path / "runs")},
        "model": {"path": str(model_path)}
        if model_path
        else {"preset": "llama-tiny", "config": SMALL_ARCH, **model},
        "tokenizer": {"train": {"vocab_size": 300}},
        "data": {"train": [{"path": str(corpus)}], "max_length": 32},
        "train": {"max_steps": 1, "micro_batch_size": 2},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


CASES = {
    # MoE to ONNX and to GGUF work now (tests/test_export_moe.py); what stays unsupported is a
    # routing llama.cpp's graph for the family hard-codes otherwise.
    "renormalized-qwen2-moe-to-gguf": (
        lambda tmp, moe: [
            "ckpt",
            "convert",
            str(_with_config(moe, tmp / "renormalized", norm_topk_prob=True)),
            "--to",
            "gguf",
            "--out",
            str(tmp / "gguf"),
        ],
        ["norm_topk_prob is True", "never renormalizes", "safetensors or ONNX"],
    ),
    "flash-attention-without-cuda": (
        lambda tmp, moe: ["train", _train_config(tmp, attn_implementation="flash_attention_2")],
        ["model.attn_implementation: flash_attention_2", "sdpa"],
    ),
    "flex-attention-training-without-cuda": (
        lambda tmp, moe: ["train", _train_config(tmp, attn_implementation="flex_attention")],
        ["model.attn_implementation: flex_attention", "no backward on CPU", "sdpa"],
    ),
    "qlora-without-cuda": (
        lambda tmp, moe: ["train", _train_config(tmp, model_path=moe), "train.method=qlora"],
        ["train.method: qlora", "train.method: lora"],
    ),
}


NEEDS_NO_GPU = {  # supported where CUDA is
    "flash-attention-without-cuda",
    "flex-attention-training-without-cuda",
    "qlora-without-cuda",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_unsupported_combination_is_one_paragraph_and_exit_2(
    case: str, tmp_path: Path, moe_model: Path
) -> None:
    if case in NEEDS_NO_GPU and torch.cuda.is_available():
        pytest.skip("supported on this machine: it has a CUDA GPU")
    args, words = CASES[case]
    result = run_cli(*args(tmp_path, moe_model))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1, result.stderr[-3000:]
    for word in words:
        assert word in error[0], error[0]
    assert not (tmp_path / "onnx").exists() and not (tmp_path / "gguf").exists()
