"""Episodes over MCP: oracle trajectories replayed through make_episode (both worlds), fresh state per episode,
rubric judges (rule-based default, OpenAI-compatible HTTP judge against a local fake server)."""
import asyncio
import http.server
import json
import threading

import pytest

from mercury_jax.chat import parse_assistant, render
from mercury_jax.chat.render import render_completion
from mercury_jax.envs.browse.tasks import generate_browse_tasks
from mercury_jax.envs.enterprise.tasks import generate_tasks
from mercury_jax.envs.episode import make_episode, oracle_trajectory
from mercury_jax.envs.judge import JudgeError, OpenAIJudge, RuleJudge


async def replay(task, messages, *, judge=None, parse=True):
    """Feed the oracle's assistant turns through the parser and MCP; return tools, observations, grade."""
    async with make_episode(task, judge=judge) as episode:
        tools = await episode.tools()
        observations = []
        for message in messages:
            if message["role"] == "assistant" and message.get("tool_calls"):
                text = render_completion(message)  # what a model would have generated for this turn
                calls = parse_assistant(text, tools).tool_calls if parse else message["tool_calls"]
                for call in calls:
                    observations.append(await episode.call(call))
        return tools, observations, episode.grade(messages[-1]["content"], messages)


@pytest.mark.parametrize("index", [0, 3, 7])
def test_enterprise_oracle_through_mcp_scores_one(index):
    task = generate_tasks(5, 10)[index]
    messages = oracle_trajectory(task)
    tools, observations, result = asyncio.run(replay(task, messages, judge=RuleJudge()))
    assert sorted(t["function"]["name"] for t in tools) == task["tool_names"]
    assert not any(o.is_error for o in observations)
    tool_texts = [m["content"] for m in messages if m["role"] == "tool"]
    assert [o.text for o in observations] == tool_texts  # direct and MCP observations are the same text
    assert result["effects_fraction"] == 1.0 and result["all_effects_pass"]
    assert any(d["type"] == "rubric" and d["ok"] for d in result["details"])
    assert "<tool_call>" in render(messages, tools)


def test_every_template_round_trips_render_parse_and_mcp():
    """One task per template: each oracle turn is rendered as model text, parsed back by the tools' schemas
    (arrays, integers, optional strings) and executed over MCP; the state checks then pass."""
    by_template = {}
    for seed in range(10):
        for task in generate_tasks(seed, 10):
            by_template.setdefault(task["template"], task)
    assert len(by_template) >= 14
    for template, task in sorted(by_template.items()):
        _, observations, result = asyncio.run(replay(task, oracle_trajectory(task)))
        assert not any(o.is_error for o in observations), (template, [o.text for o in observations if o.is_error])
        assert result["all_effects_pass"], (template, result)


def test_concurrent_episodes_do_not_share_state():
    task = generate_tasks(9, 1)[0]
    messages = oracle_trajectory(task)

    async def main():
        async def idle():
            async with make_episode(task) as episode:
                await asyncio.sleep(0.05)
                return episode.grade("")["effects_fraction"]
        return await asyncio.gather(replay(task, messages), idle(), replay(task, messages), idle())
    solved, idle_a, solved_again, idle_b = asyncio.run(main())
    assert solved[2]["all_effects_pass"] and solved_again[2]["all_effects_pass"] and idle_a == idle_b == 0.0


def test_each_episode_gets_a_fresh_state():
    task = generate_tasks(6, 1)[0]
    messages = oracle_trajectory(task)
    asyncio.run(replay(task, messages))

    async def idle():
        async with make_episode(task) as episode:
            return episode.grade("")
    assert asyncio.run(idle())["effects_fraction"] == 0.0


def test_rubric_failure_lowers_the_score_and_episode_must_be_open():
    task = generate_tasks(5, 1)[0]
    _, _, result = asyncio.run(replay(task, oracle_trajectory(task)[:-1] + [{"role": "assistant", "content": "ok"}],
                                      judge=RuleJudge()))
    assert result["effects_fraction"] < 1.0 and not result["all_effects_pass"]
    with pytest.raises(RuntimeError, match="not open"):
        asyncio.run(make_episode(task).tools())
    with pytest.raises(ValueError, match="unknown world"):
        make_episode(dict(task, world="mars"))


def test_browse_oracle_through_mcp():
    for task in generate_browse_tasks(2, 3):
        messages = oracle_trajectory(task)
        tools, observations, result = asyncio.run(replay(task, messages))
        assert [t["function"]["name"] for t in tools] == ["find", "open", "search"]
        assert [o.text for o in observations] == [m["content"] for m in messages if m["role"] == "tool"]
        assert result["accuracy"] == 1.0 and result["all_effects_pass"] and result["over_search_calls"] == 0


def test_rule_judge_kinds():
    judge = RuleJudge()
    transcript = [{"role": "assistant", "content": "", "tool_calls": [{"name": "send_email", "arguments": {}}]}]
    scores = judge.score([{"kind": "mentions", "value": "T-12", "description": "names it"},
                          {"kind": "called", "tool": "send_email", "description": "sent"},
                          {"kind": "called", "tool": "delete_email", "description": "deleted"}],
                         "Closed t-12.", transcript)
    assert [s["ok"] for s in scores] == [True, True, False]
    with pytest.raises(ValueError, match="does not know rubric kind"):
        judge.score([{"kind": "vibes", "description": "x"}], "", [])


def test_openai_judge_against_local_endpoint():
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, self.headers.get("Authorization"), body))
            verdict = "YES, it does." if "names the ticket" in body["messages"][-1]["content"] else "NO."
            data = json.dumps({"choices": [{"message": {"content": verdict}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        judge = OpenAIJudge(f"http://127.0.0.1:{server.server_port}/v1", "judge-model", api_key="k", timeout_s=10)
        scores = judge.score([{"kind": "mentions", "description": "the reply names the ticket"},
                              {"kind": "mentions", "description": "the reply is polite"}], "Closed T-1.", [])
        assert [s["ok"] for s in scores] == [True, False]
        assert seen[0][0] == "/v1/chat/completions" and seen[0][1] == "Bearer k"
        assert seen[0][2]["model"] == "judge-model" and seen[0][2]["temperature"] == 0
    finally:
        server.shutdown()
    with pytest.raises(JudgeError, match="failed on rubric item 'x'"):  # no verdict is no score (test_judge_failures)
        OpenAIJudge("http://127.0.0.1:9/v1", "m", timeout_s=2).score([{"description": "x"}], "", [])
