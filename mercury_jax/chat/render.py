"""Render a chat in the Qwen3.5 format (docs/MODEL.md section 6): ChatML turns, a tools block, XML tool calls.

Rules (the official Qwen3.5 template's structure, which `template.BUILTIN_CHAT_TEMPLATE` restates in jinja):
- every content is trimmed; a content may be a string, None or a list of `{"type": "text", "text": ...}` parts;
- with tools, the system turn is the tools section (heading, one JSON tool per line inside `<tools>`, the call
  format) followed, after a blank line, by the user's system text; without tools, a system message is its own
  turn; a system message anywhere but first is an error;
- assistant turns after the last real user query (one that is not only `<tool_response>` blocks) render
  `<think>\n{reasoning}\n</think>\n\n{content}`; earlier ones drop their reasoning; reasoning comes from
  `reasoning_content` (or `reasoning` / `thinking`) or from a `</think>` inside the content;
- tool calls follow the content (a blank line between when there is content, a newline between calls) as
  `<tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n...</function>\n</tool_call>`, VALUE being
  JSON for objects and arrays and Python's `str()` otherwise (`True`, `None`, `1.5`), like the template;
- a run of consecutive tool messages is one user turn of `\n<tool_response>\n{content}\n</tool_response>` blocks;
- the generation prompt is `<|im_start|>assistant\n<think>\n`, or `...<think>\n\n</think>\n\n` with thinking off.

`render` uses a checkpoint's own jinja `chat_template` when given one (see `template.py`), else this built-in
renderer, whose tools-block wording is ours (for models trained here from scratch). Its text is never passed to
`tokenizer.encode`: `chat_ids.chat_ids` gives the ids, with message text as plain text (no forged control ids).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from mercury_jax.chat.special_tokens import IM_END, IM_START, THINK, THINK_END, TOOL_CALL, TOOL_CALL_END
from mercury_jax.chat.template import render_chat_template
from mercury_jax.chat.tools_block import TOOLS_FOOTER, TOOLS_HEADER, TOOLS_INSTRUCTIONS, normalize_tool_call


def render(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None, *,
           add_generation_prompt: bool = True, enable_thinking: bool = True,
           chat_template: str | None = None) -> str:
    """The prompt text of `messages` (OpenAI-style dicts) with `tools` (OpenAI-style function schemas).

    `chat_template`: a checkpoint's jinja template (`template.load_chat_template(path)`); rendered through jinja2
    the way transformers does, so the model sees exactly its training format.
    """
    if chat_template is not None:
        return render_chat_template(chat_template, messages, tools, add_generation_prompt=add_generation_prompt,
                                    enable_thinking=enable_thinking)
    messages = [normalize_message(m) for m in messages]
    if not messages:
        raise ValueError("render needs at least one message")
    out = []
    system_text = messages[0]["content"] if messages[0]["role"] == "system" else None
    if tools:
        block = TOOLS_HEADER + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        block += TOOLS_FOOTER + TOOLS_INSTRUCTIONS + (f"\n\n{system_text}" if system_text else "")
        out.append(f"{IM_START}system\n{block}{IM_END}\n")
    elif system_text is not None:
        out.append(f"{IM_START}system\n{system_text}{IM_END}\n")
    last_query = last_query_index(messages)
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "system":
            if i != 0:
                raise ValueError(f"message {i} is a system message; only the first message may be one")
        elif role == "user":
            out.append(f"{IM_START}user\n{message['content']}{IM_END}\n")
        elif role == "assistant":
            out.append(f"{IM_START}assistant\n" + assistant_body(message, keep_reasoning=i > last_query)
                       + f"{IM_END}\n")
        elif role == "tool":
            if i > 0 and messages[i - 1]["role"] != "tool":
                out.append(f"{IM_START}user")
            out.append(f"\n<tool_response>\n{message['content']}\n</tool_response>")
            if i == len(messages) - 1 or messages[i + 1]["role"] != "tool":
                out.append(f"{IM_END}\n")
        else:
            raise ValueError(f"message {i} has role {role!r}; expected system, user, assistant or tool")
    if add_generation_prompt:
        out.append(generation_prompt(enable_thinking))
    return "".join(out)


def generation_prompt(enable_thinking: bool = True) -> str:
    """The text that opens the assistant turn the model is asked to write."""
    return f"{IM_START}assistant\n{THINK}\n" + ("" if enable_thinking else f"\n{THINK_END}\n\n")


def render_completion(message: Mapping[str, Any], *, enable_thinking: bool = True) -> str:
    """The text a model writes for assistant `message` after `generation_prompt(enable_thinking)`, through its
    closing `<|im_end|>`: prompt + completion equals the turn as `render` shows it in the current exchange."""
    body = assistant_body(normalize_message(message), keep_reasoning=True)
    opened = f"{THINK}\n" + ("" if enable_thinking else f"\n{THINK_END}\n\n")
    if not body.startswith(opened):
        raise ValueError("reasoning cannot be rendered after a generation prompt with thinking off")
    return body[len(opened):] + IM_END


def assistant_body(message: Mapping[str, Any], *, keep_reasoning: bool) -> str:
    """An assistant turn between `<|im_start|>assistant\\n` and `<|im_end|>` (message already normalized)."""
    content, reasoning = message["content"], message.get("reasoning_content")
    if reasoning is None and THINK_END in content:
        reasoning = content.split(THINK_END)[0].rstrip("\n").split(THINK)[-1].lstrip("\n")
        content = content.split(THINK_END)[-1].lstrip("\n")
    reasoning = (reasoning or "").strip()
    text = f"{THINK}\n{reasoning}\n{THINK_END}\n\n{content}" if keep_reasoning else content
    for k, call in enumerate(message.get("tool_calls") or ()):
        text += ("\n\n" if content.strip() else "") if k == 0 else "\n"
        text += f"{TOOL_CALL}\n<function={call['name']}>\n"
        for name, value in call["arguments"].items():
            text += f"<parameter={name}>\n{format_argument(value)}\n</parameter>\n"
        text += f"</function>\n{TOOL_CALL_END}"
    return text


def format_argument(value: Any) -> str:
    """A parameter value as the template writes it: JSON for objects and arrays, `str()` otherwise."""
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def last_query_index(messages: Sequence[Mapping[str, Any]]) -> int:
    """Index of the last user message that is a real query (not only tool responses)."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "user":
            content = content_text(messages[i].get("content")).strip()
            if not (content.startswith("<tool_response>") and content.endswith("</tool_response>")):
                return i
    raise ValueError("no user query found in messages: a chat needs at least one user message")


def normalize_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A plain dict with trimmed text `content`, `reasoning_content` when given, and tool calls as
    `{"name", "arguments": dict}`; accepts OpenAI-style `{"function": {...}}` calls with JSON-string arguments
    and objects with `.name` / `.arguments` (parsed tool calls)."""
    if "role" not in message:
        raise ValueError(f"message {message!r} has no role")
    out: dict[str, Any] = {"role": message["role"], "content": content_text(message.get("content")).strip()}
    reasoning = next((message[k] for k in ("reasoning_content", "reasoning", "thinking")
                      if message.get(k) is not None), None)
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    if message.get("tool_calls"):
        out["tool_calls"] = [normalize_tool_call(c) for c in message["tool_calls"]]
    return out


def content_text(content: Any) -> str:
    """The text of a message content: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, Mapping) and "text" in part:
            parts.append(part["text"])
        else:
            raise ValueError(f"content part {part!r} is not text; only text content can be rendered")
    return "".join(parts)
