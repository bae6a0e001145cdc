"""`lmforge ckpt merge-lora` against PEFT's own merge_and_unload() on tiny Llama and Qwen2 models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lmforge.config.schema import ModelConfig, TokenizerTrainConfig
from lmforge.data.tokenizer import train_tokenizer
from lmforge.errors import UserInputError
from lmforge.export.merge import merge_lora
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


def test_adapters_on_fused_moe_experts_merge_through_peft(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """transformers 5 keeps an MoE layer's experts in 3-D parameters; PEFT adapts them with
    target_parameters, saved under the experts module's name (nested for two parameters). The merge
    goes through PEFT's own merge_and_unload and equals it."""
    arch = {"moe_intermediate_size": 48, "num_experts": 4, "num_experts_per_tok": 2}
    base = save_base(tokenizer, tmp_path / "base", "qwen3-moe-tiny", **arch)
    adapter = save_adapter(
        base, tmp_path / "adapter", target_parameters=["experts.gate_up_proj", "experts.down_proj"]
    )
    report = merge_lora(base, adapter, tmp_path / "merged")
    assert report.merged_tensors == 2 * (4 + 1 + 2)  # per layer: q, k, v, o, the router, 2 expert parameters
    # save_pretrained writes the experts in the checkpoint layout (one tensor per expert), which
    # from_pretrained fuses again: the loaded model's weights are PEFT's merge.
    base_model = AutoModelForCausalLM.from_pretrained(str(base)).eval()
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    expected = peft_merged(base, adapter)
    for name, tensor in reloaded.state_dict().items():
        assert (tensor - expected[name]).abs().max().item() <= 1e-6, name
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(base)), str(adapter)
    ).eval()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
        assert (
            base_model(ids).logits - reference(ids).logits
        ).abs().max() > 1e-2  # the adapter does change it
    assert (tmp_path / "merged" / "tokenizer.json").is_file()


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
