"""A chat (e.g. an oracle's `oracle_trajectory(task)`) as a `Trajectory`, tokenised the way a rollout builds one.

Token-in, token-out like the episode runner (docs/ENVIRONMENTS.md section 4), so SFT warm starts train on exactly the
ids a rollout of the same chat would hold:

    prompt       chat_ids(tokenizer, system + user, tools, add_generation_prompt=True)    action_mask 0
    assistant    completion_ids(tokenizer, message), through its `<|im_end|>`             action_mask 1
    tool results observation_ids(tokenizer, ids so far, [result, ...])                   action_mask 0

`rollout_logprobs` are 0 and `policy_versions` -1 (nobody sampled these tokens). Decoded, the ids equal
`render(messages, tools, add_generation_prompt=False)` without its final newline (render closes the last
assistant turn with `<|im_end|>\\n`; a trajectory ends at the sampled `<|im_end|>`), provided every assistant
turn follows the last user query (render drops the reasoning of earlier turns; a rollout keeps what was
sampled). The ids are not `encode(render(...))`: each piece is encoded on its own, as in a rollout, and message text
(prompts, tool schemas, assistant content, reasoning and tool calls) is plain text: a special-token string inside it
never becomes a control id, so SFT never trains on a forged one (`chat/chat_ids.py`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mercury_jax.chat import chat_ids, completion_ids, observation_ids, render_completion
from mercury_jax.chat.render import content_text
from mercury_jax.chat.tokenizer import Tokenizer
from mercury_jax.rollout.trajectory import Trajectory


def trajectory_from_messages(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]],
                             tools: Sequence[Mapping[str, Any]] | None = None, *, enable_thinking: bool = True,
                             task_id: str = "") -> Trajectory:
    """`messages` (system?, user, then assistant turns and tool results) as a Trajectory with action_mask 1
    exactly on the assistant completions; the finish reason is "answered" when the chat ends on an assistant turn
    without tool calls, else "turn_budget" (the chat stops before an answer)."""
    messages = list(messages)
    first_turn = next((i for i, m in enumerate(messages) if m["role"] in ("assistant", "tool")), len(messages))
    if not any(m["role"] == "user" for m in messages[:first_turn]):
        raise ValueError("trajectory_from_messages needs a user message before the first assistant turn")
    prompt = chat_ids(tokenizer, messages[:first_turn], tools, add_generation_prompt=True,
                      enable_thinking=enable_thinking)
    tokens, mask = list(prompt), [0] * len(prompt)
    spans, texts, calls, results = [], [], [], []
    pending_results: list[str] = []
    turn = -1
    for i in range(first_turn, len(messages)):
        message = messages[i]
        if message["role"] == "tool":
            pending_results.append(_text(message.get("content")))
            results.append({"turn": turn, "name": message.get("name", ""), "text": pending_results[-1],
                            "is_error": False})
            continue
        if message["role"] != "assistant":
            raise ValueError(f"message {i} has role {message['role']!r}; after the first assistant turn a chat "
                             "holds only assistant and tool messages")
        if pending_results:
            _append_observation(tokenizer, tokens, mask, pending_results, enable_thinking)
        elif turn >= 0:
            raise ValueError(f"message {i}: two assistant turns without tool results between them")
        turn += 1
        completion = render_completion(message, enable_thinking=enable_thinking)
        ids = completion_ids(tokenizer, message, enable_thinking=enable_thinking)
        spans.append((len(tokens), len(tokens) + len(ids)))
        tokens += ids
        mask += [1] * len(ids)
        texts.append(completion)
        calls += [{"turn": turn, **_call(c)} for c in message.get("tool_calls") or ()]
    if pending_results:  # the chat ends on tool results: keep them, no generation prompt needed after them
        _append_observation(tokenizer, tokens, mask, pending_results, enable_thinking)
    answered = bool(messages) and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
    return Trajectory(task_id=task_id, tokens=tokens, action_mask=mask, rollout_logprobs=[0.0] * len(tokens),
                      policy_versions=[-1] * len(tokens), prompt_length=len(prompt), turn_spans=spans,
                      tool_calls=calls, tool_results=results, assistant_texts=texts,
                      finish_reason="answered" if answered else "turn_budget")


def _append_observation(tokenizer, tokens, mask, pending_results, enable_thinking):
    ids = observation_ids(tokenizer, tokens, pending_results, enable_thinking=enable_thinking)
    tokens += ids
    mask += [0] * len(ids)
    pending_results.clear()


def _call(call: Any) -> dict:
    if not isinstance(call, Mapping):
        return {"name": call.name, "arguments": dict(call.arguments)}
    call = call.get("function", call)
    return {"name": call["name"], "arguments": call.get("arguments", {})}


def _text(content: Any) -> str:
    return content_text(content)
