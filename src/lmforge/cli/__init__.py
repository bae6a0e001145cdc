"""The `lmforge` command line (lmforge.cli.main)."""

import logging
import sys

from lmforge.verbosity import QUIET_CONSOLE, quiet_import_notices

# Libraries log while they are imported (bitsandbytes, through peft), before main() sets up the
# console: without a handler, logging's last resort would print those records unfiltered. This
# one applies the console's filter until main() replaces it (basicConfig force=True).
_importing = logging.StreamHandler(sys.stderr)
_importing.addFilter(QUIET_CONSOLE)
logging.basicConfig(level=logging.WARNING, handlers=[_importing])
quiet_import_notices()  # notices some libraries log on loggers of their own while they are imported
