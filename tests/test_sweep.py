"""`lmforge sweep`: an Optuna study of tiny training runs. Pruning bites, the best config re-runs
to the same metric, a killed sweep continues without repeating finished trials, and two
processes share one SQLite study."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import psutil
import pytest
import yaml

from lmforge.errors import UserInputError
from lmforge.sweep.space import load_space
from tests.conftest import run_cli
from tests.test_early_stopping import events_of
from tests.test_train_e2e import metrics_of, write_config

SPACE = {"train.lr": {"low": 1.0e-5, "high": 3.0e-2, "log": True}, "train.warmup_steps": [0, 2, 4]}
SHORT = ["train.max_steps=12", "train.eval_every=3"]


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data cache for the module's sweeps: the tokenizer is trained and the data tokenized once."""
    return tmp_path_factory.mktemp("sweep-cache")


@pytest.fixture
def shared_cache(data_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMFORGE_CACHE", str(data_cache))


def write_space(tmp_path: Path, space: dict | None = None) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space or SPACE))
    return path


def load_study(sweep_dir: Path, name: str = "base") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{sweep_dir / 'study.db'}")


def states(study: optuna.Study) -> list[str]:
    return [t.state.name for t in study.trials]


@pytest.mark.parametrize(
    ("space", "message"),
    [
        ({"train.lrr": [0.1]}, "train.lrr"),
        ({"train.lr": {"low": 0.1, "high": 0.01}}, "low (0.1) must be below high (0.01)"),
        ({"train.lr": {"low": 0.0, "high": 0.1, "log": True}}, "a log range needs low > 0"),
        ({"train.lr": []}, "an empty list of choices"),
        ({"train.lr": {"low": 1e-4}}, "low or high is missing"),
        ({"train.micro_batch_size": [4, 0]}, "the value 0 is not a valid config"),
    ],
)
def test_a_bad_space_is_refused_naming_file_and_key(tmp_path: Path, space: dict, message: str) -> None:
    with pytest.raises(UserInputError, match=None) as err:
        load_space(write_space(tmp_path, space), write_config(tmp_path), [])
    assert message in str(err.value)
    assert "space.yaml" in str(err.value)


def test_the_shipped_space_fits_the_shipped_config() -> None:
    root = Path(__file__).resolve().parents[1] / "examples"
    space = load_space(root / "sweep" / "space.yaml", root / "pretrain_tiny.yaml", [])
    assert list(space.distributions) == ["train.lr", "train.warmup_steps"]


def test_cli_refuses_a_bad_space_and_a_config_without_evaluations(tmp_path: Path) -> None:
    config = str(write_config(tmp_path))
    bad = run_cli("sweep", config, *SHORT, "--space", str(write_space(tmp_path, {"train.nope": [1]})))
    assert bad.returncode == 2 and "train.nope" in bad.stderr + bad.stdout
    no_eval = run_cli("sweep", config, "--space", str(write_space(tmp_path)))
    assert no_eval.returncode == 2 and "set train.eval_every" in no_eval.stderr + no_eval.stdout
    grid = run_cli("sweep", config, *SHORT, "--space", str(write_space(tmp_path)), "--sampler", "grid")
    assert grid.returncode == 2 and "a grid search needs a list of values" in grid.stderr + grid.stdout
    for result in (bad, no_eval, grid):
        assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.usefixtures("shared_cache")
