"""VLM SFT throughput and memory: lmforge `run_training` vs TRL `SFTTrainer` on a processor (issue 39).

One SmolVLM-architecture model (Idefics3: a SigLIP-style tower on 64x64 images, pixel shuffle, a
Llama text model; 4.3M parameters, random weights, seed 0) and its processor are saved once to
one HF directory that both sides load; its BPE tokenizer (vocab 1024) is trained on the rows'
text. Two workloads, written by this script (no network), images drawn by lmforge's shapes
generator (`data/shapes.py`):

- **shapes**: the shapes task's questions and one-word answers (43 tokens a row, 19 of them image
  tokens): samples/s and peak RSS, packing off on both sides (TRL refuses packing for image rows).
- **mix**: the same images and questions, each answer followed by lognormal(`--mix-words`) filler
  words, capped at `--max-words` (default median 12, mean 28: most rows short, a few near
  max_length): non-pad tokens/s of TRL padded vs lmforge packed, and lmforge padded (which
  separates packing's gain from the rest of the pipeline; `--no-mix-padded` leaves it out).

The rows are the same on both sides, each in the layout its trainer documents: lmforge reads
LLaMA-Factory's sharegpt rows with an `<image>` placeholder (what `write_shapes_task` writes);
TRL reads `{"messages", "images"}` rows, the images decoded by `datasets` (an `Image()` feature),
the text without a placeholder (TRL puts the image part first in the user turn). Before anything
is timed the script checks that both sides make the same input ids and the same labels of the
first rows (loss on the answer and its `<|im_end|>`, never on an image token); the padded runs
of both then end on the same loss (same initial weights, sample order and masks).

- **TRL** (what a careful user writes: TRL's own vision SFT path): `SFTTrainer(model=
  AutoModelForImageTextToText.from_pretrained(dir), processing_class=AutoProcessor.from_pretrained(dir),
  train_dataset=..., args=SFTConfig(...))`, which collates with `DataCollatorForVisionLanguageModeling`
  (per batch, the processor's `apply_chat_template` renders, tokenizes, expands the image tokens
  and makes the pixels), `assistant_only_loss=True`, padding to the longest in the batch,
  truncation at max_length. The processor's chat template is the model's ChatML written for
  structured content (`STRUCTURED_CHATML`: image and text parts, `{% generation %}` markers, no
  newline after the last turn as lmforge renders it): TRL hands the template list contents, which
  the text-only ChatML cannot concatenate. TRL's defaults that differ from lmforge's are set to
  lmforge's (bf16 off, activation checkpointing off, cosine schedule, logging every step); non-pad
  tokens counted by HF's `include_num_input_tokens_seen="non_padding"` (the attention_mask).
- **lmforge**: `run_training(load_config(None, base={...}))` (the entry `lmforge train` calls),
  `train.stage: sft`, `method: full`, `train.vision: {tower: train, projector: train}` (TRL trains
  every parameter; lmforge's default freezes the tower), `data.over_length: truncate` (TRL's
  behaviour; no mix row reaches max_length at the defaults), lmforge's defaults otherwise
  (metrics.jsonl, TensorBoard, update-ratio and grad-norm monitors, exact token counting). Data
  prepared (tokenized, image tokens placed, cached) before the first step; pixels made per batch
  by `VisionCollator`. Packed: best-fit rows of max_length, `--packed-batch` rows a step.

Same micro-batch, lr, seed and fp32 on CPU on every side, and the same steps within a workload
(packed runs take fewer: a packed step holds about twice the tokens); data loading in the
training process on both (`dataloader_num_workers` 0, each side's default). Each run is its own
spawned process, so its peak RSS (`ru_maxrss`) is its own; runs alternate TRL, lmforge. Steady
state: the step-end clock's steps after `--warmup` (start-up, data preparation, the first steps
and the final save excluded). CPU ms/step (the process's CPU time) is printed beside the wall
rates: it moves little when other jobs share the cores, and gives the same ratio on a quiet
machine. Use `--threads 1` when another job holds a core (two threads then spin and run many
times slower).

    .venv/bin/python bench/vlm_sft.py [--rows 1000 --batch 8 --steps 60 --mix-steps 40
                                       --packed-steps 20 --warmup 5 --repeats 2 --threads 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from transformers import TrainerCallback

IMAGE_SIZE = 64
# 4.3M parameters: 64x64 images in 8x8 patches (64), pixel-shuffled by 2 into 16 image tokens;
# a 4-layer tower of width 128 and a 4-layer Llama of width 256. Registered as a vision preset
# in the parent process only, to build the model `build_vision_model` builds for the test's
# smolvlm-tiny (image tokens added, processor without image splitting), only larger.
BENCH_PRESET = "smolvlm-bench"
BENCH_SPEC: dict[str, Any] = {
    "image_size": IMAGE_SIZE,
    "image_seq_len": 16,
    "vision_config": {
        "hidden_size": 128,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "image_size": IMAGE_SIZE,
        "patch_size": 8,
    },
    "scale_factor": 2,
    "text_config": {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    },
}

# lmforge's ChatML (data/tokenizer.py) for TRL's structured messages: each content part rendered in
# order, an image part as the `<image>` placeholder the processor expands. No newline after the
# last turn, which lmforge's renderer drops too: both sides then train on the same ids (checked).
STRUCTURED_CHATML = (
    "{% macro render(content) %}{% if content is string %}{{ content }}{% else %}"
    "{% for part in content %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ render(message['content']) + '<|im_end|>' }}{% endgeneration %}"
    "{% if not loop.last %}{{ '\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + render(message['content']) + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

FILLER = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "by",
          "this", "are", "from", "at", "or", "an", "have", "not", "shape", "colour", "image"]  # fmt: skip


class StepClock(TrainerCallback):
    """(wall time, non-pad tokens seen, process CPU time) at the end of every optimizer step, and
    the last logged loss. CPU time barely moves when other jobs share the cores; wall time does."""

    def __init__(self) -> None:
        self.points: list[tuple[float, int, float]] = []
        self.loss: float | None = None

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.points.append((time.perf_counter(), state.num_input_tokens_seen, time.process_time()))

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        if logs and "loss" in logs:
            self.loss = float(logs["loss"])


def _result(clock: StepClock, started: float) -> dict[str, Any]:
    return {
        "points": clock.points,
        "loss": clock.loss,
        "seconds": time.perf_counter() - started,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def run_trl(model_dir: str, data: str, out: str, opts: dict[str, Any], queue: mp.Queue) -> None:
    started = time.perf_counter()
    import torch
    from datasets import Image, List, load_dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(opts["threads"])
    processor = AutoProcessor.from_pretrained(model_dir)
    processor.chat_template = STRUCTURED_CHATML
    model = AutoModelForImageTextToText.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    dataset = load_dataset("json", data_files=data, split="train", cache_dir=f"{out}/hf")
    dataset = dataset.cast_column("images", List(Image()))  # paths -> PIL images, decoded per row
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
        packing=False,  # TRL refuses packing for image rows
        assistant_only_loss=True,
        include_num_input_tokens_seen="non_padding",
    )
    clock = StepClock()
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=processor, callbacks=[clock]
    )
    trainer.train()
    queue.put(_result(clock, started))


def run_lmforge(model_dir: str, data: str, out: str, opts: dict[str, Any], queue: mp.Queue) -> None:
    started = time.perf_counter()
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
                "over_length": "truncate",  # what TRL's collator does at max_length
                "cache_dir": str(Path(out) / "lmforge-cache"),  # fresh: preparation is not reused
            },
            "train": {
                "stage": "sft",
                "method": "full",
                "max_steps": opts["steps"],
                "micro_batch_size": opts["batch"],
                "lr": opts["lr"],
                "precision": "fp32",
                "resume": "never",
                "vision": {"tower": "train", "projector": "train"},
            },
        },
    )
    clock = StepClock()
    run_training(cfg, extra_callbacks=[clock])
    queue.put(_result(clock, started))


def measure(target, *args: Any) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """`target(*args, queue)` in a fresh spawned process: its own imports, its own peak RSS."""
    context = mp.get_context("spawn")
    queue: mp.Queue = context.Queue()
    process = context.Process(target=target, args=(*args, queue))
    process.start()
    result = queue.get()
    process.join()
    return result


def write_rows(
    task: Path, *, mix: tuple[float, float] | None, max_words: int, seed: int
) -> tuple[Path, Path]:
    """The shapes task's train rows twice, as (lmforge sharegpt file, TRL messages file); with
    `mix` = (mu, sigma), each answer is followed by lognormal(mu, sigma) filler words (capped)."""
    rng = np.random.default_rng(seed)
    rows = [json.loads(line) for line in (task / "train.jsonl").read_text().splitlines()]
    ours, theirs = [], []
    for row in rows:
        question = row["conversations"][0]["value"]
        answer = row["conversations"][1]["value"]
        if mix is not None:
            words = int(min(rng.lognormal(*mix), max_words))
            answer = " ".join([answer + ".", *rng.choice(FILLER, size=words)]) if words else answer
        ours.append({**row, "conversations": [row["conversations"][0], {"from": "gpt", "value": answer}]})
        theirs.append(
            {
                "messages": [
                    {"role": "user", "content": question.removeprefix("<image>")},
                    {"role": "assistant", "content": answer},
                ],
                "images": [str(task / image) for image in row["images"]],
            }
        )
    name = "mix" if mix else "shapes"
    lmforge_file, trl_file = task / f"{name}-lmforge.jsonl", task / f"{name}-trl.jsonl"
    lmforge_file.write_text("".join(json.dumps(r) + "\n" for r in ours))
    trl_file.write_text("".join(json.dumps(r) + "\n" for r in theirs))
    return lmforge_file, trl_file


def save_model_dir(directory: Path, texts: list[str]) -> int:
    """The bench VLM (seed 0) and its processor, with a BPE tokenizer trained on `texts`; its parameters."""
    import torch

    from lmforge.config.schema import TokenizerTrainConfig
    from lmforge.data.tokenizer import train_tokenizer
    from lmforge.models.vision import VISION_PRESETS, build_vision_model, save_vision_model_dir

    tokenizer = train_tokenizer(texts, TokenizerTrainConfig(vocab_size=1024, min_frequency=1))
    VISION_PRESETS[BENCH_PRESET] = BENCH_SPEC
    torch.manual_seed(0)
    model, processor = build_vision_model(BENCH_PRESET, tokenizer)
    save_vision_model_dir(directory, model, processor)
    return sum(p.numel() for p in model.parameters())


def check_same_tokens(model_dir: Path, lmforge_file: Path, trl_file: Path, work: Path, rows: int = 8) -> dict:
    """Both sides' input ids and loss masks for the first `rows` rows (lmforge's data stage; TRL's
    collator), compared; and the length statistics of lmforge's tokenized samples (all rows)."""
    from datasets import Image, List, load_dataset
    from transformers import AutoProcessor, AutoTokenizer
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from lmforge.config.schema import DataConfig, SourceConfig
    from lmforge.data.sft import prepare_sft_data
    from lmforge.data.vision_tokens import ImageTokens, load_processor

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prepared = prepare_sft_data(
        DataConfig(train=[SourceConfig(path=str(lmforge_file))], max_length=100_000),
        tokenizer,
        seed=0,
        cache_dir=work / "cache",
        quarantine_path=work / "bad.jsonl",
        image_tokens=ImageTokens(load_processor(str(model_dir), tokenizer)),
    )
    ours = {}  # lmforge shuffles nothing at preparation, but match rows by their images to be sure
    for index in range(len(prepared.train)):
        sample = prepared.train.sample(index)
        ours[Path(sample["images"][0]).name] = sample
    processor = AutoProcessor.from_pretrained(model_dir)
    processor.chat_template = STRUCTURED_CHATML
    dataset = load_dataset("json", data_files=str(trl_file), split="train", cache_dir=str(work / "hf"))
    names = [Path(row["images"][0]).name for row in dataset.select(range(rows))]
    dataset = dataset.cast_column("images", List(Image()))
    collator = DataCollatorForVisionLanguageModeling(processor, assistant_only_loss=True)
    same = True
    for index in range(rows):
        batch = collator([dict(dataset[index])])
        ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
        sample = ours[names[index]]
        same &= ids == sample["input_ids"].tolist() and labels == sample["labels"].tolist()
    lengths = np.asarray(prepared.train.lengths())
    return {
        "same_ids_and_labels": bool(same),
        "rows_checked": rows,
        "samples": len(lengths),
        "length_p50": float(np.percentile(lengths, 50)),
        "length_p90": float(np.percentile(lengths, 90)),
        "length_max": int(lengths.max()),
        "length_mean": float(lengths.mean()),
    }


