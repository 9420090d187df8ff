"""Test session setup: 8 fake CPU devices and no TPU probing, set before JAX is imported anywhere; one persistent
compilation cache for the session's child processes; the owner of a test's child processes (`children`); the hard
stop behind pytest-timeout; the longest modules first."""
import faulthandler
import os
import sys

import pytest

os.environ["JAX_PLATFORMS"] = "cpu"
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402  (JAX reads JAX_PLATFORMS when imported: the environment above comes first)

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}"


@pytest.fixture(scope="session")
def xla_cache_dir(tmp_path_factory):
    """The session's persistent compilation cache folder (one per xdist worker), shared by this process (where a test
    asks: `persistent_compilation_cache`) and every process the tests start (`child_compilation_cache`)."""
    return tmp_path_factory.mktemp("xla_cache")


@pytest.fixture(scope="session", autouse=True)
def child_compilation_cache(xla_cache_dir):
    """Every child process the tests start (`python -m mercury_jax.main` runs, tests/*_worker.py) reads and writes
    the session's cache: a program one child (or a test in this process) compiled loads from disk in the next one
    (a reference run and its 2-process twin, a killed run and its resume, the next test's runs). Set in this
    process's environment after JAX read it at import, so this process itself caches only where a test asks."""
    os.environ.update(JAX_COMPILATION_CACHE_DIR=str(xla_cache_dir), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return xla_cache_dir


@pytest.fixture(scope="session")
def persistent_compilation_cache(xla_cache_dir):
    """A resumed run compiles the same programs as the uninterrupted one, and the trainer test modules run the same
    tiny programs: with one persistent cache for the session (from the first module that asks for it on; the child
    processes' too), each compiles once."""
    from jax.experimental.compilation_cache import compilation_cache

    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    saved = {key: jax.config.values[key] for key in keys}
    jax.config.update("jax_compilation_cache_dir", str(xla_cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.reset_cache()
    yield
    for key, value in saved.items():
        jax.config.update(key, value)
    compilation_cache.reset_cache()


@pytest.fixture
def children():
    """The test's child processes (tests/child_processes.py): SIGKILLed with their process groups when the test ends,
    however it ends."""
    from child_processes import ChildProcesses

    with ChildProcesses() as owned:
        yield owned


# A hang fails fast (pytest-timeout, `timeout` in pyproject.toml: SIGALRM raises in the test, whose `finally` and
# fixtures then kill its children). A main thread stuck in C code (an XLA collective that never completes) never
# sees that signal: HARD_TIMEOUT_GRACE_S later faulthandler prints every thread's stack and ends the process (xdist
# reports the test as crashed and starts a new worker; the kernel kills the children, tests/child_processes.py).
# xdist's `--dist loadfile` hands a crashed test to the new worker again: the test's file in `_started` (written when
# it starts, removed when it ends) says it ended its worker once, and the rerun fails at once.
HARD_TIMEOUT_GRACE_S = 60
_REAL_STDERR = pytest.StashKey[int]()


def pytest_configure(config):
    # a copy of the process's stderr taken while output capture is suspended (after the conftests load), so the
    # stacks reach the terminal or CI log, not a capture buffer that dies with the process
    config.stash[_REAL_STDERR] = os.dup(sys.__stderr__.fileno())


def pytest_unconfigure(config):
    os.close(config.stash[_REAL_STDERR])


def _started(item):
    """The file that marks `item` as running in this session's xdist workers (None outside xdist): in the session's
    base temporary folder, which the workers' own (`--basetemp`, set by xdist) are in."""
    if not hasattr(item.config, "workerinput"):
        return None
    import hashlib
    from pathlib import Path

    folder = Path(item.config.option.basetemp).parent / "started"
    folder.mkdir(exist_ok=True)
    return folder / hashlib.sha1(item.nodeid.encode()).hexdigest()


_ENDED_A_WORKER = pytest.StashKey[bool]()


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    started = _started(item)
    if started is not None:
        item.stash[_ENDED_A_WORKER] = started.exists()
        started.touch()
    faulthandler.dump_traceback_later(settings.timeout + HARD_TIMEOUT_GRACE_S, exit=True,
                                      file=item.config.stash[_REAL_STDERR])


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.stash.get(_ENDED_A_WORKER, False):
        pytest.fail(f"{item.nodeid} ended its xdist worker (a crash, or stuck past its timeout); not run again")


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item):
    faulthandler.cancel_dump_traceback_later()
    started = _started(item)
    if started is not None:
        started.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def buckets(tmp_path_factory):
    """The local folder that `gs://` URIs read from in this test process (tests/local_buckets.py), one per process:
    every test module that reads gs:// shares it."""
    from local_buckets import serve_buckets

    root = tmp_path_factory.mktemp("buckets")
    serve_buckets(root)
    return root


# The longest test modules, longest first (`pytest --durations=0` on 2 CPU cores). The two workers take modules in
# collection order (`--dist loadfile --no-loadscope-reorder` in pyproject.toml), so these start first and the short
# ones fill in behind them; xdist's own order (most tests first) left the multi-process runs (~6 min, 2 tests) alone
# on one worker at the end.
LONGEST_FIRST = ("test_multihost_train.py", "test_multihost_async.py", "test_train_reliability.py",
                 "test_rollout_replica_worker.py", "test_train_sao.py", "test_rollout_replicas.py",
                 "test_train_grpo.py", "test_sweep_layout.py", "test_export_stream.py", "test_microbatch.py",
                 "test_moe_ep.py", "test_model_hf_parity.py", "test_train_injected.py", "test_bench_pod.py",
                 "test_row_split_learner.py", "test_row_split_model.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
