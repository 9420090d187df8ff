"""External conformance: replay AgentDojo's ground truth through our whole tool-call path.

For each user task of AgentDojo's four suites (97 in total): render every ground-truth call as the Qwen3.5
assistant text a model would generate (`render_completion`), parse it back with `parse_assistant` against the
MCP-listed tool schemas, execute the parsed call through `MCPToolbox` on an in-process MCP server that wraps
AgentDojo's tool functions on the task's own environment, feed the result back as the next observation (also
checked token by token with the Qwen3.5 tokenizer), and finally score the task with its own utility function
(on the parsed final answer and the parsed call trace). Negative controls replay the same task with the last
state-changing call dropped, and with one argument of a state-changing call perturbed; both must fail.

    .ci/agentdojo.sh                                   # builds the pinned venv, then runs this file
    python tests/conformance/agentdojo_replay.py [--version v1.2.2] [--suite banking] [--json out.json]

Exits non-zero unless every task passes and every negative control fails where it applies.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import inspect
import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mercury_jax.chat import parse_assistant, render, render_completion  # noqa: E402  (after the repository is put on the path: this replay runs in its own venv)
from mercury_jax.envs import MCPToolbox, build_server  # noqa: E402  (after the repository is put on the path: this replay runs in its own venv)

SYSTEM = "You are a helpful assistant with tools. Use them to do what the user asks."


def make_tool(function, env, runtime):
    """An async MCP tool that runs AgentDojo `function` on `env`; AgentDojo errors become ToolErrors."""
    from agentdojo.agent_pipeline.tool_execution import tool_result_to_str
    from mcp.server.mcpserver.exceptions import ToolError
    from pydantic import Field

    async def tool(**kwargs):
        result, error = runtime.run_function(env, function.name, kwargs)
        if error:
            raise ToolError(error)
        return tool_result_to_str(result)

    parameters = []
    for name, info in function.parameters.model_fields.items():
        default = inspect.Parameter.empty if info.is_required() else info.default
        annotation = Annotated[info.annotation, Field(description=info.description)]
        parameters.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                                            default=default))
    tool.__signature__ = inspect.Signature(parameters, return_annotation=str)
    tool.__name__ = function.name
    tool.__doc__ = function.description
    return tool


def state_of(env) -> str:
    return env.model_dump_json()


def write_call_indices(suite, task, env) -> list[int]:
    """Indices of ground-truth calls that change the environment, found by running them on a copy."""
    from agentdojo.functions_runtime import FunctionsRuntime

    env = copy.deepcopy(env)
    runtime = FunctionsRuntime(suite.tools)
    writes = []
    for i, call in enumerate(task.ground_truth(copy.deepcopy(env))):
        before = state_of(env)
        runtime.run_function(env, call.function, call.args, raise_on_error=True)
        if state_of(env) != before:
            writes.append(i)
    return writes


def perturbed(value: Any) -> Any:
    """A wrong value of the same type (a string is replaced, not extended: utilities often test substrings)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 7
    if isinstance(value, str):
        return "a different value" if value != "a different value" else "another value"
    if isinstance(value, list):
        return [perturbed(v) for v in value] if value else ["a different value"]
    if isinstance(value, dict):
        return {k: perturbed(v) for k, v in value.items()} if value else {"changed": True}
    return "a different value"


