"""A fork server for the suite's `lmforge` commands: import the libraries once, fork per command.

A tiny `lmforge train` takes 10-12 s in a fresh interpreter on the CI's two cores, of which ~6.5 s
is importing torch, transformers, PEFT, datasets and TRL and 1-3 s is tearing them down at exit;
the suite runs a few hundred such commands. This server imports them once (`lmforge.cli` first,
as the command line does, so that its logging and import-notice settings come first), freezes the
heap (`gc.freeze()`: a child's exit does not walk the inherited objects), and then, for each
command, forks a child that runs `python -m lmforge.cli.main ARGS` the way the interpreter does:
`runpy` as `__main__`, the command's argv, working directory, environment and standard streams,
and a normal interpreter exit (threads joined, atexit handlers, the exit code or signal).

What a fork cannot give, `run_cli` does not ask of it (conftest.py): a command whose environment
differs from the server's in a variable the libraries read while importing goes to a fresh
interpreter, and tests that are about a new process (the console, the first command a new user
runs) ask for one. Forked children share the server's string-hash seed. `LMFORGE_TEST_FORK=0`
turns the server off.

Protocol (AF_UNIX, SOCK_SEQPACKET, one connection per command): the client sends a JSON request
{argv, cwd, env} with its stdin, stdout and stderr descriptors; the server answers {"pid": N}
once the child runs and {"status": S} (os.waitpid's status) when it has ended.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import importlib
import json
import locale
import os
import pkgutil
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = ("torch", "transformers", "transformers.trainer", "peft", "datasets", "accelerate", "trl")
PRELOAD_LMFORGE = ("lmforge.train.runner",)
MESSAGE_BYTES = 1 << 20
# Read while those libraries import (or by the interpreter at start): a command that sets one of
# these differently from the server's environment runs in a fresh interpreter.
IMPORT_READ = re.compile(
    r"^(HF_|HUGGINGFACE_|TRANSFORMERS_|TOKENIZERS_|DATASETS_|ACCELERATE_|PEFT_|TRL_|TORCH|PYTORCH_|CUDA_|"
    r"NCCL_|OMP_|MKL_|KMP_|OPENBLAS_|BNB_|PYTHON|LD_|MALLOC_|LMFORGE_VERBOSE$|LC_|LANG$)"
)
# ...except those that torch and accelerate set in the test process itself while it runs.
SET_IN_PROCESS = {
    "TORCHINDUCTOR_CACHE_DIR",
    "TORCH_CPP_LOG_LEVEL",
    "KINETO_LOG_LEVEL",
    "PYTORCH_NVML_BASED_CUDA_CHECK",
}
SERVER_START_S = 180


# -- the server ---------------------------------------------------------------------------------


def _preload() -> None:
    import lmforge.cli  # first: its logging setup and quiet import notices, as `lmforge` has them

    for module in pkgutil.iter_modules(lmforge.cli.__path__, "lmforge.cli."):
        if module.name != "lmforge.cli.main":  # runpy runs main itself, as `python -m` does
            importlib.import_module(module.name)
    for name in (*PRELOAD, *PRELOAD_LMFORGE):
        importlib.import_module(name)
    gc.collect()
    gc.freeze()


def serve(path: str) -> dict[str, Any]:
    """Serve forever; return (in a forked child only) the request that child is to run."""
    _preload()
    if threading.active_count() > 1:  # a fork copies only the calling thread
        print(f"threads running after the imports: {threading.enumerate()}", flush=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # the client connects once the path exists: listening by then
    parent = os.getppid()
    running: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, connection)
    while True:
        ready, _, _ = select.select([listener, *running], [], [], 1.0)
        if os.getppid() != parent:  # the test session has gone
            os._exit(0)
        for fd in ready:
            if fd is listener:
                request = _start(listener, running)
                if request is not None:  # in the child
                    listener.close()
                    for pidfd, (_, conn) in running.items():
                        os.close(pidfd)
                        conn.close()
                    return request
            else:
                pid, conn = running.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                with contextlib.suppress(OSError), conn:
                    conn.send(json.dumps({"status": status}).encode())


def _start(listener: socket.socket, running: dict[int, tuple[int, socket.socket]]) -> dict[str, Any] | None:
    conn, _ = listener.accept()
    message, fds, _, _ = socket.recv_fds(conn, MESSAGE_BYTES, 3)
    request = json.loads(message)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        return dict(request)
    for fd in fds:
        os.close(fd)
    running[os.pidfd_open(pid)] = (pid, conn)
    conn.send(json.dumps({"pid": pid}).encode())
    return None


def run_in_child(request: dict[str, Any]) -> None:
    """Become `python -m lmforge.cli.main ARGV` in CWD with ENV; returns only by raising SystemExit."""
    import runpy

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = os.getcwd()  # `python -m` puts the working directory first
    if "numpy" in sys.modules:  # its global generator was seeded once, in the server
        sys.modules["numpy"].random.seed()
    sys.argv = ["-m", *request["argv"]]
    runpy.run_module("lmforge.cli.main", run_name="__main__", alter_sys=True)


# -- the client ---------------------------------------------------------------------------------


class ForkServer:
    """Starts the server on first use; `run` is `subprocess.run(..., capture_output=True, text=True)`
    for `python -m lmforge.cli.main ARGS`."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)  # the server's environment: it starts from this one
        self.enabled = env.get("LMFORGE_TEST_FORK", "1") != "0"
        self.forked = 0
        self.fresh: collections.Counter[str] = collections.Counter()
        self._process: subprocess.Popen[bytes] | None = None
        self._socket = ""
        self._lock = threading.Lock()

    def fresh_reason(self, env: dict[str, str]) -> str | None:
        """Why a command with this environment must run in a fresh interpreter, or None."""
        if not self.enabled:
            return "LMFORGE_TEST_FORK=0"
        for key in sorted(set(env) | set(self.env)):
            if key not in SET_IN_PROCESS and IMPORT_READ.match(key) and env.get(key) != self.env.get(key):
                return key
        return None

    def run(
        self, argv: list[str], cwd: Path | None, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        path = self._ensure_started()
        command = [sys.executable, "-m", "lmforge.cli.main", *argv]
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            with conn:
                conn.connect(path)
                request = {"argv": list(argv), "cwd": str(cwd or os.getcwd()), "env": env}
                with _stdin() as stdin:  # what a subprocess would inherit
                    socket.send_fds(conn, [json.dumps(request).encode()], [stdin, out.fileno(), err.fileno()])
                pid = json.loads(conn.recv(MESSAGE_BYTES))["pid"]
                self.forked += 1
                conn.settimeout(timeout)
                try:
                    reply = conn.recv(MESSAGE_BYTES)
                    timed_out = False
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    conn.settimeout(None)
                    reply = conn.recv(MESSAGE_BYTES)
                    timed_out = True
            status = json.loads(reply)["status"]
            stdout, stderr = _text(out), _text(err)
        if timed_out:
            raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(command, os.waitstatus_to_exitcode(status), stdout, stderr)

    def _ensure_started(self) -> str:
        with self._lock:
            if self._process is None:
                directory = tempfile.mkdtemp(prefix="lmforge-forks-")
                self._socket = os.path.join(directory, "socket")
                log = open(os.path.join(directory, "server.log"), "wb")  # noqa: SIM115 - the server's
                self._process = subprocess.Popen(
                    [sys.executable, "-m", "tests.forked_cli", self._socket],
                    cwd=ROOT,
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
                log.close()
                deadline = time.monotonic() + SERVER_START_S
                while not os.path.exists(self._socket):
                    if self._process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the fork server did not start: see {directory}/server.log")
                    time.sleep(0.1)
            return self._socket

    def stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None
            shutil.rmtree(os.path.dirname(self._socket), ignore_errors=True)

    def summary(self) -> str:
        fresh = ", ".join(f"{reason} {count}" for reason, count in self.fresh.most_common())
        return f"run_cli: {self.forked} commands forked" + (f"; fresh for {fresh}" if fresh else "")


@contextlib.contextmanager
def _stdin() -> Iterator[int]:
    try:
        os.fstat(0)
    except OSError:  # closed: the command gets an empty stdin
        null = os.open(os.devnull, os.O_RDONLY)
        try:
            yield null
        finally:
            os.close(null)
    else:
        yield 0


def _text(stream: Any) -> str:
    """What subprocess.run(text=True) makes of the bytes: the locale's encoding, universal newlines."""
    stream.seek(0)
    data = stream.read().decode(locale.getpreferredencoding(False))
    return data.replace("\r\n", "\n").replace("\r", "\n")


FORK_SERVER = ForkServer(dict(os.environ))


if __name__ == "__main__":
    run_in_child(serve(sys.argv[1]))
