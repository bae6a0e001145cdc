"""Train a tiny Llama with the HF Trainer under tensor and / or context parallelism (alone, or with
FSDP2 on the same mesh) on CPU (gloo), through lmforge's
`parallelize` and the Trainer adapter (train/hf_trainer.py).

Run `python tests/dist_scripts/tp_trainer.py OUT 1` for the single-process reference, or
`torchrun --nproc_per_node N --master_port P tests/dist_scripts/tp_trainer.py OUT TP [--context CP]
[--resume]` (data_shard = N / (TP x CP)). Every rank writes OUT/[resume_]rank{R}.json: the shape of
its slice of every parameter after the Trainer prepared the model, the sample ids of each batch it
read, the sequence lengths its first attention layer saw in training, the per-step train losses
and grad norms and the eval losses. A run saves a DCP checkpoint at step 2 under OUT/ck and the
full model in OUT/final; --resume restarts from OUT/ck/checkpoint-2.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

from lmforge.distributed.fsdp import fsdp_training_arguments
from lmforge.distributed.layout import Layout
from lmforge.distributed.parallel import parallelize
from lmforge.distributed.ranks import leave_process_group
from lmforge.distributed.tensor_parallel import local_shapes
from lmforge.train.hf_trainer import HFTrainerAdapter
from lmforge.train.numerics import rank_flops_per_token

SEQ, VOCAB, GLOBAL_BATCH, STEPS = 32, 256, 4, 4


class Progressions(Dataset[dict[str, torch.Tensor]]):
    """Learnable rows (arithmetic progressions mod VOCAB); `offset` tells two sets apart."""

    def __init__(self, count: int, offset: int = 0) -> None:
        g = torch.Generator().manual_seed(offset)
        start = torch.randint(0, VOCAB, (count, 1), generator=g)
        stride = torch.randint(1, 3, (count, 1), generator=g)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB
        self.offset = offset

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i], "sample": torch.tensor(self.offset + i)}


class Batches:
    """Collates, and remembers which samples each training batch of this rank held."""

    def __init__(self) -> None:
        self.read: list[list[int]] = []

    def __call__(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        samples = [int(r["sample"]) for r in rows]
        if samples[0] < 1000:  # training rows; eval rows are offset by 1000
            self.read.append(samples)
        return {key: torch.stack([r[key] for r in rows]) for key in ("input_ids", "labels")}


class TpTrainer(HFTrainerAdapter):
    pass


class Record(TrainerCallback):
    def __init__(self) -> None:
        self.shapes: dict[str, Any] | None = None
        self.losses: dict[str, float] = {}
        self.grad_norms: dict[str, float] = {}
        self.eval_losses: dict[str, float] = {}

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.shapes is None:  # after the Trainer prepared (FSDP2-wrapped) the model
            self.shapes = local_shapes(model)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses[str(state.global_step)] = float(logs["loss"])
            self.grad_norms[str(state.global_step)] = float(logs["grad_norm"])
        if logs and "eval_loss" in logs:
            self.eval_losses[str(state.global_step)] = float(logs["eval_loss"])


def seen_lengths(model: torch.nn.Module) -> dict[str, list[int]]:
    """The sequence lengths the first attention layer receives in training and in evaluation."""
    seen: dict[str, list[int]] = {"train": [], "eval": []}

    def note(module: Any, args: Any, kwargs: Any) -> None:
        seen["train" if module.training else "eval"].append(int(kwargs["hidden_states"].shape[1]))

    model.model.layers[0].self_attn.register_forward_pre_hook(note, with_kwargs=True)
    return seen


def main(out: Path, tensor: int, context: int, resume: bool) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    lengths = seen_lengths(model)
    engine: dict[str, Any] = {}
    parallel = None
    if tensor * context > 1:
        layout = Layout(
            world_size=world,
            data=world // (tensor * context),
            data_sharded=True,
            tensor=tensor,
            context=context,
        )
        parallel = parallelize(model, layout, on_gpu=False)
        engine = fsdp_training_arguments(model, wrap_layers=False)
    flops_per_token = rank_flops_per_token(model, SEQ)  # of this rank's shard of the model (MFU)
    batches, record = Batches(), Record()
    args = TrainingArguments(
        output_dir=str(out / "ck"),
        use_cpu=True,
        per_device_train_batch_size=GLOBAL_BATCH * tensor * context // world,
        # One row per eval batch: eval_loss is then the mean over rows whatever the sharding.
        per_device_eval_batch_size=1,
        max_steps=STEPS,
        save_strategy="steps",
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        eval_on_start=not resume,
        logging_steps=1,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        report_to=[],
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        remove_unused_columns=False,
        **engine,
    )
    trainer = TpTrainer(
        model=model,
        args=args,
        train_dataset=Progressions(64),
        eval_dataset=Progressions(9, offset=1000),  # 9 rows: over 2 data ranks the last step is cut
        data_collator=batches,
        callbacks=[record],
        parallel=parallel,
    )
    trainer.train(resume_from_checkpoint=str(out / "ck" / "checkpoint-2") if resume else None)
    if not resume:
        trainer.save_model(str(out / "final"))  # a collective: every rank gathers, rank 0 writes
    rank = trainer.args.process_index
    result = {
        "rank": rank,
        "world_size": world,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "shapes": record.shapes,
        "batches": batches.read,
        "losses": record.losses,
        "grad_norms": record.grad_norms,
        "eval_losses": record.eval_losses,
        "lengths": lengths,
        "flops_per_token": flops_per_token,
    }
    (out / f"{'resume_' if resume else ''}rank{rank}.json").write_text(json.dumps(result, indent=1))
    leave_process_group()


if __name__ == "__main__":
    flags = sys.argv[3:]
    degree = int(flags[flags.index("--context") + 1]) if "--context" in flags else 1
    main(Path(sys.argv[1]), int(sys.argv[2]), degree, resume="--resume" in flags)
    # Results written, group gone: skip the interpreter's teardown, where gloo's threads once
    # aborted a complete run in CI (torch's exit, not what these runs test).
    sys.stdout.flush()
    os._exit(0)
