"""Parse a generated Qwen3.5 assistant turn into reasoning, content and tool calls (MODEL.md section 6).

One semantics, used by rollouts and evaluation alike:

- **Input** is the generated text after the generation prompt; trailing `<|im_end|>` / `<|endoftext|>` are
  dropped. Parsing never raises: every problem becomes an entry in `errors`.
- **Reasoning** (as vLLM's `qwen3` reasoning parser): when the text holds `</think>`, the reasoning is the text
  before the first one (an opening `<think>` there is optional: with thinking on, the generation prompt already
  opened it) and the rest is the reply. Without `</think>` the whole text is the reply, except that a `<think>`
  that is never closed starts unclosed reasoning (an error) which runs to the end and holds no calls.
  A second `</think>` is an error.
- **Content** is the reply before the first `<tool_call>` (trimmed); calls are the `<tool_call>` blocks in order.
  Non-blank text between or after the calls is an error of the turn (the calls still count).
  `<function=` in the content, outside any `<tool_call>`, is an error and is not executed.
- **A call** is `<function=NAME>` then `<parameter=ARG>VALUE</parameter>` blocks then `</function>`. A missing
  `</parameter>` is tolerated (the value ends at the next `<parameter=`, `</function>` or the block's end); a
  missing `</tool_call>` is tolerated when `</function>` is present, otherwise the call is cut off (an error).
  One leading and one trailing newline are stripped from each value.
- **Values** are converted by the tool's JSON schema (`tools`: OpenAI-style or bare function schemas, or MCP
  `inputSchema`s): `string` as written; `integer`, `number`; `boolean` from `true`/`True`/`false`/`False`;
  `null` from `null`/`None`; `object`/`array` via JSON, then Python-literal fallback. A nullable schema
  (`"type": [..., "null"]`, or `anyOf`/`oneOf` with a null branch) takes `null`/`None` as None and otherwise
  converts by its first non-null type. With no type (or no `tools`), the value stays a string.
- **Call errors**: unknown tool, unknown parameter (unless `additionalProperties` allows it), repeated
  parameter, missing required parameter, unconvertible value, stray text inside the block, cut-off call.
  A call with errors is **not executed**; its `error_message()` is the observation the agent gets instead.
  `AssistantTurn.errors` lists the turn's errors and every call's (prefixed with the call), for metrics.
"""
from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mercury_jax.chat.special_tokens import ENDOFTEXT, IM_END, THINK, THINK_END, TOOL_CALL, TOOL_CALL_END

FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
_MAX_SHOWN = 80  # characters of a bad value quoted in an error


@dataclass
class ToolCall:
    """One parsed call: `arguments` converted by the tool's schema; `errors` non-empty means do not execute."""
    name: str
    arguments: dict[str, Any]
    errors: list[str] = field(default_factory=list)
    raw: str = ""

    @property
    def ok(self) -> bool:
        return not self.errors

    def error_message(self) -> str:
        """What the agent reads instead of a result when the call is malformed."""
        what = f"tool call {self.name!r}" if self.name else "tool call"
        return f"Error: {what} was not executed: " + "; ".join(self.errors)


