"""The GPU hand-offs, as far as a CPU goes: compressed-tensors exports (FP8 / int8 / int4
checkpoints for vLLM) made and verified, the TensorRT-LLM bundle, and vLLM verification refused
without a GPU (tests/test_gpu.py runs it on one).

An fp8 export of a trained model through a run's export: section, gated and inspected:
tests/test_export_stage.py (it shares that run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from lmforge.config.schema import TokenizerTrainConfig
from lmforge.data.tokenizer import train_tokenizer
from tests.conftest import run_cli, save_tiny_llama

TEXTS = ["the cat sat on the mat and the dog sat on the log\n", "one two three four five six seven\n"]
# Input sizes that are whole groups of 128, as vLLM's int4 / int8 group kernels need.
GROUPABLE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1}


@pytest.fixture(scope="module")
def groupable_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = train_tokenizer(TEXTS * 50, TokenizerTrainConfig(vocab_size=300))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), num_hidden_layers=2, max_position_embeddings=128, **GROUPABLE
    )
    out = tmp_path_factory.mktemp("groupable") / "model"
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_w4a16_is_written_as_packed_int4_and_verified_as_4_bit(groupable_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "w4"
    converted = run_cli(
        "ckpt",
        "convert",
        str(groupable_model),
        "--to",
        "compressed-tensors",
        "--dtype",
        "w4a16",
        "--out",
        str(out),
    )
    assert converted.returncode == 0, converted.stderr
    assert "Compressing model" not in converted.stderr + converted.stdout  # the library's bars go to the log
    quantization = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quantization["quant_method"] == "compressed-tensors" and quantization["format"] == "pack-quantized"
    weights = quantization["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], quantization["ignore"]) == (4, 128, ["lm_head"])
    with safe_open(out / "model.safetensors", "pt") as tensors:
        names = set(tensors.keys())
        # Eight int4 values per int32, one scale per 128 inputs; lm_head kept whole.
        assert tensors.get_slice("model.layers.0.mlp.down_proj.weight_packed").get_shape() == [128, 256 // 8]
        assert tensors.get_slice("model.layers.0.mlp.down_proj.weight_scale").get_shape() == [128, 256 // 128]
    assert "lm_head.weight" in names and "model.layers.0.mlp.down_proj.weight" not in names
    assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").is_file()

    verified = run_cli("ckpt", "verify", str(out), "--json")  # against the recorded source
    verdict = json.loads(verified.stdout)
    assert (verdict["format"], verdict["runtime"]) == (
        "compressed-tensors",
        "transformers (compressed-tensors)",
    )
    assert verdict["precision"] == "4-bit or less" and verdict["tolerances"]["max_ppl_increase"] == 0.15
    # The weights really are 4-bit in the runtime: the logits move, the model stays the same model.
    assert verdict["parity"]["logits_max_abs_diff"] > 0 and abs(verdict["parity"]["ppl_increase"]) < 0.15


def test_schemes_that_do_not_fit_the_model_are_refused_before_any_work(tmp_path: Path) -> None:
    tokenizer = train_tokenizer(TEXTS * 50, TokenizerTrainConfig(vocab_size=300))
    small = save_tiny_llama(tokenizer, tmp_path / "small")  # hidden 64: no whole group of 128

    def convert(dtype: str):  # type: ignore[no-untyped-def]
        return run_cli(
            "ckpt",
            "convert",
            str(small),
            "--to",
            "compressed-tensors",
            "--dtype",
            dtype,
            "--out",
            str(tmp_path / "o"),
        )

    grouped = convert("w8a16")
    assert grouped.returncode == 2 and "hidden_size 64" in grouped.stderr
    assert "not a multiple of 128" in grouped.stderr
    assert "fp8 (one scale per channel)" in grouped.stderr and "Traceback" not in grouped.stderr
    unknown = convert("int4")
    assert unknown.returncode == 2 and "fp8, w8a16, w4a16" in unknown.stderr
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob("o.*"))  # nothing half-written


def test_vllm_verification_is_refused_without_a_gpu_naming_what_to_do(groupable_model: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tests/test_gpu.py runs the model in vLLM")
    result = run_cli(
        "ckpt", "verify", str(groupable_model), "--against", str(groupable_model), "--runtime", "vllm"
    )
    assert result.returncode == 2, result.stderr
    assert "vLLM runs on a CUDA GPU and this machine has none" in result.stderr
    assert "--runtime auto" in result.stderr and "Traceback" not in result.stderr


def test_a_run_whose_compressed_export_cannot_fit_is_refused_before_training() -> None:
    from lmforge.config import load_config
    from lmforge.errors import UserInputError
    from lmforge.train.preflight import check_machine_requirements

    config = {
        "model": {"preset": "llama-tiny"},  # hidden 256, intermediate 688: no whole groups of 128 inputs
        "tokenizer": {"train": {"vocab_size": 300}},
        "data": {"train": [{"path": "corpus.txt"}]},
        "train": {"stage": "pretrain"},
        "export": {"formats": ["compressed-tensors"], "compressed_dtype": "w4a16"},
    }
    with pytest.raises(UserInputError, match=r"export.compressed_dtype: the model: w4a16 quantizes .* 688"):
        check_machine_requirements(load_config(None, base=config))
    config["export"]["compressed_dtype"] = "fp8"  # one scale per channel fits any size
    check_machine_requirements(load_config(None, base=config))


def test_the_tensorrt_llm_hand_off_is_bf16_weights_with_a_serving_config_and_scripts(
    groupable_model: Path, tmp_path: Path
) -> None:
    """TensorRT-LLM needs an NVIDIA GPU: here the bundle is checked — bf16 weights that verify in
    transformers, LLM API settings that parse, scripts whose command line (trtllm-serve replaced by a
    program that prints its arguments) points at this export, wherever the directory is moved."""
    import shutil
    import subprocess

    import yaml

    out = tmp_path / "trt"
    converted = run_cli("ckpt", "convert", str(groupable_model), "--to", "tensorrt-llm", "--out", str(out))
    assert converted.returncode == 0, converted.stderr
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    options = yaml.safe_load((out / "tensorrt_llm" / "llm_api_options.yaml").read_text())
    assert options["max_seq_len"] == 128 and options["kv_cache_config"]["free_gpu_memory_fraction"] > 0
    verified = run_cli("ckpt", "verify", str(out), "--json")
    assert verified.returncode == 0, verified.stdout
    assert json.loads(verified.stdout)["precision"] == "f16/bf16"

    moved = shutil.move(str(out), str(tmp_path / "copied-to-the-gpu-box"))
    stub = tmp_path / "bin" / "trtllm-serve"
    stub.parent.mkdir()
    stub.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    stub.chmod(0o755)
    for script, backend in (("serve.sh", "pytorch"), ("build.sh", "tensorrt")):
        ran = subprocess.run(
            ["bash", str(Path(moved) / "tensorrt_llm" / script), "--tp_size", "1"],
            capture_output=True,
            text=True,
            env={"PATH": f"{stub.parent}:/usr/bin:/bin", "PORT": "8123"},
            check=True,
        )
        assert ran.stdout.split() == [
            moved,
            "--backend",
            backend,
            "--host",
            "127.0.0.1",
            "--port",
            "8123",
            "--config",
            f"{moved}/tensorrt_llm/llm_api_options.yaml",
            "--tp_size",
            "1",
        ]


def test_a_family_tensorrt_llm_does_not_serve_is_refused(tmp_path: Path) -> None:
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    result = run_cli(
        "ckpt", "convert", str(tmp_path / "gpt2"), "--to", "tensorrt-llm", "--out", str(tmp_path / "o")
    )
    assert result.returncode == 2 and "model_type 'gpt2' is not among TensorRT-LLM's" in result.stderr
    assert "Fix: serve it with vLLM" in result.stderr and not (tmp_path / "o").exists()
