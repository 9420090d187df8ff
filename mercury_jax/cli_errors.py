"""How every entry point ends (docs/DESIGN.md "Exit codes"): the project's own errors as one `error:` line on
stderr, a real bug as its traceback.

    def main(argv=None):
        run_entry_point(lambda: _main(argv), argv, extra=(SweepError,))

Exit codes, the same for `mercury_jax.main`, `.sweep`, `.export` and the data tools:

    0    done
    1    a bug: an exception the project does not expect; its traceback is printed (Python's own status)
    2    refused: the project's own error (`PROJECT_ERRORS`: a config, a resume, a corpus, a run directory, a
         checkpoint or an export that cannot be used as asked) or a wrong command line; one `error:` line that
         names the problem and the fix. `--debug` (or MERCURY_DEBUG=1) prints the traceback above it
    75   a lost peer: another process of a multi-process run went silent or failed (`parallel/peer_watch.py`)
    143  preempted: SIGTERM, after the step in progress was checkpointed (`runs/preemption.py`)

A `SystemExit` with a text (the entry points' own `raise SystemExit("error: ...")`) is a refusal too: its text is
the line, and the status is 2.
"""
from __future__ import annotations

import gc
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from mercury_jax.config.validate import ConfigError
from mercury_jax.data.chat_records import BadRecord
from mercury_jax.data.corpus import CorpusError
from mercury_jax.envs.judge import JudgeError
from mercury_jax.envs.mcp_adapter import MCPConnectError
from mercury_jax.parallel.peer_watch import PEER_LOST_EXIT
from mercury_jax.rollout.sizing import ReplicaDoesNotFit
from mercury_jax.runs.checkpoint_faults import CheckpointRestoreError, CheckpointSaveError
from mercury_jax.runs.checkpoints import DataLayoutChanged
from mercury_jax.runs.resume import ResumeError
from mercury_jax.runs.run_reader import RunReadError
from mercury_jax.runs.workdir_lock import WorkdirLocked
from mercury_jax.train.async_batches import AsyncLayoutChanged
from mercury_jax.train.guards import NonFiniteError
from mercury_jax.uris import RemotePathError
from models.qwen35_moe.checkpoint_errors import CheckpointError
from models.qwen35_moe.moe_ep import ExpertParallelError
from models.qwen35_moe.row_split import RowSplitError

EXIT_BUG = 1
EXIT_REFUSED = 2
EXIT_PEER_LOST = PEER_LOST_EXIT
EXIT_PREEMPTED = 143  # 128 + SIGTERM
DEBUG_ENV = "MERCURY_DEBUG"

# The errors whose message is written for the user (what is wrong, and the fix): each ends a run in one line.
PROJECT_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, ResumeError, DataLayoutChanged, AsyncLayoutChanged,   # the config, and a resume that differs
    CorpusError, BadRecord,                                            # the SFT corpus
    RemotePathError, RunReadError, WorkdirLocked,                      # run directories (RunReadError: export's)
    CheckpointRestoreError, CheckpointSaveError, CheckpointError,      # Orbax checkpoints; HF checkpoints
    NonFiniteError, ReplicaDoesNotFit, RowSplitError, ExpertParallelError,
    MCPConnectError, JudgeError,                                       # services the run depends on
)


def debug_requested(argv: Sequence[str] | None = None, environ=os.environ) -> bool:
    """`--debug` (or `--debug=true`) on the command line, or MERCURY_DEBUG set to anything but 0 / false / no."""
    argv = sys.argv[1:] if argv is None else argv
    if any(arg in ("--debug", "--debug=true", "--debug=True", "--debug=1") for arg in argv):
        return True
    return environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def refusal(error: BaseException, extra: tuple[type[BaseException], ...] = ()) -> str | None:
    """The one line (without `error: `) that `error` ends a run with, or None when it is a bug. Exception notes
    (grain adds one to an exception raised in its pipeline) are not part of the line."""
    if isinstance(error, SystemExit):
        if not isinstance(error.code, str):
            return None
        text = error.code
        return one_line(text[len("error:"):] if text.startswith("error:") else text)
    if isinstance(error, PROJECT_ERRORS + tuple(extra)):
        return one_line(str(error)) or type(error).__name__
    return None


def one_line(text: str) -> str:
    """`text` on one line: its non-empty lines joined by "; "."""
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def report(error: BaseException, *, extra: tuple[type[BaseException], ...] = (), debug: bool = False,
           stream=None) -> int:
    """Print what the user sees of `error` and return the exit status: a refusal's one line (after the traceback
    when `debug`), or a bug's traceback."""
    stream = sys.stderr if stream is None else stream
    message = refusal(error, extra)
    if message is None:
        traceback.print_exception(error, file=stream)
        return EXIT_BUG
    if debug and not isinstance(error, SystemExit):
        traceback.print_exception(error, file=stream)
    print(f"error: {message}", file=stream, flush=True)
    return EXIT_REFUSED


def run_entry_point(body: Callable[[], object], argv: Sequence[str] | None = None, *,
                    extra: tuple[type[BaseException], ...] = ()):
    """Run an entry point's `body`; a refusal (`refusal`) exits 2 after one `error:` line, anything else goes on
    as it would (a bug's traceback, exit 1; a SystemExit with a number, e.g. 143 after a preemption)."""
    try:
        return body()
    except SystemExit as error:
        if refusal(error) is None:
            raise
        report(error)
    except Exception as error:  # noqa: BLE001 - sorted into refusals and bugs by `refusal`
        if refusal(error, extra) is None:
            raise
        report(error, extra=extra, debug=debug_requested(argv))
    # The failed run's objects go now, while their finalizers can run: grain's rows in shared memory, held by the
    # error's frames, are freed by their own, not reported as "leaked" by multiprocessing's resource tracker.
    gc.collect()
    raise SystemExit(EXIT_REFUSED)


def add_debug_flag(parser) -> None:
    """`--debug` on an argparse entry point (read by `debug_requested`, before parsing can fail)."""
    parser.add_argument("--debug", action="store_true",
                        help=f"print the traceback of a refusal too (also {DEBUG_ENV}=1); exit codes: see "
                             f"mercury_jax/cli_errors.py")
