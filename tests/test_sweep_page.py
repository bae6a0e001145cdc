"""The sweep page from real in-memory Optuna studies: every section, pruned and failed trials
marked, importances, one parallel-coordinates line per drawn trial, escaping, nothing loaded."""

from __future__ import annotations

import math
import re
from pathlib import Path

import optuna
import pytest
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState, create_trial

from lmforge.report.sweep_page import sweep_summary_rows, write_sweep_page

EVIL = "<script>alert('opt')</script>"
DISTRIBUTIONS: dict[str, BaseDistribution] = {
    "lr": FloatDistribution(1e-5, 1e-2, log=True),
    "batch_size": IntDistribution(4, 32, step=4),
    "optimizer": CategoricalDistribution(["adamw", "sgd", EVIL]),
}


@pytest.fixture(autouse=True)
def _quiet_optuna() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def _trial(
    lr: float, batch: int, opt: str, state: TrialState, value: float | None, curve: list[float]
) -> FrozenTrial:
    return create_trial(
        params={"lr": lr, "batch_size": batch, "optimizer": opt},
        distributions=DISTRIBUTIONS,
        value=value,
        state=state,
        intermediate_values={10 * (i + 1): v for i, v in enumerate(curve)},
    )


def build_study(tmp_path: Path) -> tuple[optuna.Study, dict[int, Path]]:
    """8 trials: 5 complete (one with an infinite loss), 2 pruned, 1 failed; dirs for all but #7."""
    study = optuna.create_study(direction="minimize", study_name="sweep <b>bold</b>")
    done, pruned, failed = TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL
    for trial in (
        _trial(1e-4, 8, "adamw", done, 2.5, [3.0, 2.7, 2.5]),
        _trial(3e-3, 16, "sgd", pruned, None, [3.4, 3.3]),
        _trial(5e-4, 12, "adamw", done, 1.9, [2.8, 2.2, 1.9]),  # the best
        _trial(2e-5, 32, EVIL, done, 2.8, [3.1, 2.9, 2.8]),
        _trial(8e-3, 4, "sgd", failed, None, []),
        _trial(1e-3, 24, "adamw", done, float("inf"), [2.9, float("nan"), float("inf")]),
        _trial(6e-4, 20, "sgd", pruned, None, [3.2]),
        _trial(2e-4, 8, "adamw", done, 2.2, [2.9, 2.4, 2.2]),
    ):
        study.add_trial(trial)
    dirs = {n: tmp_path / "runs" / f"trial-{n}" for n in range(7)}
    for run_dir in dirs.values():
        run_dir.mkdir(parents=True)
    (dirs[2] / "report.html").write_text("<html></html>")
    return study, dirs


def _svg(page: str, metric: str) -> str:
    match = re.search(rf'<svg class="plot" data-metric="{metric}".*?</svg>', page, re.S)
    assert match, f"no {metric} plot"
    return match.group(0)


def test_page_has_every_section_and_marks_pruned_and_failed_trials(tmp_path: Path) -> None:
    study, dirs = build_study(tmp_path)
    out = write_sweep_page(study, tmp_path / "sweep" / "sweep.html", metric="eval_loss", trial_dirs=dirs)
    page = out.read_text()
    for heading in ("Best trial", "Optimisation history", "Intermediate values", "Parameter importances"):
        assert f"<h2>{heading}</h2>" in page
    assert "<h2>Parallel coordinates</h2>" in page and "<h2>Trials</h2>" in page
    assert "<b>eval_loss</b> (minimize, lower is better)" in page
    for state, n in (("complete", 5), ("pruned", 2), ("failed", 1)):
        assert f'data-state="{state}">{state} {n}</span>' in page
    assert '<div class="best" data-trial="2">' in page and '<td class="num">1.9</td>' in page

    history = _svg(page, "sweep_history")
    assert len(re.findall(r'class="trial pruned" data-trial="(\d)"', history)) == 2
    assert 'class="trial failed" data-trial="4"' in history
    assert 'class="trial best" data-trial="2"' in history
    assert 'class="best-so-far"' in history
    assert "nan" not in history.lower().replace("nonfinite", "")  # coordinates are all numbers

    curves = _svg(page, "sweep_intermediate")
    assert set(re.findall(r'class="curve pruned" data-trial="(\d)"[^>]*stroke-dasharray', curves)) == {
        "1",
        "6",
    }
    assert set(re.findall(r'class="pruned-end" data-trial="(\d)"', curves)) == {"1", "6"}
    assert 'class="nonfinite"' in curves  # trial 5's NaN and inf steps are marked, not drawn


