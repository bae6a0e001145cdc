"""`python -m lmforge.ui.waiter UI_DIR NAME ARGS...`: run `lmforge ARGS` with its console output in
`UI_DIR/NAME.console.log`, then write its exit code to `UI_DIR/NAME.exit`.

The UI starts runs through this so that a run's exit code and last lines survive the UI itself
(the UI may be closed and reopened while the run goes on). SIGTERM and SIGINT reaching the waiter
are passed on to the run, which checkpoints and exits; the waiter then records how it ended."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    ui_dir, name, args = Path(argv[0]), argv[1], argv[2:]
    with (ui_dir / f"{name}.console.log").open("ab") as console:
        child = subprocess.Popen(
            [sys.executable, "-m", "lmforge.cli.main", *args], stdout=console, stderr=subprocess.STDOUT
        )
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda number, _frame: child.send_signal(number))
        code = child.wait()
    partial = ui_dir / f"{name}.exit.partial"
    partial.write_text(str(code))
    partial.replace(ui_dir / f"{name}.exit")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