@dataclass
class AssistantTurn:
    reasoning: str
    content: str
    tool_calls: list[ToolCall]
    errors: list[str]

    def to_message(self) -> dict[str, Any]:
        """The turn as a chat message for `render` (calls with errors keep whatever arguments parsed)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content, "reasoning_content": self.reasoning}
        if self.tool_calls:
            message["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in self.tool_calls]
        return message


def parse_assistant(text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> AssistantTurn:
    """Split generated `text` into reasoning, content and tool calls; see the module docstring for the rules."""
    errors: list[str] = []
    text = _strip_stop_tokens(text)
    reasoning, reply = "", text
    if THINK_END in text:
        before, _, reply = text.partition(THINK_END)
        lead, opened, inner = before.partition(THINK)
        if opened and lead.strip():
            errors.append(f"text before <think>: {_shown(lead)}")
        reasoning = (inner if opened else before).strip()
        if THINK_END in reply:
            errors.append("more than one </think>")
    elif THINK in text:
        reply, _, reasoning = text.partition(THINK)
        reasoning = reasoning.strip()
        errors.append("<think> is never closed (no </think>); the reasoning runs to the end of the turn")

    start = reply.find(TOOL_CALL)
    content = (reply if start < 0 else reply[:start]).strip()
    if FUNCTION_OPEN in content:
        errors.append("<function=...> outside a <tool_call> block is not a call; wrap each call in "
                      "<tool_call>...</tool_call>")
    schemas = tool_schemas(tools) if tools is not None else None
    calls: list[ToolCall] = []
    while start >= 0:
        body_start = start + len(TOOL_CALL)
        end = reply.find(TOOL_CALL_END, body_start)
        next_open = reply.find(TOOL_CALL, body_start)
        if end < 0 or 0 <= next_open < end:  # unclosed: the block runs to the next <tool_call> or the end
            block_end = next_open if next_open >= 0 else len(reply)
            calls.append(_parse_call(reply[body_start:block_end], schemas, closed=False))
            start = next_open
            continue
        calls.append(_parse_call(reply[body_start:end], schemas, closed=True))
        after = end + len(TOOL_CALL_END)
        start = reply.find(TOOL_CALL, after)
        between = reply[after:start if start >= 0 else len(reply)]
        if between.strip():
            where = "between tool calls" if start >= 0 else "after the last </tool_call>"
            errors.append(f"text {where}: {_shown(between)}")
    for i, call in enumerate(calls):
        errors += [f"tool call {i + 1} ({call.name or '?'}): {e}" for e in call.errors]
    return AssistantTurn(reasoning=reasoning, content=content, tool_calls=calls, errors=errors)


def tool_schemas(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Tool name -> JSON schema of its parameters, from OpenAI-style, bare, or MCP tool descriptions."""
    out = {}
    for tool in tools:
        function = tool.get("function", tool)
        schema = function.get("parameters") or function.get("inputSchema") or function.get("input_schema") or {}
        out[function["name"]] = dict(schema)
    return out


def _parse_call(block: str, schemas: dict[str, dict[str, Any]] | None, *, closed: bool) -> ToolCall:
    errors: list[str] = []
    opened = block.find(FUNCTION_OPEN)
    if opened < 0:
        return ToolCall("", {}, [f"no <function=NAME> inside <tool_call>: {_shown(block)}"], block)
    if block[:opened].strip():
        errors.append(f"text before <function=...>: {_shown(block[:opened])}")
    name_end = block.find(">", opened)
    if name_end < 0:
        return ToolCall("", {}, [f"<function= is not closed with '>': {_shown(block[opened:])}"], block)
    name = block[opened + len(FUNCTION_OPEN):name_end].strip()
    body_end = block.find(FUNCTION_CLOSE, name_end)
    if body_end < 0:
        if not closed:
            errors.append("the call is cut off (no </function> and no </tool_call>)")
        body_end = len(block)
    elif block[body_end + len(FUNCTION_CLOSE):].strip():
        errors.append(f"text after </function>: {_shown(block[body_end + len(FUNCTION_CLOSE):])}")
    if not name:
        errors.append("empty function name")
    raw_arguments = _parse_parameters(block[name_end + 1:body_end], errors)
    arguments: dict[str, Any] = dict(raw_arguments)
    if schemas is not None and name:
        if name not in schemas:
            errors.append(f"unknown tool {name!r}; available: {', '.join(sorted(schemas)) or 'none'}")
        else:
            arguments = _convert_arguments(raw_arguments, schemas[name], errors)
    return ToolCall(name, arguments, errors, block)


def _parse_parameters(body: str, errors: list[str]) -> dict[str, str]:
    values: dict[str, str] = {}
    position = 0
    while True:
        opened = body.find(PARAMETER_OPEN, position)
        gap = body[position:opened if opened >= 0 else len(body)]
        if gap.strip():
            errors.append(f"text outside <parameter=...> blocks: {_shown(gap)}")
        if opened < 0:
            return values
        name_end = body.find(">", opened)
        if name_end < 0:
            errors.append(f"<parameter= is not closed with '>': {_shown(body[opened:])}")
            return values
        name = body[opened + len(PARAMETER_OPEN):name_end].strip()
        value_start = name_end + 1
        closing = body.find(PARAMETER_CLOSE, value_start)
        following = body.find(PARAMETER_OPEN, value_start)
        if closing >= 0 and (following < 0 or closing < following):
            value_end, position = closing, closing + len(PARAMETER_CLOSE)
        else:  # missing </parameter>: the value ends at the next <parameter= or the end of the function
            value_end = following if following >= 0 else len(body)
            position = value_end
        value = body[value_start:value_end]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        if not name:
            errors.append("a <parameter=> has an empty name")
        elif name in values:
            errors.append(f"parameter {name!r} is given more than once")
        else:
            values[name] = value


