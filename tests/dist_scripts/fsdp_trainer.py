"""Train a tiny Llama with the HF Trainer under FSDP2 on CPU (gloo), through `lmforge`'s Trainer adapter.

Run under `torchrun --nproc_per_node 2 --master_port P tests/dist_scripts/fsdp_trainer.py OUT [--resume]`.
Writes OUT/rank{R}.json (or OUT/resume_rank{R}.json with --resume): the rank, the model's total
parameter count, the elements this rank held once the Trainer prepared the model (to prove it is
sharded) and the per-step losses. The first run saves checkpoints every 3 steps under OUT and a
full HF model in OUT/final; --resume restarts from OUT/checkpoint-3 into OUT/resumed; --plain
trains with a Trainer without the mixin (accelerate's own choice on CPU: DDP) into OUT/plain.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from lmforge.distributed.fsdp import fsdp_training_arguments, local_parameter_numel
from lmforge.distributed.ranks import leave_process_group
from lmforge.train.hf_trainer import HFTrainerAdapter

SEED = 1234
SEQ = 32
VOCAB = 256


class RandomTokens(Dataset[dict[str, torch.Tensor]]):
    """Random but learnable rows: arithmetic progressions mod VOCAB, so the loss visibly drops."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(SEED)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 3, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class FsdpTrainer(HFTrainerAdapter):
    pass


class PlainTrainer(Trainer):
    """Without the mixin: what accelerate does on its own with use_cpu=True (DDP, no sharding)."""


class Record(TrainerCallback):
    def __init__(self) -> None:
        self.local_numel: int | None = None
        self.fsdp_type: str | None = None
        self.losses: dict[int, float] = {}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.local_numel is None:
            self.local_numel = local_parameter_numel(kwargs["model"])

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses[state.global_step] = float(logs["loss"])


def main(out: Path, resume: bool, plain: bool) -> None:
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    args = TrainingArguments(
        output_dir=str(out / ("plain" if plain else "resumed" if resume else "")),
        use_cpu=True,
        per_device_train_batch_size=2,
        max_steps=6,
        save_steps=3,
        save_strategy="steps",
        logging_steps=1,
        learning_rate=1e-2,
        report_to=[],
        seed=SEED,
        data_seed=SEED,
        disable_tqdm=True,
        **fsdp_training_arguments(model),
    )
    record = Record()
    trainer_cls = PlainTrainer if plain else FsdpTrainer
    trainer = trainer_cls(model=model, args=args, train_dataset=RandomTokens(64), callbacks=[record])
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-3") if resume else None)
    if not resume and not plain:
        trainer.save_model(str(out / "final"))
    rank = trainer.args.process_index
    result = {
        "rank": rank,
        "world_size": trainer.args.world_size,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "total_params": total,
        "local_numel": record.local_numel,
        "losses": {str(k): v for k, v in sorted(record.losses.items())},
    }
    name = f"{'resume_' if resume else 'plain_' if plain else ''}rank{rank}.json"
    (out / name).write_text(json.dumps(result, indent=1))
    leave_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), resume="--resume" in sys.argv[2:], plain="--plain" in sys.argv[2:])
    # Results written, group gone: skip the interpreter's teardown, where gloo's threads once
    # aborted a complete run in CI (torch's exit, not what these runs test).
    sys.stdout.flush()
    os._exit(0)