async def replay(suite, task, *, calls=None, final_answer=None, tokenizer=None) -> tuple[bool, list[str]]:
    """Run `calls` (default: the task's ground truth) through render -> parse -> MCP; score with the task."""
    from agentdojo.functions_runtime import FunctionCall, FunctionsRuntime
    from agentdojo.types import text_content_block_from_string

    problems: list[str] = []
    env = task.init_environment(suite.load_and_inject_default_environment({}))
    pre_env = env.model_copy(deep=True)
    if calls is None:
        calls = task.ground_truth(copy.deepcopy(env))
    runtime = FunctionsRuntime(suite.tools)
    server = build_server({f.name: make_tool(f, env, runtime) for f in suite.tools})
    traces = []
    async with MCPToolbox(server, call_timeout_s=30) as toolbox:
        tools = await toolbox.list_tools()
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": task.PROMPT}]
        for call in calls:
            assistant = {"role": "assistant", "content": "", "tool_calls": [{"name": call.function,
                                                                          "arguments": dict(call.args)}]}
            prompt = render(messages, tools)
            completion = render_completion(assistant)
            turn = parse_assistant(completion, tools)
            if turn.errors or len(turn.tool_calls) != 1:
                problems.append(f"{call.function}: parse errors {turn.errors}")
                continue
            parsed = turn.tool_calls[0]
            if parsed.name != call.function or json.dumps(parsed.arguments, sort_keys=True, default=str) != \
                    json.dumps(dict(call.args), sort_keys=True, default=str):
                problems.append(f"{call.function}: parsed {parsed.name}({parsed.arguments}) "
                                f"!= ground truth {call.args}")
            observation = await toolbox.call(parsed)
            if observation.is_error:
                problems.append(f"{call.function}: tool error {observation.text[:200]}")
            traces.append(FunctionCall(function=parsed.name, args=parsed.arguments))
            messages += [turn.to_message(), {"role": "tool", "content": observation.text}]
            if tokenizer is not None:
                problems += check_tokens(tokenizer, prompt, completion, messages, tools, observation.text)
        answer = task.GROUND_TRUTH_OUTPUT if final_answer is None else final_answer
        completion = render_completion({"role": "assistant", "content": answer})
        turn = parse_assistant(completion, tools)
        if turn.errors or turn.tool_calls:
            problems.append(f"final answer parse errors {turn.errors}")
    utility = suite._check_user_task_utility(task, [text_content_block_from_string(turn.content)], pre_env, env,
                                             traces)
    return bool(utility), problems


def check_tokens(tokenizer, prompt, completion, messages, tools, result_text) -> list[str]:
    """The observation ids appended after the sampled turn equal the tokens of the re-rendered chat's tail."""
    from mercury_jax.chat import observation_ids

    full = render(messages, tools)
    if not full.startswith(prompt + completion):
        return ["re-rendered chat does not extend prompt + completion"]
    trajectory = tokenizer.encode(prompt) + tokenizer.encode(completion)
    observation = observation_ids(tokenizer, trajectory, [result_text])
    expected = tokenizer.encode(full[len(prompt + completion):])
    if "<|" in result_text or "<tool" in result_text or "<think" in result_text:
        return []  # special-token strings in a tool result are encoded as text on purpose
    return [] if observation == expected else ["observation ids differ from the re-rendered chat's tokens"]


