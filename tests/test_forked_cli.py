"""The suite's fork server (tests/forked_cli.py) runs a command as a fresh interpreter would.

The suite's other tests trust `run_cli`'s results; these check that trust: the same exit code and
output forked as fresh, the variables that must send a command to a fresh interpreter, a timeout
that really ends the command, and the stand-in for `python` through which the processes a forked
command starts (launch's workers) are forked too: their thread count, signals and exit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lmforge.distributed.launch import free_port
from tests.conftest import SMALL_ARCH, run_cli
from tests.forked_cli import FORK_SERVER, ForkServer


def test_a_forked_command_prints_and_exits_as_a_fresh_interpreter(tmp_path: Path) -> None:
    if not FORK_SERVER.enabled:
        pytest.skip("the fork server is off (LMFORGE_TEST_FORK=0): every command runs fresh")
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({"run": {"name": "x"}, "train": {"lr": "fast"}}))
    forked_before = FORK_SERVER.forked
    forked = run_cli("train", str(config), cwd=tmp_path)
    fresh = run_cli("train", str(config), cwd=tmp_path, fresh=True)
    assert FORK_SERVER.forked == forked_before + 1  # the first one was forked, not silently fresh
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.returncode == 2 and "train.lr" in forked.stderr, forked.stderr
    # relative paths resolve in the command's own working directory, as in a fresh process
    relative = run_cli("train", "bad.yaml", cwd=tmp_path)
    assert relative.returncode == 2 and "train.lr" in relative.stderr, relative.stderr


def test_a_variable_read_while_importing_sends_the_command_to_a_fresh_interpreter() -> None:
    env = dict(FORK_SERVER.env)
    assert FORK_SERVER.fresh_reason(env) is None
    # read at runtime, or set by torch in the test process: a fork sees them as a fresh process would
    assert FORK_SERVER.fresh_reason({**env, "LMFORGE_CACHE": "/elsewhere"}) is None
    assert FORK_SERVER.fresh_reason({**env, "TORCHINDUCTOR_CACHE_DIR": "/tmp/x"}) is None
    # set by torchrun / accelerate for their workers and read when used; a thread count is applied
    for launcher_set in ("TORCHELASTIC_RUN_ID", "ACCELERATE_MIXED_PRECISION", "OMP_NUM_THREADS"):
        assert FORK_SERVER.fresh_reason({**env, launcher_set: "1"}) is None
    # read while torch / huggingface_hub / lmforge.verbosity import: the server's values would stick
    for key in ("HF_HUB_OFFLINE", "TORCH_LOGS", "LMFORGE_VERBOSE", "PYTHONHASHSEED"):
        assert FORK_SERVER.fresh_reason({**env, key: "1"}) == key
    # a thread count torch.set_num_threads cannot take alone
    assert (
        FORK_SERVER.fresh_reason({**env, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "2"}) == "MKL_NUM_THREADS"
    )
    assert FORK_SERVER.fresh_reason({**env, "OMP_NUM_THREADS": "many"}) == "OMP_NUM_THREADS"
    # unset where the server has it set counts too
    assert ForkServer({**env, "HF_HUB_OFFLINE": "1"}).fresh_reason(env) == "HF_HUB_OFFLINE"


def test_a_command_past_its_timeout_is_killed_and_lets_go_of_its_port(tmp_path: Path) -> None:
    port = free_port()
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        run_cli("ui", "--runs", str(tmp_path / "runs"), "--port", str(port), cwd=tmp_path, timeout=20)
    assert f"127.0.0.1:{port}" in str(timed_out.value.stdout), timed_out.value.stdout
    with socket.socket() as probe:  # the UI's process is gone: its port binds again
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))


TINY_TRAIN = {
    "run": {"name": "threads", "seed": 0},
    "model": {"preset": "llama-tiny", "config": SMALL_ARCH},
    "tokenizer": {"train": {"vocab_size": 300, "max_chars": 50_000}},
    "data": {"train": [{"path": "builtin:python-stdlib", "max_documents": 8}], "max_length": 32},
    "train": {"max_steps": 1, "micro_batch_size": 2, "precision": "fp32", "save_every": None},
}


def test_a_process_a_forked_command_starts_is_forked_with_its_own_thread_count(tmp_path: Path) -> None:
    if not FORK_SERVER.enabled:
        pytest.skip("the fork server is off (LMFORGE_TEST_FORK=0): every command runs fresh")
    config = tmp_path / "tiny.yaml"
    config.write_text(
        yaml.safe_dump({**TINY_TRAIN, "run": {**TINY_TRAIN["run"], "output_dir": str(tmp_path)}})
    )
    log = Path(FORK_SERVER.python).with_name("nested.log")
    before = log.read_text().count("\n") if log.exists() else 0
    # as launch's torchrun starts a worker: `sys.executable -u -m lmforge.cli.main train ...`
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x"}
    done = subprocess.run(
        [FORK_SERVER.python, "-u", "-m", "lmforge.cli.main", "train", str(config)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert log.read_text().splitlines()[before:] == ["forked\tlmforge.cli.main"]
    manifest = json.loads((tmp_path / "threads" / "manifest.json").read_text())
    assert manifest["hardware"]["torch_threads"] == 1  # OMP_NUM_THREADS=1, as at a fresh start
    # a command the stand-in does not fork runs in the real interpreter
    real = subprocess.run(
        [FORK_SERVER.python, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True
    )
    assert real.stdout.strip() == sys.executable


def _serve_ui(port: int, runs: Path) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [FORK_SERVER.python, "-m", "lmforge.cli.main", "ui", "--runs", str(runs), "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return process
        assert process.poll() is None, process.communicate()[0]
        time.sleep(0.2)
    raise AssertionError("the UI did not start listening")


def _port_binds(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_the_stand_in_passes_signals_on_exits_as_the_process_did_and_takes_it_down_when_killed(
    tmp_path: Path,
) -> None:
    if not FORK_SERVER.enabled:
        pytest.skip("the fork server is off (LMFORGE_TEST_FORK=0): every command runs fresh")
    port = free_port()
    ui = _serve_ui(port, tmp_path / "runs")
    ui.send_signal(signal.SIGINT)  # passed on: the UI stops as on Ctrl-C, and the stand-in exits as it did
    assert ui.wait(timeout=60) == 0, ui.communicate()[0]
    assert _port_binds(port)
    ui = _serve_ui(port, tmp_path / "runs")
    ui.kill()  # cannot be passed on: the forked UI notices its stand-in died and kills itself
    assert ui.wait(timeout=10) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while not _port_binds(port):
        assert time.monotonic() < deadline, "the forked UI outlived its SIGKILLed stand-in"
        time.sleep(0.1)
