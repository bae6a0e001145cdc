"""The training recipe: every optimizer and schedule that runs on a CPU trains a tiny model (the
loss falls) and resumes exactly after SIGKILL; torch.compile gives eager's first-step loss, and
compiled layers eager's loss curve; the memory savers leave the maths alone; what cannot work is
refused before any work."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import TrainingArguments
from transformers.optimization import get_scheduler

from lmforge.config import load_config
from lmforge.errors import UserInputError
from lmforge.run_layout import RunPaths
from lmforge.train.arguments import build_training_arguments, warmup_outlasting_the_run
from lmforge.train.optimizers import wsd_scheduler_kwargs
from lmforge.train.preflight import check_recipe_runs_here
from tests.conftest import SMALL_ARCH, run_cli

BASE = {
    "run": {"name": "run", "seed": 0},
    "model": {"preset": "llama-tiny", "config": SMALL_ARCH},
    "tokenizer": {"train": {"vocab_size": 512, "max_chars": 400_000}},
    "data": {"train": [{"path": "builtin:python-stdlib", "max_documents": 40}], "max_length": 64},
    "train": {
        "max_steps": 7,
        "micro_batch_size": 4,
        "lr": 1e-2,
        "precision": "fp32",
        "warmup_steps": 1,
        "save_every": 3,
        "log_every": 1,
    },
}


def write_config(tmp_path: Path, train: dict | None = None, **sections: dict) -> Path:
    config = json.loads(json.dumps(BASE))
    config["run"]["output_dir"] = str(tmp_path / "runs")
    config["train"].update(train or {})
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


# Each optimizer with the lr it learns at on the tiny model (Lion and Muon's AdamW part need
# their own), and the schedules spread over them so every schedule runs and resumes too.
RECIPES = {
    "adafactor": {"optimizer": "adafactor", "schedule": "cosine", "min_lr_ratio": 0.1},
    "lion": {
        "optimizer": "lion",
        "lr": 2e-3,
        "adam_beta2": 0.99,
        "schedule": "wsd",
        "decay_ratio": 0.3,
        "warmup_steps": 0,
        "warmup_ratio": 0.15,
    },
    "galore": {"optimizer": {"name": "galore", "galore": {"rank": 8, "update_interval": 2}}},
    "muon": {"optimizer": {"name": "muon", "muon": {"adamw_lr": 1e-2}}, "lr": 0.02, "weight_decay": 0.01},
    "adamw_8bit": {"optimizer": "adamw_8bit", "schedule": "linear"},
}


def killed_and_resumed(tmp_path: Path, train: dict, **sections: dict) -> tuple[Path, Path, str]:
    """The run uninterrupted, and the same run SIGKILLed after step 5 (its checkpoint is step 3's)
    then resumed: the two run directories and the resumed run's stderr."""
    reference = run_cli("train", str(write_config(tmp_path / "reference", train, **sections)))
    assert reference.returncode == 0, reference.stderr[-3000:]
    config = write_config(tmp_path / "killed", train, **sections)
    killed = run_cli("train", str(config), "debug.crash_at_step=5")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run_cli("train", str(config))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # "not resuming from step-3: ..." (a refused checkpoint) would match the words alone.
    assert "resuming from" in resumed.stderr and "step-3" in resumed.stderr
    assert "not resuming" not in resumed.stderr, resumed.stderr[-3000:]
    # DeepSpeed's import notice goes to train.log, on a resume too (where reading the checkpoint of a
    # LoRA run imports PEFT, and so DeepSpeed, before the run's log is set up).
    assert "Setting accelerator to CPU" not in resumed.stdout + resumed.stderr
    return tmp_path / "reference" / "runs" / "run", tmp_path / "killed" / "runs" / "run", resumed.stderr


def assert_same_run(reference: Path, resumed: Path) -> None:
    """Bit-identical final weights and loss curve: the optimizer's state (moments, factored
    statistics, GaLore projections, Muon momentum) and the schedule resumed exactly."""
    assert losses(resumed) == losses(reference)
    expected, got = (
        load_file(reference / "final" / "model.safetensors"),
        load_file(resumed / "final" / "model.safetensors"),
    )
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected), "weights differ after the resume"


