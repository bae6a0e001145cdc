"""`lmforge sweep`: an Optuna study of tiny training runs. Pruning bites, the best config re-runs
to the same metric, a killed sweep continues without repeating finished trials, and two
processes share one SQLite study."""

from __future__ import annotations

import csv
import math
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
    config, space = str(write_config(tmp_path)), str(write_space(tmp_path))
    # Two trials, then the same sweep run again for three in all (as after a kill): the re-run
    # used to draw the first sweep's values again (trial 2 = trial 0, to 16 digits). Trial N's values
    # come from (run.seed, N): trial 2 (lr 9e-4, warmup 2) is behind both finished trials at its
    # first evaluation, and the median pruner (after 2 finished trials) stops it.
    first = run_cli("sweep", config, *SHORT, "--space", space, "--trials", "2", "--sampler", "random")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    result = run_cli("sweep", config, *SHORT, "--space", space, "--trials", "3", "--sampler", "random")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "1 more trial(s) of 3" in result.stdout
    sweep_dir = tmp_path / "runs" / "base-sweep"
    study = load_study(sweep_dir)
    assert len(study.trials) == 3
    assert len({tuple(sorted(t.params.items())) for t in study.trials}) == 3, [t.params for t in study.trials]
    assert states(study).count("PRUNED") >= 1, states(study)
    assert set(states(study)) <= {"COMPLETE", "PRUNED"}
    pruned = next(t for t in study.trials if t.state.name == "PRUNED")
    pruned_dir = sweep_dir / f"trial-{pruned.number:04d}"
    stop = next(e for e in events_of(pruned_dir) if e["kind"] == "pruned")
    assert stop["step"] < 12 and metrics_of(pruned_dir)[-1]["step"] == stop["step"]  # stopped early
    # One run directory per trial, a summary row per trial, the page.
    assert sorted(p.name for p in sweep_dir.glob("trial-*")) == [f"trial-{n:04d}" for n in range(3)]
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
    # --trials is the total of both processes (each used to start 4), with no values drawn twice; a
    # trial both asked for at the same instant is failed untrained (rare: "over_budget").
    trained = [t for t in study.trials if not t.user_attrs.get("over_budget")]
    assert [t.state.name for t in trained] == ["COMPLETE"] * 4
    complete = trained
    assert len({tuple(sorted(t.params.items())) for t in complete}) == 4, [t.params for t in complete]
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


def test_a_space_written_as_people_write_learning_rates_is_read_as_numbers(tmp_path: Path) -> None:
    """YAML 1.1 reads `1e-6` (no dot) as a string; the config takes `train.lr: 1e-4`, so must the space."""
    path = tmp_path / "space.yaml"
    path.write_text(
        "train.lr: {low: 1e-6, high: 3e-2, log: true}\ntrain.warmup_steps: {low: 0, high: 4, step: 2}\n"
    )
    space = load_space(path, write_config(tmp_path), [])
    lr = space.distributions["train.lr"]
    assert (lr.low, lr.high, lr.log) == (1e-6, 3e-2, True)  # type: ignore[attr-defined]
    path.write_text("train.lr: {low: 1e-6, high: fast}\n")
    with pytest.raises(UserInputError, match="low and high must be numbers, got 1e-06 and 'fast'"):
        load_space(path, write_config(tmp_path), [])


