"""Parallelism as a protocol: the registry order, what `parallelize` returns, and that the parallel
state travels in a `ParallelState`, not as attributes on the model; one Trainer adapter, no mixins."""

from __future__ import annotations

import inspect
import subprocess
import sys
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import Trainer

from lmforge.config.load import load_config
from lmforge.config.schema import DistributedConfig
from lmforge.distributed import parallel
from lmforge.distributed.estimate import ModelShape, estimate_memory
from lmforge.distributed.layout import Layout
from lmforge.distributed.parallel_state import DimensionHooks, ParallelDimension
from lmforge.distributed.plan_terms import MemorySplit, Workload
from lmforge.distributed.planner import plan_layouts_for
from lmforge.errors import UserInputError
from lmforge.train.hf_trainer import HFTrainerAdapter, with_stage_trainer


def test_the_dimensions_apply_in_the_order_the_meshes_need() -> None:
    names = [dimension.name for dimension in parallel.DIMENSIONS]
    assert names == ["tensor", "context", "expert", "pipeline", "data_shard"]


def test_every_dimension_answers_every_hook_of_the_protocol() -> None:
    hooks = [
        name
        for name, _ in inspect.getmembers(ParallelDimension, inspect.isfunction)
        if not name.startswith("_")
    ]
    for dimension in parallel.DIMENSIONS:
        assert isinstance(dimension, DimensionHooks)
        for hook in hooks:
            mine = inspect.signature(getattr(type(dimension), hook))
            assert mine == inspect.signature(getattr(ParallelDimension, hook)), (dimension.name, hook)


def test_a_layout_without_model_parallelism_leaves_the_model_alone() -> None:
    model = torch.nn.Linear(4, 4)
    before = set(vars(model))
    state = parallel.parallelize(model, Layout(world_size=2, data=2, data_sharded=True), on_gpu=False)
    assert [dimension.name for dimension in state.dimensions] == ["data_shard"]
    assert state.mesh is None and state.pipeline is None and state.experts is None
    assert set(vars(model)) == before  # nothing travels on the model
    assert parallel.no_parallelism().dimensions == state.dimensions


def test_no_module_in_distributed_overrides_a_trainer_hook() -> None:
    for dimension in parallel.DIMENSIONS:
        assert not issubclass(type(dimension), Trainer)
        trainer_hooks = {
            name for name in vars(type(dimension)) if name.startswith("_") and hasattr(Trainer, name)
        }
        assert trainer_hooks <= {"__doc__", "__module__", "__init__"}, trainer_hooks


def test_a_stage_trainer_is_the_adapter_then_the_stage_class() -> None:
    class StageTrainer(Trainer):
        pass

    combined = with_stage_trainer(StageTrainer)
    assert combined.__mro__[1:3] == (HFTrainerAdapter, StageTrainer)


class _MadeUp(DimensionHooks):
    """A dimension no module of lmforge has: its checks and planner terms must reach `plan_layout`
    and the planner through the registry alone."""

    name = "made_up"

    def problems(self, settings: DistributedConfig, model_config: Any, world_size: int) -> list[str]:
        return [f"made_up: {model_config.model_type!r} has no made-up plan"]

    def planner_refusal(self, shape: ModelShape, degrees: Mapping[str, int]) -> str | None:
        return "made-up parallelism is not built yet"

    def planner_split(self, degree: int, work: Workload) -> MemorySplit:
        return MemorySplit(states=2)  # shards the states over two more ranks


def test_a_new_dimension_is_one_module_and_one_registry_line(monkeypatch: pytest.MonkeyPatch) -> None:
    base = {
        "model": {"config": {"model_type": "llama", "num_hidden_layers": 4, "tie_word_embeddings": False}},
        "data": {"train": [{"path": "builtin:python-stdlib"}], "max_length": 512},
        "train": {"micro_batch_size": 1, "precision": "bf16"},
    }
    cfg = load_config(None, [], base=base, tokenizer_optional=True)
    estimate = estimate_memory(cfg, gpus=2, gpu_mem_bytes=80 * 2**30, nodes=1)
    before = plan_layouts_for(cfg, estimate).layouts[0]

    monkeypatch.setattr(parallel, "DIMENSIONS", (*parallel.DIMENSIONS, _MadeUp()))

    with pytest.raises(UserInputError) as refused:
        parallel.plan_layout(DistributedConfig(strategy="fsdp"), SimpleNamespace(model_type="llama"), 2)
    assert str(refused.value).endswith("made_up: 'llama' has no made-up plan")
    after = plan_layouts_for(cfg, estimate).layouts[0]
    assert (after.data, after.tensor) == (before.data, before.tensor)
    assert not after.runnable and after.note == "made-up parallelism is not built yet"
    assert after.gradients == pytest.approx(before.gradients / 2, abs=1)
    assert after.optimizer == pytest.approx(before.optimizer / 2, abs=1)


def test_layouts_are_checked_and_planned_without_the_training_stack() -> None:
    """`plan_layout` and the planner ask the dimensions for their checks and terms before a run
    starts (`lmforge launch` refuses an impossible layout before any process starts): the
    registry and every dimension module import without torch or transformers."""
    heavy = ("torch", "transformers")
    modules = ", ".join(["lmforge.distributed.parallel", "lmforge.distributed.plan_terms"])
    code = f"import sys, {modules}; print([m for m in {heavy!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