# CI runs the optimizers lmforge builds itself (Muon, GaLore's arguments; LoRA+ below); the ones
# transformers builds from an `optim` name run with `make test-integration` (three runs each).
IN_CI = {"galore", "muon"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe",
    [
        name if name in IN_CI else pytest.param(name, marks=pytest.mark.integration)
        for name in sorted(RECIPES)
    ],
)
def test_optimizer_lowers_the_loss_and_resumes_exactly_after_sigkill(tmp_path: Path, recipe: str) -> None:
    reference, resumed, _ = killed_and_resumed(tmp_path, RECIPES[recipe])
    assert_same_run(reference, resumed)
    curve = losses(reference)
    assert sorted(curve) == list(range(1, 8))
    assert curve[7] < curve[1] - 0.2, curve


@pytest.mark.slow
def test_lora_plus_gives_the_b_matrices_their_own_rate_and_resumes_exactly(
    tmp_path: Path, tiny_base: Path
) -> None:
    reference, resumed, stderr = killed_and_resumed(
        tmp_path,
        {
            "method": "lora",
            "optimizer": {"name": "adamw", "lora_plus_ratio": 16},
            "lr": 1e-3,
            "eval_every": 7,
        },
        model={"preset": None, "config": None, "path": str(tiny_base)},
        tokenizer={"train": None},
        data={**BASE["data"], "eval_fraction": 0.05},
    )
    assert losses(resumed) == losses(reference)
    expected = load_file(reference / "final" / "adapter" / "adapter_model.safetensors")
    got = load_file(resumed / "final" / "adapter" / "adapter_model.safetensors")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    records = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert evals[7] < evals[0] - 0.05, evals  # the held-out loss at the start and at the end
    record = next(r for r in records if r["step"] == 3 and "loss" in r)
    rates = {v for k, v in record.items() if k.startswith("lr_group_")}
    # PEFT's groups: the A matrices at the schedule's lr, the B matrices at 16 x that lr.
    assert record["lr"] in rates and any(math.isclose(r, 16 * record["lr"]) for r in rates), record
    assert "LoRA+ (B matrices at 16x lr)" in stderr


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A briefly pretrained tiny model to put adapters on."""
    tmp_path = tmp_path_factory.mktemp("base")
    done = run_cli("train", str(write_config(tmp_path, {"max_steps": 2, "save_every": None})))
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp_path / "runs" / "run" / "final"


# -- schedules ---------------------------------------------------------------------------------
def _lrs(tmp_path: Path, overrides: list[str], steps: int = 100) -> list[float]:
    """The learning rate at each step of the schedule lmforge hands HF, as HF's scheduler builds it."""
    cfg = load_config(
        write_config(tmp_path),
        [f"train.max_steps={steps}", "train.lr=1.0", "train.warmup_steps=0", *overrides],
    )
    args = build_training_arguments(
        cfg.train, RunPaths(tmp_path / "r"), seed=0, has_eval=False, precision="fp32"
    )
    assert isinstance(args, TrainingArguments)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.get_warmup_steps(steps),
        num_training_steps=steps,
        scheduler_specific_kwargs=wsd_scheduler_kwargs(args.lr_scheduler_kwargs or {}, steps),
    )
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_cosine_with_a_minimum_lr_ends_at_the_floor(tmp_path: Path) -> None:
    rates = _lrs(tmp_path, ["train.schedule=cosine", "train.min_lr_ratio=0.1", "train.warmup_steps=10"])
    assert rates[0] == 0.0 and rates[10] == pytest.approx(1.0)
    assert min(rates[10:]) >= 0.1 - 1e-9 and rates[-1] == pytest.approx(0.1, abs=1e-3)


