"""Environments: tools served over MCP (in process, or external servers), worlds and rewards.

Interfaces the rollout engine relies on (docs/ENVIRONMENTS.md; details in each module's docstring):

- **Task**: a JSON dict with at least `task_id`, `world` ("enterprise" | "browse"), `seed`, `system_prompt`,
  `user_prompt` (the persona's indirect request, or the question) and `tool_names`. Enterprise tasks add
  `template`, `persona`, `required_effects`, `forbidden_effects`, `rubric`, `records`, `oracle`, `world_config`;
  browse tasks add `answer`, `answer_fact`, `evidence`, `hops`, `chain`, `corpus_config`. Made by
  `enterprise.tasks.generate_tasks(seed, count)`, `browse.tasks.generate_browse_tasks(seed, count)`,
  `presets.preset_tasks(world, "full" | "tiny", seed, count)`, or read from a corpus written by
  `python -m mercury_jax.envs.generate` (`generate.read_tasks(DIR)`).
- **Episode**: `make_episode(task, *, judge=None, call_timeout_s=30, connect_timeout_s=30,
  max_result_chars=DEFAULT_MAX_RESULT_CHARS) -> Episode`, an async context manager holding a fresh state on a
  fresh in-process MCP server (a server that does not open or list its tools in time raises `MCPConnectTimeout`;
  one that fails raises `MCPConnectError`; results past `max_result_chars` are cut with a note):

      async with make_episode(task) as ep:
          tools = await ep.tools()                  # OpenAI-style schemas, for render(messages, tools)
          observation = await ep.call(tool_call)    # parsed ToolCall -> ToolObservation (through MCPToolbox)
          result = ep.grade(final_answer_text, transcript)

  `grade` returns `effects_fraction`, `all_effects_pass`, `details` (enterprise: state checks, plus rubric items
  when a judge is given, plus `forbidden_violations`; browse: `accuracy`, `grounded`, `evidence_sufficient`,
  `over_search_calls`, with `effects_fraction` = accuracy).
- **Behaviour multiplier**: `behaviour_multiplier(assistant_texts, *, finish_reason, answered_turn=None,
  forbidden_violations=0, format_errors=0, config=BehaviourConfig()) -> (multiplier, parts)`; reward =
  effects_fraction * multiplier.
- **Oracle**: `oracle_trajectory(task, **browse_options) -> list[dict]` chat messages (system, user, assistant
  turns with `tool_calls`, `tool` results, final answer) for `mercury_jax.chat.render` (SFT warm starts).
- **Browsing pivots**: `browse.pivots.extract_pivots(task, messages)`, `browse.stop_verifier.verify_stop(task,
  prefix, continuation)`, `browse.sufficiency.evidence_sufficient(task, messages)`.
- **Judges**: `RuleJudge()` (deterministic default), `OpenAIJudge(base_url, model)` (OpenAI-compatible HTTP).
"""
from mercury_jax.envs.behaviour import BehaviourConfig, behaviour_multiplier
from mercury_jax.envs.episode import Episode, grade_browse, make_episode, oracle_trajectory
from mercury_jax.envs.judge import OpenAIJudge, RuleJudge
from mercury_jax.envs.mcp_adapter import (
                                          DEFAULT_MAX_RESULT_CHARS,
                                          MCPConnectError,
                                          MCPConnectTimeout,
                                          MCPToolbox,
                                          ToolObservation,
                                          build_server,
                                          openai_schema,
                                          result_text,
)
from mercury_jax.envs.mcp_external import connect_external, external_server

__all__ = ["DEFAULT_MAX_RESULT_CHARS", "BehaviourConfig", "Episode", "MCPConnectError", "MCPConnectTimeout",
           "MCPToolbox", "OpenAIJudge", "RuleJudge", "ToolObservation", "behaviour_multiplier", "build_server",
           "connect_external", "external_server", "grade_browse", "make_episode", "openai_schema", "oracle_trajectory",
           "result_text"]
