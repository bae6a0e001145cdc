"""Expert parallelism on CPU (gloo) through lmforge's `shard_experts`: the engine, then the HF Trainer.

`torchrun --nproc_per_node 2 --master_port P tests/dist_scripts/ep_worker.py OUT` runs, on every rank:
1. engine: a tiny Qwen2-MoE built from seed 0, a copy kept whole as the single-process reference;
   `shard_experts` (expert = data = 2), FSDP2 over the data ranks as the Trainer path wraps it
   (`shard_experts_over_data`, then `shard_data_over_mesh`); each rank trains on its half of a
   4-row batch, the reference on the whole batch, both with AdamW, 3 steps. Recorded: the shape of
   each rank's slice of every parameter, which reference experts its rows are, and per step the
   loss gap and the largest gradient gap of every parameter (sharded gradients gathered whole).
2. trainer: the same model class, fresh from seed 0, 3 HF Trainer steps under the Trainer adapter.
`python tests/dist_scripts/ep_worker.py OUT` (one process) runs step 2 unsharded: the reference
losses. Every rank writes OUT/rank{R}.json.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import Dataset
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, TrainerCallback, TrainingArguments

from lmforge.distributed.expert_parallel import shard_experts_over_data
from lmforge.distributed.fsdp import fsdp_training_arguments
from lmforge.distributed.layout import Layout
from lmforge.distributed.parallel import parallelize
from lmforge.distributed.parallel_state import ParallelState
from lmforge.distributed.ranks import leave_process_group
from lmforge.distributed.tensor_parallel import local_shapes, shard_data_over_mesh
from lmforge.train.hf_trainer import HFTrainerAdapter

SEQ, VOCAB, GLOBAL_BATCH, STEPS, EXPERTS = 16, 128, 4, 3, 4
LAYER = "Qwen2MoeDecoderLayer"


def tiny_moe() -> Qwen2MoeForCausalLM:
    """4 experts of width 32, top-2, one shared expert, 2 layers: seconds on a CPU."""
    torch.manual_seed(0)
    config = Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        tie_word_embeddings=True,
    )
    return Qwen2MoeForCausalLM(config)


def progressions(count: int, offset: int = 0) -> torch.Tensor:
    """Learnable rows (arithmetic progressions mod VOCAB)."""
    g = torch.Generator().manual_seed(offset)
    start = torch.randint(0, VOCAB, (count, 1), generator=g)
    stride = torch.randint(1, 3, (count, 1), generator=g)
    return (start + stride * torch.arange(SEQ)) % VOCAB


def ep_layout(world: int) -> Layout:
    return Layout(world_size=world, data=world, data_sharded=True, expert=world)


def wrap_like_the_trainer(model: nn.Module, world: int, state: ParallelState) -> None:
    """FSDP2 as the data-shard dimension applies it, with FSDP2's default settings: a stand-in for the Trainer whose
    only fields `shard_data_over_mesh` reads are the model and the FSDP plugin."""
    plugin = SimpleNamespace(mixed_precision_policy=None, cpu_offload=None, reshard_after_forward=True)
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), num_processes=world)
    shard_experts_over_data(model, state, plugin)
    assert shard_data_over_mesh(SimpleNamespace(model=model, accelerator=accelerator), state.mesh, [LAYER])


def held_experts(model: nn.Module, reference: nn.Module) -> list[int]:
    """Which reference experts this rank's rows of layer 0's gate_up_proj are, in order."""
    name = "model.layers.0.mlp.experts.gate_up_proj"
    local = dict(model.named_parameters())[name]
    rows = local.to_local() if isinstance(local, DTensor) else local
    full = dict(reference.named_parameters())[name]
    return [i for row in rows for i in range(EXPERTS) if torch.equal(row, full[i])]


def mesh_param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """One AdamW group per device mesh: a foreach kernel cannot mix DTensors of different meshes
    (the HF Trainer splits its groups the same way)."""
    groups: dict[Any, list[nn.Parameter]] = {}
    for param in model.parameters():
        groups.setdefault(getattr(param, "device_mesh", None), []).append(param)
    return [{"params": params} for params in groups.values()]


def gradient_gaps(model: nn.Module, reference: nn.Module) -> dict[str, list[float]]:
    """Per parameter: [largest |gradient - reference gradient|, largest |reference gradient|],
    sharded gradients gathered whole (a collective: every rank calls it)."""
    gaps = {}
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        want = expected[name].grad
        gaps[name] = [float((grad - want).abs().max()), float(want.abs().max())]
    return gaps


def engine_run(world: int, rank: int) -> dict[str, Any]:
    model = tiny_moe()
    reference = copy.deepcopy(model)
    state = parallelize(model, ep_layout(world), on_gpu=False)
    shapes, held = local_shapes(model), held_experts(model, reference)
    wrap_like_the_trainer(model, world, state)
    batch = progressions(GLOBAL_BATCH)
    mine = batch.chunk(world)[rank]  # the data ranks split the global batch, as the Trainer's loader does
    optimizer = torch.optim.AdamW(mesh_param_groups(model), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    steps = []
    for _ in range(STEPS):
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        expected = reference(input_ids=batch, labels=batch).loss
        expected.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # equal token counts: the mean of the ranks' losses is the batch's
        mean /= world
        gaps = gradient_gaps(model, reference)
        steps.append({"loss": float(mean), "reference": float(expected), "grad_gaps": gaps})
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()
    return {"shapes": shapes, "held_experts": held, "steps": steps}


class Rows(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, count: int) -> None:
        self.ids = progressions(count)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class EpTrainer(HFTrainerAdapter):
    pass


class Losses(TrainerCallback):
    def __init__(self) -> None:
        self.losses: dict[str, float] = {}
        self.grad_norms: dict[str, float] = {}
        self.shapes: dict[str, Any] | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.shapes is None:
            self.shapes = local_shapes(model)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses[str(state.global_step)] = float(logs["loss"])
            self.grad_norms[str(state.global_step)] = float(logs["grad_norm"])


def trainer_run(out: Path, world: int) -> dict[str, Any]:
    model = tiny_moe()
    engine: dict[str, Any] = {}
    parallel = None
    if world > 1:
        parallel = parallelize(model, ep_layout(world), on_gpu=False)
        engine = fsdp_training_arguments(model, wrap_layers=False)
    record = Losses()
    args = TrainingArguments(
        output_dir=str(out / "ck"),
        use_cpu=True,
        per_device_train_batch_size=GLOBAL_BATCH // world,
        max_steps=STEPS,
        save_strategy="no",
        logging_steps=1,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,  # below the measured norms (1.6-3.1): clipping, over both meshes, runs
        report_to=[],
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        **engine,
    )
    trainer = EpTrainer(model=model, args=args, train_dataset=Rows(32), callbacks=[record], parallel=parallel)
    trainer.train()
    return {
        "losses": record.losses,
        "grad_norms": record.grad_norms,
        "shapes": record.shapes,
        "distributed_type": str(trainer.accelerator.distributed_type),
    }


def main(out: Path) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    result: dict[str, Any] = {"rank": rank, "world_size": world}
    if world > 1:
        dist.init_process_group("gloo")
        result["engine"] = engine_run(world, rank)
    result["trainer"] = trainer_run(out, world)
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    leave_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # Results written, group gone: skip the interpreter's teardown, where gloo's threads once
    # aborted a complete run in CI (torch's exit, not what these runs test).
    sys.stdout.flush()
    os._exit(0)
