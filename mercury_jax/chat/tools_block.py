"""The parts of the Qwen3.5 prompt that both renderers share: the tools block's wording around the tool schemas,
and the normal form of one tool call (`{"name": str, "arguments": dict}`) from an OpenAI-style call, a
`{"function": {...}}` wrapper, JSON-string arguments or a parsed call object.

`render.render` writes the block in Python; `template.BUILTIN_CHAT_TEMPLATE` restates it in jinja from these
same strings, so the two cannot drift apart.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

TOOLS_HEADER = "# Tools\n\nYou can call the functions described below.\n\n<tools>"
TOOLS_FOOTER = "\n</tools>"
TOOLS_INSTRUCTIONS = (
    "\n\nTo call a function, write one block of exactly this form per call, and nothing after the last block:\n\n"
    "<tool_call>\n<function=function_name>\n<parameter=argument_name>\nvalue\n</parameter>\n"
    "<parameter=other_argument>\na value may span\nseveral lines\n</parameter>\n</function>\n</tool_call>\n\n"
    "Rules:\n"
    "- Give every required argument; write objects and arrays as JSON, everything else as plain text.\n"
    "- Explain yourself, if at all, before the first call, never after the last one.\n"
    "- When no function helps, answer in plain text and do not mention functions."
)


def normalize_tool_call(call: Any) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        call = {"name": call.name, "arguments": call.arguments}
    if isinstance(call.get("function"), Mapping):
        call = call["function"]
    arguments = call.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            raise ValueError(f"tool call {call.get('name')!r} has arguments that are not JSON: {error}") from None
    if not isinstance(arguments, Mapping):
        raise ValueError(f"tool call {call.get('name')!r} has arguments {arguments!r}; expected an object")
    return {"name": call["name"], "arguments": dict(arguments)}
