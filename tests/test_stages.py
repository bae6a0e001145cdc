"""Training stages x methods on a tiny model: each trains, and its artifacts load in the
libraries their users use (transformers, peft)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from peft import PeftConfig, PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from lmforge.config import load_config
from lmforge.config.schema import TokenizerTrainConfig
from lmforge.data.chat_templates import BUILTIN_TEMPLATES
from lmforge.data.tokenizer import train_tokenizer
from lmforge.report import write_report
from lmforge.report.stage_metrics_section import RM_TITLE
from lmforge.train.runner import run_training
from tests.conftest import ROOT, run_cli, save_tiny_llama

pytestmark = pytest.mark.slow
DATA = ROOT / "examples" / "data"
PREFERENCE = DATA / "arithmetic_preference.jsonl"
KTO = DATA / "arithmetic_kto.jsonl"
ALPACA = DATA / "arithmetic_alpaca.jsonl"


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small untrained llama (HF directory) with a tokenizer trained on the example data."""
    texts = [line for path in (PREFERENCE, KTO, ALPACA) for line in path.read_text().splitlines()]
    tokenizer = train_tokenizer(texts * 2, TokenizerTrainConfig(vocab_size=400, min_frequency=1))
    return save_tiny_llama(tokenizer, tmp_path_factory.mktemp("base") / "model")


def write_config(tmp_path: Path, base: Path, name: str, data: Path, **train: Any) -> Path:
    config = {
        "run": {"name": name, "output_dir": str(tmp_path / "runs"), "seed": 0},
        "model": {"path": str(base)},
        "data": {"train": [{"path": str(data)}], "max_length": 128, "over_length": "truncate"},
        "train": {
            "max_steps": 4,
            "micro_batch_size": 4,
            "lr": 1e-3,
            "precision": "fp32",
            "log_every": 1,
            **train,
        },
    }
    export = config["train"].pop("export", None)
    if export:
        config["export"] = export
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_lora_sft_adapter_loads_in_peft_and_matches_the_merged_model(
    tmp_path: Path, base_model: Path
) -> None:
    config = write_config(
        tmp_path, base_model, "lora", ALPACA, stage="sft", method="lora", export={"merge_lora": True}
    )
    result = run_cli("train", str(config))
    assert result.returncode == 0, result.stderr
    assert "parameters train" in result.stderr  # the trainable share is reported
    final = tmp_path / "runs" / "lora" / "final"
    adapter = PeftConfig.from_pretrained(str(final / "adapter"))
    assert adapter.peft_type == "LORA" and adapter.r == 8
    suffixes = {name.rsplit(".", 1)[-1] for name in adapter.target_modules}
    assert suffixes == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }  # all-linear
    assert Path(adapter.base_model_name_or_path) == base_model.resolve()
    assert not list(final.rglob("*.bin")) and not list(final.rglob("*.pkl"))

    base = AutoModelForCausalLM.from_pretrained(str(base_model))
    ids = AutoTokenizer.from_pretrained(str(final))("What is 2 + 3?", return_tensors="pt").input_ids
    before = logits(base, ids)
    with_adapter = PeftModel.from_pretrained(base, str(final / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(final)).eval()
    assert not torch.allclose(logits(with_adapter, ids), before, atol=1e-4)  # the adapter learned
    torch.testing.assert_close(logits(merged, ids), logits(with_adapter, ids), atol=1e-4, rtol=1e-4)
    # final/ (merged model and adapter/) is sealed by training and unchanged since: it pushes as is.
    from lmforge.registry import push_run

    pushed = push_run(tmp_path / "runs" / "lora", str(tmp_path / "registry"))
    lineage = json.loads((Path(pushed.location) / "lineage.json").read_text())
    assert (
        lineage["model"]["sealed"] is True
        and "adapter/adapter_model.safetensors" in lineage["model"]["files"]
    )


def test_dora_adapter_is_peft_dora(tmp_path: Path, base_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_config(tmp_path, base_model, "dora", ALPACA, stage="sft", method="dora")
    monkeypatch.chdir(base_model.parent)
    # A relative model.path; a built-in template chosen in the config.
    outcome = run_training(load_config(config, ["model.path=model", "data.chat_template=qwen2"]))
    assert AutoTokenizer.from_pretrained(str(outcome.final_dir)).chat_template == BUILTIN_TEMPLATES["qwen2"]
    adapter = PeftConfig.from_pretrained(str(outcome.final_dir / "adapter"))
    assert adapter.use_dora is True
    assert adapter.base_model_name_or_path == str(base_model.resolve())  # loads from any directory
    PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(base_model)), str(outcome.final_dir / "adapter")
    )
    assert not (outcome.final_dir / "model.safetensors").exists()  # no merge unless export.merge_lora


