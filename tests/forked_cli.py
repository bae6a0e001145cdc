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

The processes a forked command starts with `sys.executable -m ...` (launch's workers, a sweep's
trials, the UI's runs) are forked the same way: a child's `sys.executable` is a stand-in for python
(tests/forked_python.py) that asks the server, and the server forks them unless their environment
sets an import-read variable differently (the launchers' own variables are read at run time; a
thread count is applied with torch.set_num_threads, as the variable would be at start).

Protocol (AF_UNIX, SOCK_SEQPACKET, one connection per command): the client sends a JSON request
{argv, cwd, env[, module, unbuffered, stand_in]} with its stdin, stdout and stderr descriptors;
the server answers {"pid": N} once the child runs (or {"fresh": REASON} to a stand-in) and
{"status": S} (os.waitpid's status) when it has ended.
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
# Set by the launchers for their workers and read when used (accelerate's by its state at run
# time, CUDA_VISIBLE_DEVICES when CUDA starts: never in the CPU-only server), or applied in the
# child (thread counts).
LAUNCHER_SET = re.compile(
    r"^(TORCHELASTIC_|TORCH_NCCL_ASYNC_ERROR_HANDLING$|ACCELERATE_|CUDA_VISIBLE_DEVICES$)"
)
THREAD_COUNTS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
SERVER_START_S = 180
STAND_IN = Path(__file__).with_name("forked_python.py")


def fresh_reason(server_env: dict[str, str], env: dict[str, str]) -> str | None:
    """The variable that sends a command with `env` to a fresh interpreter, or None: one read while
    the server imported its libraries, set differently from `server_env`."""
    for key in sorted(set(env) | set(server_env)):
        if key in SET_IN_PROCESS or LAUNCHER_SET.match(key) or not IMPORT_READ.match(key):
            continue
        if key in THREAD_COUNTS and _thread_count(env) is not None:
            continue
        if key == "PYTHONPATH" and "PYTHONPATH" not in server_env and _source_paths(env) is not None:
            continue
        if env.get(key) != server_env.get(key):
            return key
    return None


def _source_paths(env: dict[str, str]) -> list[str] | None:
    """PYTHONPATH's entries where each is this checkout (or its src/), whose modules the server
    imported already: a fork puts them on sys.path as the interpreter would. None otherwise."""
    entries = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    if all(Path(entry).resolve() in (ROOT, ROOT / "src") for entry in entries):
        return entries
    return None


def _thread_count(env: dict[str, str]) -> int | None:
    """OMP_NUM_THREADS as torch.set_num_threads takes it, where MKL_NUM_THREADS (if set) agrees."""
    value = env.get("OMP_NUM_THREADS", "")
    if not value.isdigit() or int(value) < 1 or env.get("MKL_NUM_THREADS", value) != value:
        return None
    return int(value)


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
    _write_stand_in(os.path.dirname(path))
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


def _write_stand_in(directory: str) -> None:
    """`python` beside the socket: tests/forked_python.py run by the real interpreter (-I -S: no
    site-packages, ~20 ms), and links to the other programs beside the real interpreter (code that
    looks for `trl` or `vllm` next to sys.executable finds them)."""
    real = Path(sys.executable)
    for program in real.parent.iterdir():
        if not program.name.startswith("python"):
            os.symlink(program, os.path.join(directory, program.name))
    python = os.path.join(directory, "python")
    with open(python, "w", encoding="utf-8") as handle:
        handle.write(f"#!{real} -IS\n{STAND_IN.read_text(encoding='utf-8')}")
    os.chmod(python, 0o755)


def _start(listener: socket.socket, running: dict[int, tuple[int, socket.socket]]) -> dict[str, Any] | None:
    conn, _ = listener.accept()
    message, fds, _, _ = socket.recv_fds(conn, MESSAGE_BYTES, 3)
    request = json.loads(message)
    if "stand_in" in request:  # a process a forked command started: fork it unless its env says no
        reason = fresh_reason(SERVER_ENV, request["env"])
        script = request.get("script")
        if script is not None and not Path(script).resolve().is_relative_to(ROOT / "tests"):
            reason = "a script outside tests/"
        with open(os.path.join(os.path.dirname(SOCKET[0]), "nested.log"), "a", encoding="utf-8") as log:
            log.write(f"{reason or 'forked'}\t{script or request['module']}\n")
        if reason is not None:
            for fd in fds:
                os.close(fd)
            with conn:
                conn.send(json.dumps({"fresh": reason}).encode())
            return None
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
    """Become `python [-u] -m MODULE ARGV` (or `python SCRIPT ARGV`) in CWD with ENV; returns only
    by raising SystemExit or by the script's end."""
    import runpy

    import torch

    if "stand_in" in request:
        _end_with(request["stand_in"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    threads = _thread_count(request["env"])
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)  # as OMP_NUM_THREADS would have set it at start
    sys.executable = os.path.join(os.path.dirname(SOCKET[0]), "python")  # its children: forked too
    if request.get("unbuffered"):  # -u: every line reaches the stream at once (a killed worker's too)
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True, write_through=True)
    script = request.get("script")
    # The interpreter puts the script's directory first (the working directory for -m), then PYTHONPATH.
    sys.path[0] = os.path.dirname(os.path.realpath(script)) if script else os.getcwd()
    sys.path[1:1] = _source_paths(request["env"]) or []
    if "numpy" in sys.modules:  # its global generator was seeded once, in the server
        sys.modules["numpy"].random.seed()
    if script is not None:
        sys.argv = [script, *request["argv"]]
        runpy.run_path(script, run_name="__main__")
        return
    sys.argv = ["-m", *request["argv"]]
    runpy.run_module(request.get("module", "lmforge.cli.main"), run_name="__main__", alter_sys=True)


def _end_with(stand_in: int) -> None:
    """Kill this process when its stand-in (tests/forked_python.py) dies: a SIGKILL sent to the
    stand-in (a launcher's last resort) reaches the process it stands for."""
    try:
        pidfd = os.pidfd_open(stand_in)
    except ProcessLookupError:
        os._exit(128 + signal.SIGKILL)

    def watch() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="stand-in watch", daemon=True).start()


# -- the client ---------------------------------------------------------------------------------


class ForkServer:
    """Starts the server on first use; `run` is `subprocess.run(..., capture_output=True, text=True)`
    for `python -m lmforge.cli.main ARGS` (its `args[0]` the forked command's sys.executable)."""

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
        return fresh_reason(self.env, env)

    def run(
        self, argv: list[str], cwd: Path | None, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        path = self._ensure_started()
        command = [os.path.join(os.path.dirname(path), "python"), "-m", "lmforge.cli.main", *argv]
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

    @property
    def python(self) -> str:
        """The `sys.executable` of forked commands: the stand-in that forks what they start."""
        return os.path.join(os.path.dirname(self._ensure_started()), "python")

    def interpreter(self) -> str:
        """`python` for a test's own subprocesses (torchrun over a script, several commands at once):
        the stand-in, which forks what it can, or sys.executable with the server off. Not for tests
        about pids or killing: the stand-in's pid is not the process's."""
        return self.python if self.enabled else sys.executable

    def counts(self) -> dict[str, Any]:
        """How this process's commands ran: forked, or fresh and why; and the processes they started."""
        log = os.path.join(os.path.dirname(self._socket), "nested.log") if self._socket else ""
        nested = collections.Counter(row.split("\t")[0] for row in _read(log))
        return {"forked": self.forked, "fresh": dict(self.fresh), "nested": dict(nested)}


def summary(*counts: dict[str, Any]) -> str:
    """One line for the suite's end from `ForkServer.counts()` of each process that ran tests (the
    pytest-xdist workers, or pytest itself): a change that sends every command fresh shows here."""
    forked = sum(part["forked"] for part in counts)
    fresh: collections.Counter[str] = collections.Counter()
    nested: collections.Counter[str] = collections.Counter()
    for part in counts:
        fresh.update(part["fresh"])
        nested.update(part["nested"])
    reasons = ", ".join(f"{reason} {count}" for reason, count in fresh.most_common())
    line = f"run_cli: {forked} commands forked" + (f"; fresh for {reasons}" if reasons else "")
    if nested:
        started = ", ".join(
            f"{reason} {count}" for reason, count in nested.most_common() if reason != "forked"
        )
        line += f"; the processes they started: {nested['forked']} forked" + (
            f", fresh for {started}" if started else ""
        )
    return line


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


def _read(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().splitlines()
    except OSError:
        return []


def _text(stream: Any) -> str:
    """What subprocess.run(text=True) makes of the bytes: the locale's encoding, universal newlines."""
    stream.seek(0)
    data = stream.read().decode(locale.getpreferredencoding(False))
    return data.replace("\r\n", "\n").replace("\r", "\n")


FORK_SERVER = ForkServer(dict(os.environ))


SERVER_ENV: dict[str, str] = {}
SOCKET: list[str] = []

if __name__ == "__main__":
    SERVER_ENV.update(os.environ)
    SOCKET.append(sys.argv[1])
    run_in_child(serve(sys.argv[1]))
