"""The config's export: section: merge -> convert -> verify at the end of `lmforge train`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from lmforge.ckpt.atomic import check_checkpoint
from lmforge.config.schema import ExportConfig, TokenizerTrainConfig
from lmforge.data.tokenizer import train_tokenizer
from lmforge.errors import ExportVerificationFailed
from lmforge.export.inspect import inspect_checkpoint
from lmforge.export.run_export import run_export
from tests.conftest import ROOT, run_cli, save_tiny_llama

pytestmark = pytest.mark.slow
ALPACA = ROOT / "examples" / "data" / "arithmetic_alpaca.jsonl"


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = train_tokenizer(ALPACA.read_text().splitlines() * 2, TokenizerTrainConfig(vocab_size=400))
    return save_tiny_llama(tokenizer, tmp_path_factory.mktemp("base") / "model")


def train(tmp_path: Path, base: Path, name: str, method: str, export: dict) -> tuple[Path, str]:
    config = {
        "run": {"name": name, "output_dir": str(tmp_path / "runs"), "seed": 0},
        "model": {"path": str(base)},
        "data": {"train": [{"path": str(ALPACA)}], "max_length": 128, "over_length": "truncate"},
        "train": {
            "stage": "sft",
            "method": method,
            "max_steps": 6,
            "micro_batch_size": 4,
            "lr": 3e-3,
            "precision": "fp32",
            "log_every": 2,
        },
        "export": export,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run_cli("train", str(path))
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp_path / "runs" / name, result.stdout


def test_full_run_exports_every_format_and_each_passes_verification(tmp_path: Path, base_model: Path) -> None:
    run_dir, stdout = train(
        tmp_path,
        base_model,
        "full",
        "full",
        {
            "formats": ["safetensors", "gguf", "onnx", "compressed-tensors"],
            "gguf_dtype": "f32",
            "safetensors_dtype": "bf16",
        },
    )
    summary = json.loads((run_dir / "export" / "export.json").read_text())
    assert summary["reference"] == str(run_dir / "final")
    for fmt, precision in (
        ("safetensors", "f16/bf16"),
        ("gguf", "f32"),
        ("onnx", "f32"),
        ("compressed-tensors", "8-bit"),
    ):
        artifact = summary["artifacts"][fmt]
        verdict = artifact["verification"]
        assert verdict["passed"], (fmt, verdict["failures"])
        assert verdict["precision"] == precision
        assert check_checkpoint(Path(artifact["dir"])).complete  # sealed with a hash manifest
        assert f"export {fmt}" in stdout and "PASS" in stdout
    assert summary["artifacts"]["onnx"]["verification"]["runtime"] == "onnxruntime"
    assert summary["artifacts"]["gguf"]["verification"]["parity"]["top1_agreement"] == 1.0

    # ckpt inspect reads what each export is from its headers.
    hf_parameters = sum(t.numel() for t in load_file(run_dir / "final" / "model.safetensors").values())
    gguf = inspect_checkpoint(run_dir / "export" / "gguf")
    assert (gguf["format"], gguf["architecture"], gguf["tokenizer"]) == ("gguf", "llama", "gpt2")
    assert gguf["parameters"] == hf_parameters and gguf["chat_template"] is True
    assert gguf["lmforge_checkpoint"]["complete"] is True
    onnx = inspect_checkpoint(run_dir / "export" / "onnx")
    assert onnx["format"] == "onnx" and onnx["inputs"] == ["input_ids", "attention_mask"]
    assert onnx["outputs"] == ["logits"] and set(onnx["dtypes"]) >= {"FLOAT"}
    # The FP8 checkpoint for vLLM: FP8 weights with their scales, lm_head kept, run (activations
    # quantized per token) by transformers with compressed-tensors.
    fp8 = inspect_checkpoint(run_dir / "export" / "compressed-tensors")
    assert fp8["quantization"] == {
        "method": "compressed-tensors",
        "weights": ["float8 per channel"],
        "not_quantized": ["lm_head"],
    }
    assert "F8_E4M3" in fp8["dtypes"] and fp8["bytes"] < gguf["bytes"] / 2
    fp8_verdict = summary["artifacts"]["compressed-tensors"]["verification"]
    assert fp8_verdict["runtime"] == "transformers (compressed-tensors)"
    assert fp8_verdict["parity"]["logits_max_abs_diff"] > 0 and fp8_verdict["parity"]["top1_agreement"] >= 0.9

    # A gate the export misses: int8 ONNX held to full agreement of next-token predictions. The
    # export is verified before it takes its place, so it is removed (no half-written directory),
    # its numbers kept in export.json, and the run's export fails (exit 1 through the CLI).
    strict = ExportConfig(formats=["onnx"], onnx_dtype="int8", gates={"min_top1_agreement": 1.0})
    with pytest.raises(ExportVerificationFailed, match="top-1 agreement"):
        run_export(strict, run_dir / "final", run_dir / "export")
    assert not (run_dir / "export" / "onnx").exists()
    assert not list((run_dir / "export").glob("*.partial"))
    rejected = json.loads((run_dir / "export" / "export.json").read_text())["artifacts"]["onnx"]
    assert rejected["dir"] is None and rejected["dtype"] == "int8"
    verdict = rejected["verification"]
    assert verdict["precision"] == "8-bit" and verdict["tolerances"]["min_top1_agreement"] == 1.0
    assert 0.5 < verdict["parity"]["top1_agreement"] < 1.0
    assert verdict["tolerances"]["max_ppl_increase"] == 0.03  # the 8-bit default where no gate was set


def test_lora_run_is_merged_then_exported_and_verified_against_the_adapter(
    tmp_path: Path, base_model: Path
) -> None:
    run_dir, _ = train(tmp_path, base_model, "lora", "lora", {"formats": ["gguf"], "gguf_dtype": "f32"})
    summary = json.loads((run_dir / "export" / "export.json").read_text())
    assert summary["source"] == str(run_dir / "export" / "merged")  # final/ holds the adapter only
    assert summary["reference"] == str(run_dir / "final" / "adapter")
    verdict = summary["artifacts"]["gguf"]["verification"]
    assert verdict["passed"], verdict["failures"]
    assert verdict["parity"]["logits_rel_diff"] < 1e-4


def test_export_of_a_reward_model_is_refused_before_training(tmp_path: Path, base_model: Path) -> None:
    path = tmp_path / "rm.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"path": str(base_model)},
                "data": {
                    "train": [{"path": str(ROOT / "examples" / "data" / "arithmetic_preference.jsonl")}]
                },
                "train": {"stage": "rm"},
                "export": {"formats": ["gguf"]},
            }
        )
    )
    result = run_cli("train", str(path))
    assert result.returncode == 2
    assert "export.formats" in result.stderr and "reward model" in result.stderr
