"""Test session setup: 8 fake CPU devices and no TPU probing, set before JAX is imported anywhere."""
import os

os.environ["JAX_PLATFORMS"] = "cpu"
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402  (must come after the environment is set)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}"


@pytest.fixture(scope="session")
def persistent_compilation_cache(tmp_path_factory):
    """A resumed run compiles the same programs as the uninterrupted one, and the trainer test modules run the same
    tiny programs: with one persistent cache for the session (from the first module that asks for it on), each
    compiles once."""
    from jax.experimental.compilation_cache import compilation_cache

    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    saved = {key: jax.config.values[key] for key in keys}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("xla_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.reset_cache()
    yield
    for key, value in saved.items():
        jax.config.update(key, value)
    compilation_cache.reset_cache()


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
