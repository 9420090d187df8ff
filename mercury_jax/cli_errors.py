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

from collections.abc import Callable, Sequence

from mercury_jax.cli import ending
from mercury_jax.cli.ending import DEBUG_ENV, EXIT_BUG, EXIT_REFUSED, add_debug_flag, debug_requested, one_line
from mercury_jax.config.validate import ConfigError
from mercury_jax.data.chat_records import BadRecord
from mercury_jax.data.corpus import CorpusError
from mercury_jax.data.uris import RemotePathError
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
from models.qwen35_moe.checkpoint_errors import CheckpointError
from models.qwen35_moe.moe_ep import ExpertParallelError
from models.qwen35_moe.row_split import RowSplitError

EXIT_PEER_LOST = PEER_LOST_EXIT
EXIT_PREEMPTED = 143  # 128 + SIGTERM

# The errors whose message is written for the user (what is wrong, and the fix): each ends a run in one line.
PROJECT_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, ResumeError, DataLayoutChanged, AsyncLayoutChanged,   # the config, and a resume that differs
    CorpusError, BadRecord,                                            # the SFT corpus
    RemotePathError, RunReadError, WorkdirLocked,                      # run directories (RunReadError: export's)
    CheckpointRestoreError, CheckpointSaveError, CheckpointError,      # Orbax checkpoints; HF checkpoints
    NonFiniteError, ReplicaDoesNotFit, RowSplitError, ExpertParallelError,
    MCPConnectError, JudgeError,                                       # services the run depends on
)

__all__ = ["DEBUG_ENV", "EXIT_BUG", "EXIT_PEER_LOST", "EXIT_PREEMPTED", "EXIT_REFUSED", "PROJECT_ERRORS",
           "add_debug_flag", "debug_requested", "one_line", "refusal", "report", "run_entry_point"]


def refusal(error: BaseException, extra: tuple[type[BaseException], ...] = ()) -> str | None:
    """The one line (without `error: `) that `error` ends a run with, or None when it is a bug."""
    return ending.refusal(error, PROJECT_ERRORS + tuple(extra))


def report(error: BaseException, *, extra: tuple[type[BaseException], ...] = (), debug: bool = False,
           stream=None) -> int:
    """Print what the user sees of `error` (`ending.report` over the project's errors) and return the exit status."""
    return ending.report(error, PROJECT_ERRORS + tuple(extra), debug=debug, stream=stream)


def run_entry_point(body: Callable[[], object], argv: Sequence[str] | None = None, *,
                    extra: tuple[type[BaseException], ...] = ()):
    """`ending.run_entry_point` over the project's own errors (and `extra`)."""
    return ending.run_entry_point(body, PROJECT_ERRORS + tuple(extra), argv)