def test_freeze_trains_only_the_top_layer_and_named_modules(tmp_path: Path, base_model: Path) -> None:
    freeze = {"trainable_layers": 1, "trainable_modules": ["model.norm"]}
    outcome = run_training(
        load_config(
            write_config(tmp_path, base_model, "freeze", ALPACA, stage="sft", method="freeze", freeze=freeze)
        )
    )
    before = load_file(str(base_model / "model.safetensors"))
    after = load_file(str(outcome.final_dir / "model.safetensors"))
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed, "nothing trained"
    assert all(name.startswith(("model.layers.1.", "model.norm.")) for name in changed), changed
    assert any(name.startswith("model.layers.1.") for name in changed)
    assert "model.norm.weight" in changed


def test_freeze_naming_a_module_that_does_not_exist_fails_before_training(
    tmp_path: Path, base_model: Path
) -> None:
    config = write_config(
        tmp_path,
        base_model,
        "bad",
        ALPACA,
        stage="sft",
        method="freeze",
        freeze={"trainable_modules": ["nope"]},
    )
    result = run_cli("train", str(config))
    assert result.returncode == 2
    assert "train.freeze.trainable_modules: no parameter name contains ['nope']" in result.stderr


@pytest.mark.parametrize(
    ("stage", "method", "loss", "data"),
    [
        ("dpo", "full", "sigmoid", PREFERENCE),
        ("dpo", "lora", "ipo", PREFERENCE),
        ("dpo", "full", "orpo", PREFERENCE),
        ("dpo", "lora", "simpo", PREFERENCE),
        ("kto", "full", None, KTO),
        ("kto", "lora", None, PREFERENCE),  # pairs read as one desirable and one undesirable row
        ("rm", "full", None, PREFERENCE),
        ("rm", "lora", None, PREFERENCE),
    ],
)
def test_preference_stages_train_and_save_loadable_models(
    tmp_path: Path, base_model: Path, stage: str, method: str, loss: str | None, data: Path
) -> None:
    extra: dict[str, Any] = {"dpo": {"loss": loss}} if loss else {}
    outcome = run_training(
        load_config(
            write_config(tmp_path, base_model, f"{stage}-{method}", data, stage=stage, method=method, **extra)
        )
    )
    rows = [r for r in records(outcome.run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["tokens_per_s"] > 0 and r["loss"] == r["loss"] for r in rows)  # counted, finite
    if stage != "rm":  # every variant's implicit-reward margin, as TRL logs it (rm: accuracy, margin)
        assert all(math.isfinite(r["rewards/margins"]) for r in rows), rows[-1]
    report = json.loads((outcome.run_dir / "data_report.json").read_text())
    assert report["stage"] == stage and report["train"]["rows"] > 0
    auto = AutoModelForSequenceClassification if stage == "rm" else AutoModelForCausalLM
    if method == "lora":
        base = auto.from_pretrained(str(base_model), **({"num_labels": 1} if stage == "rm" else {}))
        model = PeftModel.from_pretrained(base, str(outcome.final_dir / "adapter"))
    else:
        model = auto.from_pretrained(str(outcome.final_dir))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        out = model(input_ids=ids).logits
    assert out.shape[-1] == (1 if stage == "rm" else model.config.vocab_size)


def sum_pairs(tmp_path: Path) -> Path:
    """64 preference pairs whose chosen answers state the sum and whose rejected ones refuse."""
    pairs = [
        {"instruction": f"What is {a} + {b}?", "chosen": f"{a} + {b} = {a + b}", "rejected": "I do not know."}
        for a in range(1, 9)
        for b in range(1, 9)
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return data


def test_reward_model_logs_pairwise_accuracy_and_margin_and_the_report_charts_them(
    tmp_path: Path, base_model: Path
) -> None:
    """The rm stage's held-out pairs are measured at each evaluation: the share ranked right rises
    from chance to nearly all as the model learns that stating the sum beats refusing. The console
    says in one line that the causal LM gets a new score head; transformers' key table for it and
    TRL's tokenizing bars stay off it (train.log keeps the table)."""
    data = sum_pairs(tmp_path)
    config = write_config(
        tmp_path, base_model, "rm-measured", data, stage="rm", max_steps=24, eval_every=8, lr=3e-3
    )
    result = run_cli("train", str(config), "data.eval_fraction=0.2")
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "runs" / "rm-measured"
    console = result.stdout + result.stderr
    assert "model: a new score head (score, one output)" in console
    assert "LOAD REPORT" not in console and "MISSING" not in console, console
    assert "Tokenizing train dataset" not in console and "examples/s" not in console, console
    assert "LlamaForSequenceClassification LOAD REPORT" in (run_dir / "train.log").read_text()
    rows = records(run_dir)
    trained = [r for r in rows if "loss" in r]
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["margin"] == r["margin"] for r in trained)
    evals = [r for r in rows if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 8, 16, 24]
    assert all(0.0 <= r["eval_accuracy"] <= 1.0 for r in evals)
    assert evals[-1]["eval_accuracy"] >= 0.9 and evals[-1]["eval_margin"] > evals[0]["eval_margin"] + 1.0, (
        evals
    )
    page = write_report(run_dir).read_text()
    section = page[page.index(RM_TITLE) :]
    assert section.index("eval_accuracy") < section.index("eval_margin") < section.index(">accuracy<")


def test_dpo_loss_falls_on_a_small_preference_set(tmp_path: Path, base_model: Path) -> None:
    """The chosen answers state the sum, the rejected ones refuse: a preference DPO learns quickly."""
    data = sum_pairs(tmp_path)
    outcome = run_training(
        load_config(write_config(tmp_path, base_model, "dpo-long", data, stage="dpo", max_steps=30, lr=3e-3))
    )
    rows = [r for r in records(outcome.run_dir) if "loss" in r]
    losses = [r["loss"] for r in rows]
    assert losses[0] == pytest.approx(0.6931, abs=0.01)  # policy == reference at the start
    assert sum(losses[-5:]) / 5 < 0.3, losses
    # What a DPO user reads to see it learn, kept from TRL's logs: pairs ranked right, and by how much.
    assert rows[0]["rewards/margins"] == 0.0 and rows[0]["rewards/accuracies"] == 0.0
    assert min(r["rewards/accuracies"] for r in rows[-5:]) == 1.0
    assert sum(r["rewards/margins"] for r in rows[-5:]) / 5 > 1.0, [r["rewards/margins"] for r in rows]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU-only refusal; tests/test_gpu.py runs QLoRA on CUDA"
)
def test_qlora_on_a_cpu_machine_fails_before_any_work(tmp_path: Path, base_model: Path) -> None:
    config = write_config(tmp_path, base_model, "qlora", ALPACA, stage="sft", method="qlora")
    result = run_cli("train", str(config))
    assert result.returncode == 2
    assert "train.method: qlora needs a CUDA GPU" in result.stderr
    assert not (tmp_path / "runs" / "qlora").exists()


