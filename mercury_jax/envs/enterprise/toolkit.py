"""Shared pieces of the enterprise tool surfaces: lookups with helpful errors, text search, compact JSON,
a synchronous driver so scripted code (oracle, tests) runs the same async tools without an event loop, and
`blocking(tool)`: the same tool as a plain function, which the MCP adapter runs in a thread (episodes mount every
world tool that way, so a search over a large world never stalls the event loop other episodes share).

Every tool returns compact JSON text (the exact observation the agent reads through MCP) and raises `ToolError`
with a message that names the problem and the fix ("no ticket 'T-9'; ticket ids look like T-123, find them with
search_tickets"). Searches match every word of `query` case-insensitively against the record's text fields.
"""
from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable
from typing import Any

from mcp.server.mcpserver.exceptions import ToolError

__all__ = ["ToolError", "dumps", "get_record", "matches", "call_sync", "blocking", "error_text", "check_date",
           "check_datetime", "person_by_email"]


def dumps(value: Any) -> str:
    """Compact, stable JSON (the observation text)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def get_record(db: dict, collection: str, record_id: str, *, noun: str, prefix: str, finder: str) -> dict:
    """The record or a ToolError saying what ids look like and which tool finds them."""
    record = db[collection].get(str(record_id).strip())
    if record is None:
        raise ToolError(f"no {noun} {record_id!r}; {noun} ids look like {prefix}-123, find them with {finder}")
    return record


def matches(record: dict, query: str | None, fields: Iterable[str]) -> bool:
    """True when every word of `query` occurs in one of `fields` (case-insensitive); an empty query matches."""
    if not query or not query.strip():
        return True
    text = " ".join(str(record.get(f, "")) for f in fields).lower()
    return all(word in text for word in re.findall(r"[\w@.-]+", query.lower()))


def check_date(value: str, name: str) -> str:
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", value or ""):
        raise ToolError(f"{name} must be a date like 2026-03-14 (YYYY-MM-DD), got {value!r}")
    return value


def check_datetime(value: str, name: str) -> str:
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}", value or ""):
        raise ToolError(f"{name} must be a date and time like 2026-03-14T15:00 (YYYY-MM-DDTHH:MM), got {value!r}")
    return value


def person_by_email(db: dict, email: str) -> dict | None:
    email = email.strip().lower()
    return next((p for p in db["people"].values() if p["email"] == email), None)


def call_sync(tool: Callable[..., Any], arguments: dict[str, Any]) -> tuple[str, bool]:
    """Run one async tool to completion without an event loop (the tools never await): (text, is_error).

    Error text matches what the agent reads through MCP: "Error executing tool NAME: message".
    """
    coroutine = tool(**arguments)
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value, False
    except ToolError as error:
        return error_text(tool.__name__, str(error)), True
    coroutine.close()
    raise RuntimeError(f"tool {tool.__name__!r} awaited something; enterprise tools must not await")


def blocking(tool: Callable[..., Any]) -> Callable[..., Any]:
    """`tool` (an `async def` that never awaits) as a plain function with its signature, name and docstring (so
    its MCP schema is unchanged): `build_server` runs plain functions in its thread pool instead of on the loop.
    Returns the tool's value; a `ToolError` propagates (the server turns it into the agent's error text)."""
    @functools.wraps(tool)
    def run(**arguments):
        coroutine = tool(**arguments)
        try:
            coroutine.send(None)
        except StopIteration as done:
            return done.value
        coroutine.close()
        raise RuntimeError(f"tool {tool.__name__!r} awaited something; world tools must not await (they run "
                           f"in a thread through `blocking`)")
    return run


def error_text(tool_name: str, message: str) -> str:
    return f"Error executing tool {tool_name}: {message}"
