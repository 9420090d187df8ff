"""The pipelines `mercury_jax.main` runs, by `config.pipeline`: the one place that registers an algorithm.

A pipeline is one module with `run(config, workdir, seams)` (and, optionally, a module whose
`check_config(config)` states the rules between its own fields, raising `validate.ConfigError`) plus its entry
below: the config sections it requires, the config fields a resumed run must share with the run that wrote the
checkpoints, and where its checkpoints hold the policy. Everything else reads it from here: `validate.py`
(sections, checks), `resume.py` (resume fields), `rundir.py` (stage folders: a pipeline's stage is its name, and
every RL pipeline may also hold the "sft" warm start), `run_reader.py` (the policy's arrays, for the sweep and the
export).

The modules are named, not imported, so that the run directory and the config checks can read this table without
importing the trainers (which import them).
"""
from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType

# Fields (dotted prefixes) every pipeline's resumed run must share with the run that wrote its checkpoints: they
# change the parameters' shapes, the tokenizer, the tasks, or which data each step sees. Anything else (steps,
# learning rates, cadences, devices, budgets) may change on a resume.
COMMON_RESUME_FIELDS = ("pipeline", "seed", "model", "tokenizer", "world", "sft.enabled", "sft.row_length",
                        "sft.batch_rows", "sft.data", "sft.packing_bins", "sft.data_workers")
RL_SECTIONS = ("seed", "model", "tokenizer", "world", "sft", "rollout", "checkpoint", "devices")


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """One algorithm's registration: `name` is `config.pipeline` and its stage folder in the run directory."""
    name: str
    module: str                                 # defines run(config, workdir, seams)
    sections: tuple[str, ...]                   # config sections the pipeline requires
    resume_fields: tuple[str, ...] = ()         # beyond COMMON_RESUME_FIELDS
    policy_role: tuple[str, ...] = ("actor",)   # the policy's subtree in a checkpoint: ROLE/params, ROLE/frozen
    checks: str = ""                            # a module defining check_config(config); "" for none
    roles: tuple[str, ...] = ("actor",)         # the roles with a mesh each (config/roles.py, train/placement.py)

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)

    def run(self, config, workdir, seams=None):
        module = self.load()
        return module.run(config, workdir) if seams is None else module.run(config, workdir, seams)

    def check(self, config) -> None:
        """The pipeline's own config rules (raising `validate.ConfigError`), after the common ones."""
        if self.checks:
            importlib.import_module(self.checks).check_config(config)

    @property
    def policy_arrays(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Where the policy's trainable and frozen arrays sit inside this stage's checkpoint."""
        return self.policy_role + ("params",), self.policy_role + ("frozen",)

    @property
    def all_resume_fields(self) -> tuple[str, ...]:
        return COMMON_RESUME_FIELDS + self.resume_fields


PIPELINES = {p.name: p for p in (
    Pipeline("sft", "mercury_jax.train.warm_start", ("seed", "model", "tokenizer", "world", "sft", "checkpoint"),
             policy_role=()),
    Pipeline("sao", "mercury_jax.train.sao", RL_SECTIONS + ("sao",), ("sao.batch_prompts",),
             checks="mercury_jax.config.sao_rules", roles=("rollout", "actor", "critic")),
    Pipeline("grpo", "mercury_jax.train.grpo", RL_SECTIONS + ("oracle", "grpo"),
             ("oracle", "grpo.batch_states", "grpo.group_size", "grpo.pivots_path", "grpo.pivot_source",
              "grpo.pivot_kinds", "grpo.pivot_tasks", "grpo.pivot_task_seed"), checks="mercury_jax.config.grpo_rules",
             roles=("rollout", "actor", "reference")),
    Pipeline("group_baseline", "mercury_jax.train.group_baseline", RL_SECTIONS + ("group_baseline",),
             ("group_baseline.batch_prompts", "group_baseline.group_size"),
             checks="mercury_jax.config.group_baseline_rules", roles=("rollout", "actor")),
)}


def stages() -> tuple[str, ...]:
    """Every registered pipeline's stage folder ("sft" is also the RL pipelines' warm start)."""
    return tuple(PIPELINES)


def register(entry: Pipeline) -> Pipeline:
    """Add a pipeline (a fourth algorithm, a user's own) to the registry `main` runs from; its name must be new."""
    if entry.name in PIPELINES:
        raise ValueError(f"a pipeline named {entry.name!r} is already registered ({PIPELINES[entry.name].module})")
    PIPELINES[entry.name] = entry
    return entry


def pipeline(name: str) -> Pipeline:
    if name not in PIPELINES:
        raise ValueError(f"config.pipeline is {name!r}; expected one of {sorted(PIPELINES)}")
    return PIPELINES[name]
