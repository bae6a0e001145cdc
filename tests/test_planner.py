"""`lmforge estimate` plans 3-D layouts: the degrees it allows, their memory, the order and the choice;
and it sizes an architecture that names no tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from lmforge.cli.main import app
from lmforge.config.load import load_config
from lmforge.distributed.estimate import estimate_memory
from lmforge.distributed.planner import plan_layouts_for

GIB = 2**30


def _config(model: dict[str, Any], **train: Any) -> Any:
    base = {
        "model": {"config": {"model_type": "llama", "tie_word_embeddings": False, **model}},
        "data": {"train": [{"path": "builtin:python-stdlib"}], "max_length": train.pop("max_length", 4096)},
        "train": {"micro_batch_size": 1, "precision": "bf16", "gradient_checkpointing": True, **train},
    }
    return load_config(None, [], base=base, tokenizer_optional=True)


LLAMA_7B = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
}


def _layouts(cfg: Any, gpus: int, mem: float | None) -> dict[str, Any]:
    estimate = estimate_memory(cfg, gpus=gpus, gpu_mem_bytes=None if mem is None else int(mem), nodes=1)
    return plan_layouts_for(cfg, estimate).to_dict()


def _row(plan: dict[str, Any], **degrees: int) -> dict[str, Any]:
    return next(r for r in plan["layouts"] if all(r[k] == v for k, v in degrees.items()))


def test_an_architecture_without_a_tokenizer_is_estimated_with_its_default_vocabulary(tmp_path: Path) -> None:
    config = tmp_path / "7b.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"config": {"model_type": "llama", **LLAMA_7B}},
                "data": {"train": [{"path": "d.jsonl"}]},
            }
        ),
        encoding="utf-8",
    )
    result = CliRunner().invoke(app, ["estimate", str(config), "--gpus", "8", "--gpu-mem", "80GB", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert (
        report["model"]["vocab_size"] == 32000 and report["model"]["vocab_source"] == "architecture default"
    )
    assert 6.6e9 < report["model"]["total_params"] < 6.8e9
    # Training still needs a tokenizer: the same file is refused by `lmforge train`'s loader.
    with pytest.raises(Exception, match="no tokenizer"):
        load_config(config)


def test_the_data_only_layout_equals_the_fsdp_strategy_row() -> None:
    cfg = _config(LLAMA_7B)
    estimate = estimate_memory(cfg, gpus=8, gpu_mem_bytes=80 * GIB, nodes=1)
    fsdp = next(r for r in estimate.strategies if r.strategy == "fsdp")
    data_only = _row(
        plan_layouts_for(cfg, estimate).to_dict(), data=8, tensor=1, context=1, pipeline=1, expert=1
    )
    assert data_only["parameters"] + data_only["gradients"] + data_only["optimizer"] == pytest.approx(
        fsdp.model_states_gpu, rel=1e-6
    )
    assert data_only["total"] == pytest.approx(fsdp.total_gpu, rel=1e-6)


def test_only_degrees_the_model_allows_are_listed() -> None:
    # 12 heads / 4 KV heads: TP 1, 2 or 4 on an 8-GPU node; 30 layers: 1 or 2 pipeline stages of 8.
    cfg = _config(
        {
            **LLAMA_7B,
            "hidden_size": 3072,
            "num_attention_heads": 12,
            "num_key_value_heads": 4,
            "num_hidden_layers": 30,
        }
    )
    plan = _layouts(cfg, gpus=8, mem=None)
    assert {r["tensor"] for r in plan["layouts"]} == {1, 2, 4}
    assert {r["pipeline"] for r in plan["layouts"]} == {1, 2}
    assert {r["expert"] for r in plan["layouts"]} == {1}  # a dense model
    assert all(r["data"] * r["tensor"] * r["context"] * r["pipeline"] == 8 for r in plan["layouts"])
    assert all(4096 % (2 * r["context"]) == 0 for r in plan["layouts"])


def test_tensor_parallel_divides_weights_and_activations_and_pipelines_pay_a_bubble() -> None:
    cfg = _config(LLAMA_7B, gradient_checkpointing=False)
    cfg = cfg.model_copy(
        update={"distributed": cfg.distributed.model_copy(update={"pipeline_microbatches": 8})}
    )
    plan = _layouts(cfg, gpus=8, mem=None)
    one, two = _row(plan, tensor=1, context=1, pipeline=1), _row(plan, tensor=2, context=1, pipeline=1)
    assert two["activations"] == pytest.approx(one["activations"] / 2, rel=1e-6)
    assert two["logits"] == one["logits"]  # transformers' plan gathers the head's logits on every rank
    staged = _row(plan, tensor=1, context=1, pipeline=2)
    assert staged["bubble"] == pytest.approx(1 / 9, abs=1e-4)  # (p - 1) / (m + p - 1), m = 8 micro-batches
    # 1F1B keeps p = 2 of the 8 chunks (each 1/8 of the micro-batch) of its half of the layers in flight.
    assert staged["activations"] == pytest.approx(one["activations"] / 2 / 8 * 2, rel=1e-6)
    assert one["bubble"] == 0
    cp = _row(plan, tensor=1, context=2, pipeline=1)
    assert cp["logits"] == pytest.approx(one["logits"] / 2, rel=1e-6)


def test_the_recommendation_follows_the_order_and_skips_what_does_not_fit() -> None:
    cfg = _config(LLAMA_7B, gradient_checkpointing=False, micro_batch_size=2)
    plan = _layouts(cfg, gpus=8, mem=None)
    data_only = _row(plan, tensor=1, context=1, pipeline=1)
    tp2 = _row(plan, tensor=2, context=1, pipeline=1)
    assert tp2["total"] < data_only["total"]
    budget = (tp2["total"] + data_only["total"]) / 2 / 0.9  # fits TP 2 but not data parallelism alone
    chosen = _layouts(cfg, gpus=8, mem=budget)
    assert (chosen["recommended"]["data"], chosen["recommended"]["tensor"]) == (4, 2)
    nothing = _layouts(cfg, gpus=8, mem=GIB)
    assert nothing["recommended"] is None and "no layout fits" in nothing["reason"]


def test_expert_parallel_degrees_divide_the_experts_of_an_moe_model() -> None:
    moe = {
        "model_type": "mixtral",
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }
    base = {
        "model": {"config": moe},
        "data": {"train": [{"path": "builtin:python-stdlib"}], "max_length": 1024},
        "train": {"micro_batch_size": 1, "precision": "bf16"},
    }
    cfg = load_config(None, [], base=base, tokenizer_optional=True)
    plan = _layouts(cfg, gpus=8, mem=None)
    assert {r["expert"] for r in plan["layouts"]} == {1, 2, 4}
    one, four = _row(plan, data=8, tensor=1, expert=1), _row(plan, data=8, tensor=1, expert=4)
    assert four["parameters"] < one["parameters"]  # the experts are split four ways
    assert four["runnable"] and four["note"] == "fsdp x ep"  # experts over the data ranks
    both = _row(plan, data=4, tensor=2, expert=2)
    assert not both["runnable"] and "expert parallelism composes with data sharding only" in both["note"]


def test_an_architecture_transformers_refuses_is_a_config_error_not_a_traceback(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    model = {"model_type": "llama", **LLAMA_7B, "num_attention_heads": 12}  # 4096 is not a multiple of 12
    config.write_text(
        yaml.safe_dump({"model": {"config": model}, "data": {"train": [{"path": "d.jsonl"}]}}),
        encoding="utf-8",
    )
    result = CliRunner().invoke(app, ["estimate", str(config), "--gpu-mem", "80GB"])
    assert result.exit_code == 2
    assert "model.config: transformers cannot build a 'llama' config" in result.output
    assert "not a multiple of the number of attention heads" in result.output


def test_strategy_auto_takes_tensor_parallelism_before_offloading() -> None:
    from lmforge.distributed.strategy import _model_parallel_choice

    cfg = _config(LLAMA_7B, gradient_checkpointing=False, micro_batch_size=2)
    plan = _layouts(cfg, gpus=8, mem=None)
    budget = int(
        (
            _row(plan, tensor=2, context=1, pipeline=1)["total"]
            + _row(plan, tensor=1, context=1, pipeline=1)["total"]
        )
        / 2
        / 0.9
    )
    estimate = estimate_memory(cfg, gpus=8, gpu_mem_bytes=budget, nodes=1)
    assert (
        estimate.recommended is not None and "offload" in estimate.recommended
    )  # data-parallel would offload
    settings, reason = _model_parallel_choice(cfg, estimate, budget, 8) or (None, "")
    assert settings is not None and (settings.strategy, settings.tensor_parallel) == ("fsdp", 2)
    assert "fsdp x tp (data 4 x tensor 2)" in reason
    lora = cfg.model_copy(update={"train": cfg.train.model_copy(update={"method": "lora"})})
    assert _model_parallel_choice(lora, estimate, budget, 8) is None  # adapters cannot take TP


def test_strategy_auto_takes_pipeline_stages_where_tensor_parallelism_cannot_split_the_heads() -> None:
    from lmforge.distributed.strategy import _model_parallel_choice

    one_kv_head = {**LLAMA_7B, "num_key_value_heads": 1}  # no tensor degree but 1 divides one KV head
    # Eager attention: context parallelism (next in the order, and it would fit) needs sdpa, so the
    # choice falls through to the pipeline layout.
    cfg = _config(one_kv_head, gradient_checkpointing=False, micro_batch_size=2)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"attn_implementation": "eager"})})
    plan = _layouts(cfg, gpus=8, mem=None)
    assert {r["tensor"] for r in plan["layouts"]} == {1}
    staged, data_only = (
        _row(plan, tensor=1, context=1, pipeline=2),
        _row(plan, tensor=1, context=1, pipeline=1),
    )
    assert staged["runnable"] and staged["total"] < data_only["total"]
    budget = int((staged["total"] + data_only["total"]) / 2 / 0.9)
    estimate = estimate_memory(cfg, gpus=8, gpu_mem_bytes=budget, nodes=1)
    assert (
        estimate.recommended is None or "offload" in estimate.recommended
    )  # no data-parallel choice on-device
    settings, reason = _model_parallel_choice(cfg, estimate, budget, 8) or (None, "")
    assert settings is not None and (settings.strategy, settings.pipeline_parallel) == ("fsdp", 2)
    assert "fsdp x pp (data 4 x pipeline 2)" in reason
    # A micro-batch the two stages cannot cut in two: the data-parallel choice (offload) stands.
    too_small = cfg.model_copy(update={"train": cfg.train.model_copy(update={"micro_batch_size": 1})})
    assert _model_parallel_choice(too_small, estimate, budget, 8) is None


def test_strategy_auto_takes_context_parallelism_for_long_sequences_before_pipeline_stages() -> None:
    from lmforge.distributed.strategy import _model_parallel_choice

    one_kv_head = {**LLAMA_7B, "num_key_value_heads": 1}  # tensor parallelism cannot split it
    cfg = _config(one_kv_head, gradient_checkpointing=False, micro_batch_size=2, max_length=4096)
    plan = _layouts(cfg, gpus=8, mem=None)
    split, data_only = (
        _row(plan, tensor=1, context=2, pipeline=1),
        _row(plan, tensor=1, context=1, pipeline=1),
    )
    assert split["runnable"] and split["note"] == "fsdp x cp"
    # Each rank holds half of every sequence: activations and logits halve.
    assert split["activations"] == pytest.approx(data_only["activations"] / 2, rel=1e-6)
    budget = int((split["total"] + data_only["total"]) / 2 / 0.9)
    estimate = estimate_memory(cfg, gpus=8, gpu_mem_bytes=budget, nodes=1)
    assert estimate.recommended is not None and "offload" in estimate.recommended
    settings, reason = _model_parallel_choice(cfg, estimate, budget, 8) or (None, "")
    assert settings is not None and (settings.strategy, settings.context_parallel) == ("fsdp", 2)
    assert "fsdp x cp (data 4 x context 2)" in reason
    # A stage context parallelism cannot split (a sequence's log-probabilities): no model parallelism.
    dpo = cfg.model_copy(update={"train": cfg.train.model_copy(update={"stage": "dpo"})})
    assert _model_parallel_choice(dpo, estimate, budget, 8) is None