def steady(points: list[tuple[float, int, float]], warmup: int) -> tuple[float, float, float]:
    """(steps/s, non-pad tokens/s, CPU ms a step) over the steps after `warmup`."""
    (t0, n0, c0), (t1, n1, c1) = points[warmup], points[-1]
    steps = len(points) - 1 - warmup
    return steps / (t1 - t0), (n1 - n0) / (t1 - t0), 1000 * (c1 - c0) / steps


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1000, help="rows of each workload")
    parser.add_argument("--batch", type=int, default=8, help="micro-batch of samples (padded runs)")
    parser.add_argument("--packed-batch", type=int, default=2, help="packed rows a step (lmforge packed)")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=60, help="steps of the shapes runs")
    parser.add_argument("--mix-steps", type=int, default=40, help="steps of the padded mix runs")
    parser.add_argument("--packed-steps", type=int, default=20, help="steps of the lmforge packed run")
    parser.add_argument("--mix-words", type=float, nargs=2, default=(2.5, 1.3), metavar=("MU", "SIGMA"),
                        help="lognormal filler words after each mix answer (median e^MU)")  # fmt: skip
    parser.add_argument("--max-words", type=int, default=400, help="cap on a mix answer's filler words")
    parser.add_argument(
        "--mix-padded",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run lmforge padded on the mix (packing's gain apart from the pipeline's)",
    )
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the steady state")
    parser.add_argument("--repeats", type=int, default=2, help="runs a side, alternating")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in each child")
    parser.add_argument("--skip-check", action="store_true", help="skip the same-ids check")
    return parser.parse_args()


