"""Command line: argument parsing (reshard.cli.args) and one module per command, each calling the public API
(reshard.api) and printing its typed result."""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from reshard.cli import convert, diff, export, inspect, list as list_command, plan, prune, thin, validate, watch
from reshard.cli.args import build_parser
from reshard.cli.output import error
from reshard.errors import ReshardError, UsageError

# A reader that closed our stdout (`reshard inspect X | head -1`) ends the command quietly with the
# status of a Unix tool killed by SIGPIPE, 128 + 13: `set -o pipefail` sees what it sees for `cat`.
EXIT_STDOUT_CLOSED = 141

COMMANDS = {"inspect": inspect.run, "validate": validate.run, "plan": plan.run, "convert": convert.run,
            "export": export.run, "diff": diff.run, "list": list_command.run, "prune": prune.run, "thin": thin.run,
            "watch": watch.run}


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()      # output still buffered meets a closed pipe here, not at interpreter exit
        return code
    except BrokenPipeError:
        # Python's recommended handling: point stdout at devnull so the flush at exit cannot fail again.
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
        return EXIT_STDOUT_CLOSED
    except KeyboardInterrupt:   # here, not in _main: a Ctrl-C while the arguments are parsed ends as quietly
        print("reshard: interrupted", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:     # --help, --version (0), a bad argument (2: args._Parser.error said it in one line)
        return e.code if isinstance(e.code, int) else int(e.code is not None)     # (argparse exits with an int)
    try:
        return COMMANDS[args.command](args)
    except BrokenPipeError:
        raise
    except UsageError as e:
        error(args, str(e), e.file)
        return 2
    except ReshardError as e:
        error(args, str(e), e.file)
        return getattr(args, "error_exit", 1)
    except OSError as e:       # an I/O failure no layer turned into a ReshardError: still one line
        error(args, f"{e.filename or ''}: {e.strerror or e}", e.filename)
        return getattr(args, "error_exit", 1)