def test_importances_and_parallel_coordinates(tmp_path: Path) -> None:
    study, dirs = build_study(tmp_path)
    page = write_sweep_page(study, tmp_path / "sweep.html", metric="eval_loss", trial_dirs=dirs).read_text()
    bars = _svg(page, "sweep_importance")
    for name in ("lr", "batch_size", "optimizer"):
        assert f'<g class="importance" data-param="{name}">' in bars

    parallel = _svg(page, "sweep_parallel")
    lines = re.findall(r'<polyline class="trial (\w+)" data-trial="(\d+)"', parallel)
    assert sorted(int(n) for _, n in lines) == [0, 1, 2, 3, 5, 6, 7]  # complete and pruned, not failed
    assert {n for state, n in lines if state == "pruned"} == {"1", "6"}
    assert 'class="axis log" data-param="lr"' in parallel
    assert 'class="axis linear" data-param="batch_size"' in parallel
    assert 'class="axis categorical" data-param="optimizer"' in parallel
    assert 'class="axis linear" data-param="eval_loss"' in parallel
    best_line = re.search(r'data-trial="2" fill="none" stroke="(#[0-9a-f]{6})"', parallel)
    worst_line = re.search(r'data-trial="3" fill="none" stroke="(#[0-9a-f]{6})"', parallel)
    assert best_line and worst_line and best_line.group(1) != worst_line.group(1)
    assert parallel.rfind('data-trial="2"') > parallel.rfind('data-trial="3"')  # the best drawn on top


def test_untrusted_text_is_escaped_and_the_page_loads_nothing(tmp_path: Path) -> None:
    study, dirs = build_study(tmp_path)
    page = write_sweep_page(study, tmp_path / "sweep.html", metric="loss<i>", trial_dirs=dirs).read_text()
    assert "<script" not in page.lower() and "<img" not in page and "<b>bold</b>" not in page
    assert "&lt;script&gt;alert(&#x27;opt&#x27;)&lt;/script&gt;" in page  # a categorical choice, as text
    assert "sweep &lt;b&gt;bold&lt;/b&gt;" in page and "loss&lt;i&gt;" in page
    tags = re.findall(r"<[^>]+>", page)
    assert not [t for t in tags if re.search(r"^<(link|iframe|object|embed|image|use)\b|\bsrc\s*=", t, re.I)]
    hrefs = [h for t in tags for h in re.findall(r'\bhref="([^"]*)"', t)]
    assert hrefs and all(not re.match(r"[a-z][a-z0-9+.-]*:|//", h, re.I) for h in hrefs)  # relative only
    assert "runs/trial-2/" in hrefs and "runs/trial-2/report.html" in hrefs
    assert "runs/trial-3/report.html" not in hrefs  # no report written for it
    style = page.split("<style>")[1].split("</style>")[0]
    assert "url(" not in style and "@import" not in style


def test_summary_rows(tmp_path: Path) -> None:
    study, dirs = build_study(tmp_path)
    rows = sweep_summary_rows(study, dirs)
    assert [r["state"] for r in rows] == ["complete", "pruned", "complete", "complete"] + [
        "failed",
        "complete",
        "pruned",
        "complete",
    ]
    assert [r["number"] for r in rows if r["best"]] == [2] and rows[2]["value"] == 1.9
    assert rows[1]["last_step"] == 20 and rows[1]["last_intermediate"] == 3.3
    assert rows[6]["last_step"] == 10 and rows[4]["value"] is None and math.isinf(rows[5]["value"])
    assert rows[3]["params"] == {"lr": 2e-5, "batch_size": 32, "optimizer": EVIL}
    assert rows[0]["run_dir"] == str(dirs[0]) and rows[7]["run_dir"] is None
    assert all(isinstance(r["duration_s"], float) for r in rows)