def main() -> None:
    opts = parse_args()
    print(f"load average before: {load_average()} on {os.cpu_count()} cores", flush=True)
    from lmforge.data.shapes import write_shapes_task

    # (workload, side) -> (runner, packing, steps, micro-batch)
    plan: dict[tuple[str, str], tuple[Any, bool, int, int]] = {
        ("shapes", "trl"): (run_trl, False, opts.steps, opts.batch),
        ("shapes", "lmforge"): (run_lmforge, False, opts.steps, opts.batch),
        ("mix", "trl"): (run_trl, False, opts.mix_steps, opts.batch),
        ("mix", "lmforge packed"): (run_lmforge, True, opts.packed_steps, opts.packed_batch),
    }
    if opts.mix_padded:
        plan[("mix", "lmforge")] = (run_lmforge, False, opts.mix_steps, opts.batch)
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {key: [] for key in plan}
    checks: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        write_shapes_task(out / "task", train_rows=opts.rows, eval_rows=0, size=IMAGE_SIZE, seed=0)
        files = {
            "shapes": write_rows(out / "task", mix=None, max_words=0, seed=0),
            "mix": write_rows(out / "task", mix=tuple(opts.mix_words), max_words=opts.max_words, seed=0),
        }
        texts = [
            turn["value"].removeprefix("<image>")
            for row in map(json.loads, files["mix"][0].read_text().splitlines())
            for turn in row["conversations"]
        ]
        parameters = save_model_dir(out / "model", texts)
        print(f"model: {parameters / 1e6:.2f}M parameters, {IMAGE_SIZE}x{IMAGE_SIZE} images", flush=True)
        for workload, (ours, theirs) in files.items():
            if not opts.skip_check:
                checks[workload] = check_same_tokens(out / "model", ours, theirs, out / f"check-{workload}")
                print(f"{workload} rows: {checks[workload]}", flush=True)
        for repeat in range(opts.repeats):
            for (workload, side), (runner, packing, steps, batch) in plan.items():
                lmforge_file, trl_file = files[workload]
                data = trl_file if runner is run_trl else lmforge_file
                child = {**vars(opts), "packing": packing, "steps": steps, "batch": batch}
                run_dir = out / f"{workload}-{side.replace(' ', '-')}-{repeat}"
                result = measure(runner, str(out / "model"), str(data), str(run_dir), child)
                runs[(workload, side)].append(result)
                steps_per_s, tokens_per_s, cpu_ms = steady(result["points"], opts.warmup)
                print(
                    f"  {workload:6} {side:15} run {repeat}: {steps_per_s:.3f} steps/s, {tokens_per_s:,.0f} "
                    f"tokens/s, CPU {cpu_ms:.0f} ms/step, peak RSS {result['peak_rss_mib']:,.0f} MiB, "
                    f"{result['seconds']:.1f} s in all, load {load_average()}",
                    flush=True,
                )
    sides = summarise(plan, runs, opts.warmup)
    print(
        f"\n{opts.rows} rows, micro-batch {opts.batch} (packed: {opts.packed_batch} rows of {opts.max_length}), "
        f"steady state after step {opts.warmup}, {opts.repeats} run(s) a side, {opts.threads} torch "
        f"thread(s) a child; same ids and labels: "
        + ", ".join(f"{w} {'yes' if c['same_ids_and_labels'] else 'NO'}" for w, c in checks.items())
    )
    print_table(plan, sides)
    ratios = print_ratios(sides)
    print(f"load average after: {load_average()} on {os.cpu_count()} cores")
    record = {
        "bench": "vlm_sft",
        "options": vars(opts),
        "parameters": parameters,
        "checks": checks,
        "sides": sides,
        "ratios": ratios,
        "load_average_after": os.getloadavg(),
    }
    print(json.dumps(record))


