"""`python` for the processes that the suite's forked commands start (tests/forked_cli.py).

A forked `lmforge launch` starts its workers as `sys.executable -u -m lmforge.cli.main train ...`
(torchrun, accelerate, the deepspeed launcher), a sweep its trials and the UI its runs the same
way: each a fresh interpreter that imports torch, transformers, PEFT and TRL again (10-20 s on two
cores). The fork server sets `sys.executable` of its children to a copy of this file (the real
interpreter in its #! line, `-I -S`: it starts in ~20 ms), which asks the server to fork the
process instead, and stands in for it until it ends:

- the process's standard streams are this one's (passed over the socket), its working directory
  and environment too; the server answers "fresh" when the environment sets a variable read while
  importing differently, and then this program becomes the real interpreter (exec), as it does for
  anything but `[-u] -m MODULE` of lmforge or of a launcher, or a script of the suite's;
- signals a launcher sends (SIGTERM, SIGINT, ...) are passed on to the forked process, and if this
  stand-in is killed (SIGKILL, which cannot be passed on) the forked process kills itself;
- it exits as the forked process did: the same exit code, or the same signal.

The forked process's pid and parent differ from this stand-in's; tests about pids and process
trees start their commands fresh.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import sys

FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGCONT,
)
FORKED_MODULES = (
    "lmforge.",
    "torch.distributed.run",
    "accelerate.commands.launch",
    "deepspeed.launcher.runner",
    "deepspeed.launcher.launch",
)
MESSAGE_BYTES = 1 << 20


def forkable(args: list[str]) -> dict[str, object] | None:
    """The request for `python ARGS`, or None where a real interpreter must run it."""
    unbuffered = False
    while args and args[0] == "-u":
        unbuffered, args = True, args[1:]
    if len(args) >= 2 and args[0] == "-m" and args[1].startswith(FORKED_MODULES):
        return {"module": args[1], "argv": args[2:], "unbuffered": unbuffered}
    if args and args[0].endswith(".py") and os.path.isfile(args[0]):  # the server forks tests/ scripts only
        return {"script": os.path.abspath(args[0]), "argv": args[1:], "unbuffered": unbuffered}
    return None


def become_python(args: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *args])


def exit_as(status: int) -> None:
    """End this process as os.waitpid's `status` says the forked one ended."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))


def standard_fds() -> list[int]:
    fds = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:  # closed: the forked process gets /dev/null there
            fds.append(os.open(os.devnull, os.O_RDWR))
    return fds


def main() -> None:
    args = sys.argv[1:]
    request = forkable(args)
    if request is None:
        become_python(args)
    forked: list[int] = []
    pending: list[int] = []

    def forward(sig: int, _frame: object) -> None:
        if not forked:
            pending.append(sig)
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(forked[0], sig)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(os.path.join(os.path.dirname(os.path.abspath(__file__)), "socket"))
    except OSError:  # the server has gone (the test session ended): run it for real
        become_python(args)
    request.update(cwd=os.getcwd(), env=dict(os.environ), stand_in=os.getpid())
    socket.send_fds(conn, [json.dumps(request).encode()], standard_fds())
    reply = json.loads(conn.recv(MESSAGE_BYTES))
    if "pid" not in reply:  # the server says: a fresh interpreter (its environment differs)
        conn.close()
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        for sig in pending:
            os.kill(os.getpid(), sig)
        become_python(args)
    forked.append(reply["pid"])
    for sig in pending:
        forward(sig, None)
    exit_as(json.loads(conn.recv(MESSAGE_BYTES))["status"])


if __name__ == "__main__":
    main()
