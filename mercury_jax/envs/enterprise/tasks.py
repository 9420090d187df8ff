"""Task generator: per world seed, `count` state-changing tasks with a persona, one indirect request, a tool
subset (required tools plus distractors), required and forbidden effects, rubric items and the oracle script.

Rules:
- Templates are visited in a seeded order (each once before any repeats); a template that finds no suitable
  records, or repeats an earlier request of the same world, is skipped.
- Tool count: `round(gauss(tool_mean, tool_sd))` clipped to `tool_range` and to at least the required tools;
  distractors come first from the services the task touches, then from the others (plausible tools first).
  `tool_names` is sorted, so the rendered prompt does not reveal which tools are required.
- The persona (who asks: name, title, department) may use the services of the offered tools (`permissions`,
  stated in the system prompt).
- Every task has forbidden effects: the template's near misses, else two untouched records of the collections
  it writes.
- The task is plain JSON; `initial_state(task)` rebuilds the world from `seed` and `world_config`.
- Deterministic: the same (seed, count, config) gives byte-identical JSON.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

from mercury_jax.envs.enterprise import templates_customer, templates_internal, templates_tiny
from mercury_jax.envs.enterprise.drafts import Draft, View, unchanged
from mercury_jax.envs.enterprise.toolset import ALL_TOOLS, SERVICE_OF, SERVICE_TOOLS
from mercury_jax.envs.enterprise.world import WorldConfig, generate_world

FULL_TEMPLATES = tuple(sorted({**templates_customer.TEMPLATES, **templates_internal.TEMPLATES}))
TEMPLATES = {**templates_customer.TEMPLATES, **templates_internal.TEMPLATES, **templates_tiny.TEMPLATES}


@dataclass(frozen=True)
class TaskConfig:
    """How tasks are drawn: tool-count distribution, templates, prompt style (short for the tiny preset)."""
    tool_range: tuple[int, int] = (10, 26)
    tool_mean: float = 16.2
    tool_sd: float = 3.5
    templates: tuple[str, ...] = FULL_TEMPLATES
    short_prompts: bool = False
    world: WorldConfig = field(default_factory=WorldConfig)


def generate_tasks(seed: int, count: int, config: TaskConfig = TaskConfig()) -> list[dict]:
    """`count` tasks (fewer only if the world cannot support that many distinct requests) for world `seed`."""
    db = generate_world(seed, config.world)
    rng = random.Random(f"enterprise-tasks-{seed}")
    view, tasks, seen = View(db), [], set()
    order: list[str] = []
    attempts = 0
    while len(tasks) < count and attempts < 20 * max(count, 1):
        attempts += 1
        if not order:
            order = list(config.templates)
            rng.shuffle(order)
        name = order.pop()
        draft = TEMPLATES[name](view, rng)
        if draft is None or draft.user_prompt in seen:
            continue
        seen.add(draft.user_prompt)
        tasks.append(_task(db, seed, len(tasks), draft, rng, config))
    return tasks


def initial_state(task: dict) -> dict:
    """A fresh copy of the task's world before the episode, with the persona recorded in `meta`."""
    config = world_config_from(task["world_config"])
    db = generate_world(task["seed"], config)
    db["meta"].update(persona_id=task["persona"]["id"], persona_email=task["persona"]["email"])
    return db


def world_config_from(data: dict) -> WorldConfig:
    return WorldConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def system_prompt(db: dict, persona: dict, short: bool = False) -> str:
    if short:
        return f"You help {persona['name']} ({persona['email']}). Today is {db['meta']['today']}."
    return (f"You are the operations assistant at {db['meta']['company']}. You act for {persona['name']}, "
            f"{persona['title']} ({persona['email']}), who may read and change records in "
            f"{', '.join(persona['permissions'])}. Today is {db['meta']['today']}. Requests describe records "
            "indirectly: look them up with the tools before changing anything, change only what the request asks "
            "for, and finish with a short summary of what you did.")


def _task(db: dict, seed: int, index: int, draft: Draft, rng: random.Random, config: TaskConfig) -> dict:
    if not draft.forbidden:
        draft.forbidden = _bystanders(db, draft, rng)
    tool_names = _tool_subset([s["tool"] for s in draft.steps], rng, config)
    persona = {k: db["people"][draft.persona_id][k] for k in ("id", "name", "title", "email", "department")}
    persona["permissions"] = sorted({SERVICE_OF[t] for t in tool_names})  # the services this persona may use
    return {
        "task_id": f"enterprise-{seed:06d}-{index:02d}", "world": "enterprise", "seed": seed,
        "template": draft.template,
        "persona": persona,
        "system_prompt": system_prompt(db, persona, config.short_prompts), "user_prompt": draft.user_prompt,
        "tool_names": tool_names,
        "required_effects": draft.required, "forbidden_effects": draft.forbidden, "rubric": draft.rubric,
        "records": draft.records, "oracle": {"steps": draft.steps, "answer": draft.answer},
        "world_config": asdict(config.world),
    }


def _bystanders(db: dict, draft: Draft, rng: random.Random) -> list[dict]:
    """Default forbidden effects: leave alone two records of the collections the task writes that it is not about."""
    touched = {(c, i) for c, i in draft.records} | {(e["collection"], e.get("id")) for e in draft.required}
    collections = sorted({e["collection"] for e in draft.required})
    pool = [(c, i) for c in collections for i in db[c] if (c, i) not in touched]
    return [unchanged(c, i, f"{c} record {i} is left alone") for c, i in rng.sample(pool, min(2, len(pool)))]


def _tool_subset(required: list[str], rng: random.Random, config: TaskConfig) -> list[str]:
    required = list(dict.fromkeys(required))
    low, high = config.tool_range
    target = min(high, max(low, len(required), round(rng.gauss(config.tool_mean, config.tool_sd))))
    services = {SERVICE_OF[t] for t in required}
    near = [t for s in sorted(services) for t in SERVICE_TOOLS[s] if t not in required]
    far = [t for t in ALL_TOOLS if t not in required and t not in near]
    rng.shuffle(near), rng.shuffle(far)
    return sorted(required + (near + far)[: max(0, target - len(required))])