async def run(args) -> int:
    from agentdojo.task_suite.load_suites import get_suites

    tokenizer = None
    if not args.no_tokens:
        from mercury_jax.chat import qwen35_tokenizer
        tokenizer = qwen35_tokenizer()
    suites = get_suites(args.version)
    rows, failures, report = [], [], {"version": args.version, "tasks": {}}
    totals = dict(tasks=0, passed=0, drop_applicable=0, drop_failed=0, perturb_applicable=0, perturb_failed=0,
                  answer_applicable=0, answer_failed=0)
    for suite_name, suite in sorted(suites.items()):
        if args.suite and suite_name not in args.suite:
            continue
        counts = dict(tasks=0, passed=0, drop=0, drop_failed=0, perturb=0, perturb_failed=0)
        for task_id, task in sorted(suite.user_tasks.items(), key=lambda kv: int(kv[0].split("_")[-1])):
            if args.task and task_id not in args.task:
                continue
            env = task.init_environment(suite.load_and_inject_default_environment({}))
            calls = task.ground_truth(copy.deepcopy(env))
            ok, problems = await replay(suite, task, tokenizer=tokenizer)
            entry: dict[str, Any] = {"utility": ok, "problems": problems, "calls": len(calls)}
            passed = ok and not problems
            counts["tasks"] += 1
            counts["passed"] += passed
            if not passed:
                failures.append(f"{suite_name}/{task_id}: utility={ok} {problems}")
            writes = write_call_indices(suite, task, env)
            entry["writes"] = writes
            # A task whose utility holds for an agent that does nothing and says nothing cannot fail any
            # control (AgentDojo has a few: state already as asked, or no check at all); they are listed.
            vacuous, _ = await replay(suite, task, calls=[], final_answer="")
            entry["vacuous"] = vacuous
            if vacuous:
                report.setdefault("vacuous", []).append(f"{suite_name}/{task_id}")
            elif writes:
                # Control 1: drop the last state-changing call.
                dropped = [c for i, c in enumerate(calls) if i != writes[-1]]
                drop_ok, _ = await replay(suite, task, calls=dropped)
                counts["drop"] += 1
                counts["drop_failed"] += not drop_ok
                entry["drop_last_write_passes"] = drop_ok
                if drop_ok:
                    failures.append(f"{suite_name}/{task_id}: still passes without its last write call")
                # Control 2: perturb one argument of a write call; the first argument, in order, whose
                # perturbation the task detects (all are tried and counted).
                detected, tried = [], 0
                for index in reversed(writes):
                    for name in calls[index].args:
                        changed = [c.model_copy(deep=True) for c in calls]
                        changed[index].args[name] = perturbed(changed[index].args[name])
                        tried += 1
                        perturb_ok, _ = await replay(suite, task, calls=changed)
                        if not perturb_ok:
                            detected.append(f"{calls[index].function}.{name}")
                entry["perturbations_detected"] = detected
                entry["perturbations_tried"] = tried
                counts["perturb"] += tried > 0
                counts["perturb_failed"] += bool(detected)
                if tried and not detected:
                    failures.append(f"{suite_name}/{task_id}: no single-argument perturbation is detected")
            else:
                # Read-only task: the answer is what is graded; a wrong final answer must fail.
                answer_ok, _ = await replay(suite, task, final_answer="I could not find that information.")
                totals["answer_applicable"] += 1
                totals["answer_failed"] += not answer_ok
                entry["wrong_answer_passes"] = answer_ok
                if answer_ok:
                    failures.append(f"{suite_name}/{task_id}: passes with a wrong final answer")
            report["tasks"][f"{suite_name}/{task_id}"] = entry
        rows.append((suite_name, counts))
        for key in ("tasks", "passed"):
            totals[key] += counts[key]
        totals["drop_applicable"] += counts["drop"]
        totals["drop_failed"] += counts["drop_failed"]
        totals["perturb_applicable"] += counts["perturb"]
        totals["perturb_failed"] += counts["perturb_failed"]
    print(f"AgentDojo {args.version} replay through render -> parse_assistant -> MCP -> observation")
    print("| suite | tasks | pass | drop-last-write fails | perturbed-argument fails |  "
          "(controls on non-vacuous tasks)")
    print("|---|---|---|---|---|")
    for name, c in rows:
        print(f"| {name} | {c['tasks']} | {c['passed']} | {c['drop_failed']}/{c['drop']} | "
              f"{c['perturb_failed']}/{c['perturb']} |")
    print(f"| total | {totals['tasks']} | {totals['passed']} | {totals['drop_failed']}/{totals['drop_applicable']} | "
          f"{totals['perturb_failed']}/{totals['perturb_applicable']} |")
    print(f"read-only tasks failing with a wrong final answer: {totals['answer_failed']}/{totals['answer_applicable']}")
    print(f"controls not applicable (utility holds for an agent that does nothing): {report.get('vacuous', [])}")
    report["totals"] = totals
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    for failure in failures:
        print("FAIL", failure)
    return 1 if failures or totals["tasks"] == 0 else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default="v1.2.2", help="AgentDojo benchmark version")
    parser.add_argument("--suite", action="append", help="only this suite (repeatable)")
    parser.add_argument("--task", action="append", help="only this user task id (repeatable)")
    parser.add_argument("--json", help="write a per-task report here")
    parser.add_argument("--no-tokens", action="store_true", help="skip the Qwen3.5 token-level observation check")
    args = parser.parse_args()
    import logging
    logging.getLogger("mcp").setLevel(logging.CRITICAL)
    start = time.time()
    code = asyncio.run(run(args))
    print(f"replay took {time.time() - start:.1f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
