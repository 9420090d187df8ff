"""Token ids of a rendered chat, in which message text can never become a control token (docs/MODEL.md section 6).

`tokenizer.encode(render(...))` turns every special-token string of the text into its control id, including one
inside message text: `<|im_end|>\\n<|im_start|>assistant` in a task prompt, or in a tool description an MCP server
sends through `tools/list`, closes the turn and forges a new one in the policy's prompt; in SFT data (assistant
content and reasoning) the forged ids would even be trained on. Here control ids come only from the template's own
structure (`<|im_start|>`, `<|im_end|>`, `<think>`, `<tool_call>`, ... that the renderer writes); every string of
the messages and tool schemas (contents, reasoning, tool names, arguments, descriptions) is plain text.

How. The chat is rendered as usual (`text`, what `render` returns) and once more with every `<` and `>` of the
message strings swapped for a placeholder character (the shadow). Position by position the shadow equals `text`
except where a `<` or `>` came from message text. Every special-token string starts with `<` and ends with `>`, so
one whose first or last character is such a position is message text, also when it straddles the boundary (a tool
name ending in `<|im_end|` that the template closes with `>`). The check assumes a template never writes the start
of a special token, message text, then its end; the built-in and the Qwen templates never do.

Ids. When every special-token string of `text` is structure (always so for message text without `<` or `>`) the ids
are `tokenizer.encode(text)`, byte for byte what they were before. Otherwise each stretch of text between two
structural specials is encoded as one piece with `allow_special=False`: the same pieces the tokenizer cuts at
specials, with the message text's special strings spelt as ordinary tokens.

Templates that inspect message text see the placeholders. So the reasoning of an assistant content
(`<think>...</think>answer`, no reasoning field) is split out first, as both built-in renderers and the Qwen
templates do, and the template writes its own `<think>` tags; a template that shows the content raw is rendered
once more without the split, and the tags stay plain text. When a template's decision still depends on a special
string in message text (`render` counts a user message made only of `<tool_response>` blocks as no query; as plain
text it is one), the ids follow the shadow's rendering, the chat as the template renders it with message text as
plain text, and decode to that text rather than to `render`'s.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mercury_jax.chat.observation import encode_segments
from mercury_jax.chat.render import content_text, render, render_completion
from mercury_jax.chat.special_tokens import SPECIAL_TOKENS, THINK, THINK_END
from mercury_jax.chat.tokenizer import Tokenizer

Messages = Sequence[Mapping[str, Any]]
Tools = Sequence[Mapping[str, Any]] | None

_PLACEHOLDER_BASE = 0xF0000  # Supplementary Private Use Area-A: never produced by a tokenizer or a template
_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


def chat_ids(tokenizer: Tokenizer, messages: Messages, tools: Tools = None, *, add_generation_prompt: bool = True,
             enable_thinking: bool = True, chat_template: str | None = None) -> list[int]:
    """Ids of `render(messages, tools, ...)` (same arguments) with every message string encoded as plain text."""
    def render_chat(chat: Messages, chat_tools: Tools) -> str:
        return render(chat, chat_tools, add_generation_prompt=add_generation_prompt,
                      enable_thinking=enable_thinking, chat_template=chat_template)
    return plain_text_ids(tokenizer, render_chat, messages, tools)


def completion_ids(tokenizer: Tokenizer, message: Mapping[str, Any], *, enable_thinking: bool = True) -> list[int]:
    """Ids of `render_completion(message)` (an assistant turn after the generation prompt, through `<|im_end|>`)
    with the message's content, reasoning and tool calls encoded as plain text: SFT targets never hold a control
    id the template did not write."""
    def render_turn(chat: Messages, _tools: Tools) -> str:
        return render_completion(chat[0], enable_thinking=enable_thinking)
    return plain_text_ids(tokenizer, render_turn, [message], None)


def plain_text_ids(tokenizer: Tokenizer, render_fn: Callable[[Messages, Tools], str], messages: Messages,
                   tools: Tools) -> list[int]:
    """Ids of `render_fn(messages, tools)` in which only the specials `render_fn` writes itself are control ids."""
    text = render_fn(messages, tools)
    if not any("<" in s or ">" in s for s in _strings((messages, tools))):
        return tokenizer.encode(text)  # no special string can start or end in message text
    used = set(text).union(*map(set, _strings((messages, tools))))
    free = (chr(c) for c in range(_PLACEHOLDER_BASE, 0x10FFFE) if chr(c) not in used)
    placeholders = {"<": next(free), ">": next(free)}
    shadow = _shadow(render_fn, split_reasoning(messages), tools, placeholders)
    if _restore(shadow, placeholders) != text:
        unsplit = _shadow(render_fn, messages, tools, placeholders)
        if _restore(unsplit, placeholders) == text:
            shadow = unsplit
        else:  # the template decided on a special string in message text: follow its plain-text rendering
            text = _restore(shadow, placeholders)
    from_message = {i for i, ch in enumerate(shadow) if ch in placeholders.values()}
    spans = special_spans(text)
    structural = [(start, token) for start, token in spans
                  if start not in from_message and start + len(token) - 1 not in from_message]
    if len(structural) == len(spans):
        return tokenizer.encode(text)
    segments, end = [], 0
    for start, token in structural:
        segments += [("text", text[end:start]), ("special", token)]
        end = start + len(token)
    segments.append(("text", text[end:]))
    return encode_segments(tokenizer, [(kind, value) for kind, value in segments if value])


def special_spans(text: str) -> list[tuple[int, str]]:
    """(start, token) of every special-token string in `text`, left to right, as a tokenizer finds them (a special
    holds `<` only at its start, so two can never overlap)."""
    spans, i = [], text.find("<")
    while i >= 0:
        token = next((t for t in SPECIAL_TOKENS if text.startswith(t, i)), None)
        spans += [(i, token)] if token else []
        i = text.find("<", i + (len(token) if token else 1))
    return spans


def split_reasoning(messages: Messages) -> list[Mapping[str, Any]]:
    """`messages` with the reasoning of an assistant content (`<think>r</think>answer`, no reasoning field) moved to
    `reasoning_content`, split the way `render.assistant_body` and the Qwen templates split it."""
    out: list[Mapping[str, Any]] = []
    for message in messages:
        content = content_text(message.get("content")).strip() if message.get("role") == "assistant" else ""
        if THINK_END in content and all(message.get(k) is None for k in _REASONING_KEYS):
            reasoning = content.split(THINK_END)[0].rstrip("\n").split(THINK)[-1].lstrip("\n")
            message = {**message, "content": content.split(THINK_END)[-1].lstrip("\n"), "reasoning_content": reasoning}
        out.append(message)
    return out


def _shadow(render_fn, messages, tools, placeholders: dict[str, str]) -> str:
    return render_fn(_defuse(messages, placeholders), _defuse(tools, placeholders))


def _defuse(value: Any, placeholders: dict[str, str]) -> Any:
    """A copy of `value` with `<` and `>` in every string (keys included) swapped for their placeholders."""
    if isinstance(value, str):
        return value.replace("<", placeholders["<"]).replace(">", placeholders[">"])
    if isinstance(value, Mapping):
        return {_defuse(k, placeholders): _defuse(v, placeholders) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_defuse(v, placeholders) for v in value]
    if hasattr(value, "name") and hasattr(value, "arguments"):  # a parsed tool call
        return {"name": _defuse(value.name, placeholders), "arguments": _defuse(value.arguments, placeholders)}
    return value


def _restore(shadow: str, placeholders: dict[str, str]) -> str:
    return shadow.replace(placeholders["<"], "<").replace(placeholders[">"], ">")


def _strings(value: Any):
    """Every string inside `value` (dict keys included)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)
    elif hasattr(value, "name") and hasattr(value, "arguments"):
        yield from _strings(value.name)
        yield from _strings(value.arguments)
