"""`lmforge quickstart`: the whole pipeline, offline, on CPU, in minutes.

A list of stages run in order over one shared state; each stage prints what it did.
Later stages (fine-tuning, export, verification, report) are appended to STAGES.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmforge.config import LmforgeConfig, load_config
from lmforge.report import write_report
from lmforge.run_layout import RunPaths, read_finished

SAMPLE_PROMPT = "def main():\n    "


class QuickstartInterrupted(Exception):
    """A stage's training stopped at a checkpoint on SIGINT / SIGTERM; the same command resumes it."""

    def __init__(self, stage: str, signal_name: str, step: int) -> None:
        super().__init__(f"{stage} stopped by {signal_name} at step {step}")
        self.stage, self.signal_name, self.step = stage, signal_name, step


@dataclass
class QuickstartState:
    out: Path
    pretrain_steps: int
    finetune_steps: int = 200
    rl_steps: int = 40  # 0: no RL stage
    results: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)


def pretrain_config(state: QuickstartState) -> LmforgeConfig:
    """A tiny Llama pretrained on the Python standard library's source, with a tokenizer trained on it."""
    base = {
        "run": {"name": "pretrain", "output_dir": str(state.out), "seed": 0, **_start(state, "pretrain")},
        "model": {"preset": "llama-tiny"},
        "tokenizer": {"train": {"vocab_size": 4096, "max_chars": 4_000_000}},
        "data": {
            "train": [{"path": "builtin:python-stdlib", "max_documents": 500}],
            "eval_fraction": 0.01,
            "max_length": 256,
            "cache_dir": str(state.out / "cache"),
        },
        "train": {
            "max_steps": state.pretrain_steps,
            "micro_batch_size": 8,
            "lr": 2e-3,
            "warmup_steps": 20,
            "weight_decay": 0.01,
            "adam_beta2": 0.95,
            "log_every": 10,
            "eval_every": max(state.pretrain_steps // 2, 1),
            "save_every": max(state.pretrain_steps // 2, 1),
            "keep_last": 1,
            "resume": "auto",  # an interrupted quickstart continues where it stopped
        },
    }
    return load_config(None, base=base)


def stage_pretrain(state: QuickstartState, console: Console) -> None:
    from lmforge.train.runner import run_training

    outcome = run_training(pretrain_config(state))
    _stop_if_interrupted("pretrain", outcome)
    state.results["pretrain"] = {
        "run_dir": str(outcome.run_dir),
        "final_dir": str(outcome.final_dir),
        "steps": outcome.steps,
        "parameters": outcome.parameters,
        "eval_ppl_before": outcome.first_eval_ppl,
        "eval_ppl_after": outcome.last_eval_ppl,
    }
    console.print(
        f"pretrained {outcome.parameters / 1e6:.1f}M-parameter llama for {outcome.steps} steps: "
        f"eval perplexity [bold]{outcome.first_eval_ppl:.1f} -> {outcome.last_eval_ppl:.1f}[/]"
    )


def _start(state: QuickstartState, name: str) -> dict[str, Any]:
    """How a stage's run starts: resumed from its newest checkpoint (the quickstart was
    interrupted), reported (it finished before with the same steps), or afresh when an earlier
    quickstart finished it with another step count."""
    steps = state.pretrain_steps if name == "pretrain" else state.finetune_steps
    finished = read_finished(RunPaths(state.out / name))
    target = (finished or {}).get("target") or {}
    return {"overwrite": finished is not None and target.get("max_steps") != steps}


def _stop_if_interrupted(stage: str, outcome: Any) -> None:
    if outcome.interrupted_by is not None:
        raise QuickstartInterrupted(stage, outcome.interrupted_by, outcome.steps)


def stage_sample(state: QuickstartState, console: Console) -> None:
    """Greedy continuation from the exported model, loaded the way any HF user would load it.

    no_repeat_ngram_size keeps a 4M-parameter model from looping on one token; decoding
    stays deterministic."""
    final = state.results["pretrain"]["final_dir"]
    tokenizer = AutoTokenizer.from_pretrained(final)
    model: Any = AutoModelForCausalLM.from_pretrained(final)
    inputs = tokenizer(SAMPLE_PROMPT, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(
            **inputs,
            max_new_tokens=48,
            do_sample=False,
            no_repeat_ngram_size=3,
            pad_token_id=tokenizer.pad_token_id,
        )
    sample = tokenizer.decode(output[0], skip_special_tokens=True)
    state.results["sample"] = sample
    console.print("[bold]sample[/] (greedy, no repeated 3-grams, from final/):")
    console.print(sample, markup=False, highlight=False)


HELD_OUT_QUESTIONS = 60


def finetune_config(state: QuickstartState, train_file: Path) -> LmforgeConfig:
    """LoRA SFT of the pretrained model on the word-group task; the adapter is also merged into final/."""
    base = {
        "run": {"name": "finetune", "output_dir": str(state.out), "seed": 0, **_start(state, "finetune")},
        "model": {"path": state.results["pretrain"]["final_dir"]},
        "data": {
            "train": [{"path": str(train_file), "format": "alpaca"}],
            "max_length": 64,
            "packing": True,
            "cache_dir": str(state.out / "cache"),
        },
        "train": {
            "stage": "sft",
            "method": "lora",
            # The base was pretrained on code and never saw the chat template's tokens, so the
            # (tied) embedding trains in full beside the adapter, as is usual when a template
            # brings new tokens; it is saved with the adapter.
            "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "modules_to_save": ["embed_tokens"]},
            "max_steps": state.finetune_steps,
            "epochs": 1000,  # max_steps decides
            "micro_batch_size": 8,
            "lr": 1e-3,
            "schedule": "constant",
            "warmup_steps": 10,
            "log_every": 10,
            "resume": "auto",  # an interrupted quickstart continues where it stopped
        },
        # After training: merge, convert to GGUF (f16) and ONNX (int8, onnxruntime's quantization),
        # and verify each in its own runtime against the adapter on its base, on the held-out
        # questions: the precision's gates (perplexity, top-1 agreement, task accuracy).
        "export": {
            "merge_lora": True,
            "formats": ["gguf", "onnx"],
            "onnx_dtype": "int8",
            "verify_data": str(state.out / "data" / "groups_test.jsonl"),
        },
    }
    return load_config(None, base=base)


def stage_finetune(state: QuickstartState, console: Console) -> None:
    """LoRA SFT on a task the project generates, with held-out accuracy measured before and after.

    The task: name the group (fruit, animal, color, tool) of a word, asked in six phrasings.
    Held-out questions pair words and phrasings never seen together in training."""
    from lmforge.data.synthetic import as_alpaca, category_task_rows, write_jsonl
    from lmforge.evaluate import answer_accuracy, load_for_inference
    from lmforge.train.runner import run_training

    train, test = category_task_rows(held_out=HELD_OUT_QUESTIONS, seed=0)
    train_file = write_jsonl(state.out / "data" / "groups_train.jsonl", as_alpaca(train))
    test_file = write_jsonl(state.out / "data" / "groups_test.jsonl", test)
    model, tokenizer = load_for_inference(state.results["pretrain"]["final_dir"])
    before = answer_accuracy(model, tokenizer, test, max_new_tokens=8)
    outcome = run_training(finetune_config(state, train_file))
    _stop_if_interrupted("finetune", outcome)
    model, tokenizer = load_for_inference(str(outcome.final_dir))  # the merged model
    after = answer_accuracy(model, tokenizer, test, max_new_tokens=8)
    state.results["finetune"] = {
        "run_dir": str(outcome.run_dir),
        "final_dir": str(outcome.final_dir),
        "adapter_dir": str(outcome.final_dir / "adapter"),
        "steps": outcome.steps,
        "train_questions": len(train),
        "test_file": str(test_file),
        "held_out_accuracy_before": before["accuracy"],
        "held_out_accuracy_after": after["accuracy"],
        "examples_after": after["examples"],
    }
    console.print(
        f"LoRA fine-tuned on {len(train)} word-group questions for {outcome.steps} steps: held-out accuracy "
        f"[bold]{before['accuracy']:.0%} -> {after['accuracy']:.0%}[/] ({len(test)} unseen questions)"
    )
    for example in after["examples"][:3]:
        mark = "ok" if example["correct"] else "wrong"
        console.print(f"  {example['question']!r} -> {example['got']!r} ({mark})", markup=False)
    if outcome.export is not None:
        state.results["export"] = outcome.export.artifacts


def rl_config(state: QuickstartState) -> LmforgeConfig:
    """GRPO of the merged SFT model (all weights: 5M parameters, and LoRA at rates that move it
    collapsed or stood still here): the word-group questions SFT trained on are the prompts,
    exact match against their answer the reward (the default), and the held-out questions the
    eval, scored by TRL's evaluation before and after."""
    finetune = state.results["finetune"]
    data_dir = state.out / "data"
    base = {
        "run": {"name": "rl", "output_dir": str(state.out), "seed": 0, **_start(state, "rl")},
        "model": {"path": finetune["final_dir"]},
        "data": {
            "train": [{"path": str(data_dir / "groups_train.jsonl"), "format": "alpaca"}],
            "eval": [{"path": finetune["test_file"]}],
            "max_length": 64,
            "cache_dir": str(state.out / "cache"),
        },
        "train": {
            "stage": "grpo",
            "method": "full",
            # The SFT model's distribution is flat past its top few tokens: at temperature 1
            # nearly every sample is noise, at 0.6 about half the answers are right.
            "rl": {"group_size": 4, "max_completion_length": 6, "temperature": 0.6},
            "max_steps": state.rl_steps,
            "micro_batch_size": 16,  # 4 prompts x 4 completions per step
            "lr": 1e-4,
            "schedule": "constant",
            "log_every": 5,
            "eval_every": state.rl_steps,
            "resume": "auto",
        },
    }
    return load_config(None, base=base)


def stage_rl(state: QuickstartState, console: Console) -> None:
    """A short GRPO run after the SFT: sampled reward and greedy held-out accuracy, before and after."""
    from lmforge.evaluate import answer_accuracy, load_for_inference
    from lmforge.monitor.metrics import read_metrics
    from lmforge.train.runner import run_training

    finetune = state.results["finetune"]
    test = [json.loads(line) for line in Path(finetune["test_file"]).read_text().splitlines()]
    outcome = run_training(rl_config(state))
    _stop_if_interrupted("rl", outcome)
    records = read_metrics(outcome.run_dir / "metrics.jsonl")
    evaluated = [r["eval_reward"] for r in records if "eval_reward" in r]
    model, tokenizer = load_for_inference(str(outcome.final_dir))
    after = answer_accuracy(model, tokenizer, test, max_new_tokens=8)
    state.results["rl"] = {
        "run_dir": str(outcome.run_dir),
        "final_dir": str(outcome.final_dir),
        "steps": outcome.steps,
        "held_out_reward_before": evaluated[0],
        "held_out_reward_after": evaluated[-1],
        "held_out_accuracy_before": finetune["held_out_accuracy_after"],
        "held_out_accuracy_after": after["accuracy"],
    }
    result = state.results["rl"]
    console.print(
        f"GRPO ({outcome.steps} steps, exact-match reward): held-out reward of sampled answers "
        f"[bold]{result['held_out_reward_before']:.2f} -> {result['held_out_reward_after']:.2f}[/], greedy "
        f"held-out accuracy {result['held_out_accuracy_before']:.0%} -> {result['held_out_accuracy_after']:.0%}"
    )


def stage_export(state: QuickstartState, console: Console) -> None:
    """What the fine-tune run's export: section made (it ran at the end of training) and how each
    artifact compares with the adapter on its base, measured in the artifact's own runtime."""
    from lmforge.export.run_export import ExportOutcome

    outcome = ExportOutcome(Path(state.results["finetune"]["run_dir"]) / "export", state.results["export"])
    for line in outcome.summary_lines():
        console.print(line, markup=False)
    console.print("(verified on the held-out questions: logits, perplexity and greedy answers)")


STAGES: list[tuple[str, Callable[[QuickstartState, Console], None]]] = [
    ("pretrain", stage_pretrain),
    ("sample", stage_sample),
    ("finetune", stage_finetune),
    ("export", stage_export),
    ("rl", stage_rl),
]


def run_quickstart(
    out: Path,
    *,
    pretrain_steps: int = 300,
    finetune_steps: int = 200,
    rl_steps: int = 40,
    console: Console | None = None,
) -> QuickstartState:
    """Run every stage (the GRPO stage unless `rl_steps` is 0); write quickstart.json (results
    and timings) into `out`."""
    console = console or Console()
    state = QuickstartState(
        out=out, pretrain_steps=pretrain_steps, finetune_steps=finetune_steps, rl_steps=rl_steps
    )
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for name, stage in STAGES:
        if name == "rl" and not rl_steps:
            continue
        console.rule(f"[bold]{name}")
        t0 = time.perf_counter()
        try:
            stage(state, console)
        except QuickstartInterrupted as stop:
            console.print(
                f"[bold yellow]stopped[/] by {stop.signal_name}: {stop.stage} saved a checkpoint at step "
                f"{stop.step}; run the same command again (make demo) to resume it"
            )
            state.results["interrupted"] = {"stage": stop.stage, "step": stop.step}
            return state
        state.timings[name] = round(time.perf_counter() - t0, 1)
    state.timings["total"] = round(time.perf_counter() - started, 1)
    for name in ("pretrain", "finetune", "rl"):  # written at the end of training; again, now complete
        if name in state.results:
            state.results[name]["report"] = str(write_report(Path(state.results[name]["run_dir"])))
    summary = {**asdict(state), "out": str(out)}
    (out / "quickstart.json").write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")
    _print_locations(state, console)
    return state


def _print_locations(state: QuickstartState, console: Console) -> None:
    run_dir = Path(state.results["pretrain"]["run_dir"])
    console.rule("[bold]where everything is")
    console.print(f"run directory     {run_dir}")
    console.print(f"  model (HF)      {run_dir / 'final'}")
    console.print(f"  metrics         {run_dir / 'metrics.jsonl'}  (TensorBoard: {run_dir / 'tb'})")
    console.print(f"  checkpoints     {run_dir / 'checkpoints'}")
    console.print(f"  data report     {run_dir / 'data_report.json'}")
    if "finetune" in state.results:
        finetune = Path(state.results["finetune"]["run_dir"])
        console.print(f"fine-tune run     {finetune}")
        console.print(f"  LoRA adapter    {finetune / 'final' / 'adapter'}  (PEFT format)")
        console.print(f"  merged model    {finetune / 'final'}")
        for fmt, artifact in state.results.get("export", {}).items():
            console.print(f"  {fmt + ' export':15} {artifact['dir']}")
        console.print(
            f"  try it          lmforge generate {finetune / 'final'} --prompt 'Is plum a fruit, an animal, a color or a tool?'"
        )
    if "rl" in state.results:
        rl = Path(state.results["rl"]["run_dir"])
        console.print(f"GRPO run          {rl}")
        console.print(f"  model (HF)      {rl / 'final'}")
        console.print(f"  samples         {rl / 'rl_samples.jsonl'}  (completions with their rewards)")
    for name in ("pretrain", "finetune", "rl"):
        if "report" in state.results.get(name, {}):
            console.print(f"{name + ' report':17} {state.results[name]['report']}  (open in a browser)")
    console.print(f"summary           {state.out / 'quickstart.json'}")
    console.print(f"total time        {state.timings['total']:.0f} s")
