"""mercury_jax entry point: `python -m mercury_jax.main --config experiments/sao.py[:tiny] [--workdir DIR]`.

Reads an ml_collections config (variants after `:`, overrides with `--config.key=value`), checks it before any
work starts, initialises multi-host JAX when running on a pod, logs versions and devices, and runs the pipeline
named by `config.pipeline`. A rerun with the same `--workdir` resumes from its last checkpoint, refusing a config
that differs from the workdir's in a field that changes shapes or data, and an SFT corpus (`sft.data`) whose files
changed since the run started (`--resume_force_config` overrides both).

Exit codes (`cli_errors.py`, docs/DESIGN.md "Exit codes"): 0 done; 2 refused, with one `error:` line on stderr that
names the problem and the fix (a missing or unloadable config file, an override of the wrong type, a config that
fails validation, a workdir that cannot be a directory or is in use, a resume that differs, a corpus or checkpoint
that cannot be read, ...; `--debug` or MERCURY_DEBUG=1 adds the traceback); 1 a bug (its traceback); 75 a lost peer
of a multi-process run (`parallel/peer_watch.py`); 143 SIGTERM, after checkpointing the step in progress
(`runs/preemption.py`).
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys
import time
from pathlib import Path

import flax
import jax
from absl import app, flags, logging
from ml_collections import config_flags

from mercury_jax import cli_errors
from mercury_jax.config.registry import pipeline
from mercury_jax.config.validate import ConfigError, validate_config
from mercury_jax.data.uris import RemotePathError, check_remote
from mercury_jax.parallel import distributed, peer_watch
from mercury_jax.runs import preemption  # SIGTERM: checkpoint the current step, then exit 143
from mercury_jax.runs.environment import record_environment  # package versions of each start
from mercury_jax.runs.resume import check_corpus, check_run_config  # a rerun resumes: it must be the same run
from mercury_jax.runs.run_guard import run_guard  # the workdir lock and the peer watch
from mercury_jax.runs.rundir import RunDir, is_local

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file, e.g. experiments/sao.py:tiny",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (checkpoints, metrics, plots); default runs/NAME")
_MULTIHOST = flags.DEFINE_bool("multihost", None, "call jax.distributed.initialize() (default: auto on pods)")
flags.DEFINE_float(  # read by peer_watch.timeout_from_argv (before absl, for JAX's heartbeat too)
    "peer_timeout_s", peer_watch.DEFAULT_TIMEOUT_S, "multi-process runs: when another process has been silent this "
    "long (dead host, killed process), stop with a message naming it, the last checkpoint and the resume command "
    "(also MERCURY_PEER_TIMEOUT_S; JAX's own heartbeat timeout is set above it)")
_RESUME_FORCE_CONFIG = flags.DEFINE_bool(
    "resume_force_config", False, "resume a workdir even though its config.json differs from this config in fields "
    "that change shapes or data (model, tokenizer, world, seed, ...: each pipeline's resume fields, "
    "config/registry.py), or whose SFT corpus files changed since it started")
flags.DEFINE_bool("debug", False, "print the traceback of a refused run above its error line (also "
                  f"{cli_errors.DEBUG_ENV}=1)")


def main(argv):
    # Multi-process JAX starts before anything touches a device (importing this module does not: JAX's backends
    # start lazily, and no module imported above runs a jax computation): N processes on one machine from
    # JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (gloo collectives on CPU), or on a pod
    # (`--multihost`, or a TPU pod's environment) by JAX's own detection.
    multihost = distributed.initialize_for_main(sys.argv)
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; options go after --config / --workdir")
    if not flags.FLAGS["verbosity"].present:  # library INFO chatter (Orbax) drowns the progress lines
        logging.set_verbosity(logging.WARNING)
    config = _CONFIG.value
    if config is None:
        raise app.UsageError("--config is required, e.g. --config experiments/sao.py:tiny")
    try:
        validate_config(config)
    except ConfigError as error:
        raise SystemExit(f"error: {error}") from None

    workdir = _WORKDIR.value or os.path.join("runs", f"{config.pipeline}-{time.strftime('%Y%m%d-%H%M%S')}")
    _check_workdir(workdir)
    run = RunDir(workdir).make()  # a local path, file:///abs/path or a remote URI (gs://bucket/run)
    print(f"mercury_jax: pipeline={config.pipeline} workdir={workdir}\n"
          f"jax {jax.__version__}, flax {flax.__version__}, backend {jax.default_backend()}, {jax.device_count()} "
          f"devices ({jax.local_device_count()} local), process {jax.process_index()}/{jax.process_count()}",
          flush=True)
    if multihost:
        print(f"multi-process JAX ({multihost}): this is process {jax.process_index()} of "
              f"{jax.process_count()}; process 0 writes the run's files, every process its checkpoint shards",
              flush=True)
    # one run per workdir (a lock); on several processes, a lost peer stops every other one with a message
    # a multi-process run that fails leaves from inside the guard: it reports as this entry point would
    report = functools.partial(cli_errors.report, debug=cli_errors.debug_requested())
    with run_guard(run, sys.argv, peer_timeout_s=peer_watch.timeout_from_argv(sys.argv), report=report):
        check_run_config(run, config, force=_RESUME_FORCE_CONFIG.value)
        check_corpus(run, config, force=_RESUME_FORCE_CONFIG.value)  # sft.data: the same files as at the start
        run.write_config(config)  # lets `mercury_jax.export` and the sweep rebuild the model
        record_environment(run)
        preemption.install()
        pipeline(config.pipeline).run(config, run.root)


def _check_workdir(workdir: str) -> None:
    """A local `--workdir` that is a file, or that cannot be created or written, ends the run in one line before
    any work (RunDir.make would raise a traceback), and so does a remote URI with `..` or whose filesystem package
    is missing (gcsfs for gs://); the rest of a remote URI is left to RunDir.make."""
    try:
        check_remote(workdir, "--workdir")
    except RemotePathError as error:
        raise SystemExit(f"error: {error}") from None
    try:
        root = RunDir(workdir).root
    except ValueError as error:  # a relative file:// URI
        raise SystemExit(f"error: --workdir {workdir}: {error}") from None
    if not is_local(root):
        return
    path = Path(os.fspath(root))
    if path.exists() and not path.is_dir():
        raise SystemExit(f"error: --workdir {workdir} is a file, not a directory; pass a directory (a new one, or a "
                         f"run's to resume it)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SystemExit(f"error: --workdir {workdir} cannot be created ({error.strerror}: {error.filename}); pass "
                         f"a directory this user can create") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise SystemExit(f"error: --workdir {workdir} is not writable by this user; pass another directory")


def _config_arg(argv: list[str]) -> str | None:
    """The value of `--config` in `argv` (`path[:variant]`), or None."""
    config_arg = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if config_arg is None and "--config" in argv[:-1]:
        config_arg = argv[argv.index("--config") + 1]
    return config_arg


def unknown_override(argv: list[str]) -> str | None:
    """The first `--config.a.b=...` override naming a field the config file does not have, as a message."""
    config_arg = _config_arg(argv)
    if not config_arg:
        return None
    path, _, variant = config_arg.partition(":")
    spec = importlib.util.spec_from_file_location("_mercury_config", path)
    if spec is None or not os.path.exists(path):
        return f"--config {path}: no such config file"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(variant or None)
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        dotted = arg[len("--config."):].split("=", 1)[0]
        node, walked = config, []
        for key in dotted.split("."):
            if not hasattr(node, "keys") or key not in node:
                known = sorted(node.keys()) if hasattr(node, "keys") else []
                where = ".".join(walked) or "the config"
                return (f"unknown config field config.{dotted} (from {arg}): {where} has no field {key!r}; "
                        f"known fields there: {known}")
            node, walked = node[key], walked + [key]
    return None


def _parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing, ending in one `error:` line (no traceback) for a misspelt `--config.x.y=` override (naming
    the field), a config file that is missing or cannot be read, a config file that raises (its last line), and
    an override of the wrong type (`--config.sao.steps=abc`, as ml_collections words it)."""
    try:
        remaining = flags.FLAGS(argv)
        if _CONFIG.value is not None:
            _CONFIG.value.keys()  # config_flags defers a file that failed to load to the first access: make it here
        return remaining
    except (AttributeError, KeyError) as error:
        message = unknown_override(argv)
        if message is None:
            raise
        raise SystemExit(f"error: {message}") from error
    except OSError as error:  # config_flags: "Configuration is not available because of an earlier failure ..."
        path = (_config_arg(argv) or "").partition(":")[0]
        if path and not os.path.exists(path):
            raise SystemExit(f"error: --config {path}: no such config file; pass an experiment file, e.g. "
                             f"--config experiments/sao.py:tiny") from None
        raise SystemExit(f"error: --config {path}: cannot be loaded ({_last_line(error.__cause__ or error)})") from None
    except flags.IllegalFlagValueError as error:  # a wrong override type, or the config file's own exception
        raise SystemExit(f"error: {_last_line(error)}") from None


def _last_line(error: BaseException) -> str:
    """The message of `error` in one line: a wrapped traceback (config_flags quotes one) gives its last line, after
    the flag it concerns."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("flag --"):
        return f"{lines[0].split(': ', 1)[0]}: {lines[-1]}"
    return lines[-1] if lines else type(error).__name__


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cli_errors.run_entry_point(lambda: app.run(main, flags_parser=_parse_flags))
