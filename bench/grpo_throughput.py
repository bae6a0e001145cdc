"""GRPO step throughput: lmforge `run_training` (`train.stage: grpo`) vs TRL's plain `GRPOTrainer`.

lmforge's grpo stage runs TRL's GRPOTrainer itself, wrapped with lmforge's step hooks,
callbacks and metrics (metrics.jsonl, TensorBoard, the RL guard, the completion samples, the
checked reward functions). This measures what that wrapping costs per optimizer step.

Both sides load the same saved llama-tiny (8192-token ChatML BPE tokenizer, 5.0M parameters,
fresh weights, seed 0, fp32, sdpa) from one HF directory and train on the same 288 synthetic
question/answer rows (`lmforge.data.synthetic.category_task_rows`), with the same group size
(num_generations), max_completion_length, temperature, top_p 1, micro-batch (completions per
step), grad_accum 1, lr, constant schedule, beta 0 (no reference model), loss dapo, seed,
precision and number of steps, logging every step, generation by transformers (no vLLM),
and the same reward: exact match of the stripped completion against the row's `answer`,
ignoring case (lmforge's default reward).

- **lmforge**: `run_training(load_config(None, base={...}))` on a JSONL of {question, answer}
  rows, lmforge defaults otherwise (monitoring on, the RL guard, 4 sample completions per log).
- **TRL**: `GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(dir), reward_funcs=[exact],
  args=GRPOConfig(...), train_dataset=Dataset of {prompt: [user message], answer},
  processing_class=AutoTokenizer.from_pretrained(dir))`, with every GRPOConfig value lmforge
  sets (train/stages/online_rl.py, train/arguments.py) set the same. The run prints every resolved
  argument that still differs between the two (read from the trainers' own `args`).

All runs are in this one process, after one short untimed warm-up run of each side
(`--warmup-steps`); the timed runs go in ABBA order (lmforge, TRL, TRL, lmforge, ...). Each is
timed by the same step-end clock callback; steady state is the steps after `--warmup` (steps
3-20 by default, timed from the end of step 2).
Completion tokens per step are TRL's logged `completions/mean_length` x the micro-batch (the
same metric on both sides). "end-to-end" is the whole call: for lmforge `run_training` (data
checks, run directory, model load, training, final/ save), for TRL model load + trainer
construction + `train()`. Also printed: TRL's logged `num_tokens` per step (the trainer
state's `num_input_tokens_seen`, prompt + completion tokens), the load average before, after
and at the end of each run, and every step's duration in the JSON line.

    .venv/bin/python bench/grpo_throughput.py [--steps 20 --warmup 2 --repeats 2 --group-size 4
                                               --batch 16 --completion-length 16]
    .venv/bin/python bench/grpo_throughput.py --quick    # a smoke run: 5 steps, 1 repeat, no warm-up run
    .venv/bin/python bench/grpo_throughput.py --tools    # multi-turn: episodes that call a calculator

`--tools` measures multi-turn tool-use episodes instead: the policy is the same llama-tiny shape
(with a 512-token BPE of llama3-rendered conversations) given 300 SFT steps on conversations that
call the calculator half the time (`lmforge.data.synthetic.calculator_sft_rows`, as
tests/test_rl_tools.py): it writes tool calls in about half its episodes (not always the right
expression: what is measured is the step, not the answers), trained on calculator questions; lmforge with `train.rl.tools: {functions:
[calculator], max_turns: 2}`, TRL with `tools=[calculator]`, `max_tool_calling_iterations=2` and the
tokenizer's `response_template` set to TRL's llama3 template (what lmforge sets). Completion tokens
then count the model's own tokens (TRL's mean_length counts tool_mask = 1 only).

Use `--threads 1` when another job holds a core: two torch threads then run steps up to 30x slower
and at random (seen: 0.45 s steps taking 5-16 s).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import PrinterCallback, TrainerCallback

# Arguments that differ by nature (paths, names), not by configuration.
NOT_COMPARED = {"output_dir", "logging_dir", "run_name", "hub_model_id", "_n_gpu"}


class StepClock(TrainerCallback):
    """Wall-clock time at the end of every optimizer step, the logged completion lengths, and the
    trainer's resolved arguments."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.lengths: dict[int, float] = {}
        self.seen: dict[int, float] = {}  # TRL's num_tokens: prompt + completion tokens so far
        self.args: dict[str, Any] = {}

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.args = args.to_dict()

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.ends.append(time.perf_counter())

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        logs = logs or {}
        if "completions/mean_length" in logs:
            self.lengths[state.global_step] = float(logs["completions/mean_length"])
        if "num_tokens" in logs:
            self.seen[state.global_step] = float(logs["num_tokens"])

    def durations(self) -> list[float]:
        """Seconds of steps 2, 3, ... (step 1 has no start on this clock)."""
        return [round(b - a, 3) for a, b in itertools.pairwise(self.ends)]

    def steady(self, warmup: int, batch: int) -> dict[str, float]:
        """steps/s, completion tokens/s, mean completion length and prompt + completion tokens per
        step over steps warmup + 1 ... N, timed from the end of step `warmup` (>= 1)."""
        ends = self.ends[warmup - 1 :]
        seconds = ends[-1] - ends[0]
        steps = range(warmup + 1, len(self.ends) + 1)
        lengths = [self.lengths[s] for s in steps if s in self.lengths]
        tokens = sum(lengths) * batch if len(lengths) == len(steps) else float("nan")
        first, last = warmup, len(self.ends)
        seen = (
            (self.seen[last] - self.seen[first]) / (last - first)
            if {first, last} <= set(self.seen)
            else float("nan")
        )
        return {
            "steps_per_s": (len(ends) - 1) / seconds,
            "tokens_per_s": tokens / seconds,
            "mean_length": statistics.fmean(lengths) if lengths else float("nan"),
            "tokens_per_step": seen,  # from TRL's logged num_tokens
        }