@pytest.mark.slow
@pytest.mark.usefixtures("shared_cache")
def test_a_sweep_killed_mid_trial_seals_its_checkpoint_and_the_retry_resumes_it(tmp_path: Path) -> None:
    """SIGTERM to the sweep's process group (what a scheduler or `kill -- -PGID` sends): the running
    trial checkpoints once, and the sweep run again resumes it from that checkpoint, not step 1."""
    config, space = str(write_config(tmp_path)), write_space(tmp_path)
    options = ("--trials", "1", "--sampler", "random", "--pruner", "none")
    trial_dir = tmp_path / "runs" / "base-sweep" / "trial-0000"
    command = [sys.executable, "-m", "lmforge.cli.main", "sweep", config, *SHORT, "train.save_every=3"]
    first = subprocess.Popen(
        [*command, "--space", str(space), *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as under a shell's job control
    )
    _wait_for(lambda: (trial_dir / "checkpoints" / "step-3").is_dir())
    os.killpg(first.pid, signal.SIGTERM)
    first_output = first.communicate(timeout=300)[0]
    # Run again at once, as a user or a scheduler's requeue does.
    again = run_cli("sweep", config, *SHORT, "train.save_every=3", "--space", str(space), *options)
    assert again.returncode == 0, first_output[-2000:] + again.stdout[-3000:] + again.stderr[-3000:]
    assert "trial 0 was interrupted: queued again" in again.stdout
    stop = [e for e in events_of(trial_dir) if e["kind"] == "signal"]
    assert len(stop) == 1, events_of(trial_dir)
    checkpoint = stop[0]["step"]
    log = (trial_dir.parent / "logs" / "trial-0000.log").read_text()
    assert "exiting now, without a checkpoint" not in log
    assert f"resuming from {trial_dir / 'checkpoints' / f'step-{checkpoint}'}" in log, log[-3000:]
    # metrics.jsonl: the first launch's steps up to the checkpoint, then the retry's from the next.
    steps = [r["step"] for r in metrics_of(trial_dir)]
    assert steps == sorted(set(steps)) and steps[:2] == [0, 1] and steps[-1] == 12
    assert checkpoint in steps and checkpoint >= 3
    assert [e["kind"] for e in events_of(trial_dir)][-1] == "finished"


def _study_of(url: str, sampler: str, seed: int = 0) -> optuna.Study:
    from lmforge.sweep import study as studies

    return studies.open_study(
        studies.open_storage(url),
        "base",
        direction="minimize",
        metric="eval_loss",
        space_keys=["x", "n"],
        sampler=studies.make_sampler(sampler, seed, {"x": [0.1, 0.2, 0.3], "n": [1, 2]}, ["x", "n"]),  # type: ignore[arg-type]
        pruner=optuna.pruners.NopPruner(),
    )


def _drawer(sampler: str):  # type: ignore[no-untyped-def]
    """A stand-in for training: the values drawn are what is checked."""

    def draw(trial: optuna.Trial) -> float:
        if sampler == "grid":
            return trial.suggest_categorical("x", [0.1, 0.2, 0.3]) * trial.suggest_categorical("n", [1, 2])
        return trial.suggest_float("x", 1e-5, 1e-1, log=True) * trial.suggest_int("n", 0, 10**6)

    return draw


@pytest.mark.parametrize("sampler", ["random", "tpe", "grid"])
def test_a_rerun_sweep_and_a_second_process_never_draw_the_same_values(tmp_path: Path, sampler: str) -> None:
    """The sampler used to be seeded with run.seed in every process: a killed sweep run again drew
    trial 0's values for trial 3, and two sweeps on one study drew the same values side by side."""
    url, _draw = f"sqlite:///{tmp_path / 'study.db'}", _drawer(sampler)
    _study_of(url, sampler).optimize(_draw, n_trials=2)  # a sweep, killed after two trials
    _study_of(url, sampler).optimize(_draw, n_trials=2)  # the same sweep run again
    beside = [_study_of(url, sampler), _study_of(url, sampler)]  # two processes, both seeded alike
    for study in beside:
        study.optimize(_draw, n_trials=1)
    params = [tuple(sorted(t.params.items())) for t in load_study(tmp_path).trials]
    assert len(params) == 6 and len(set(params)) == 6, params
    # The same seed and history give the same values: a sweep stays reproducible.
    again = tmp_path / "again"
    again.mkdir()
    _study_of(f"sqlite:///{again / 'study.db'}", sampler).optimize(_draw, n_trials=2)
    assert [t.params for t in load_study(again).trials] == [t.params for t in load_study(tmp_path).trials[:2]]


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_the_first_trials_spread_over_the_space_with_the_default_seed(tmp_path: Path, sampler: str) -> None:
    """Independent draws cluster: with the default seed (42) the first three trials of a learning-rate
    sweep all drew lr 8.4e-4 to 8.7e-4. Now the first eight fall one in each eighth of the log range,
    a list's choices come in turn, and TPE models the trials once ten have finished."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = _study_of(url, sampler, seed=42)
    drawn = []
    for _ in range(12):
        trial = study.ask()
        lr, n = trial.suggest_float("x", 3e-4, 3e-3, log=True), trial.suggest_int("n", 1, 3)
        study.tell(trial, lr)  # lower is better: TPE, once it models the trials, goes low
        drawn.append((lr, n))
    eighths = sorted(int(8 * math.log(lr / 3e-4, 10)) for lr, _ in drawn[:8])
    assert eighths == list(range(8)), drawn
    assert {n for _, n in drawn[:3]} == {1, 2, 3}, drawn
    if sampler == "tpe":  # the trials after the tenth are TPE's: below the median of the first ten
        assert all(lr < sorted(v for v, _ in drawn[:10])[5] for lr, _ in drawn[10:]), drawn


def test_the_trial_budget_counts_running_and_queued_trials_of_every_process(tmp_path: Path) -> None:
    """--trials is the study's total: another process's running trials count, a queued retry is
    asked for (that runs it), and a trial asked for beyond the total is not trained."""
    from lmforge.sweep import study as studies

    study = _study_of(f"sqlite:///{tmp_path / 'study.db'}", "random")
    study.optimize(_drawer("random"), n_trials=1)  # complete
    elsewhere = study.ask()  # running in another sweep
    assert studies.trials_to_ask(study, 4) == 2
    study.tell(elsewhere, state=optuna.trial.TrialState.FAIL)  # interrupted: a retry is queued
    study.enqueue_trial(elsewhere.params)
    assert studies.trials_to_ask(study, 4) == 3  # the retry and the two missing trials
    retry = study.ask()  # a queued trial is popped first
    assert retry.params == elsewhere.params
    last, extra = study.ask(), study.ask()  # two sweeps ask for the third trial of 3 at once
    assert not studies.over_budget(study, retry.number, 3)
    assert not studies.over_budget(study, last.number, 3)
    assert studies.over_budget(study, extra.number, 3)


def test_a_trial_reporting_to_a_study_that_already_ended_it_still_checkpoints(tmp_path: Path) -> None:
    """A killed sweep's trial finishes its step while the re-run fails it in the study (to queue its
    retry): its evaluation report used to raise UpdateFinishedTrialError before the checkpoint was
    written, so the retry started from scratch."""
    from transformers import TrainerControl, TrainerState

    from lmforge.sweep.pruning import PruningReport
    from lmforge.sweep.trial import TrialSpec

    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = _study_of(url, "random")
    trial = study.ask()
    study.tell(trial, state=optuna.trial.TrialState.FAIL)  # what the re-run does to a dead sweep's trial
    spec = TrialSpec(url, "base", trial._trial_id, "eval_loss", str(tmp_path / "trial-0000"), "median", 2)
    control = TrainerControl()
    PruningReport(spec).on_evaluate(
        None,  # type: ignore[arg-type]
        TrainerState(global_step=4),
        control,
        metrics={"eval_loss": 2.5},
    )
    assert control.should_save and not control.should_training_stop  # the signal stops it, checkpointed
    assert load_study(tmp_path).trials[0].intermediate_values == {}


def test_a_rerun_waits_for_the_killed_sweeps_trial_to_write_its_checkpoint(tmp_path: Path) -> None:
    """The sweep died (SIGKILL); its trial got SIGTERM and is still writing its checkpoint, holding
    its run directory. The re-run used to queue the retry at once: the retry found the run
    directory in use (refused, which stops the sweep) or started before the checkpoint was sealed."""
    from lmforge.sweep import study as studies

    study = _study_of(f"sqlite:///{tmp_path / 'study.db'}", "random")
    trial = study.ask({"x": optuna.distributions.FloatDistribution(1e-5, 1e-1, log=True)})
    run_dir = tmp_path / "trial-0000"
    run_dir.mkdir()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    trial.set_user_attr(studies.OWNER, {"host": studies.owner_attr()["host"], "pid": int(dead.stdout)})
    trial.set_user_attr("run_dir", str(run_dir))
    # The trial's `lmforge train` holds its run lock for 3 more seconds (its checkpoint being written).
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from lmforge.train.run_lock import RunLock; "
            "lock = RunLock(Path(sys.argv[1])); lock.acquire(); print('held', flush=True); time.sleep(3); lock.release()",
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    said: list[str] = []
    assert studies.recover_interrupted(study, said.append) == [0]
    # The holder emptied its lock file on release: the retry was queued only after that.
    assert (run_dir / ".lock").read_text() == "", (
        "the retry was queued while the trial held its run directory"
    )
    holder.wait(timeout=30)
    assert said == [f"trial 0 is still writing its checkpoint in {run_dir}: waiting for it"]
    assert states(study) == ["FAIL", "WAITING"]
