"""A rubric judge that gives no verdict is an environment failure, not a silent 0.

A local stub of an OpenAI-compatible chat-completions endpoint (no network) answers, fails or garbles on demand.
`OpenAIJudge.score` raises `JudgeError` naming the item for each way an endpoint fails (HTTP error, timeout, refused
connection, a body that is not a chat completion, a reply without YES/NO); through `EpisodeRunner` the episode whose
grading met such a judge is a "grade" environment failure: marked `env_failure`, counted in `stats()`, reward 0,
dropped by `failures.trainable`, while the other episodes (judged YES) keep their verdicts.
"""
from __future__ import annotations

import contextlib
import http.server
import json
import threading
import time

import pytest
from scripted_engine import ScriptedEngine

from mercury_jax.chat.tokenizer import qwen35_tokenizer
from mercury_jax.envs import presets
from mercury_jax.envs.judge import JudgeError, OpenAIJudge
from mercury_jax.rollout.episode import EpisodeRunner
from mercury_jax.rollout.failures import trainable
from mercury_jax.rollout.settings import Budgets, EnvLimits, EpisodeSettings

ITEM = {"kind": "mentions", "value": "T-3", "description": "the reply names the ticket"}


def completion(text) -> bytes:
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()


# how the stub answers one request: (HTTP status, body, seconds to wait first)
REPLIES = {
    "yes": (200, completion("YES, it names T-3."), 0.0),
    "http 503": (503, b"overloaded", 0.0),
    "timeout": (200, completion("YES"), 2.0),
    "not json": (200, b"<html>gateway</html>", 0.0),
    "no choices": (200, json.dumps({"error": "model not loaded"}).encode(), 0.0),
    "content not text": (200, completion(None), 0.0),
    "no verdict": (200, completion("The transcript is ambiguous; I cannot tell."), 0.0),
}


@contextlib.contextmanager
def stub_judge(choose):
    """A chat-completions endpoint on 127.0.0.1; `choose(prompt)` names its reply in REPLIES. Yields the base URL."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status, data, delay = REPLIES[choose(body["messages"][-1]["content"])]
            time.sleep(delay)
            with contextlib.suppress(OSError):  # the client may have given up (the timeout case)
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/v1"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("mode", [m for m in REPLIES if m != "yes"])
def test_a_judge_without_a_verdict_raises_and_names_the_item(mode):
    with stub_judge(lambda prompt: mode) as url:
        judge = OpenAIJudge(url, "judge-model", timeout_s=0.5)
        with pytest.raises(JudgeError, match="the reply names the ticket"):
            judge.score([ITEM], "Closed T-3.", [])


def test_a_refused_connection_raises():
    with stub_judge(lambda prompt: "yes") as url:
        pass  # the server is gone: nothing listens on its port
    with pytest.raises(JudgeError, match=r"failed on rubric item .*URLError"):
        OpenAIJudge(url, "m", timeout_s=2).score([ITEM], "", [])


def test_a_verdict_is_read_from_the_reply():
    with stub_judge(lambda prompt: "yes" if "Closed T-3." in prompt else "no verdict") as url:
        (score,) = OpenAIJudge(url, "m").score([ITEM], "Closed T-3.", [])
    assert score["ok"] is True and score["judge_reply"].startswith("YES")


def test_an_episode_whose_judge_fails_is_an_environment_failure_and_not_trained_on():
    tasks = presets.preset_tasks("enterprise", "tiny", 0, 4)
    broken = tasks[2]["user_prompt"]  # the judge fails on this task's episode only (its prompt is in the question)
    with stub_judge(lambda prompt: "http 503" if broken in prompt else "yes") as url:
        runner = EpisodeRunner(ScriptedEngine(None, num_slots=2, max_length=8192), qwen35_tokenizer(),
                               EpisodeSettings(budgets=Budgets(max_tool_turns=1, max_total_tokens=8192),
                                               limits=EnvLimits(judge=OpenAIJudge(url, "judge-model", timeout_s=10))))
        trajectories = runner.run(tasks)
    assert [t.task_id for t in trajectories] == [t["task_id"] for t in tasks]
    failed = trajectories[2]
    assert failed.reward == 0.0 and failed.env_failure.startswith("grade: JudgeError") and "503" in failed.env_failure
    assert failed.num_action_tokens > 0  # the episode ran; its tokens stay for the logs, never for training
    kept, dropped = trainable(trajectories)
    assert dropped == 1 and [t.task_id for t in kept] == [tasks[i]["task_id"] for i in (0, 1, 3)]
    for trajectory in kept:  # the judge's YES is one of the graded checks
        rubric = [d for d in trajectory.reward_parts["grade"]["details"] if d["type"] == "rubric"]
        assert rubric == [{"type": "rubric", "description": rubric_of(tasks, trajectory), "ok": True}]
    (record,) = runner.failures
    assert (record.task_id, record.stage) == (tasks[2]["task_id"], "grade")
    assert runner.stats()["env_failures"] == 1 and runner.stats()["env_failure_stages"] == {"grade": 1}


def rubric_of(tasks, trajectory) -> str:
    return next(t["rubric"][0]["description"] for t in tasks if t["task_id"] == trajectory.task_id)
