"""The suite's fork server (tests/forked_cli.py) runs a command as a fresh interpreter would.

The suite's other tests trust `run_cli`'s results; these check that trust: the same exit code and
output forked as fresh, the variables that must send a command to a fresh interpreter, and a
timeout that really ends the command.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from lmforge.distributed.launch import free_port
from tests.conftest import run_cli
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
    # read while torch / huggingface_hub / lmforge.verbosity import: the server's values would stick
    for key in ("OMP_NUM_THREADS", "HF_HUB_OFFLINE", "TORCH_LOGS", "LMFORGE_VERBOSE", "PYTHONHASHSEED"):
        assert FORK_SERVER.fresh_reason({**env, key: "1"}) == key
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