def _convert_arguments(raw: dict[str, str], schema: dict[str, Any], errors: list[str]) -> dict[str, Any]:
    properties = schema.get("properties") or {}
    extra_allowed = schema.get("additionalProperties", not properties)
    arguments = {}
    for name, text in raw.items():
        if name not in properties:
            if not extra_allowed:
                errors.append(f"unknown parameter {name!r}; expected one of: {', '.join(properties)}")
                continue
            prop = extra_allowed if isinstance(extra_allowed, dict) else {}
        else:
            prop = properties[name]
        try:
            arguments[name] = convert_value(text, prop, root=schema)
        except ValueError as error:
            errors.append(f"parameter {name!r}: {error}")
    missing = [p for p in schema.get("required") or () if p not in raw]
    if missing:
        errors.append(f"missing required parameter{'s' if len(missing) > 1 else ''}: {', '.join(missing)}")
    return arguments


def convert_value(text: str, schema: Mapping[str, Any], *, root: Mapping[str, Any] | None = None) -> Any:
    """`text` as the Python value `schema` asks for; ValueError (with a readable message) when it cannot be."""
    types = _schema_types(schema, root or schema)
    stripped = text.strip()
    if "null" in types and stripped in ("null", "None"):
        return None
    kind = next((t for t in types if t != "null"), None)
    if kind is None:
        if types == ["null"]:
            if stripped in ("null", "None", ""):
                return None
            raise ValueError(f"expects null, got {_shown(text)}")
        return text
    if kind == "string":
        return text
    if kind == "integer":
        try:
            return int(stripped)
        except ValueError:
            pass
        try:
            number = float(stripped)
        except ValueError:
            raise ValueError(f"expects an integer, got {_shown(text)}") from None
        if math.isfinite(number) and number.is_integer():
            return int(number)
        raise ValueError(f"expects an integer, got {_shown(text)}")
    if kind == "number":
        try:
            number = int(stripped) if re.fullmatch(r"[+-]?\d+", stripped) else float(stripped)
        except ValueError:
            raise ValueError(f"expects a number, got {_shown(text)}") from None
        if not math.isfinite(number):
            raise ValueError(f"expects a finite number, got {_shown(text)}")
        return number
    if kind == "boolean":
        if stripped.lower() in ("true", "false"):
            return stripped.lower() == "true"
        raise ValueError(f"expects true or false, got {_shown(text)}")
    if kind in ("object", "array"):
        value = _structured(stripped)
        if kind == "object" and isinstance(value, dict):
            return value
        if kind == "array" and isinstance(value, (list, tuple)):
            return list(value)
        raise ValueError(f"expects an {kind} (JSON or a Python literal), got {_shown(text)}")
    return text  # an unknown type name: leave the value to the tool's own validation


_NOT_PARSED = object()


def _structured(text: str) -> Any:
    try:
        return json.loads(text)
    except Exception:  # noqa: BLE001 (RecursionError on deep nesting, ValueError, ...)
        pass
    try:
        return ast.literal_eval(text)
    except Exception:  # noqa: BLE001 (SyntaxError, MemoryError, RecursionError, ValueError, ...)
        return _NOT_PARSED


def _schema_types(schema: Mapping[str, Any], root: Mapping[str, Any], depth: int = 0) -> list[str]:
    """The schema's types in preference order ("null" included where allowed), following `$ref` and unions."""
    if depth > 16 or not isinstance(schema, Mapping):
        return []
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for key in ref[2:].split("/"):
            target = target.get(key, {}) if isinstance(target, Mapping) else {}
        return _schema_types(target, root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    for union in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(union), list):
            return [t for branch in schema[union] for t in _schema_types(branch, root, depth + 1)]
    if "properties" in schema:
        return ["object"]
    return []


def _strip_stop_tokens(text: str) -> str:
    while True:
        trimmed = text.rstrip()
        for stop in (IM_END, ENDOFTEXT):
            if trimmed.endswith(stop):
                text = trimmed[:-len(stop)]
                break
        else:
            return text


def _shown(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN] + "...")
