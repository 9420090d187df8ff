"""Named sizes of both worlds. `full` is the training distribution (docs/ENVIRONMENTS.md); `tiny` shrinks the company,
the corpus, the prompts and the tool subsets (two tools per task) so that a whole oracle trajectory, rendered with
its tools, takes about 500-600 tokens of a 2,048-piece SentencePiece vocabulary trained on such trajectories
(measured: browse mean ~495, max ~525; enterprise mean ~590, max ~770), for CPU demos and tests. The renderer's
fixed tool-call instructions alone take ~170 of them, and SentencePiece never merges across spaces or digits.

    tasks = preset_tasks("enterprise", "tiny", seed=0, count=4)
    messages = oracle_trajectory(tasks[0])        # mercury_jax.envs.episode
"""
from __future__ import annotations

from mercury_jax.envs.browse.corpus import CorpusConfig
from mercury_jax.envs.browse.tasks import generate_browse_tasks
from mercury_jax.envs.enterprise.tasks import TaskConfig, generate_tasks
from mercury_jax.envs.enterprise.world import WorldConfig

ENTERPRISE = {
    "full": TaskConfig(),
    "tiny": TaskConfig(
        tool_range=(2, 3), tool_mean=2.0, tool_sd=0.0, short_prompts=True,
        templates=("tiny_close_ticket", "tiny_deal_stage", "tiny_delete_phishing"),
        world=WorldConfig(departments=2, staff_per_department=(1, 2), accounts=(2, 2), tickets_per_account=(1, 1),
                          events=2, documents_extra=0, leave_requests=1, filler_emails=0,
                          short_ids=True)),
}
BROWSE = {
    "full": CorpusConfig(),
    "tiny": CorpusConfig(people=5, companies=2, cities=2, countries=1, filler_lines=(0, 0), hops=(1, 1),
                          short_names=True),
}
BROWSE_ORACLE = {  # per-preset browsing-oracle settings, stored in each task as `oracle_config`
    "full": {},
    "tiny": {"use_find": False},
}


def preset_tasks(world: str, size: str, seed: int, count: int) -> list[dict]:
    """`count` tasks of `world` ("enterprise" or "browse") at preset `size` ("full" or "tiny") for `seed`."""
    table = {"enterprise": ENTERPRISE, "browse": BROWSE}.get(world)
    if table is None:
        raise ValueError(f"unknown world {world!r}; expected 'enterprise' or 'browse'")
    if size not in table:
        raise ValueError(f"unknown preset {size!r} for {world}; expected one of {sorted(table)}")
    if world == "enterprise":
        return generate_tasks(seed, count, table[size])
    tasks = generate_browse_tasks(seed, count, table[size], short_prompts=size == "tiny")
    for task in tasks:
        task["oracle_config"] = dict(BROWSE_ORACLE[size])
        if size == "tiny":
            task["tool_names"] = ["open", "search"]  # one-hop questions need no find
    return tasks