def exact(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the stripped completion (its last turn) equals the reference answer ignoring case."""
    texts = [c if isinstance(c, str) else c[-1].get("content") or "" for c in completions]
    return [
        float(t.strip().casefold() == str(a).strip().casefold()) for t, a in zip(texts, answer, strict=True)
    ]


def build_inputs(out: Path, vocab_size: int, max_length: int) -> tuple[Path, Path, list[dict[str, str]]]:
    """The model directory (llama-tiny and its ChatML tokenizer), the lmforge JSONL and the rows."""
    from transformers import set_seed

    from lmforge.config.schema import ModelConfig, TokenizerTrainConfig
    from lmforge.data.corpus import iter_builtin_documents
    from lmforge.data.synthetic import category_task_rows
    from lmforge.data.tokenizer import train_tokenizer
    from lmforge.models.build import build_model

    rows, _ = category_task_rows(held_out=0, seed=0)
    data = out / "qa.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    texts = itertools.chain(
        (f"{r['question']} {r['answer']}" for r in rows), iter_builtin_documents("builtin:python-stdlib")
    )
    tokenizer = train_tokenizer(texts, TokenizerTrainConfig(vocab_size=vocab_size, max_chars=3_000_000))
    set_seed(0)
    model = build_model(ModelConfig(preset="llama-tiny"), tokenizer, max_length=max_length)
    model_dir = out / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir, data, rows


def build_tool_inputs(out: Path) -> tuple[Path, Path, list[dict[str, str]]]:
    """A llama-tiny SFT'd to call the calculator about half the time, and calculator question rows."""
    from transformers import set_seed

    from lmforge.config import load_config
    from lmforge.config.schema import ModelConfig
    from lmforge.data.synthetic import (
        calculator_sft_rows,
        calculator_task_rows,
        calculator_tokenizer,
        write_jsonl,
    )
    from lmforge.models.build import build_model
    from lmforge.train.runner import run_training

    sft_rows = calculator_sft_rows(2000, tool_share=0.5, seed=3)
    write_jsonl(out / "sft.jsonl", sft_rows)
    rows = calculator_task_rows(400, seed=4)
    data = write_jsonl(out / "questions.jsonl", rows)
    tokenizer = calculator_tokenizer(sft_rows)
    set_seed(0)
    build_model(ModelConfig(preset="llama-tiny"), tokenizer, max_length=128).save_pretrained(out / "base")
    tokenizer.save_pretrained(out / "base")
    sft = run_training(
        load_config(
            None,
            base={
                "run": {"name": "sft", "output_dir": str(out), "seed": 0},
                "model": {"path": str(out / "base")},
                "data": {"train": [{"path": str(out / "sft.jsonl")}], "max_length": 96},
                "train": {
                    "stage": "sft",
                    "max_steps": 300,
                    "micro_batch_size": 16,
                    "lr": 1e-3,
                    "schedule": "cosine",
                    "warmup_steps": 10,
                    "precision": "fp32",
                    "log_every": 500,
                },
            },
        )
    )
    return sft.final_dir, data, rows


def run_lmforge(
    opts: argparse.Namespace, model_dir: Path, data: Path, out: Path, name: str, steps: int
) -> tuple[StepClock, float]:
    from lmforge.config import load_config
    from lmforge.train.runner import run_training

    cfg = load_config(
        None,
        base={
            "run": {"name": name, "output_dir": str(out), "seed": 0, "overwrite": True},
            "model": {"path": str(model_dir)},
            "data": {
                "train": [{"path": str(data)}],
                "max_length": opts.max_length,
                "cache_dir": str(out / "cache"),
            },
            "train": {
                "stage": "grpo",
                "method": "full",
                "rl": {
                    "group_size": opts.group_size,
                    "max_completion_length": opts.completion_length,
                    "temperature": opts.temperature,
                    "beta": 0.0,
                    "loss": "dapo",
                    "generation": "transformers",
                    **({"tools": {"functions": ["calculator"], "max_turns": 2}} if opts.tools else {}),
                },
                "max_steps": steps,
                "micro_batch_size": opts.batch,
                "lr": opts.lr,
                "schedule": "constant",
                "precision": opts.precision,
                "log_every": opts.log_every,
                "save_every": None,
                "resume": "never",
            },
        },
    )
    clock = StepClock()
    start = time.perf_counter()
    run_training(cfg, extra_callbacks=[clock])
    return clock, time.perf_counter() - start


def run_trl(
    opts: argparse.Namespace, model_dir: Path, rows: list[dict[str, str]], out: Path, name: str, steps: int
) -> tuple[StepClock, float]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]} for r in rows]
    )
    use_cuda = torch.cuda.is_available()
    args = GRPOConfig(
        output_dir=str(out / name),
        max_steps=steps,
        per_device_train_batch_size=opts.batch,
        per_device_eval_batch_size=opts.batch,
        gradient_accumulation_steps=1,
        learning_rate=opts.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta2=0.999,
        max_grad_norm=1.0,
        bf16=opts.precision == "bf16",  # TRL defaults to bf16
        fp16=False,
        use_cpu=not use_cuda,
        activation_checkpointing=False,  # TRL defaults to on; lmforge's default is off
        gradient_checkpointing=False,
        logging_strategy="steps",
        logging_steps=opts.log_every,
        logging_first_step=True,
        logging_nan_inf_filter=False,
        include_num_input_tokens_seen="no",
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
        dataloader_pin_memory=use_cuda,
        report_to=[],
        disable_tqdm=True,
        remove_unused_columns=False,
        # train.rl
        num_generations=opts.group_size,
        max_completion_length=opts.completion_length,
        temperature=opts.temperature,
        top_p=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.2,
        mask_truncated_completions=False,
        reward_weights=[1.0],
        log_completions=False,
        use_vllm=False,
        loss_type="dapo",
        importance_sampling_level="token",
        scale_rewards="group",
        model_init_kwargs={"dtype": "auto"},  # as lmforge: ignored (the model is passed built)
        **({"max_tool_calling_iterations": 2} if opts.tools else {}),
    )
    clock = StepClock()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tools: dict[str, Any] = {}
    if opts.tools:
        from trl.chat_template_utils import llama3_template

        from lmforge.train.tools import calculator

        tokenizer.response_template = llama3_template  # TRL does not know the template's text
        tools = {"tools": [calculator]}
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[exact],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
        **tools,
    )
    trainer.remove_callback(PrinterCallback)  # HF's print of raw log dicts; lmforge removes it too
    trainer.train()
    return clock, time.perf_counter() - start