def test_stage_and_data_mismatch_is_a_config_error(tmp_path: Path, base_model: Path) -> None:
    config = write_config(tmp_path, base_model, "mismatch", ALPACA, stage="dpo")
    config.write_text(config.read_text().replace(str(ALPACA), str(ALPACA)))
    cfg = yaml.safe_load(config.read_text())
    cfg["data"]["train"][0]["format"] = "alpaca"
    config.write_text(yaml.safe_dump(cfg))
    result = run_cli("train", str(config))
    assert result.returncode == 2
    assert "train.stage: dpo and rm learn from preference pairs" in result.stderr


def test_lora_run_resumes_exactly_after_a_crash(tmp_path: Path, base_model: Path) -> None:
    """Kill a LoRA run after its step-4 checkpoint; the resumed run's adapter equals an uninterrupted run's."""
    settings = {"stage": "sft", "method": "lora", "max_steps": 8, "save_every": 4}
    straight = run_training(load_config(write_config(tmp_path, base_model, "straight", ALPACA, **settings)))
    crashing = write_config(tmp_path, base_model, "crashing", ALPACA, **settings)
    killed = run_cli("train", str(crashing), "debug.crash_at_step=4")
    assert killed.returncode == -9
    resumed = run_cli("train", str(crashing))
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stderr
    run_dir = tmp_path / "runs" / "crashing"
    assert [r["step"] for r in records(run_dir) if "loss" in r] == list(range(1, 9))
    expected = load_file(str(straight.final_dir / "adapter" / "adapter_model.safetensors"))
    got = load_file(str(run_dir / "final" / "adapter" / "adapter_model.safetensors"))
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-5)