def test_maximize_direction_picks_the_highest_value(tmp_path: Path) -> None:
    study = optuna.create_study(direction="maximize")
    dist: dict[str, BaseDistribution] = {
        "lr": FloatDistribution(1e-5, 1e-2, log=True),
        "warmup": IntDistribution(0, 100),
    }
    for i, value in enumerate((0.4, 0.7, 0.5)):
        study.add_trial(
            create_trial(params={"lr": 1e-4 * (i + 1), "warmup": 10 * i}, distributions=dist, value=value)
        )
    page = write_sweep_page(study, tmp_path / "sweep.html", metric="accuracy", trial_dirs={}).read_text()
    assert "(maximize, higher is better)" in page and '<div class="best" data-trial="1">' in page
    assert "no intermediate values" in page and "no run directory" in page


def test_one_complete_trial_and_one_param_renders_with_a_note(tmp_path: Path) -> None:
    study = optuna.create_study()
    dist: dict[str, BaseDistribution] = {"lr": FloatDistribution(1e-5, 1e-2, log=True)}
    study.add_trial(
        create_trial(params={"lr": 1e-3}, distributions=dist, value=2.0, intermediate_values={5: 2.4})
    )
    study.add_trial(create_trial(params={"lr": 1e-2}, distributions=dist, state=TrialState.FAIL))
    page = write_sweep_page(study, tmp_path / "sweep.html", metric="eval_loss", trial_dirs={}).read_text()
    assert "parameter importances: needs at least 2 complete trials" in page
    assert 'data-metric="sweep_importance"' not in page
    assert len(re.findall(r'<polyline class="trial complete"', _svg(page, "sweep_parallel"))) == 1

    study.add_trial(create_trial(params={"lr": 1e-4}, distributions=dist, value=2.5))
    page = write_sweep_page(study, tmp_path / "sweep.html", metric="eval_loss", trial_dirs={}).read_text()
    assert "only one parameter was searched (lr)" in page


def test_a_study_without_trials_renders(tmp_path: Path) -> None:
    page = write_sweep_page(optuna.create_study(), tmp_path / "sweep.html", metric="eval_loss", trial_dirs={})
    text = page.read_text()
    assert "no complete trial yet" in text and "none yet" in text
    assert sweep_summary_rows(optuna.create_study(), {}) == []


def test_odd_studies_render_with_every_coordinate_a_number(tmp_path: Path) -> None:
    """Conditional params, None/bool choices, a one-value range, running and never-reporting
    trials, all-infinite objectives and long curves: the page renders and draws no NaN."""
    study = optuna.create_study(direction="maximize")
    space: dict[str, BaseDistribution] = {
        "flag": CategoricalDistribution([None, True, 1]),
        "dropout": FloatDistribution(0.1, 0.1),
        "depth": IntDistribution(1, 1000, log=True),
    }
    long_curve = {step: math.sin(step / 50) if step % 997 else float("nan") for step in range(1, 20_001)}
    for i, (state, value) in enumerate(
        [(TrialState.COMPLETE, float("-inf")), (TrialState.PRUNED, None), (TrialState.RUNNING, None)]
        + [(TrialState.COMPLETE, float("inf")), (TrialState.WAITING, None)]
    ):
        params = {"flag": [None, True, 1][i % 3], "dropout": 0.1} | ({"depth": 10**i} if i % 2 else {})
        study.add_trial(
            create_trial(
                params=params,
                distributions={k: space[k] for k in params},
                state=state,
                value=value,
                intermediate_values=long_curve if i == 0 else {},
            )
        )
    page = write_sweep_page(study, tmp_path / "sweep.html", metric="acc", trial_dirs={}).read_text()
    numbers = re.findall(r'\b(?:x|y|cx|cy|x1|x2|y1|y2|width|height|points|d)="([^"]*)"', page)
    assert numbers and not [n for n in numbers if re.search(r"nan|inf", n, re.I)]
    assert len(re.findall(r'class="curve complete"', _svg(page, "sweep_intermediate"))) > 1  # broken at NaNs
    assert 'data-state="running">running 1</span>' in page and 'data-state="waiting">waiting 1</span>' in page
    assert "parameter importances: needs at least 2 complete trials with a finite objective" in page
    assert (
        'class="axis categorical" data-param="flag"' in page and 'class="axis log" data-param="depth"' in page
    )
    first = re.search(r'data-trial="0"[^>]*points="([^"]*)"', _svg(page, "sweep_parallel"))
    assert first and len(first.group(1).split()) == 2  # flag=None and dropout; no depth, objective -inf