def test_warmup_stable_decay_holds_the_peak_then_decays_over_the_last_share(tmp_path: Path) -> None:
    rates = _lrs(
        tmp_path,
        ["train.schedule=wsd", "train.decay_ratio=0.2", "train.min_lr_ratio=0.05", "train.warmup_ratio=0.1"],
    )
    assert rates[0] < 0.1 and 0.4 < rates[5] < 0.6  # warmup: 10% of 100 steps
    assert rates[9] < 1.0 and all(r == pytest.approx(1.0) for r in rates[10:80])  # stable
    assert rates[90] < 0.6 and rates[-1] == pytest.approx(0.05, abs=0.01)  # the last 20 steps decay


def test_a_constant_schedule_warms_up_first(tmp_path: Path) -> None:
    """HF's "constant" scheduler skips warmup_steps; lmforge's constant warms up, then holds."""
    rates = _lrs(tmp_path, ["train.schedule=constant", "train.warmup_steps=10"], steps=30)
    assert rates[:11] == pytest.approx([i / 10 for i in range(11)]) and rates[10:] == [1.0] * 20
    assert _lrs(tmp_path, ["train.schedule=constant"], steps=5) == [1.0] * 5


def test_warmup_ratio_is_a_share_of_all_steps(tmp_path: Path) -> None:
    rates = _lrs(tmp_path, ["train.schedule=linear", "train.warmup_ratio=0.25"], steps=40)
    assert rates[:11] == pytest.approx([i / 10 for i in range(11)])  # 25% of 40 = 10 warmup steps


def test_a_warmup_longer_than_the_run_is_warned_with_the_peak_it_reaches(tmp_path: Path) -> None:
    """A sweep's warmup_steps 50 beside max_steps 20: the rate never reaches train.lr, and the start
    banner's warning says how far it gets."""
    rates = _lrs(tmp_path, ["train.schedule=constant", "train.warmup_steps=50"], steps=20)
    assert max(rates) == pytest.approx(19 / 50)
    cfg = load_config(write_config(tmp_path), ["train.max_steps=20", "train.warmup_steps=50"])
    assert warmup_outlasting_the_run(cfg.train) == (
        "train.warmup_steps=50 is not below train.max_steps=20: the learning rate is still warming up when "
        "the run ends and peaks at about 40% of train.lr. Fix: lower train.warmup_steps, or set "
        "train.warmup_ratio (a share of the steps; 0.03 is common)"
    )
    for fine in (["train.warmup_steps=19"], ["train.warmup_steps=0", "train.warmup_ratio=0.5"]):
        assert (
            warmup_outlasting_the_run(
                load_config(write_config(tmp_path), ["train.max_steps=20", *fine]).train
            )
            is None
        )


# -- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (["train.warmup_steps=5", "train.warmup_ratio=0.1"], "train.warmup_ratio", "not both"),
        (["train.schedule=linear", "train.min_lr_ratio=0.1"], "train.min_lr_ratio", "cosine or wsd"),
        (["train.decay_ratio=0.2"], "train.decay_ratio", "schedule: wsd"),
        (["train.optimizer.lora_plus_ratio=16"], "train.optimizer.lora_plus_ratio", "lora, dora or qlora"),
        (["train.optimizer={name: adamw, muon: {ns_steps: 3}}"], "train.optimizer", "set name: muon"),
        (["train.optimizer=sgd"], "train.optimizer.name", "adamw"),
        (["train.optimizer=muon", "distributed.strategy=fsdp"], "train.optimizer.name", "strategy: ddp"),
        (
            ["train.optimizer=lion", "distributed.strategy=deepspeed"],
            "train.optimizer.name",
            "DeepSpeed runs",
        ),
        (["train.checkpoint_every=2"], "train.checkpoint_every", "gradient_checkpointing: true"),
        (["train.compile=true", "distributed.strategy=deepspeed"], "train.compile", "DeepSpeed's own"),
        (["train.compile=layers", "distributed.strategy=deepspeed"], "train.compile", "DeepSpeed's own"),
        (["train.compile=true", "train.kernels=liger"], "train.compile", "set train.compile: layers"),
        (
            ["train.compile=model", "train.chunked_cross_entropy=true"],
            "train.chunked_cross_entropy",
            "set train.compile: layers",
        ),
    ],
)
def test_impossible_recipes_are_refused_at_load(
    tmp_path: Path, overrides: list[str], key: str, says: str
) -> None:
    with pytest.raises(UserInputError) as caught:
        load_config(write_config(tmp_path), overrides)
    assert key in str(caught.value) and says in str(caught.value)