def differing_arguments(a: dict[str, Any], b: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {
        k: (a.get(k), b.get(k))
        for k in sorted(set(a) | set(b))
        if k not in NOT_COMPARED and a.get(k) != b.get(k)
    }


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the steady state")
    parser.add_argument(
        "--warmup-steps", type=int, default=3, help="steps of the untimed warm-up run of each side"
    )
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per side")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="micro-batch: completions per step")
    parser.add_argument("--completion-length", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 5 steps, 1 repeat, no warm-up run")
    parser.add_argument("--tools", action="store_true", help="multi-turn episodes with the calculator tool")
    parser.add_argument(
        "--log-every",
        type=int,
        default=1,
        help="log cadence of both sides (lmforge's log_every, TRL's logging_steps); tokens/s needs 1",
    )
    opts = parser.parse_args()
    if opts.quick:
        opts.steps, opts.warmup, opts.warmup_steps, opts.repeats = 5, 2, 0, 1
    if opts.warmup < 1 or opts.steps - opts.warmup < 2:
        parser.error("--warmup must be >= 1 and --steps must exceed it by at least 2")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    logging.getLogger("lmforge").setLevel(logging.WARNING)
    sides = ("lmforge", "trl")
    clocks: dict[str, list[StepClock]] = {side: [] for side in sides}
    walls: dict[str, list[float]] = {side: [] for side in sides}
    loads: list[float] = []
    print(f"load average before: {load_average()} on {os.cpu_count()} cores", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        if opts.tools:
            model_dir, data, rows = build_tool_inputs(out)
        else:
            model_dir, data, rows = build_inputs(out, opts.vocab_size, opts.max_length)

        def run(side: str, name: str, steps: int) -> tuple[StepClock, float]:
            if side == "lmforge":
                return run_lmforge(opts, model_dir, data, out, name, steps)
            return run_trl(opts, model_dir, rows, out, name, steps)

        if opts.warmup_steps:
            for side in sides:
                run(side, f"warm-{side}", opts.warmup_steps)
        for repeat in range(opts.repeats):
            for side in sides if repeat % 2 == 0 else sides[::-1]:  # ABBA
                clock, wall = run(side, f"{side}-{repeat}", opts.steps)
                clocks[side].append(clock)
                walls[side].append(wall)
                loads.append(os.getloadavg()[0])
                rate = clock.steady(opts.warmup, opts.batch)
                print(
                    f"{side:7} run {repeat}: {rate['steps_per_s']:.3f} steps/s, "
                    f"{rate['tokens_per_s']:.0f} completion tokens/s, end-to-end {wall:.1f} s, "
                    f"load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
    resolved = {side: clocks[side][0].args for side in sides}
    differences = differing_arguments(resolved["lmforge"], resolved["trl"])
    rates = {side: [c.steady(opts.warmup, opts.batch) for c in clocks[side]] for side in sides}
    medians = {
        side: {
            key: statistics.median(r[key] for r in rates[side])
            for key in ("steps_per_s", "tokens_per_s", "mean_length", "tokens_per_step")
        }
        for side in sides
    }
    ratio_steps = medians["lmforge"]["steps_per_s"] / medians["trl"]["steps_per_s"]
    ratio_tokens = medians["lmforge"]["tokens_per_s"] / medians["trl"]["tokens_per_s"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(
        f"device {device}, torch threads {torch.get_num_threads()}, {opts.precision}; group {opts.group_size}, "
        f"micro-batch {opts.batch} completions, max_completion_length {opts.completion_length}, {opts.steps} steps, "
        f"steady state after step {opts.warmup}, {opts.repeats} runs per side (ABBA)"
    )
    print(
        "| side | steps/s (runs) | completion tokens/s (runs) | mean completion length | end-to-end s (runs) |"
    )
    print("|---|---|---|---:|---|")
    for side in sides:
        steps = ", ".join(f"{r['steps_per_s']:.3f}" for r in rates[side])
        tokens = ", ".join(f"{r['tokens_per_s']:.0f}" for r in rates[side])
        wall = ", ".join(f"{w:.1f}" for w in walls[side])
        m = medians[side]
        print(
            f"| {side} | {m['steps_per_s']:.3f} ({steps}) | {m['tokens_per_s']:.0f} ({tokens}) "
            f"| {m['mean_length']:.1f} | {statistics.median(walls[side]):.1f} ({wall}) |"
        )
    print(f"ratio lmforge / TRL steps/s: {ratio_steps:.3f}  completion tokens/s: {ratio_tokens:.3f}")
    print(
        "logged num_tokens per step (trainer state's num_input_tokens_seen: prompt + completion): "
        + ", ".join(f"{side} {medians[side]['tokens_per_step']:.0f}" for side in sides)
    )
    print(
        f"load average after: {load_average()} on {os.cpu_count()} cores (1-min during runs: {min(loads):.2f}-{max(loads):.2f})"
    )
    compared = len((set(resolved["lmforge"]) | set(resolved["trl"])) - NOT_COMPARED)
    print(f"resolved arguments that differ (lmforge, TRL), of {compared} compared: {differences or 'none'}")
    record = {
        "bench": "grpo_throughput",
        "tools": opts.tools,
        "device": device,
        "threads": torch.get_num_threads(),
        "precision": opts.precision,
        "group_size": opts.group_size,
        "batch": opts.batch,
        "completion_length": opts.completion_length,
        "steps": opts.steps,
        "warmup": opts.warmup,
        "repeats": opts.repeats,
        "steps_per_s": {side: [round(r["steps_per_s"], 4) for r in rates[side]] for side in sides},
        "tokens_per_s": {side: [round(r["tokens_per_s"], 1) for r in rates[side]] for side in sides},
        "mean_length": {side: round(medians[side]["mean_length"], 2) for side in sides},
        "logged_num_tokens_per_step": {side: round(medians[side]["tokens_per_step"], 1) for side in sides},
        "step_s": {side: [c.durations() for c in clocks[side]] for side in sides},
        "end_to_end_s": {side: [round(w, 2) for w in walls[side]] for side in sides},
        "ratio_steps_per_s": round(ratio_steps, 4),
        "ratio_tokens_per_s": round(ratio_tokens, 4),
        "load_average_1min": [round(x, 2) for x in loads],
        "arguments_compared": compared,
        "arguments_differing": {k: [repr(a), repr(b)] for k, (a, b) in differences.items()},
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
