"""Parse a generated Qwen3.5 assistant turn into reasoning, content and tool calls (docs/MODEL.md section 6).

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
  Call syntax in the content, outside any `<tool_call>` (`<function=`, `</function>`, `<parameter=`,
  `</parameter>`, a `</tool_call>` that no `<tool_call>` opened), is an error of the turn and is not executed.
- **A call** is `<function=NAME>` then `<parameter=ARG>VALUE</parameter>` blocks then `</function>`. A missing
  `</parameter>` is tolerated (the value ends at the next `<parameter=`, `</function>` or the block's end); a
  missing `</tool_call>` is tolerated when `</function>` is present, otherwise the call is cut off (an error).
  One leading and one trailing newline are stripped from each value.
- **Values** are converted by the tool's JSON schema (`tools`: OpenAI-style or bare function schemas, or MCP
  `inputSchema`s). What the format allows is what the chat template writes (`render.format_argument`): a
  `string` parameter's raw text is the string, as written; objects and arrays are JSON; other values are
  `str()` of the Python value, so booleans and null may be JSON or Python spelled. Accepted, nothing else:
  `integer`: a JSON number with an integral value (`4`, `-3`, `4.0`, `1e3`; `4.5` is an error, never
  truncated; no `+5`, `1_000` or non-ASCII digits); `number`: a finite JSON number (int when written without
  fraction or exponent); `boolean`: `true`/`True`/`false`/`False`; `null`: `null`/`None`; `object`/`array`:
  strict JSON (no Python literals such as `{'a': 1}` or `(1,)`, no NaN/Infinity, no number that overflows to
  infinity, no unpaired surrogate escape), so every parsed value survives `json.dumps(..., allow_nan=False)`
  and re-rendering. A nullable schema (`"type": [..., "null"]`, or `anyOf`/`oneOf` with a null branch) takes
  `null`/`None` as None and otherwise converts by its first non-null type. With no type (or no `tools`), the
  value stays a string.
- **Call errors**: unknown tool, unknown parameter (unless `additionalProperties` allows it), repeated
  parameter, missing required parameter, unconvertible value, stray text inside the block, cut-off call.
  A call with errors is **not executed**; its `error_message()` is the observation the agent gets instead.
  `AssistantTurn.errors` lists the turn's errors and every call's (prefixed with the call), for metrics.
- **Limits**: at most `MAX_CALLS_PER_TURN` (128) `<tool_call>` blocks per turn and `MAX_PARAMETERS_PER_CALL` (128)
  `<parameter=` blocks per call are read; more is an error (of the turn: the rest of the reply is not read; of
  the call: it is not executed).
- **Cost** is linear in the length of the text, with a small constant: every scan moves forward (a search for a
  closer is reused until the position passes it; re-searching per opener made 1 MB of unclosed `<tool_call>`
  take over a minute), and the limits bound the per-block Python work, so 100,000 `<tool_call>`s or a call body
  of 60,000 `<parameter=q>`s parse in milliseconds.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from mercury_jax.chat.special_tokens import ENDOFTEXT, IM_END, THINK, THINK_END, TOOL_CALL, TOOL_CALL_END

FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
STRAY_IN_CONTENT = (FUNCTION_OPEN, FUNCTION_CLOSE, PARAMETER_OPEN, PARAMETER_CLOSE, TOOL_CALL_END)
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")  # [0-9]: \d takes any digit
MAX_CALLS_PER_TURN = 128
MAX_PARAMETERS_PER_CALL = 128
_MAX_INT_DIGITS = 4300  # Python's int <-> str limit
_MAX_SHOWN = 80  # characters of a bad value quoted in an error
_STOP_SUFFIX_REVERSED = re.compile("(?:\\s*(?:" + "|".join(re.escape(t[::-1]) for t in (IM_END, ENDOFTEXT)) + "))+")


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
    for marker in STRAY_IN_CONTENT[1:]:
        if marker in content:
            errors.append(f"stray {marker} in the content, outside any <tool_call> block: call syntax belongs "
                          f"inside <tool_call>...</tool_call>; write plain text otherwise")
    schemas = tool_schemas(tools) if tools is not None else None
    calls: list[ToolCall] = []
    end = -2  # the next </tool_call> at or after the current block's body; -2: not searched yet
    while start >= 0:
        if len(calls) == MAX_CALLS_PER_TURN:
            errors.append(f"more than {MAX_CALLS_PER_TURN} <tool_call> blocks in one turn: only the first "
                          f"{MAX_CALLS_PER_TURN} are read; make fewer calls per turn")
            break
        body_start = start + len(TOOL_CALL)
        if end == -2 or 0 <= end < body_start:
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
    for number, call in enumerate(calls, 1):
        if call.errors:
            label = f"tool call {number} ({call.name or '?'}): "
            for error in call.errors:
                errors.append(label + error)
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
        shown = "''" if not block or block.isspace() else _shown(block)
        return ToolCall("", {}, [f"no <function=NAME> inside <tool_call>: {shown}"], block)
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
    repeated: set[str] = set()
    blocks, position, closing = 0, 0, -2  # closing: the next </parameter> at or after the value; -2: not searched yet
    while True:
        opened = body.find(PARAMETER_OPEN, position)
        gap = body[position:opened if opened >= 0 else len(body)]
        if gap.strip():
            errors.append(f"text outside <parameter=...> blocks: {_shown(gap)}")
        if opened < 0:
            return values
        if blocks == MAX_PARAMETERS_PER_CALL:
            errors.append(f"more than {MAX_PARAMETERS_PER_CALL} <parameter=...> blocks: only the first "
                          f"{MAX_PARAMETERS_PER_CALL} are read; give each parameter once")
            return values
        blocks += 1
        name_end = body.find(">", opened)
        if name_end < 0:
            errors.append(f"<parameter= is not closed with '>': {_shown(body[opened:])}")
            return values
        name = body[opened + len(PARAMETER_OPEN):name_end].strip()
        value_start = name_end + 1
        if closing == -2 or 0 <= closing < value_start:
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
            if name not in repeated:  # one error per name
                repeated.add(name)
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
        return _integer(stripped, text)
    if kind == "number":
        number = _json_number(stripped)
        if number is None or not math.isfinite(number):
            raise ValueError(f"expects a finite number (JSON, e.g. 2.5), got {_shown(text)}")
        return number
    if kind == "boolean":
        if stripped in ("true", "True", "false", "False"):
            return stripped.lower() == "true"
        raise ValueError(f"expects true or false, got {_shown(text)}")
    if kind in ("object", "array"):
        value, problem = _strict_json(stripped)
        expected = dict if kind == "object" else list
        if problem is None and not isinstance(value, expected):
            problem = f"that is {_json_kind(value)}"
        if problem is None:
            return value
        example = '{"key": "value"}' if kind == "object" else '["a", 1]'
        raise ValueError(f"expects an {kind} written as strict JSON (e.g. {example}; double-quoted strings, "
                         f"true/false/null), got {_shown(text)}: {problem}")
    return text  # an unknown type name: leave the value to the tool's own validation


def _integer(stripped: str, text: str) -> int:
    """A JSON number with an integral value (JSON Schema's integer: 4.0 and 1e3 are integers), exactly."""
    found = _JSON_NUMBER.fullmatch(stripped)
    if found is None:
        raise ValueError(f"expects an integer (JSON, e.g. 4), got {_shown(text)}")
    if not (found.group(1) or found.group(2)):
        if len(stripped.lstrip("-")) > _MAX_INT_DIGITS:
            raise ValueError(f"expects an integer of at most {_MAX_INT_DIGITS} digits, got {_shown(text)}")
        return int(stripped)
    exact = Decimal(stripped)  # exact: float("1.0000000000000001") would be 1.0 and pass as an integer
    if exact != exact.to_integral_value():
        raise ValueError(f"expects an integer, got {_shown(text)}, which has a fractional part (it is not "
                         f"rounded or truncated: write a whole number)")
    if exact.adjusted() >= _MAX_INT_DIGITS:
        raise ValueError(f"expects an integer of at most {_MAX_INT_DIGITS} digits, got {_shown(text)}")
    return int(exact)


def _json_number(stripped: str) -> int | float | None:
    """A JSON number: int when written without fraction or exponent, else float (may overflow to inf); None
    when `stripped` is not one."""
    found = _JSON_NUMBER.fullmatch(stripped)
    if found is None:
        return None
    if found.group(1) or found.group(2):
        return float(stripped)
    return int(stripped) if len(stripped.lstrip("-")) <= _MAX_INT_DIGITS else None


def _strict_json(text: str) -> tuple[Any, str | None]:
    """(value, None) for strict JSON whose every number is finite and every string valid Unicode (so it dumps
    with `allow_nan=False` and encodes as UTF-8); (None, what is wrong) otherwise."""
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        return None, "nested too deeply"
    except ValueError as error:  # JSONDecodeError, a NaN/Infinity, an int beyond the digit limit
        return None, str(error)
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack += item.keys()
            stack += item.values()
        elif isinstance(item, list):
            stack += item
        elif isinstance(item, float) and not math.isfinite(item):
            return None, "a number overflows to infinity"
        elif isinstance(item, str) and not _valid_unicode(item):
            return None, "a string holds an unpaired surrogate escape (\\ud800-\\udfff)"
    return value, None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number; write a finite number or null")


def _valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _json_kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


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
    """`text` without its trailing stop tokens (each with the blanks after it); blanks before them are kept.
    One anchored match on the reversed text: stripping one token at a time copied the text per token."""
    stripped = text.rstrip()
    if not stripped.endswith((IM_END, ENDOFTEXT)):
        return text
    found = _STOP_SUFFIX_REVERSED.match(stripped[::-1])
    return stripped[:len(stripped) - found.end()]


def _shown(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN] + "...")