@pytest.mark.parametrize(
    ("compile", "hf_compile"), [("false", False), ("true", True), ("model", True), ("layers", False)]
)
def test_only_compile_model_is_hf_torch_compile(tmp_path: Path, compile: str, hf_compile: bool) -> None:
    """`compile: true` is the whole model, as before; `layers` leaves HF's switch off and compiles
    the layers itself (train/regional_compile.py)."""
    cfg = load_config(write_config(tmp_path), [f"train.compile={compile}"])
    args = build_training_arguments(
        cfg.train, RunPaths(tmp_path / "r"), seed=0, has_eval=False, precision="fp32"
    )
    assert args.torch_compile is hf_compile
    assert args.torch_compile_mode == ("default" if hf_compile else None)


@pytest.mark.parametrize("beside", ["train.chunked_cross_entropy=true", "train.kernels=liger"])
def test_compile_layers_loads_beside_the_chunked_loss_and_liger(tmp_path: Path, beside: str) -> None:
    assert load_config(write_config(tmp_path), ["train.compile=layers", beside]).train.compile == "layers"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals of a machine without a CUDA GPU")
@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["train.optimizer=paged_adamw_8bit"], "no CUDA GPU; use adamw_8bit"),
        (["train.kernels=liger"], "Triton kernels on a CUDA GPU"),
    ],
)
def test_gpu_only_recipes_are_refused_on_a_cpu_before_any_work(
    tmp_path: Path, overrides: list[str], says: str
) -> None:
    with pytest.raises(UserInputError, match=says):
        check_recipe_runs_here(load_config(write_config(tmp_path), overrides).train)
    done = run_cli("train", str(write_config(tmp_path)), *overrides)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "runs" / "run" / "metrics.jsonl").exists()