def test_best_checkpoint_by_eval_loss_is_recorded_and_kept(tmp_path: Path, base_model: Path) -> None:
    settings = {
        "stage": "sft",
        "method": "lora",
        "max_steps": 6,
        "eval_every": 2,
        "save_every": 2,
        "keep_last": 1,
        "best_metric": "eval_loss",
    }
    config = write_config(tmp_path, base_model, "best", ALPACA, **settings)
    cfg = yaml.safe_load(config.read_text())
    cfg["data"]["eval_fraction"] = 0.2
    config.write_text(yaml.safe_dump(cfg))
    outcome = run_training(load_config(config))
    evals = {
        r["step"]: r["eval_loss"] for r in records(outcome.run_dir) if "eval_loss" in r and r["step"] > 0
    }
    best = json.loads((outcome.run_dir / "checkpoints" / "best.json").read_text())
    best_step = min((step for step in evals if step % 2 == 0), key=lambda step: evals[step])
    assert best["step"] == best_step and best["value"] == pytest.approx(evals[best_step])
    kept = sorted(p.name for p in (outcome.run_dir / "checkpoints").glob("step-*"))
    assert kept == sorted({f"step-{best_step}", "step-6"})  # newest (keep_last=1) plus the best


def test_preparing_pairs_prints_the_data_report_without_upstream_bars(
    tmp_path: Path, base_model: Path
) -> None:
    """`lmforge prepare` on preference pairs: the data report and lmforge's own progress, not
    datasets' "Saving the dataset (1/1 shards)" bars (two per split)."""
    config = write_config(tmp_path, base_model, "dpo-prep", PREFERENCE, stage="dpo")
    result = run_cli("prepare", str(config))
    assert result.returncode == 0, result.stderr
    assert '"stage": "dpo"' in result.stdout and "data report written to" in result.stdout
    assert "Saving the dataset" not in result.stdout + result.stderr, result.stderr


def test_dpo_run_resumes_exactly_after_a_crash(tmp_path: Path, base_model: Path) -> None:
    """A full-weight DPO run (frozen reference copy) killed after its step-2 checkpoint resumes to
    the same final weights as an uninterrupted run; its eval loss is never called a perplexity."""
    settings = {"stage": "dpo", "max_steps": 4, "save_every": 2, "eval_every": 2}
    straight_config = write_config(tmp_path, base_model, "dpo-straight", PREFERENCE, **settings)
    crashing = write_config(tmp_path, base_model, "dpo-crashing", PREFERENCE, **settings)
    for config in (straight_config, crashing):
        cfg = yaml.safe_load(config.read_text())
        cfg["data"]["eval_fraction"] = 0.1
        config.write_text(yaml.safe_dump(cfg))
    straight = run_training(load_config(straight_config))
    assert run_cli("train", str(crashing), "debug.crash_at_step=2").returncode == -9
    resumed = run_cli("train", str(crashing))
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stderr and "eval loss (dpo)" in resumed.stdout
    # TRL tokenizes the pairs lmforge's data stage already checked: its datasets bars stay off.
    assert "Tokenizing train dataset" not in resumed.stderr and "examples/s" not in resumed.stderr
    assert re.search(r"eval at step 4:  loss \S+  pair acc \S+  margin \S+", resumed.stderr), resumed.stderr
    run_dir = tmp_path / "runs" / "dpo-crashing"
    rows = records(run_dir)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert any("eval_loss" in r for r in rows) and not any("eval_ppl" in r for r in rows)
    expected = load_file(str(straight.final_dir / "model.safetensors"))
    got = load_file(str(run_dir / "final" / "model.safetensors"))
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-5)
