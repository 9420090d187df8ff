"""How a command-line tool of the project ends, for any tuple of the errors it treats as refusals: a refusal as one
`error:` line on stderr and exit 2 (`--debug` or MERCURY_DEBUG=1 prints its traceback too), a bug as its traceback
and exit 1. It imports nothing of the project, so a tool in any package can end through it; `mercury_jax/cli_errors.py`
holds the project's own error types, which `main`, `sweep` and `export` pass."""
from __future__ import annotations

import gc
import os
import sys
import traceback
from collections.abc import Callable, Sequence

EXIT_BUG = 1
EXIT_REFUSED = 2
DEBUG_ENV = "MERCURY_DEBUG"
Errors = tuple[type[BaseException], ...]


def debug_requested(argv: Sequence[str] | None = None, environ=os.environ) -> bool:
    """`--debug` (or `--debug=true`) on the command line, or MERCURY_DEBUG set to anything but 0 / false / no."""
    argv = sys.argv[1:] if argv is None else argv
    if any(arg in ("--debug", "--debug=true", "--debug=True", "--debug=1") for arg in argv):
        return True
    return environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def refusal(error: BaseException, errors: Errors) -> str | None:
    """The one line (without `error: `) that `error` ends a run with, or None when it is a bug. Exception notes
    (grain adds one to an exception raised in its pipeline) are not part of the line."""
    if isinstance(error, SystemExit):
        if not isinstance(error.code, str):
            return None
        text = error.code
        return one_line(text[len("error:"):] if text.startswith("error:") else text)
    if isinstance(error, errors):
        return one_line(str(error)) or type(error).__name__
    return None


def one_line(text: str) -> str:
    """`text` on one line: its non-empty lines joined by "; "."""
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def report(error: BaseException, errors: Errors, *, debug: bool = False, stream=None) -> int:
    """Print what the user sees of `error` and return the exit status: a refusal's one line (after the traceback
    when `debug`), or a bug's traceback."""
    stream = sys.stderr if stream is None else stream
    message = refusal(error, errors)
    if message is None:
        traceback.print_exception(error, file=stream)
        return EXIT_BUG
    if debug and not isinstance(error, SystemExit):
        traceback.print_exception(error, file=stream)
    print(f"error: {message}", file=stream, flush=True)
    return EXIT_REFUSED


def run_entry_point(body: Callable[[], object], errors: Errors, argv: Sequence[str] | None = None):
    """Run an entry point's `body`; a refusal (`refusal`) exits 2 after one `error:` line, anything else goes on
    as it would (a bug's traceback, exit 1; a SystemExit with a number, e.g. 143 after a preemption)."""
    try:
        return body()
    except SystemExit as error:
        if refusal(error, errors) is None:
            raise
        report(error, errors)
    except Exception as error:  # noqa: BLE001 - sorted into refusals and bugs by `refusal`
        if refusal(error, errors) is None:
            raise
        report(error, errors, debug=debug_requested(argv))
    # The failed run's objects go now, while their finalizers can run: grain's rows in shared memory, held by the
    # error's frames, are freed by their own, not reported as "leaked" by multiprocessing's resource tracker.
    gc.collect()
    raise SystemExit(EXIT_REFUSED)


def add_debug_flag(parser) -> None:
    """`--debug` on an argparse entry point (read by `debug_requested`, before parsing can fail)."""
    parser.add_argument("--debug", action="store_true",
                        help=f"print the traceback of a refusal too (also {DEBUG_ENV}=1); exit codes: see "
                             f"mercury_jax/cli/ending.py")