def test_galore_targets_that_match_nothing_name_the_key(tmp_path: Path) -> None:
    done = run_cli(
        "train",
        str(write_config(tmp_path, {"max_steps": 1, "save_every": None})),
        "train.optimizer={name: galore, galore: {targets: [nothing_here]}}",
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "train.optimizer.galore.targets ['nothing_here'] match no linear layer" in done.stderr
    assert "Traceback" not in done.stderr


# -- compile and memory savers -----------------------------------------------------------------
@pytest.mark.integration  # inductor compiles for about 40 s on 2 cores: `make test-integration`
def test_compile_gives_the_eager_first_step_loss_with_checkpointing(tmp_path: Path) -> None:
    steps = {"max_steps": 2, "save_every": None, "gradient_checkpointing": True}
    eager = run_cli("train", str(write_config(tmp_path / "eager", steps)))
    assert eager.returncode == 0, eager.stderr[-3000:]
    compiled = run_cli("train", str(write_config(tmp_path / "compiled", {**steps, "compile": True})))
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    first_eager = losses(tmp_path / "eager" / "runs" / "run")[1]
    first_compiled = losses(tmp_path / "compiled" / "runs" / "run")[1]
    # Inductor fuses and reorders float32 reductions: the same maths, rounded differently
    # (measured 1.5e-7 relative on this model); 1e-5 leaves room and still catches a wrong graph.
    assert first_compiled == pytest.approx(first_eager, rel=1e-5)


@pytest.mark.slow  # inductor compiles one layer: about 45 s on 2 cores with a cold inductor cache, 30 s warm
def test_memory_savers_and_compiled_layers_leave_the_loss_curve_alone(tmp_path: Path) -> None:
    """Selective checkpointing, activation offload and the chunked loss recompute or move what a
    step keeps, never its maths: the loss curve equals the plain run's. `train.compile: layers`
    compiles each decoder layer in place and leaves the loss eager: beside checkpointing and the
    chunked loss (which `compile: model` refuses) the curve is the plain run's too, the two layers
    share one compiled graph, and the checkpoints and final/ keep eager's parameter names."""
    steps = {"max_steps": 6, "save_every": 3}
    plain = run_cli("train", str(write_config(tmp_path / "plain", steps)))
    assert plain.returncode == 0, plain.stderr[-3000:]
    savers = {
        **steps,
        "gradient_checkpointing": True,
        "checkpoint_every": 2,
        "activation_offload": True,
        "chunked_cross_entropy": True,
    }
    saved = run_cli("train", str(write_config(tmp_path / "savers", savers)))
    assert saved.returncode == 0, saved.stderr[-3000:]
    assert (
        "memory savers: gradient checkpointing (every 2 layers), activations in host memory, chunked "
        "cross-entropy (1024-token chunks)"
    ) in saved.stderr
    compiled_steps = {
        **steps,
        "gradient_checkpointing": True,
        "chunked_cross_entropy": True,
        "compile": "layers",
    }
    compiled = run_cli(
        "train",
        str(write_config(tmp_path / "layers", compiled_steps)),
        env={"TORCH_LOGS": "dynamo"},  # dynamo says each graph it traces
    )
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    run, plain_run = tmp_path / "layers" / "runs" / "run", tmp_path / "plain" / "runs" / "run"
    said = (
        "compile: 2 decoder layers (LlamaDecoderLayer) compiled in place, mode default; the loss runs eager"
    )
    assert said in compiled.stderr and said in (run / "train.log").read_text()
    assert "compiled in place" not in plain.stderr + saved.stderr
    # One graph: the second layer reuses the first's (no recompile), and nothing outside the layers compiles.
    assert compiled.stderr.count("torchdynamo start tracing") == 1, compiled.stderr[-3000:]
    expected = losses(plain_run)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]
    # The chunked loss sums the tokens' losses in another order, and inductor may round float32
    # reductions differently from eager: float32 rounding, within 1e-5 relative.
    for other in (tmp_path / "savers" / "runs" / "run", run):
        got = losses(other)
        assert sorted(got) == sorted(expected), other
        assert [got[s] for s in sorted(got)] == pytest.approx(
            [expected[s] for s in sorted(expected)], rel=1e-5
        )
    names = load_file(plain_run / "final" / "model.safetensors").keys()
    for checkpoint in (run / "checkpoints" / "step-3", run / "final"):
        keys = load_file(checkpoint / "model.safetensors").keys()
        assert keys == names and not any("_orig_mod" in key for key in keys), checkpoint


def test_a_recorded_config_reads_back_with_its_optimizer(tmp_path: Path) -> None:
    """config.yaml holds every default (galore's and muon's sections, decay_ratio, ...): read back,
    as a resume compares it, it must give the same optimizer and pass the load checks."""
    from lmforge.config import dump_config
    from lmforge.config.recorded import read_recorded_config

    cfg = load_config(write_config(tmp_path), ["train.optimizer={name: muon, muon: {adamw_lr: 0.01}}"])
    recorded = tmp_path / "recorded.yaml"
    recorded.write_text(yaml.safe_dump(dump_config(cfg)))
    again = read_recorded_config(recorded)
    assert again.notes == () and again.train.optimizer == cfg.train.optimizer
    assert load_config(recorded).train == cfg.train
