"""The experiment configs are data: they import nothing from the project's code, and the reward weights they
spell out are the code's own defaults (a change to either side shows here)."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from experiments import common, grpo, sao
from mercury_jax.envs.behaviour import BehaviourConfig
from mercury_jax.envs.browse.stop_verifier import STOP_RULES

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


@pytest.mark.parametrize("path", sorted(EXPERIMENTS.glob("*.py")), ids=lambda p: p.name)
def test_experiments_import_no_project_code(path):
    tree = ast.parse(path.read_text(), str(path))
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    project = [name for name in imported if name.split(".")[0] in ("mercury_jax", "models", "mercury_kernels")]
    assert not project, f"{path.name} imports {project}: configs are data (ml_collections values only)"


def test_released_behaviour_weights_are_the_multipliers_defaults():
    assert common.behaviour_config().to_dict() == dataclasses.asdict(BehaviourConfig())
    assert sao.get_config().behaviour.to_dict() == dataclasses.asdict(BehaviourConfig())


def test_released_stop_rules_are_the_verifiers_weights():
    assert grpo.get_config().grpo.stop_rules.to_dict() == STOP_RULES
