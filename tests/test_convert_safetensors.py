"""`lmforge ckpt convert --to safetensors`: re-shard, re-dtype and .bin rescue, convert -> reload -> compare."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lmforge.config.schema import ModelConfig, TokenizerTrainConfig
from lmforge.data.tokenizer import train_tokenizer
from lmforge.errors import UserInputError
from lmforge.export.convert import convert
from lmforge.models.build import build_model
from tests.conftest import SMALL_ARCH, run_cli

IDS = torch.tensor([[1, 5, 9, 23, 42, 7, 3]])


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with tied embeddings, saved in one safetensors file, with its tokenizer."""
    tokenizer = train_tokenizer(
        ["the cat sat on the mat\n", "one two three\n"] * 50, TokenizerTrainConfig(vocab_size=300)
    )
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="llama-tiny", config=SMALL_ARCH), tokenizer, max_length=64)
    out = tmp_path_factory.mktemp("source")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for shard in directory.glob("model*.safetensors"):
        found.update(load_file(str(shard)))
    return found


def logits(directory: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(IDS).logits


def test_reshard_is_bit_equal_and_loads(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "resharded"
    result = convert(source, "safetensors", out, max_shard_size="100KB")
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1 and result.details["shards"] == len(shards)
    assert all(s.stat().st_size <= 100_000 + 4096 for s in shards if len(load_file(str(s))) > 1)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    before, after = tensors(source), tensors(out)
    assert set(index["weight_map"]) == set(after) == set(before)
    for name, tensor in before.items():  # same bytes, same dtype, same shape
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    for side in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / side).read_bytes() == (source / side).read_bytes()
    assert torch.equal(logits(out), logits(source))


@pytest.mark.parametrize(("dtype", "torch_dtype"), [("bf16", torch.bfloat16), ("f16", torch.float16)])
def test_redtype_casts_floats_and_updates_config(
    source: Path, tmp_path: Path, dtype: str, torch_dtype: torch.dtype
) -> None:
    out = tmp_path / dtype
    convert(source, "safetensors", out, dtype=dtype)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == str(torch_dtype).removeprefix("torch.")
    before, after = tensors(source), tensors(out)
    for name, tensor in before.items():
        assert after[name].dtype == torch_dtype and torch.equal(after[name], tensor.to(torch_dtype)), name
    reloaded = AutoModelForCausalLM.from_pretrained(str(out))  # dtype from config.json
    assert reloaded.dtype == torch_dtype


def save_bin(source: Path, out: Path, *, shards: int) -> Path:
    """The source as legacy pytorch_model*.bin files: what torch.save(state_dict) writes, tied head included."""
    out.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((source / name).read_bytes())
    model = AutoModelForCausalLM.from_pretrained(str(source))
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    if shards == 1:
        torch.save(state, out / "pytorch_model.bin")
        return out
    names = list(state)
    parts = [names[: len(names) // 2], names[len(names) // 2 :]]
    parts[0].append("lm_head.weight")  # the tied pair stays in one file, as save_pretrained did
    parts[1].remove("lm_head.weight")
    weight_map = {}
    for i, part in enumerate(parts):
        file = f"pytorch_model-{i + 1:05d}-of-00002.bin"
        torch.save({n: state[n] for n in part}, out / file)
        weight_map.update(dict.fromkeys(part, file))
    (out / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out


def test_bin_is_refused_without_allow_bin(source: Path, tmp_path: Path) -> None:
    legacy = save_bin(source, tmp_path / "legacy", shards=1)
    with pytest.raises(UserInputError, match="--allow-bin") as err:
        convert(legacy, "safetensors", tmp_path / "out")
    assert "pickle" in str(err.value) and not (tmp_path / "out").exists()
    result = run_cli("ckpt", "convert", str(legacy), "--to", "safetensors", "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and "--allow-bin" in result.stderr, result.stderr


@pytest.mark.parametrize("shards", [1, 2])
def test_bin_converts_with_allow_bin(source: Path, tmp_path: Path, shards: int) -> None:
    legacy = save_bin(source, tmp_path / "legacy", shards=shards)
    out = tmp_path / "out"
    result = convert(legacy, "safetensors", out, allow_bin=True)
    assert result.details["source_format"] == "bin"
    assert result.details["dropped_shared"] == ["lm_head.weight"]  # stored once, tied again on load
    before, after = tensors(source), tensors(out)
    assert set(after) == set(before)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    assert torch.equal(logits(out), logits(source))


class _Payload:
    """Unpickling this runs code: it touches a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.marker,))


def test_a_bin_with_a_pickle_payload_is_refused(source: Path, tmp_path: Path) -> None:
    legacy = save_bin(source, tmp_path / "legacy", shards=1)
    marker = tmp_path / "payload-ran"
    state = torch.load(legacy / "pytorch_model.bin", weights_only=True)
    torch.save({**state, "extra": _Payload(marker)}, legacy / "pytorch_model.bin")
    with pytest.raises(UserInputError, match=r"refused: it holds Python objects other than tensors") as err:
        convert(legacy, "safetensors", tmp_path / "out", allow_bin=True)
    assert "weights_only=False" not in str(err.value)  # no advice to unpickle it in full
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_bad_options_name_the_option(source: Path, tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="--dtype 'q4'"):
        convert(source, "safetensors", tmp_path / "a", dtype="q4")
    with pytest.raises(UserInputError, match="--max-shard-size"):
        convert(source, "safetensors", tmp_path / "b", max_shard_size="lots")