def summarise(plan: dict, runs: dict, warmup: int) -> dict[str, dict[str, Any]]:
    """Per `workload/side`: medians over its runs, and every run's figures."""
    sides = {}
    for (workload, side), results in runs.items():
        _, packing, _, batch = plan[(workload, side)]
        rates = [steady(r["points"], warmup) for r in results]
        steps_per_s = statistics.median(r[0] for r in rates)
        sides[f"{workload}/{side}"] = {
            "steps_per_s": steps_per_s,
            "samples_per_s": None if packing else steps_per_s * batch,  # a packed row's count varies
            "tokens_per_s": statistics.median(r[1] for r in rates),
            "cpu_ms_per_step": statistics.median(r[2] for r in rates),
            "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in results),
            "last_loss": results[-1]["loss"],
            "runs_steps_per_s": [r[0] for r in rates],
            "runs_tokens_per_s": [r[1] for r in rates],
            "runs_peak_rss_mib": [r["peak_rss_mib"] for r in results],
        }
    return sides


def print_table(plan: dict, sides: dict[str, dict[str, Any]]) -> None:
    print(
        "| workload | side | steps | samples/s | non-pad tokens/s (runs) | CPU ms/step | peak RSS MiB | last loss |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (workload, side), (_, _, steps, _) in plan.items():
        row = sides[f"{workload}/{side}"]
        samples = "-" if row["samples_per_s"] is None else f"{row['samples_per_s']:.2f}"
        runs = ", ".join(f"{t:,.0f}" for t in row["runs_tokens_per_s"])
        loss = "-" if row["last_loss"] is None else f"{row['last_loss']:.3f}"
        print(
            f"| {workload} | {side} | {steps} | {samples} | {row['tokens_per_s']:,.0f} ({runs}) "
            f"| {row['cpu_ms_per_step']:.0f} | {row['peak_rss_mib']:,.0f} | {loss} |"
        )


def print_ratios(sides: dict[str, dict[str, Any]]) -> dict[str, float]:
    """lmforge over TRL, each printed with its goal."""
    shapes, ours = sides["shapes/trl"], sides["shapes/lmforge"]
    mix, packed = sides["mix/trl"], sides["mix/lmforge packed"]
    ratios = {
        "shapes_samples_per_s": ours["samples_per_s"] / shapes["samples_per_s"],
        "shapes_cpu_per_step": ours["cpu_ms_per_step"] / shapes["cpu_ms_per_step"],
        "shapes_peak_rss": ours["peak_rss_mib"] / shapes["peak_rss_mib"],
        "mix_packed_tokens_per_s": packed["tokens_per_s"] / mix["tokens_per_s"],
        "mix_packed_peak_rss": packed["peak_rss_mib"] / mix["peak_rss_mib"],
    }
    print(f"ratio lmforge / TRL samples/s (shapes): {ratios['shapes_samples_per_s']:.3f}x (goal >= 1.0x)")
    print(
        f"ratio lmforge / TRL CPU time a step (shapes): {ratios['shapes_cpu_per_step']:.3f}x (lower is better)"
    )
    print(f"ratio lmforge / TRL peak RSS (shapes): {ratios['shapes_peak_rss']:.3f}x (goal <= 1.0x)")
    print(
        f"ratio lmforge packed / TRL non-pad tokens/s (mix): {ratios['mix_packed_tokens_per_s']:.2f}x (goal >= 1.5x)"
    )
    print(f"ratio lmforge packed / TRL peak RSS (mix): {ratios['mix_packed_peak_rss']:.3f}x")
    if "mix/lmforge" in sides:
        ratios["mix_padded_tokens_per_s"] = sides["mix/lmforge"]["tokens_per_s"] / mix["tokens_per_s"]
        print(f"ratio lmforge padded / TRL non-pad tokens/s (mix): {ratios['mix_padded_tokens_per_s']:.3f}x")
    return ratios


if __name__ == "__main__":
    main()
