"""`lmforge ckpt prune`: prune -> reload -> compare with the same cut made by hand in transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from lmforge.config.schema import ModelConfig, TokenizerTrainConfig
from lmforge.data.tokenizer import train_tokenizer
from lmforge.errors import UserInputError
from lmforge.export.prune import prune_checkpoint
from lmforge.export.prune_cuts import parse_layers
from lmforge.models.build import build_model
from tests.conftest import SMALL_ARCH, run_cli

IDS = torch.tensor([[1, 5, 9, 23, 42, 7, 3, 11]])


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return train_tokenizer(
        ["the cat sat on the mat\n", "one two three\n"] * 50, TokenizerTrainConfig(vocab_size=300)
    )


def save_model(tokenizer, out: Path, preset: str, **arch: int) -> Path:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    config = {**SMALL_ARCH, **arch} if preset != "gpt2-tiny" else {"n_embd": 64, "n_layer": 2, "n_head": 2}
    model = build_model(ModelConfig(preset=preset, config=config), tokenizer, max_length=64)
    model.save_pretrained(out, max_shard_size="100KB")  # several shards, as big models have
    tokenizer.save_pretrained(out)
    return out


def load(directory: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def logits(model: torch.nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for shard in directory.glob("model*.safetensors"):
        found.update(load_file(str(shard)))
    return found


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-tiny"])
def test_keep_layers_equals_the_same_layers_cut_by_hand(tokenizer, tmp_path: Path, preset: str) -> None:  # type: ignore[no-untyped-def]
    source = save_model(tokenizer, tmp_path / "source", preset, num_hidden_layers=4)
    report = prune_checkpoint(source, tmp_path / "pruned", keep_layers="0,2-3")
    config = json.loads((tmp_path / "pruned" / "config.json").read_text())
    assert config["num_hidden_layers"] == 3
    if "layer_types" in config:  # qwen2 keeps one entry per layer
        assert len(config["layer_types"]) == 3
    names = set(tensors(tmp_path / "pruned"))
    assert {n.split(".")[2] for n in names if n.startswith("model.layers.")} == {"0", "1", "2"}
    assert report.parameters_after < report.parameters_before
    assert report.bytes_after < report.bytes_before

    by_hand = load(source)  # the same cut made on the module tree
    by_hand.model.layers = torch.nn.ModuleList([by_hand.model.layers[i] for i in (0, 2, 3)])
    by_hand.config.num_hidden_layers = 3
    pruned = load(tmp_path / "pruned")
    # Same weights through the same modules: identical logits, not merely close.
    torch.testing.assert_close(logits(pruned), logits(by_hand), atol=0, rtol=0)
    assert not torch.allclose(logits(pruned), logits(load(source)))  # the cut did change the model


def test_max_positions_slices_a_learned_table(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source = save_model(tokenizer, tmp_path / "gpt2", "gpt2-tiny")
    report = prune_checkpoint(source, tmp_path / "short", max_positions=32)
    config = json.loads((tmp_path / "short" / "config.json").read_text())
    assert config["n_positions"] == 32
    wpe = tensors(tmp_path / "short")["transformer.wpe.weight"]
    assert wpe.shape[0] == 32 and torch.equal(wpe, tensors(source)["transformer.wpe.weight"][:32])
    assert any("wpe" in change for change in report.changes)
    short = load(tmp_path / "short")
    assert short.config.n_positions == 32
    torch.testing.assert_close(
        logits(short), logits(load(source)), atol=0, rtol=0
    )  # positions < 32 unchanged


def test_max_positions_on_a_rope_model_changes_the_config(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source = save_model(tokenizer, tmp_path / "llama", "llama-tiny")
    report = prune_checkpoint(source, tmp_path / "short", max_positions=48)
    assert any("config only" in change for change in report.changes)
    assert report.parameters_after == report.parameters_before
    short = load(tmp_path / "short")
    assert short.config.max_position_embeddings == 48
    torch.testing.assert_close(logits(short), logits(load(source)), atol=0, rtol=0)
    with pytest.raises(UserInputError, match="--max-positions 4096: larger than"):
        prune_checkpoint(source, tmp_path / "long", max_positions=4096)


def add_adapter(final: Path) -> None:
    """An adapter run's final/: the adapter lives in final/adapter/ next to the full model."""
    (final / "adapter").mkdir()
    (final / "adapter" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    save_file(
        {"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 64)},
        final / "adapter" / "adapter_model.safetensors",
    )


def test_drop_adapters(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    final = save_model(tokenizer, tmp_path / "final", "llama-tiny")
    add_adapter(final)
    report = prune_checkpoint(final, tmp_path / "slim", drop_adapters=True)
    assert report.changes == ["dropped adapter"]
    assert not (tmp_path / "slim" / "adapter").exists()
    before, after = tensors(final), tensors(tmp_path / "slim")
    assert set(after) == set(before) and all(torch.equal(after[n], before[n]) for n in before)
    assert (tmp_path / "slim" / "tokenizer.json").is_file()
    # Kept when not dropped; refused when the layers it was trained on go away.
    prune_checkpoint(final, tmp_path / "half", dtype="f16")
    assert (tmp_path / "half" / "adapter" / "adapter_config.json").is_file()
    with pytest.raises(UserInputError, match="--drop-adapters"):
        prune_checkpoint(final, tmp_path / "cut", keep_layers="0")


def test_dtype(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source = save_model(tokenizer, tmp_path / "source", "qwen2-tiny")
    report = prune_checkpoint(source, tmp_path / "bf16", dtype="bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    before, after = tensors(source), tensors(tmp_path / "bf16")
    for name, tensor in before.items():
        assert after[name].dtype == torch.bfloat16 and torch.equal(after[name], tensor.to(torch.bfloat16))
    assert report.bytes_after * 2 == report.bytes_before
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16")).dtype == torch.bfloat16


def test_parse_layers() -> None:
    assert parse_layers("0-3,6", 8) == [0, 1, 2, 3, 6]
    assert parse_layers(" 5 , 1-2,2", 8) == [1, 2, 5]
    for text, message in [("0-8", r"\[8\] do not exist"), ("3-1", "runs backwards"), ("a-b", "not a layer")]:
        with pytest.raises(UserInputError, match=message):
            parse_layers(text, 8)


def test_cli(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    source = save_model(tokenizer, tmp_path / "source", "llama-tiny")
    ok = run_cli(
        "ckpt", "prune", str(source), "--out", str(tmp_path / "o"), "--keep-layers", "1", "--dtype", "f16"
    )
    assert ok.returncode == 0, ok.stderr
    assert "num_hidden_layers 2 -> 1" in ok.stdout and "parameters " in ok.stdout and "pruned" in ok.stdout
    bad = run_cli("ckpt", "prune", str(source), "--out", str(tmp_path / "b"), "--keep-layers", "0-5")
    assert bad.returncode == 2
    assert "--keep-layers '0-5': layer(s) [2, 3, 4, 5] do not exist; the model has 2 layers" in bad.stderr
    assert not (tmp_path / "b").exists()
