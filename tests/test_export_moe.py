"""Mixture-of-Experts exports: GGUF for the families llama.cpp reads (mixtral, qwen2_moe with its
shared expert, qwen3_moe), each layer's experts stacked into the 3-D tensors llama.cpp expects and
verified in llama.cpp (where it is installed; without it the verification is refused by name, as
transformers' GGUF reader cannot load stacked experts); an MoE llama.cpp would route differently is
refused before any work; ONNX of an MoE traces transformers' batched experts and is verified in
onnxruntime."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from lmforge.config.schema import TokenizerTrainConfig
from lmforge.data.tokenizer import train_tokenizer
from lmforge.export.convert import convert
from tests.conftest import run_cli

TEXTS = ["the cat sat on the mat and the dog sat on the log\n", "one two three four five six seven\n"]
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 128,
    "num_experts_per_tok": 2,
}
FAMILIES = {
    "mixtral": {"num_local_experts": 4},
    "qwen2_moe": {"num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
    "qwen3_moe": {"num_experts": 4, "moe_intermediate_size": 32, "norm_topk_prob": True},
}
HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


def save_moe(model_type: str, out: Path, **overrides: object) -> Path:
    tokenizer = train_tokenizer(TEXTS * 50, TokenizerTrainConfig(vocab_size=300))
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), **SHAPE, **{**FAMILIES[model_type], **overrides}
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # logits with a real spread, as after training
        for param in model.parameters():
            param.mul_(4.0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {name: save_moe(name, root / name) for name in FAMILIES}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_moe_gguf_holds_the_experts_stacked_and_runs_in_llama_cpp(
    models: dict[str, Path], family: str, tmp_path: Path
) -> None:
    out = tmp_path / "gguf"
    convert(models[family], "gguf", out, dtype="f32")
    reader = GGUFReader(out / "model-f32.gguf")
    arch = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[family]
    count = reader.fields[f"{arch}.expert_count"]
    assert int(count.parts[count.data[0]][0]) == 4
    tensors = {t.name: t for t in reader.tensors}
    weights = load_file(models[family] / "model.safetensors")
    prefix = "block_sparse_moe" if family == "mixtral" else "mlp"
    projections = {"w1": "gate", "w3": "up", "w2": "down"} if family == "mixtral" else {
        "gate_proj": "gate", "up_proj": "up", "down_proj": "down"
    }  # fmt: skip
    for checkpoint, gguf_name in projections.items():
        stacked = torch.stack(
            [weights[f"model.layers.1.{prefix}.experts.{e}.{checkpoint}.weight"] for e in range(4)]
        )
        written = tensors[f"blk.1.ffn_{gguf_name}_exps.weight"]
        data = np.asarray(written.data).reshape(stacked.shape)
        np.testing.assert_array_equal(data, stacked.numpy())  # experts in order, f32 bit for bit
    router = np.asarray(tensors["blk.0.ffn_gate_inp.weight"].data)
    np.testing.assert_array_equal(
        router.reshape(4, 64), weights[f"model.layers.0.{prefix}.gate.weight"].numpy()
    )
    if family == "qwen2_moe":
        assert {"blk.0.ffn_gate_shexp.weight", "blk.0.ffn_gate_inp_shexp.weight"} <= set(tensors)

    verified = run_cli("ckpt", "verify", str(out), "--json")
    if not HAS_LLAMA_CPP:  # CI: the reader that could run it is not there, and verify says so
        assert verified.returncode == 2 and "Mixture-of-Experts GGUF runs in llama.cpp" in verified.stderr
        return
    verdict = json.loads(verified.stdout)
    assert verified.returncode == 0 and verdict["runtime"] == "llama.cpp", verdict["failures"]
    assert verdict["parity"]["top1_agreement"] == 1.0 and verdict["parity"]["logits_rel_diff"] < 1e-4


def test_an_moe_llama_cpp_would_route_differently_is_refused_before_any_work(tmp_path: Path) -> None:
    """Qwen3-MoE with norm_topk_prob false (transformers' default): llama.cpp's qwen3moe graph
    always renormalizes the chosen experts' weights."""
    model = save_moe("qwen3_moe", tmp_path / "model", norm_topk_prob=False)
    result = run_cli("ckpt", "convert", str(model), "--to", "gguf", "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "norm_topk_prob" in result.stderr and "renormalizes" in result.stderr
    assert not (tmp_path / "out").exists() and "Traceback" not in result.stderr


def test_an_moe_exports_to_onnx_and_matches_in_onnxruntime(models: dict[str, Path], tmp_path: Path) -> None:
    """qwen2_moe (routed and shared experts): transformers' default grouped experts have no ONNX
    translation; the batched ones trace, and the graph matches the model in onnxruntime."""
    out = tmp_path / "onnx"
    conversion = convert(models["qwen2_moe"], "onnx", out, dtype="f32")
    assert conversion.details["max_rel_diff"] < 1e-4
    result = run_cli("ckpt", "verify", str(out), "--json")
    verdict = json.loads(result.stdout)
    assert result.returncode == 0 and verdict["runtime"] == "onnxruntime", verdict["failures"]
    assert verdict["parity"]["top1_agreement"] == 1.0 and verdict["parity"]["greedy_identical"] == 1.0
