"""LoRA SFT step throughput: lmforge `run_training` vs TRL's `SFTTrainer`, configured the same way.

Both load the same saved llama-tiny (fp32, sdpa) and its ChatML tokenizer from one HF directory
(`model.path` / `from_pretrained`), read the same synthetic chat JSONL (heavy-tailed answer
lengths), train the same LoRA (r=8, alpha=16, dropout 0.05, all-linear) with the same micro-batch,
max_length, lr, cosine schedule, seed and number of steps, loss on assistant tokens only, padded
to the longest in the batch (packing off), no gradient checkpointing, logging every step.

- **TRL**: `SFTTrainer(model=AutoModelForCausalLM.from_pretrained(dir), args=SFTConfig(...),
  train_dataset=Dataset of {"messages"}, processing_class=tokenizer, peft_config=LoraConfig(...))`
  with `assistant_only_loss=True` (the ChatML template has `{% generation %}` markers); non-pad
  tokens counted by HF's `include_num_input_tokens_seen="non_padding"` (its batches' attention_mask).
- **lmforge**: `run_training(load_config(None, base={...}))`, `train.stage: sft`, `train.method:
  lora`, lmforge defaults otherwise (metrics.jsonl, TensorBoard, checkpoint-commit callback);
  non-pad tokens counted exactly by its collator (`tokens_seen`).
- **lmforge packed**: the same with `data.packing: true` (same micro-batch, of packed rows of max_length;
  `--packed-steps` of them, since a packed step holds about ten times the tokens of a padded one).

Each run is its own spawned child process; runs alternate TRL, lmforge, lmforge packed. All are
timed by the same step-end clock callback; steady state is the steps after `--warmup`.
Use `--threads 1` when another job holds a core: two threads per child then run up to 30x slower.

    .venv/bin/python bench/lora_sft_vs_trl.py [--rows 2000 --batch 4 --steps 60 --packed-steps 20
                                               --warmup 5 --repeats 2 --threads 2]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from sft_prepare import measure
from synthetic_chat import write_synthetic_chat
from transformers import TrainerCallback

LORA = {"r": 8, "alpha": 16, "dropout": 0.05, "target_modules": "all-linear"}


class StepTokenClock(TrainerCallback):
    """(time, non-pad tokens seen) at the end of every optimizer step, and the last logged loss."""

    def __init__(self) -> None:
        self.points: list[tuple[float, int]] = []
        self.loss: float | None = None

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.points.append((time.perf_counter(), state.num_input_tokens_seen))

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        if logs and "loss" in logs:
            self.loss = float(logs["loss"])

    def result(self) -> dict[str, Any]:
        return {"points": self.points, "loss": self.loss}


def run_trl(model_dir: str, data: str, out: str, opts: dict[str, Any], queue: mp.Queue) -> None:
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(opts["threads"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    args = SFTConfig(
        output_dir=out,
        max_steps=opts["steps"],
        per_device_train_batch_size=opts["batch"],
        learning_rate=opts["lr"],
        lr_scheduler_type="cosine",  # lmforge's default; TRL's is linear
        bf16=False,  # TRL defaults to bf16; lmforge runs train.precision: fp32
        activation_checkpointing=False,  # TRL defaults to on; lmforge's default is off
        logging_steps=1,  # lmforge logs every step by default
        logging_first_step=True,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        max_length=opts["max_length"],
        packing=False,
        assistant_only_loss=True,
        include_num_input_tokens_seen="non_padding",
    )
    lora = LoraConfig(
        r=LORA["r"],
        lora_alpha=LORA["alpha"],
        lora_dropout=LORA["dropout"],
        target_modules=LORA["target_modules"],
        task_type="CAUSAL_LM",
    )
    clock = StepTokenClock()
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=load_dataset("json", data_files=data, split="train", cache_dir=f"{out}/hf"),
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[clock],
    )
    trainer.train()
    queue.put(clock.result())


def run_lmforge(model_dir: str, data: str, out: str, opts: dict[str, Any], queue: mp.Queue) -> None:
    import torch

    from lmforge.config import load_config
    from lmforge.train.runner import run_training

    torch.set_num_threads(opts["threads"])
    cfg = load_config(
        None,
        base={
            "run": {"name": "lmforge", "output_dir": out, "seed": 0, "overwrite": True},
            "model": {"path": model_dir},
            "data": {
                "train": [{"path": data}],
                "max_length": opts["max_length"],
                "packing": opts["packing"],
                "cache_dir": str(Path(out).parent / "lmforge-cache"),
            },
            "train": {
                "stage": "sft",
                "method": "lora",
                "lora": LORA,
                "max_steps": opts["steps"],
                "micro_batch_size": opts["batch"],
                "lr": opts["lr"],
                "precision": "fp32",
                "resume": "never",
            },
        },
    )
    clock = StepTokenClock()
    run_training(cfg, extra_callbacks=[clock])
    queue.put(clock.result())


def steady_rates(points: list[tuple[float, int]], warmup: int) -> tuple[float, float, float]:
    """steps/s, non-pad tokens/s and tokens per step over the steps after `warmup`."""
    (t0, n0), (t1, n1) = points[warmup], points[-1]
    steps = len(points) - 1 - warmup
    return steps / (t1 - t0), (n1 - n0) / (t1 - t0), (n1 - n0) / steps


def save_model_dir(directory: Path, data: Path, max_length: int) -> None:
    """llama-tiny (vocab 2048, fresh weights, seed 0) and its ChatML BPE tokenizer, in one HF directory."""
    from transformers import set_seed

    from lmforge.config.schema import ModelConfig, TokenizerTrainConfig
    from lmforge.data.tokenizer import train_tokenizer
    from lmforge.models.build import build_model

    tokenizer = train_tokenizer(data.read_text().splitlines()[:500], TokenizerTrainConfig(vocab_size=2048))
    set_seed(0)
    model = build_model(ModelConfig(preset="llama-tiny"), tokenizer, max_length=max_length)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4, help="micro-batch: samples (padded) or packed rows")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=60, help="steps of the TRL and lmforge (padded) runs")
    parser.add_argument("--packed-steps", type=int, default=20, help="steps of the lmforge packed run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads in each child")
    opts = parser.parse_args()
    sides = {"trl": (run_trl, False), "lmforge": (run_lmforge, False), "lmforge packed": (run_lmforge, True)}
    torch_threads = f"torch threads {opts.threads} per child"
    print(f"load average before: {load_average()} on {os.cpu_count()} cores")
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        data = out / "chat.jsonl"
        write_synthetic_chat(data, opts.rows)  # single-turn; answers median ~60 words, tail to 900
        save_model_dir(out / "model", data, opts.max_length)
        for repeat in range(opts.repeats):
            for side, (target, packing) in sides.items():
                steps = opts.packed_steps if packing else opts.steps
                child = {**vars(opts), "packing": packing, "steps": steps}
                run_dir = out / f"{side.replace(' ', '-')}-{repeat}"
                runs[side].append(measure(target, str(out / "model"), str(data), str(run_dir), child))
    rates = {
        side: [steady_rates(r["points"], opts.warmup) for r in results] for side, results in runs.items()
    }
    print(
        f"{opts.rows} rows, micro-batch {opts.batch}, max_length {opts.max_length}, {opts.steps} steps "
        f"({opts.packed_steps} packed), steady state after step {opts.warmup}, {opts.repeats} runs per side, "
        f"{torch_threads}"
    )
    medians: dict[str, tuple[float, float]] = {}
    print("| side | steps/s (runs) | non-pad tokens/s (runs) | non-pad tokens/step | last loss |")
    print("|---|---|---|---:|---:|")
    for side, side_rates in rates.items():
        steps = [r[0] for r in side_rates]
        tokens = [r[1] for r in side_rates]
        medians[side] = (statistics.median(steps), statistics.median(tokens))
        per_step = statistics.median(r[2] for r in side_rates)
        losses = ", ".join(f"{r['loss']:.3f}" for r in runs[side] if r["loss"] is not None)
        print(
            f"| {side} | {medians[side][0]:.3f} ({', '.join(f'{s:.3f}' for s in steps)}) "
            f"| {medians[side][1]:,.0f} ({', '.join(f'{t:,.0f}' for t in tokens)}) | {per_step:,.0f} | {losses} |"
        )
    trl, ours, packed = medians["trl"], medians["lmforge"], medians["lmforge packed"]
    print(f"ratio lmforge / TRL steps/s: {ours[0] / trl[0]:.3f}x (goal >= 1.0x)")
    print(f"ratio lmforge / TRL non-pad tokens/s: {ours[1] / trl[1]:.3f}x")
    print(f"ratio lmforge packed / TRL non-pad tokens/s: {packed[1] / trl[1]:.2f}x")
    print(f"load average after: {load_average()} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
