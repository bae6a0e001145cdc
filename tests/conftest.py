"""Shared fixtures: every test writes under its tmp_path and uses its own data cache."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest


def _share_the_cores_between_workers() -> None:
    """Under pytest-xdist (`make test` runs two workers), each worker, its fork server and the
    processes they start compute on their share of the cores, as `lmforge launch` gives each worker
    its share: two PyTorch processes each with threads for every core slow each other ~3x on two
    cores (the quickstart test went from 218 s to over 600 s). Before the fork server is built from
    this environment and before torch is imported here; an OMP_NUM_THREADS set by the caller wins."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = str(max(1, len(os.sched_getaffinity(0)) // workers))
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = threads


_share_the_cores_between_workers()

from tests.forked_cli import FORK_SERVER, summary  # noqa: E402 - the environment above comes first

ROOT = Path(__file__).resolve().parents[1]
# A preset narrowed so that each end-to-end training run in the suite takes seconds.
SMALL_ARCH = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


WORKER_COUNTS: list[dict[str, object]] = []  # the fork servers' counts of the xdist workers


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its counts travel to the controller
        workeroutput["fork_server"] = FORK_SERVER.counts()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    counts = getattr(node, "workeroutput", {}).get("fork_server")
    if counts:
        WORKER_COUNTS.append(counts)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    counts = WORKER_COUNTS or [FORK_SERVER.counts()]
    terminalreporter.write_line(summary(*counts))  # a change that sends every command fresh shows here


def pytest_unconfigure(config: pytest.Config) -> None:
    FORK_SERVER.stop()


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMFORGE_CACHE", str(tmp_path_factory.mktemp("cache")))


def save_tiny_llama(tokenizer, out: Path) -> Path:  # type: ignore[no-untyped-def]
    """A small untrained llama (SMALL_ARCH, 128 positions, seed 0) with `tokenizer`, saved as an
    HF model directory at `out`: the base the fine-tuning tests start from."""
    import torch

    from lmforge.config.schema import ModelConfig
    from lmforge.models.build import build_model

    torch.manual_seed(0)
    build_model(
        ModelConfig(preset="llama-tiny", config=SMALL_ARCH), tokenizer, max_length=128
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def run_cli(
    *args: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: int = 600,
    fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run `lmforge ARGS` the way a user does, in a process of its own: forked from a server that has
    imported the libraries already (tests/forked_cli.py), or a fresh interpreter when `fresh` (a test
    about what a new process shows) or when `env` sets a variable those imports read."""
    full_env = {**os.environ, **(env or {})}
    reason = "fresh=True" if fresh else FORK_SERVER.fresh_reason(full_env)
    if reason is None:
        return FORK_SERVER.run(list(args), cwd, full_env, timeout)
    FORK_SERVER.fresh[reason] += 1
    return subprocess.run(
        [sys.executable, "-m", "lmforge.cli.main", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def reseal(checkpoint: Path) -> None:
    """Recompute a checkpoint's hash manifest and marker after editing it, as anyone who can
    write the run directory could: the checkpoint then passes every hash check."""
    from lmforge.ckpt.atomic import MARKER_NAME, commit_checkpoint

    step = int(checkpoint.name.split("-")[1])
    (checkpoint / MARKER_NAME).unlink()
    staging = checkpoint.with_name(f".{checkpoint.name}")
    checkpoint.rename(staging)
    commit_checkpoint(staging, checkpoint, step=step)


# A small vocabulary: tiny models learn it within a few steps, so loss curves move visibly.
WORDS = "the cat sat on a mat while one dog ran to the big red barn and two birds sang".split()  # noqa: SIM905


@pytest.fixture
def unreachable_hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The hub's endpoint a closed local port (no proxy, HF_HUB_OFFLINE unset): a lookup fails at once,
    whether or not the machine has a network."""
    import huggingface_hub

    from lmforge.config.hub_names import PROXY_VARIABLES, hub_unreachable_reason

    for variable in ("HF_HUB_OFFLINE", *PROXY_VARIABLES):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens
    hub_unreachable_reason.cache_clear()
    yield
    hub_unreachable_reason.cache_clear()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 rows of 20-60 random words ({"text": ...} jsonl), the same every time."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "text.jsonl"
    rows = [{"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))} for _ in range(300)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def word_documents(words: list[str], count: int, seed: int, *, max_words: int) -> list[str]:
    """`count` seeded documents of 1 to max_words-1 words drawn from `words` (multi-byte ones included)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(words, size=int(rng.integers(1, max_words)))) for _ in range(count)]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    """`texts` as {"text": ...} rows of a .jsonl file."""
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path
