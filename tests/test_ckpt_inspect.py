"""`lmforge ckpt inspect`: formats, parameter counts, shards, adapters and completeness, from metadata."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from lmforge.ckpt.atomic import commit_checkpoint
from lmforge.config.schema import ModelConfig, TokenizerTrainConfig
from lmforge.data.tokenizer import train_tokenizer
from lmforge.errors import UserInputError
from lmforge.export.inspect import inspect_checkpoint
from lmforge.models.build import build_model, count_parameters
from tests.conftest import SMALL_ARCH, run_cli


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    tokenizer = train_tokenizer(["a b c d e f\n"] * 50, TokenizerTrainConfig(vocab_size=300))
    model = build_model(ModelConfig(preset="qwen2-tiny", config=SMALL_ARCH), tokenizer, max_length=64)
    out = tmp_path_factory.mktemp("hf") / "model"
    model.save_pretrained(out, max_shard_size="100KB")
    return out, count_parameters(model)


def test_hf_model_directory(model_dir: tuple[Path, int]) -> None:
    path, parameters = model_dir
    info = inspect_checkpoint(path)
    assert info["format"] == "hf" and info["architecture"] == "Qwen2ForCausalLM"
    assert info["parameters"] == parameters  # tied weights stored (and counted) once
    assert info["dtypes"] == {"F32": parameters} and len(info["shards"]) > 1 and info["complete"]


def test_missing_shard_is_reported(model_dir: tuple[Path, int], tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(model_dir[0], copy)
    victim = sorted(copy.glob("*.safetensors"))[0]
    victim.unlink()
    info = inspect_checkpoint(copy)
    assert info["complete"] is False and info["missing_shards"] == [victim.name]


def test_adapter_directory(model_dir: tuple[Path, int], tmp_path: Path) -> None:
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(model_dir[0])),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    model.save_pretrained(tmp_path / "adapter")
    info = inspect_checkpoint(tmp_path / "adapter")
    assert info["format"] == "peft-adapter" and info["r"] == 4
    assert info["target_modules"] == ["q_proj", "v_proj"]
    expected = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert info["parameters"] == expected


def test_lmforge_checkpoint_completeness_and_tampering(model_dir: tuple[Path, int], tmp_path: Path) -> None:
    import shutil

    staging = tmp_path / "staging"
    shutil.copytree(model_dir[0], staging)
    step_dir = commit_checkpoint(staging, tmp_path / "checkpoints" / "step-7", step=7)
    assert inspect_checkpoint(step_dir)["lmforge_checkpoint"] == {"step": 7, "complete": True, "problem": ""}
    shard = sorted(step_dir.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-1] + b"\0")
    status = inspect_checkpoint(step_dir)["lmforge_checkpoint"]
    assert status["complete"] is False and shard.name in status["problem"]


def test_cli_json_and_errors(model_dir: tuple[Path, int], tmp_path: Path) -> None:
    result = run_cli("ckpt", "inspect", str(model_dir[0]), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["parameters"] == model_dir[1]
    (tmp_path / "empty").mkdir()
    bad = run_cli("ckpt", "inspect", str(tmp_path / "empty"))
    assert bad.returncode == 2 and "not a checkpoint lmforge recognises" in bad.stderr
    with pytest.raises(UserInputError, match="no such file"):
        inspect_checkpoint(tmp_path / "nope")


def test_torch_dcp_directory(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"weight": torch.zeros(3)}, checkpoint_id=str(tmp_path / "dcp"))
    assert inspect_checkpoint(tmp_path / "dcp") == {
        "path": str(tmp_path / "dcp"),
        "format": "torch-dcp",
        "world_size": 1,
    }


def test_final_of_an_adapter_run_without_a_merged_model(model_dir: tuple[Path, int], tmp_path: Path) -> None:
    """A LoRA run with export.merge_lora off leaves final/ = adapter/ + tokenizer: inspect names
    it and describes the adapter instead of refusing the directory."""
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(model_dir[0])),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    final = tmp_path / "final"
    model.save_pretrained(final / "adapter")
    (final / "lmforge_finished.json").write_text(json.dumps({"step": 4}))
    info = inspect_checkpoint(final)
    assert info["format"] == "lmforge-final-adapter" and "merge-lora" in info["note"]
    assert info["adapter"]["format"] == "peft-adapter" and info["adapter"]["r"] == 4
    result = run_cli("ckpt", "inspect", str(final))
    assert result.returncode == 0 and "lmforge-final-adapter" in result.stdout
