"""The code's shape rules, held by the code itself: no function or constructor in mercury_jax/rollout,
mercury_jax/train, mercury_jax/data, mercury_jax/bench, models or mercury_kernels takes more than 10 parameters or
runs longer than 60 lines (settings travel as dataclasses, `rollout/settings.py`), but for the few in `EXEMPT`, each
with its reason; config defaults live in one table (`config/defaults.py`), whose every name is a field some
experiment config spells out; and every registered pipeline has its experiment file and module."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from mercury_jax.config.defaults import DEFAULTS
from mercury_jax.config.registry import PIPELINES

ROOT = Path(__file__).resolve().parents[1]
MAX_PARAMS, MAX_LINES = 10, 60


def _functions(folder: str):
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.relative_to(ROOT), node


def _params(node) -> int:
    args = node.args
    count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
    count += (args.vararg is not None) + (args.kwarg is not None)
    return count - (bool(args.args) and args.args[0].arg in ("self", "cls"))


FOLDERS = ("mercury_jax/rollout", "mercury_jax/train", "mercury_jax/data", "mercury_jax/bench", "models",
           "mercury_kernels")
# (file, function): why it may be larger
EXEMPT = {
    ("mercury_kernels/cached_attention/pallas.py", "_kernel"):
        "a Pallas kernel: one ref per operand, output and scratch buffer, in the order pallas_call passes them",
    ("mercury_kernels/gated_delta/pallas.py", "_backward_kernel"):
        "a Pallas kernel: one ref per operand, output and scratch buffer, in the order pallas_call passes them",
    ("mercury_kernels/gated_delta/split.py", "split_gated_delta_rule"):
        "gated_delta_rule's own signature (5 arrays, initial state, segment ids, impl, chunk size), which it stands "
        "in for under shard_map, plus the mesh axis and the span table of the split",
}


def _too_big(path, node) -> bool:
    return _params(node) > MAX_PARAMS or node.end_lineno - node.lineno + 1 > MAX_LINES


@pytest.mark.parametrize("folder", FOLDERS)
def test_functions_are_small(folder):
    too_big = [f"{path}:{node.lineno} {node.name} ({_params(node)} parameters, "
               f"{node.end_lineno - node.lineno + 1} lines)" for path, node in _functions(folder)
               if _too_big(path, node) and (str(path), node.name) not in EXEMPT]
    assert not too_big, "split these (or pass a settings dataclass): " + "; ".join(too_big)


def test_every_exemption_is_still_needed():
    over = {(str(path), node.name) for folder in FOLDERS for path, node in _functions(folder) if _too_big(path, node)}
    assert set(EXEMPT) <= over, f"within the rule now, drop from EXEMPT: {sorted(set(EXEMPT) - over)}"


def _config_fields(config, prefix=""):
    for key, value in config.items():
        yield key
        if hasattr(value, "items"):
            yield from _config_fields(value, f"{prefix}{key}.")


def test_every_default_names_a_field_the_experiments_spell_out():
    fields = set()
    for name in PIPELINES:
        module = importlib.import_module(f"experiments.{name}")
        for variant in (None, "tiny"):
            fields |= set(_config_fields(module.get_config(variant)))
    assert set(DEFAULTS) <= fields, f"defaults no experiment config has: {sorted(set(DEFAULTS) - fields)}"


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_a_registered_pipeline_has_its_config_module_and_stage(name):
    pipeline = PIPELINES[name]
    config = importlib.import_module(f"experiments.{name}").get_config("tiny")
    assert config.pipeline == name and set(pipeline.sections) <= set(config.keys())
    assert callable(pipeline.load().run)
