"""Training overhead: lmforge's steady-state step throughput vs a bare HF Trainer.

Same model (llama-tiny), same data blocks, same batch, same seed, fp32, in one process.
The bare Trainer logs at the same cadence with nothing else on; lmforge runs with its
defaults (metrics.jsonl, TensorBoard, token counting, NaN-visible logging). Runs are
interleaved (bare, lmforge, bare, lmforge, ...) so drift of the machine hits both.

    .venv/bin/python bench/train_overhead.py [--steps 60 --warmup 10 --repeats 2]
    # a larger model on a GPU, in bf16:
    python bench/train_overhead.py --precision bf16 --seq-len 1024 \
        --model-config '{"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, \
                         "num_attention_heads": 12, "num_key_value_heads": 12}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed

from lmforge.config import load_config
from lmforge.data.run_data import prepare_data_for_run
from lmforge.models.build import build_model
from lmforge.run_layout import RunPaths
from lmforge.train.runner import run_training


class StepClock(TrainerCallback):
    """Wall-clock time at the end of every optimizer step."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.ends.append(time.perf_counter())

    def steps_per_s(self, warmup: int) -> float:
        steady = self.ends[warmup:]
        return (len(steady) - 1) / (steady[-1] - steady[0])


def lmforge_config(  # type: ignore[no-untyped-def]
    out: Path,
    steps: int,
    log_every: int,
    *,
    precision: str = "fp32",
    seq_len: int = 256,
    model_config: dict | None = None,
):
    return load_config(
        None,
        base={
            "run": {"name": "lmforge", "output_dir": str(out), "seed": 0, "overwrite": True},
            "model": {"preset": "llama-tiny", **({"config": model_config} if model_config else {})},
            "tokenizer": {"train": {"vocab_size": 8192, "max_chars": 3_000_000}},
            "data": {
                "train": [{"path": "builtin:python-stdlib", "max_documents": 400}],
                "max_length": seq_len,
                "cache_dir": str(out / "cache"),
            },
            "train": {
                "max_steps": steps,
                "micro_batch_size": 8,
                "precision": precision,
                "log_every": log_every,
                "resume": "never",
            },
        },
    )


def run_bare(cfg, tokenizer, data, out: Path) -> StepClock:  # type: ignore[no-untyped-def]
    set_seed(cfg.run.seed)
    model = build_model(cfg.model, tokenizer, max_length=cfg.data.max_length)
    clock = StepClock()
    args = TrainingArguments(
        output_dir=str(out / "bare"),
        max_steps=cfg.train.max_steps,
        per_device_train_batch_size=8,
        learning_rate=cfg.train.lr,
        lr_scheduler_type="cosine",
        logging_steps=cfg.train.log_every,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        bf16=cfg.train.precision == "bf16",
        seed=cfg.run.seed,
        dataloader_pin_memory=False,
        disable_tqdm=False,
    )
    Trainer(
        model=model,
        args=args,
        train_dataset=data.train,
        data_collator=data.collator,
        callbacks=[clock],
    ).train()
    return clock


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--model-config", type=json.loads, default=None, help="llama-tiny fields to override")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        cfg = lmforge_config(
            out,
            opts.steps,
            opts.log_every,
            precision=opts.precision,
            seq_len=opts.seq_len,
            model_config=opts.model_config,
        )
        tokenizer, data = prepare_data_for_run(cfg, RunPaths(out / "prep"))
        bare, ours = [], []
        for _ in range(opts.repeats):
            bare.append(run_bare(cfg, tokenizer, data, out).steps_per_s(opts.warmup))
            clock = StepClock()
            run_training(cfg, extra_callbacks=[clock])
            ours.append(clock.steps_per_s(opts.warmup))
    ratio = statistics.median(ours) / statistics.median(bare)
    tokens = 8 * cfg.data.max_length
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"device: {device}, threads {torch.get_num_threads()}, {opts.precision}, seq {opts.seq_len}")
    print(
        f"bare HF Trainer : {statistics.median(bare):.3f} steps/s ({statistics.median(bare) * tokens:.0f} tokens/s) runs={bare}"
    )
    print(
        f"lmforge         : {statistics.median(ours):.3f} steps/s ({statistics.median(ours) * tokens:.0f} tokens/s) runs={ours}"
    )
    print(f"ratio lmforge / bare: {ratio:.3f}  (goal >= 0.97)")


if __name__ == "__main__":
    main()
