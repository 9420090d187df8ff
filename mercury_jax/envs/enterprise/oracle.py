"""Scripted oracle: replays a task's oracle script through the same tools, proving the task solvable and
producing warm-start chat messages (one assistant turn per tool call, then the final summary).

`run_script(task, db, limit)` executes the first `limit` calls (all when None) directly on `db` (no MCP; the
observation text is the same as through MCP). `oracle_trajectory(task)` returns OpenAI-style messages for
`mercury_jax.chat.render`: system, user, then assistant `tool_calls` / `tool` results, then the answer.
"""
from __future__ import annotations

from mercury_jax.envs.enterprise.tasks import initial_state
from mercury_jax.envs.enterprise.toolkit import call_sync
from mercury_jax.envs.enterprise.toolset import make_tools

WRITE_PREFIXES = ("send_", "delete_", "create_", "update_", "post_", "reassign_", "add_", "share_", "approve_",
                  "reject_", "cancel_")


def is_write(tool_name: str) -> bool:
    return tool_name.startswith(WRITE_PREFIXES)


def run_script(task: dict, db: dict, steps: list[dict] | None = None) -> list[tuple[dict, str, bool]]:
    """Run `steps` (default: the task's whole oracle script) on `db`: [(step, observation text, is_error)]."""
    steps = task["oracle"]["steps"] if steps is None else steps
    tools = make_tools(db, task["tool_names"])
    out = []
    for step in steps:
        if step["tool"] not in tools:
            raise ValueError(f"oracle step {step['tool']!r} is not among task {task['task_id']}'s tools")
        text, is_error = call_sync(tools[step["tool"]], step["args"])
        out.append((step, text, is_error))
    return out


def partial_script(task: dict, write_fraction: float) -> list[dict]:
    """The oracle script keeping every lookup but only the first `write_fraction` of the writes."""
    writes = [i for i, s in enumerate(task["oracle"]["steps"]) if is_write(s["tool"])]
    keep = set(writes[: int(len(writes) * write_fraction)])
    return [s for i, s in enumerate(task["oracle"]["steps"]) if not is_write(s["tool"]) or i in keep]


def oracle_trajectory(task: dict) -> list[dict]:
    """Chat messages of the oracle solving `task` (tool results included), ready for `render`."""
    db = initial_state(task)
    messages = [{"role": "system", "content": task["system_prompt"]}, {"role": "user", "content": task["user_prompt"]}]
    for step, text, is_error in run_script(task, db):
        if is_error:
            raise RuntimeError(f"oracle call {step} failed on task {task['task_id']}: {text}")
        messages.append({"role": "assistant", "content": "",
                         "tool_calls": [{"name": step["tool"], "arguments": step["args"]}]})
        messages.append({"role": "tool", "name": step["tool"], "content": text})
    messages.append({"role": "assistant", "content": task["oracle"]["answer"]})
    return messages
