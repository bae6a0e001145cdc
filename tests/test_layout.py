"""distributed.{tensor,context,pipeline,expert}_parallel -> a device mesh, and every combination the
engines cannot run refused with its reason and fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from transformers import AutoConfig
from typer.testing import CliRunner

from lmforge.cli.main import app
from lmforge.config.schema import DistributedConfig
from lmforge.distributed.layout import plan_layout
from lmforge.errors import UserInputError


def _llama(**fields: Any) -> Any:
    shape = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4}
    return AutoConfig.for_model("llama", **{**shape, **fields})


def _refusal(settings: dict[str, Any], model: Any, world: int) -> str:
    with pytest.raises(UserInputError) as caught:
        plan_layout(DistributedConfig(**settings), model, world)
    return str(caught.value)


def test_fsdp_with_tensor_parallel_is_a_two_dimensional_mesh() -> None:
    layout = plan_layout(DistributedConfig(strategy="fsdp", tensor_parallel=2), _llama(), 4)
    assert (layout.data, layout.tensor, layout.data_sharded) == (2, 2, True)
    assert layout.mesh_dims() == {"dp_shard": 2, "tp": 2}
    assert layout.describe() == "data_shard=2 x tensor=2"
    pure = plan_layout(DistributedConfig(strategy="ddp", tensor_parallel=2), _llama(), 2)
    assert pure.mesh_dims() == {"dp_replicate": 1, "tp": 2} and pure.data == 1


@pytest.mark.parametrize(
    ("settings", "model", "world", "says"),
    [
        (
            {"tensor_parallel": 3},
            _llama(num_attention_heads=6, hidden_size=384),
            3,
            "num_key_value_heads (2)",
        ),
        (
            {"tensor_parallel": 8},
            _llama(),
            8,
            "num_attention_heads (4) and num_key_value_heads (2): each rank must hold whole heads; choose tensor_parallel from [1, 2]",
        ),
        ({"tensor_parallel": 2}, _llama(), 3, "does not divide the world size 3"),
        (
            {"tensor_parallel": 2},
            AutoConfig.for_model("gpt2"),
            2,
            "no tensor-parallel plan (tp_plan) for 'gpt2'",
        ),
        (
            {"tensor_parallel": 2, "strategy": "deepspeed"},
            _llama(),
            2,
            "DeepSpeed ZeRO runs data parallelism",
        ),
        ({"pipeline_parallel": 3}, _llama(), 3, "do not divide the model's 4 layers"),
        (
            {"pipeline_parallel": 2},
            AutoConfig.for_model("gemma", hidden_size=256, num_attention_heads=4, num_key_value_heads=2),
            2,
            "'gemma' is not a family whose stages lmforge cuts",
        ),
        (
            {"pipeline_parallel": 2, "pipeline_schedule": "interleaved_1f1b"},
            _llama(num_hidden_layers=6),
            2,
            "with schedule interleaved_1f1b makes 4 stages, which do not divide the model's 6 layers",
        ),
        (
            {"pipeline_parallel": 2, "tensor_parallel": 2},
            _llama(),
            4,
            "pipeline_parallel: 2 with tensor_parallel: 2: pipeline stages compose with data sharding (FSDP2) only",
        ),
        (
            {"context_parallel": 2},
            AutoConfig.for_model("mistral", hidden_size=256, num_attention_heads=4, sliding_window=64),
            2,
            "'mistral' has sliding_attention layers; ring attention runs full causal attention only",
        ),
        (
            {"context_parallel": 2},
            AutoConfig.for_model(
                "gemma2", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2
            ),
            2,
            "'gemma2' has sliding_attention layers",
        ),
        (
            {"context_parallel": 2, "pipeline_parallel": 2},
            _llama(),
            4,
            "pipeline_parallel: 2 with context_parallel: 2: pipeline stages compose with data sharding (FSDP2) only",
        ),
        ({"expert_parallel": 2}, _llama(), 2, "'llama' is a dense model"),
    ],
)
def test_impossible_layouts_are_refused_with_the_reason_and_the_fix(
    settings: dict[str, Any], model: Any, world: int, says: str
) -> None:
    assert says in _refusal(settings, model, world)


def test_pipeline_stages_sit_inside_the_data_dimension() -> None:
    layout = plan_layout(DistributedConfig(strategy="fsdp", pipeline_parallel=2), _llama(), 4)
    assert (layout.data, layout.pipeline) == (2, 2)
    # Neighbouring ranks are one pipeline's stages: accelerate gives them one batch.
    assert layout.mesh_dims() == {"dp_shard": 2, "pp": 2}
    assert layout.describe() == "data_shard=2 x pipeline=2"


def test_context_and_tensor_parallel_nest_inside_the_data_dimension() -> None:
    layout = plan_layout(
        DistributedConfig(strategy="fsdp", context_parallel=2, tensor_parallel=2), _llama(), 8
    )
    assert (layout.data, layout.context, layout.tensor) == (2, 2, 2)
    # tensor innermost, then context: a context group's ranks are one tensor group apart
    assert layout.mesh_dims() == {"dp_shard": 2, "cp": 2, "tp": 2}
    assert layout.describe() == "data_shard=2 x context=2 x tensor=2"
    # a full-attention Mistral (no window) runs: only windowed layers are refused
    mistral = AutoConfig.for_model("mistral", hidden_size=256, num_attention_heads=4, sliding_window=None)
    assert plan_layout(DistributedConfig(strategy="fsdp", context_parallel=2), mistral, 2).context == 2


def test_expert_parallel_must_divide_the_experts() -> None:
    mixtral = AutoConfig.for_model(
        "mixtral", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_local_experts=6
    )
    assert "does not divide the model's 6 experts" in _refusal({"expert_parallel": 4}, mixtral, 4)


def test_every_problem_is_listed_at_once() -> None:
    message = _refusal({"tensor_parallel": 8, "pipeline_parallel": 3}, _llama(), 12)
    assert (
        "num_attention_heads (4)" in message
        and "4 layers" in message
        and "does not divide the world" in message
    )


def _tp_config(tmp_path: Path) -> Path:
    config = tmp_path / "tp.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"preset": "llama-tiny"},
                "tokenizer": {"train": {"vocab_size": 1000}},
                "data": {"train": [{"path": "builtin:python-stdlib"}], "max_length": 128},
                "distributed": {"strategy": "fsdp", "tensor_parallel": 2},
            }
        ),
        encoding="utf-8",
    )
    return config


def test_launch_dry_run_prints_the_mesh_with_the_command(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["launch", str(_tp_config(tmp_path)), "--nproc-per-node", "4", "--dry-run"]
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "# device mesh: data_shard=2 x tensor=2 (4 processes)" in lines
    assert any("torch.distributed.run" in line and "--nproc-per-node 4" in line for line in lines)


def test_launch_refuses_an_impossible_mesh_before_starting_anything(tmp_path: Path) -> None:
    config = _tp_config(tmp_path)
    result = CliRunner().invoke(app, ["launch", str(config), "--nproc-per-node", "3", "--dry-run"])
    assert result.exit_code == 2
    assert "tensor_parallel x context_parallel x pipeline_parallel = 2 does not divide the world size 3" in (
        result.output
    )
    result = CliRunner().invoke(
        app, ["launch", str(config), "distributed.tensor_parallel=4", "--nproc-per-node", "4", "--dry-run"]
    )
    assert result.exit_code == 2 and "choose tensor_parallel from [1, 2]" in result.output
    assert "Traceback" not in result.output
