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
from lmforge.distributed.parallel import plan_layout
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
    pure = plan_layout(DistributedConfig(strategy="fsdp", tensor_parallel=2), _llama(), 2)
    assert pure.mesh_dims() == {"dp_shard": 1, "tp": 2} and pure.data == 1


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


# -- every layout rule the config alone decides, before any worker starts (config/layout_rules.py) --


def _config_file(tmp_path: Path, distributed: dict[str, Any], **sections: dict[str, Any]) -> Path:
    config = {
        "run": {"name": "layout", "output_dir": str(tmp_path / "runs")},
        "model": {"preset": "llama-tiny"},
        "tokenizer": {"train": {"vocab_size": 1000}},
        "data": {"train": [{"path": "builtin:python-stdlib"}], "max_length": 128},
        "distributed": distributed,
    }
    config.update(sections)
    path = tmp_path / "layout.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


REFUSED_AT_LOAD = {
    "ddp-x-tensor": (
        {"strategy": "ddp", "tensor_parallel": 2},
        {},
        "distributed.strategy: ddp with tensor_parallel: 2: tensor parallelism runs on FSDP2's",
    ),
    "deepspeed-x-tensor": (
        {"strategy": "deepspeed", "tensor_parallel": 2},
        {},
        "distributed.strategy: deepspeed with tensor_parallel: 2",
    ),
    "context-x-sft-packing": (
        {"strategy": "fsdp", "context_parallel": 2},
        {
            "train": {"stage": "sft"},
            "tokenizer": {"path": "tokenizer"},
            "data": {"train": [{"path": "rows.jsonl", "format": "alpaca"}], "packing": True},
        },
        "data.packing: true with context_parallel: 2: ring attention runs one causal mask",
    ),
    "interleaved-not-a-multiple": (
        {"strategy": "fsdp", "pipeline_parallel": 2, "pipeline_schedule": "interleaved_1f1b",
         "pipeline_microbatches": 3},
        {"train": {"micro_batch_size": 4}},
        "must be a multiple of pipeline_parallel (2); set distributed.pipeline_microbatches: 4",
    ),
    "context-x-pipeline": (
        {"strategy": "fsdp", "pipeline_parallel": 2, "context_parallel": 2},
        {},
        "pipeline_parallel: 2 with context_parallel: 2: pipeline stages compose with data sharding (FSDP2) only",
    ),
    "pipeline-x-tensor": (
        {"strategy": "fsdp", "pipeline_parallel": 2, "tensor_parallel": 2},
        {},
        "pipeline_parallel: 2 with tensor_parallel: 2: pipeline stages compose with data sharding",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(REFUSED_AT_LOAD))
def test_launch_dry_run_refuses_what_the_workers_would_refuse(tmp_path: Path, case: str) -> None:
    """Each of these passed `launch --dry-run` and was refused by the workers 38-53 s later."""
    distributed, sections, says = REFUSED_AT_LOAD[case]
    config = _config_file(tmp_path, distributed, **sections)
    result = CliRunner().invoke(app, ["launch", str(config), "--nproc-per-node", "4", "--dry-run"])
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output
    assert f"{config}" in result.output  # the file (and line) the key is on
    # Model-parallel layouts run on FSDP2's mesh only: no refusal recommends DDP (or DeepSpeed) for them.
    assert "or ddp" not in result.output and "strategy: ddp" not in result.output.replace(
        "distributed.strategy: ddp with", ""
    )


def test_train_and_estimate_refuse_a_layout_before_any_work(tmp_path: Path) -> None:
    config = _config_file(tmp_path, {"strategy": "ddp", "tensor_parallel": 2})
    for command in (["train", str(config)], ["estimate", str(config)]):
        # In process: the console entry point (cli/main.py main) turns a UserInputError into exit 2.
        result = CliRunner().invoke(app, command)
        refused = isinstance(result.exception, UserInputError) or result.exit_code == 2
        assert refused, (command, result.output, result.exception)
        assert "distributed.strategy: ddp with tensor_parallel: 2" in f"{result.exception} {result.output}"
    assert not (tmp_path / "runs").exists()  # train stopped before making the run directory


def test_the_workers_refuse_with_the_words_of_the_config_check() -> None:
    """An accelerate config can choose the engine in the worker: the worker's refusal is the same
    table's (distributed/strategy.py), word for word."""
    from lmforge.config.layout_rules import layout_problems
    from lmforge.distributed.ranks import World
    from lmforge.distributed.strategy import plan_for
    from tests.test_tensor_parallel import config_with

    cfg = config_with({"preset": "llama-tiny"}, {"strategy": "ddp", "tensor_parallel": 2})
    with pytest.raises(UserInputError) as refused:
        plan_for(cfg, precision="fp32", on_gpu=False, world=World(2, 2, 0))
    [(key, message)] = layout_problems(cfg)
    assert key == "distributed.strategy" and f"{key}: {message}" in str(refused.value)
