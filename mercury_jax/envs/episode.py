"""One episode of either world: a fresh state mounted on a fresh in-process MCP server through the adapter.

    async with make_episode(task) as episode:
        tools = await episode.tools()                    # OpenAI-style schemas for render(messages, tools)
        messages, ids = episode.prompt(tokenizer, tools)  # the task's system and user prompts, rendered
        observation = await episode.call(tool_call)      # parsed ToolCall -> ToolObservation (via MCPToolbox)
        result = episode.grade(final_answer_text, transcript)

Enterprise `grade`: `effects_fraction`, `all_effects_pass`, `forbidden_violations`, `details` from the final state
(plus rubric items scored by `judge`, as extra effects, when a judge is given). Browse `grade`: `accuracy`
(normalized match of the `Final answer:` line), `effects_fraction` = accuracy, `all_effects_pass` = correct and
grounded, `evidence_sufficient`, `over_search_calls` (tool calls made after the evidence became sufficient).
Nothing is shared between episodes: each `make_episode` rebuilds the world from the task's seed.

Nothing here blocks the event loop that other episodes share: the world is built (`_tools`) in a worker thread
(`tool_threads.run_blocking`, within `connect_timeout_s`), and the world tools are mounted as plain functions
(`toolkit.blocking`) that the MCP adapter runs in its thread pool under `call_timeout_s`. Results longer than
`max_result_chars` are cut with a note (`MCPToolbox`). `grade` is synchronous: async callers run it in a thread
(the episode runner does, since a judge may call a remote model).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from mercury_jax.chat.chat_ids import chat_ids
from mercury_jax.envs.browse.oracle import OracleConfig
from mercury_jax.envs.browse.oracle import oracle_trajectory as browse_oracle
from mercury_jax.envs.browse.sufficiency import answer_shown, evidence_sufficient
from mercury_jax.envs.browse.tasks import corpus_of, extract_answer, normalize_answer
from mercury_jax.envs.browse.tools import BrowseIndex, browse_tools
from mercury_jax.envs.enterprise.effects import grade_state
from mercury_jax.envs.enterprise.oracle import oracle_trajectory as enterprise_oracle
from mercury_jax.envs.enterprise.tasks import initial_state
from mercury_jax.envs.enterprise.toolkit import blocking
from mercury_jax.envs.enterprise.toolset import make_tools
from mercury_jax.envs.mcp_adapter import DEFAULT_MAX_RESULT_CHARS, MCPToolbox, ToolObservation, build_server
from mercury_jax.envs.tool_threads import run_blocking


def task_prompt(task: Mapping, tokenizer, tools: list[dict], *,
                enable_thinking: bool = True) -> tuple[list[dict], list[int]]:
    """(the chat messages of a task's prompt, their ids ending in the assistant's generation prompt): its system
    prompt (when it has one) and its user prompt, rendered with `tools` (message text never becomes control ids)."""
    messages = [{"role": "user", "content": task["user_prompt"]}]
    if task.get("system_prompt"):
        messages.insert(0, {"role": "system", "content": task["system_prompt"]})
    return messages, chat_ids(tokenizer, messages, tools, add_generation_prompt=True, enable_thinking=enable_thinking)


class Episode:
    """Base: owns the MCP toolbox; subclasses build the state and tools and grade."""
    def __init__(self, task: Mapping, *, call_timeout_s: float = 30.0, connect_timeout_s: float = 30.0,
                 max_result_chars: int | None = DEFAULT_MAX_RESULT_CHARS):
        self.task = dict(task)
        self.call_timeout_s, self.connect_timeout_s = call_timeout_s, connect_timeout_s
        self.max_result_chars = max_result_chars
        self.toolbox: MCPToolbox | None = None
        self.messages: list[dict] = []  # tool calls and observations seen through `call`, in order

    def _tools(self) -> dict:
        raise NotImplementedError

    async def __aenter__(self) -> Episode:
        try:  # the server too: the SDK builds a pydantic model per tool (~10 ms each), too slow for the loop
            server = await run_blocking(self._server, timeout_s=self.connect_timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{self.task['world']} task {self.task.get('task_id')}: building the world took "
                               f"more than {self.connect_timeout_s:g} s; raise connect_timeout_s or use a "
                               f"smaller world") from None
        self.toolbox = MCPToolbox(server, call_timeout_s=self.call_timeout_s, connect_timeout_s=self.connect_timeout_s,
                                  max_result_chars=self.max_result_chars)
        await self.toolbox.__aenter__()
        return self

    def _server(self):
        return build_server(self._tools(), name=f"{self.task['world']}-{self.task['task_id']}")

    async def __aexit__(self, *exc_info) -> None:
        if self.toolbox is not None:
            await self.toolbox.__aexit__(*exc_info)
        self.toolbox = None

    async def tools(self) -> list[dict]:
        return await self._open().list_tools()

    def prompt(self, tokenizer, tools: list[dict], *, enable_thinking: bool = True) -> tuple[list[dict], list[int]]:
        return task_prompt(self.task, tokenizer, tools, enable_thinking=enable_thinking)

    async def call(self, tool_call) -> ToolObservation:
        observation = await self._open().call(tool_call)
        self.messages.append({"role": "assistant", "content": "",
                              "tool_calls": [{"name": tool_call.name, "arguments": dict(tool_call.arguments)}]})
        self.messages.append({"role": "tool", "name": observation.name, "content": observation.text})
        return observation

    def _open(self) -> MCPToolbox:
        if self.toolbox is None:
            raise RuntimeError("episode is not open: use `async with make_episode(task) as episode:`")
        return self.toolbox


class EnterpriseEpisode(Episode):
    def __init__(self, task: Mapping, *, judge=None, **limits):
        super().__init__(task, **limits)
        self.judge = judge

    def _tools(self) -> dict:
        self.initial, self.state = initial_state(self.task), initial_state(self.task)
        return {name: blocking(tool) for name, tool in make_tools(self.state, self.task["tool_names"]).items()}

    def grade(self, final_answer_text: str, transcript: Sequence[Mapping] | None = None) -> dict:
        extra = self.judge.score(self.task["rubric"], final_answer_text, transcript) if self.judge else ()
        return grade_state(self.task["required_effects"], self.task["forbidden_effects"], self.initial, self.state,
                           extra)


class BrowseEpisode(Episode):
    def _tools(self) -> dict:
        tools = browse_tools(BrowseIndex(corpus_of(self.task)))
        return {name: blocking(tools[name]) for name in self.task["tool_names"]}

    def grade(self, final_answer_text: str, transcript: Sequence[Mapping] | None = None) -> dict:
        return grade_browse(self.task, final_answer_text, self.messages if transcript is None else transcript)


def grade_browse(task: Mapping, final_answer_text: str, transcript: Sequence[Mapping]) -> dict:
    """Accuracy, grounding and over-search of a finished browsing trajectory (`transcript`: chat messages)."""
    answer = extract_answer(final_answer_text or "")
    correct = answer is not None and normalize_answer(answer) == normalize_answer(task["answer"])
    grounded = answer is not None and answer_shown(answer, transcript)
    calls = [k for k, m in enumerate(transcript) if m.get("role") == "assistant" and m.get("tool_calls")]
    first_sufficient = next((k for k in range(len(transcript) + 1) if evidence_sufficient(task, transcript[:k])), None)
    over = sum(len(transcript[k]["tool_calls"]) for k in calls
               if first_sufficient is not None and k >= first_sufficient)
    details = [{"type": "required", "description": f"the final answer is {task['answer']!r}", "ok": correct},
               {"type": "required", "description": "the answer occurs in page text seen", "ok": grounded}]
    return {"effects_fraction": float(correct), "all_effects_pass": correct and grounded, "accuracy": float(correct),
            "grounded": grounded, "evidence_sufficient": first_sufficient is not None,
            "over_search_calls": over, "answer": answer, "details": details}


def make_episode(task: Mapping, *, judge=None, call_timeout_s: float = 30.0, connect_timeout_s: float = 30.0,
                 max_result_chars: int | None = DEFAULT_MAX_RESULT_CHARS) -> Episode:
    """A fresh episode for `task` (enterprise or browse); use it as an async context manager."""
    limits = dict(call_timeout_s=call_timeout_s, connect_timeout_s=connect_timeout_s,
                  max_result_chars=max_result_chars)
    if task["world"] == "enterprise":
        return EnterpriseEpisode(task, judge=judge, **limits)
    if task["world"] == "browse":
        return BrowseEpisode(task, **limits)
    raise ValueError(f"unknown world {task['world']!r}; expected 'enterprise' or 'browse'")


def oracle_trajectory(task: Mapping, **options) -> list[dict]:
    """The scripted solver's chat messages for `task` (either world); for browsing, the task's `oracle_config`
    and then `options` set the oracle's `OracleConfig` (e.g. `over_search_prob=0.5`)."""
    if task["world"] == "enterprise":

        return enterprise_oracle(dict(task))

    return browse_oracle(dict(task), OracleConfig(**{**task.get("oracle_config", {}), **options}))
