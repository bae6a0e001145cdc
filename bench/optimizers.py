"""Optimizers and torch.compile on CPU: step time, optimizer-state memory and peak RSS, side by side.

Every side trains the same random Llama (bench/side_by_side.py: hidden 512, 4 layers, vocabulary
8,192, 21M parameters, seed 0) on the same random token blocks through lmforge's own Trainer,
with the TrainingArguments lmforge builds from `train.optimizer` / `train.compile`. Each side runs
in a fresh spawned child, so its peak RSS is its own; sides alternate over the repeats. Figures:
median step time after the warm-up steps (compilation included in neither), optimizer state
(bytes of every tensor in optimizer.state), peak RSS of the child, and the loss after the last step.

    .venv/bin/python bench/optimizers.py                       # the optimizers (AdamW is the baseline)
    .venv/bin/python bench/optimizers.py --compare compile     # eager vs torch.compile (AdamW)
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

OPTIMIZERS = ["adamw", "adafactor", "lion", "galore", "muon", "adamw_8bit"]
# The learning rate each optimizer is usually run at (Lion: lower; Muon: its own scale).
LR = {"lion": 1e-4, "muon": 0.02}


def run_side(side: str, compare: str, steps: int, warmup: int, queue: Any) -> None:
    import torch
    from datasets import Dataset
    from side_by_side import random_llama
    from transformers import TrainerCallback, default_data_collator

    from lmforge.config.schema import TrainConfig
    from lmforge.run_layout import RunPaths
    from lmforge.train.arguments import build_training_arguments
    from lmforge.train.hf_trainer import HFTrainerAdapter
    from lmforge.train.step import TrainStep

    torch.set_num_threads(torch.get_num_threads())
    model = random_llama(512, 4, vocab=8192)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8192, (64, 256), generator=generator)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    settings = (
        TrainConfig(optimizer=side, lr=LR.get(side, 1e-3), max_steps=steps, micro_batch_size=4)
        if compare == "optimizers"
        else TrainConfig(compile=side == "compile", lr=1e-3, max_steps=steps, micro_batch_size=4)
    )

    class Clock(TrainerCallback):
        ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            self.ends.append(time.perf_counter())

    clock = Clock()
    with tempfile.TemporaryDirectory() as tmp:
        args = build_training_arguments(
            settings, RunPaths(Path(tmp)), seed=0, has_eval=False, precision="fp32"
        )
        args.save_strategy, args.logging_steps = "no", steps
        trainer = HFTrainerAdapter(
            model=model,
            args=args,
            train_dataset=data,
            data_collator=default_data_collator,
            callbacks=[clock],
            train_step=TrainStep(),  # lmforge's step, no guardrails
            train_settings=settings,
        )
        result = trainer.train()
    state = trainer.optimizer.state
    state_bytes = sum(
        t.numel() * t.element_size() for s in state.values() for t in s.values() if torch.is_tensor(t)
    )
    times = [b - a for a, b in zip(clock.ends[warmup:], clock.ends[warmup + 1 :], strict=False)]
    queue.put(
        {
            "step_s": statistics.median(times),
            "state_mib": state_bytes / 2**20,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "loss": result.training_loss,
        }
    )


def measure(side: str, compare: str, steps: int, warmup: int) -> dict[str, float]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=run_side, args=(side, compare, steps, warmup, queue))
    child.start()
    result = queue.get()
    child.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--compare", choices=["optimizers", "compile"], default="optimizers")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="Steps left out of the step time.")
    parser.add_argument("--repeats", type=int, default=2)
    options = parser.parse_args()
    sides = OPTIMIZERS if options.compare == "optimizers" else ["eager", "compile"]
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for _ in range(options.repeats):
        for side in sides:
            runs[side].append(measure(side, options.compare, options.steps, options.warmup))
            print(side, {k: round(v, 4) for k, v in runs[side][-1].items()}, flush=True)
    base = sides[0]

    def median(side: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[side])

    print(
        f"\n| {options.compare[:-1] if options.compare == 'optimizers' else 'mode'} | step s | x {base} | "
        f"state MiB | x {base} | peak RSS MiB | x {base} | loss after {options.steps} |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for side in sides:
        step, state, rss = median(side, "step_s"), median(side, "state_mib"), median(side, "peak_rss_mib")
        state_ratio = f"{state / median(base, 'state_mib'):.2f}" if median(base, "state_mib") else "-"
        print(
            f"| {side} | {step:.3f} | {step / median(base, 'step_s'):.2f} | {state:.1f} | {state_ratio} | "
            f"{rss:,.0f} | {rss / median(base, 'peak_rss_mib'):.2f} | {median(side, 'loss'):.3f} |"
        )


if __name__ == "__main__":
    main()
