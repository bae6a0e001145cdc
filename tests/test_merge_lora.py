"""`lmforge ckpt merge-lora` against PEFT's own merge_and_unload() on tiny Llama and Qwen2 models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lmforge.ckpt.merge import merge_lora
from lmforge.config.schema import ModelConfig, TokenizerTrainConfig
from lmforge.data.tokenizer import train_tokenizer
from lmforge.errors import UserInputError
from lmforge.models.build import build_model
from tests.conftest import SMALL_ARCH, run_cli


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return train_tokenizer(
        ["the cat sat on the mat\n", "one two three\n"] * 50, TokenizerTrainConfig(vocab_size=300)
    )


def save_base(tokenizer, out: Path, preset: str, **arch: int) -> Path:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset=preset, config={**SMALL_ARCH, **arch}), tokenizer, max_length=64)
    # Several shards, so the merge really goes shard by shard.
    model.save_pretrained(out, max_shard_size="100KB")
    tokenizer.save_pretrained(out)
    return out


def save_adapter(base: Path, out: Path, **lora: object) -> Path:
    model = AutoModelForCausalLM.from_pretrained(str(base))
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **lora))
    torch.manual_seed(1)
    with torch.no_grad():  # a trained-looking adapter: B is zero at init
        for name, param in peft_model.named_parameters():
            if "lora_B" in name or "lora_magnitude" in name or "modules_to_save" in name:
                param.add_(torch.randn_like(param) * 0.05)
    peft_model.save_pretrained(out)
    return out


def peft_merged(base: Path, adapter: Path) -> dict[str, torch.Tensor]:
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(adapter))
    return {k: v.detach() for k, v in model.merge_and_unload().state_dict().items()}


def ours(out: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in out.glob("*.safetensors"):
        tensors.update(load_file(str(shard)))
    return tensors


@pytest.mark.parametrize(
    ("preset", "lora"),
    [
        ("llama-tiny", {}),
        ("llama-tiny", {"use_dora": True}),
        ("qwen2-tiny", {"use_rslora": True, "rank_pattern": {"q_proj": 2}, "alpha_pattern": {"v_proj": 3}}),
        ("qwen2-tiny", {"modules_to_save": ["embed_tokens"]}),
    ],
)
def test_merge_equals_peft_merge_and_unload(tokenizer, tmp_path: Path, preset: str, lora: dict) -> None:  # type: ignore[no-untyped-def]
    base = save_base(tokenizer, tmp_path / "base", preset)
    assert len(list(base.glob("*.safetensors"))) > 1
    adapter = save_adapter(base, tmp_path / "adapter", **lora)
    report = merge_lora(base, adapter, tmp_path / "merged")
    expected, got = peft_merged(base, adapter), ours(tmp_path / "merged")
    assert report.merged_tensors > 0 and len(report.shards) > 1
    for name, tensor in got.items():
        diff = (tensor - expected[name]).abs().max().item()
        assert diff <= 1e-5, f"{name}: {diff}"
    index = json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got)  # every stored tensor is indexed
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))  # loads as a plain HF model
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(base)), str(adapter)
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-4)


def test_a_base_that_does_not_match_the_adapter_is_refused(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    base = save_base(tokenizer, tmp_path / "base", "llama-tiny")
    other = save_base(tokenizer, tmp_path / "other", "llama-tiny", hidden_size=32, intermediate_size=64)
    adapter = save_adapter(base, tmp_path / "adapter")
    with pytest.raises(UserInputError, match="the base does not match the adapter"):
        merge_lora(other, adapter, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


def test_cli_merge_lora(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    base = save_base(tokenizer, tmp_path / "base", "llama-tiny")
    adapter = save_adapter(base, tmp_path / "adapter")
    result = run_cli(
        "ckpt", "merge-lora", "--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "m")
    )
    assert result.returncode == 0, result.stderr
    assert "merged" in result.stdout and (tmp_path / "m" / "config.json").is_file()
    missing = run_cli(
        "ckpt", "merge-lora", "--base", str(base), "--adapter", str(tmp_path), "--out", str(tmp_path / "x")
    )
    assert missing.returncode == 2 and "not a PEFT adapter directory" in missing.stderr