def test_sweep_prunes_writes_its_results_and_the_best_config_reruns_to_its_metric(tmp_path: Path) -> None:
    config = str(write_config(tmp_path))
    result = run_cli(
        "sweep", config, *SHORT, "--space", str(write_space(tmp_path)), "--trials", "6", "--sampler", "random"
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sweep_dir = tmp_path / "runs" / "base-sweep"
    study = load_study(sweep_dir)
    assert len(study.trials) == 6
    assert states(study).count("PRUNED") >= 1, states(study)
    assert set(states(study)) <= {"COMPLETE", "PRUNED"}
    pruned = next(t for t in study.trials if t.state.name == "PRUNED")
    pruned_dir = sweep_dir / f"trial-{pruned.number:04d}"
    stop = next(e for e in events_of(pruned_dir) if e["kind"] == "pruned")
    assert stop["step"] < 12 and metrics_of(pruned_dir)[-1]["step"] == stop["step"]  # stopped early
    # One run directory per trial, a summary row per trial, the page.
    assert sorted(p.name for p in sweep_dir.glob("trial-*")) == [f"trial-{n:04d}" for n in range(6)]
    rows = list(csv.DictReader((sweep_dir / "summary.csv").open()))
    assert [r["state"] for r in rows] == [t.state.name.lower() for t in study.trials]
    assert "parallel" in (sweep_dir / "sweep.html").read_text().lower()
    # The best config is ready to run and reaches the best trial's metric (same seed).
    best = yaml.safe_load((sweep_dir / "best.yaml").read_text())
    assert best["train"]["lr"] == study.best_params["train.lr"] and best["run"]["name"] == "base-best"
    rerun = run_cli("train", str(sweep_dir / "best.yaml"), f"run.output_dir={tmp_path / 'again'}")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    last_eval = [r["eval_loss"] for r in metrics_of(tmp_path / "again" / "base-best") if "eval_loss" in r][-1]
    assert last_eval == pytest.approx(study.best_value, rel=1e-6)
    # The trials are ordinary runs: `lmforge runs compare` reads them.
    compare = run_cli(
        "runs",
        "compare",
        str(sweep_dir / "trial-0000"),
        str(sweep_dir / "trial-0001"),
        "--out",
        str(tmp_path / "c.html"),
    )
    assert compare.returncode == 0, compare.stderr[-2000:]


def _sweep_process(config: str, space: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lmforge.cli.main",
            "sweep",
            config,
            *SHORT,
            "train.save_every=3",
            "--space",
            str(space),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ.copy(),
    )


def _trial_processes(name: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(name in part for part in process.info["cmdline"] or []):
            found.append(process)
    return found


def _wait_for(condition, timeout: float = 300) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


@pytest.mark.integration  # heavy: `make test-integration` (CI stays near its time budget)
@pytest.mark.slow
@pytest.mark.usefixtures("shared_cache")
def test_a_killed_sweep_continues_without_repeating_finished_trials(tmp_path: Path) -> None:
    config, space = str(write_config(tmp_path)), write_space(tmp_path)
    options = ("--trials", "3", "--sampler", "random", "--pruner", "none")
    sweep_dir = tmp_path / "runs" / "base-sweep"
    first = _sweep_process(config, space, *options)
    _wait_for(lambda: (sweep_dir / "trial-0001" / "checkpoints" / "step-3").is_dir())
    first.send_signal(signal.SIGKILL)  # the sweep dies; its trial is told to stop (SIGTERM) and exits
    first.wait()
    _wait_for(lambda: not _trial_processes("trial-0001"))
    killed = load_study(sweep_dir)
    assert states(killed)[:2] == ["COMPLETE", "RUNNING"]
    trial0_records = (sweep_dir / "trial-0000" / "metrics.jsonl").read_text()

    again = run_cli("sweep", config, *SHORT, "train.save_every=3", "--space", str(space), *options)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "trial 1 was interrupted: queued again" in again.stdout
    study = load_study(sweep_dir)
    assert states(study) == ["COMPLETE", "FAIL", "COMPLETE", "COMPLETE"]
    retry = study.trials[2]
    assert retry.params == study.trials[1].params  # the interrupted trial, again
    assert retry.user_attrs["run_dir"].endswith("trial-0001")  # in its own run directory, resumed
    assert (sweep_dir / "trial-0000" / "metrics.jsonl").read_text() == trial0_records  # not repeated
    steps = [r["step"] for r in metrics_of(sweep_dir / "trial-0001")]
    assert steps == sorted(set(steps)) and steps[-1] == 12
    # Trial 2 (the retry) ran in trial-0001; trial 3 is the third trial of the budget.
    assert sorted(p.name for p in sweep_dir.glob("trial-*")) == ["trial-0000", "trial-0001", "trial-0003"]
    assert [e["kind"] for e in events_of(sweep_dir / "trial-0001")][-1] == "finished"


@pytest.mark.integration  # heavy: `make test-integration` (CI stays near its time budget)
@pytest.mark.slow
@pytest.mark.usefixtures("shared_cache")
def test_two_processes_share_one_sqlite_study(tmp_path: Path) -> None:
    config, space = str(write_config(tmp_path)), write_space(tmp_path)
    options = ("--trials", "4", "--sampler", "random", "--pruner", "none", "--parallel", "1")
    # Prepare the data once, so the two processes start training at the same time.
    assert run_cli("prepare", config, *SHORT).returncode == 0
    workers = [_sweep_process(config, space, *options) for _ in range(2)]
    outputs = [w.communicate(timeout=900)[0] for w in workers]
    for worker, output in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, output[-3000:]
        assert "database is locked" not in output
    study = load_study(tmp_path / "runs" / "base-sweep")
    complete = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert len(complete) >= 4 and "FAIL" not in states(study)
    dirs = [t.user_attrs["run_dir"] for t in complete]
    assert len(set(dirs)) == len(dirs)
    assert all((Path(d) / "final").is_dir() for d in dirs)
    # Both processes ran trials: each printed at least one finished trial of its own.
    assert all("->  eval_loss" in output for output in outputs)


def test_joining_a_study_its_creator_is_still_describing(tmp_path: Path) -> None:
    """A second sweep may open the study between the creator's two attribute writes: it records
    what is missing; a study of another metric or space is refused."""
    from lmforge.sweep import study as studies

    storage = studies.open_storage(f"sqlite:///{tmp_path / 'study.db'}")
    half = optuna.create_study(storage=storage, study_name="base")
    half.set_user_attr("metric", "eval_loss")  # the creator has not written the space yet

    def join(metric: str, space: list[str]) -> optuna.Study:
        return studies.open_study(
            storage,
            "base",
            direction="minimize",
            metric=metric,
            space_keys=space,
            sampler=optuna.samplers.RandomSampler(),
            pruner=optuna.pruners.NopPruner(),
        )

    joined = join("eval_loss", ["train.lr"])
    assert joined.user_attrs == {"metric": "eval_loss", "space": ["train.lr"]}
    with pytest.raises(UserInputError, match="optimises eval_loss over"):
        join("eval_loss", ["train.lr", "train.warmup_steps"])


def test_several_processes_opening_one_new_sqlite_study_at_once(tmp_path: Path) -> None:
    """Each creates the tables of a new database when it opens it: the lock beside the file makes
    them take turns (without it, one failed with 'table studies already exists' or a UNIQUE error)."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    code = f"from lmforge.sweep.study import open_storage; open_storage({url!r})"
    openers = [
        subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True) for _ in range(4)
    ]
    errors = [opener.communicate(timeout=120)[1] for opener in openers]
    assert [opener.returncode for opener in openers] == [0, 0, 0, 0], errors
