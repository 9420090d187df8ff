"""Tools behind MCP: mount async Python tools on an in-process MCP server (official `mcp` SDK 2.x), list them
as OpenAI-style schemas for rendering, and turn parsed tool calls into observation text.

One `MCPToolbox` per episode (docs/ENVIRONMENTS.md section 1: never reuse a server or a state across episodes):

    async with MCPToolbox(build_server([search_tickets, update_ticket])) as toolbox:
        tools = await toolbox.list_tools()            # for render(messages, tools)
        turn = parse_assistant(text, tools)
        observations = await toolbox.call_all(turn.tool_calls)

Observation text: the tool's text content; a `ToolError` raised by the tool reaches the agent as the SDK's
"Error executing tool NAME: message"; any other exception only as "Error executing tool NAME" (the SDK hides
it). A call that failed to parse is not executed: its `error_message()` is the observation. A call that runs
past `call_timeout_s` is abandoned with a timeout error. An external server (stdio or streamable HTTP) is
mounted the same way: `MCPToolbox(external_server(config))` (see `mcp_external.py`).

Misbehaving servers (every limit is a constructor argument):
- opening (connect + `initialize`) and `tools/list` must answer within `connect_timeout_s`, else
  `MCPConnectTimeout`; any other failure to open or list raises `MCPConnectError` (both name the server and a fix);
- a call that times out, or a transport failure (the connection closed, a broken pipe, a malformed reply), sets
  the observation's `failure`: the environment, not the model, spoiled that call, and the episode runner marks the
  trajectory (`Trajectory.env_failure`) so it is not trained on. After the connection is lost the server is dead:
  later calls are not attempted (`executed=False`, `failure` set) instead of each waiting for its own error;
- a result longer than `max_result_chars` (default `DEFAULT_MAX_RESULT_CHARS`) is cut, with a note saying how long
  it was. The cap bounds what reaches the agent and the tokenizer; the transport still carries the whole result
  (over stdio the SDK reads and parses an 8 MiB line in seconds), so keep servers' results small at the source;
- a tool given as a plain `def` runs in a bounded pool of daemon threads (`tool_threads.py`) so the event loop
  and the call timeout keep working while it blocks; an abandoned (timed-out) thread runs on until it returns.
  An `async def` tool runs on the event loop and must not block it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import jsonschema  # noqa: F401 (the SDK imports it on the first structured result: 0.2 s on the event loop)
from mcp import Client
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError

from mercury_jax.chat.parse import ToolCall
from mercury_jax.envs.tool_threads import TOOL_THREADS, ToolThreads

DEFAULT_MAX_RESULT_CHARS = 32_768  # about 8k tokens: an observation past this is a server bug, not information
_CONNECTION_CLOSED = -32000  # mcp_types.CONNECTION_CLOSED: the MCPError code when the transport ended
_REQUEST_TIMEOUT = -32001  # mcp_types.REQUEST_TIMEOUT: the SDK's own read timeout fired


class MCPConnectError(RuntimeError):
    """The MCP server could not be opened or could not list its tools."""


class MCPConnectTimeout(MCPConnectError, TimeoutError):
    """The MCP server did not finish `initialize` or `tools/list` within the connect timeout."""


@dataclass(frozen=True)
class ToolObservation:
    """What one call produced for the agent: `text`, whether it is an error, whether the tool ran at all, and
    `failure`: why the environment (not the model) spoiled the call (a timeout, a lost connection), else None."""
    name: str
    text: str
    is_error: bool
    executed: bool
    failure: str | None = None


def build_server(tools: Sequence[Callable[..., Any]] | Mapping[str, Callable[..., Any]], *,
                 name: str = "mercury-tools", instructions: str | None = None, threads: ToolThreads | None = None):
    """A fresh in-process `MCPServer` with `tools` (named by function name, or by the mapping's keys).

    Each tool has type hints and a docstring: the SDK derives the input schema from the signature and the
    description from the docstring. An `async def` tool runs on the event loop (it must not block); a plain `def`
    tool runs in `threads` (default: the process-wide `TOOL_THREADS`), so a blocking tool cannot stall other
    episodes and the caller's timeout still fires. Raise `mcp.server.mcpserver.exceptions.ToolError` for errors
    the agent should read.
    """

    server = MCPServer(name, instructions=instructions, warn_on_duplicate_tools=False, log_level="WARNING")
    items = tools.items() if isinstance(tools, Mapping) else ((fn.__name__, fn) for fn in tools)
    seen = set()
    for tool_name, fn in items:
        if tool_name in seen:
            raise ValueError(f"two tools are named {tool_name!r}; tool names must be unique on one server")
        if not callable(fn):
            raise TypeError(f"tool {tool_name!r} is a {type(fn).__name__}, not a function")
        seen.add(tool_name)
        server.add_tool(fn if inspect.iscoroutinefunction(fn) else _in_threads(fn, threads or TOOL_THREADS),
                        name=tool_name)
    return server


def _in_threads(fn: Callable[..., Any], threads: ToolThreads) -> Callable[..., Any]:
    """An `async def` with `fn`'s signature and docstring that runs `fn` in `threads`."""
    @functools.wraps(fn)
    async def run_in_thread(**arguments):
        return await threads.run(fn, **arguments)
    return run_in_thread


class MCPToolbox:
    """An MCP client session on one server (an `MCPServer`, a `StdioServerParameters`, or a streamable-HTTP URL).

    `call_timeout_s`: per call; `connect_timeout_s`: opening (connect + initialize) and listing the tools;
    `close_timeout_s`: how long closing waits for the transport to wind down before abandoning it;
    `max_result_chars`: the cap on one observation's text (None: uncapped).
    """

    def __init__(self, server: Any, *, call_timeout_s: float = 30.0, connect_timeout_s: float = 30.0,
                 close_timeout_s: float = 10.0, max_result_chars: int | None = DEFAULT_MAX_RESULT_CHARS):
        for label, value in (("call_timeout_s", call_timeout_s), ("connect_timeout_s", connect_timeout_s),
                             ("close_timeout_s", close_timeout_s)):
            if not value > 0:
                raise ValueError(f"MCPToolbox {label} must be a positive number of seconds, got {value!r}")
        if max_result_chars is not None and max_result_chars < 1:
            raise ValueError(f"max_result_chars must be >= 1 (or None for no cap), got {max_result_chars!r}")
        self.server = server
        self.call_timeout_s, self.connect_timeout_s = call_timeout_s, connect_timeout_s
        self.close_timeout_s, self.max_result_chars = close_timeout_s, max_result_chars
        self.dead: str | None = None  # why the connection is gone, once it is
        self._client = None
        self._holder: asyncio.Task | None = None
        self._scope = None
        self._tools: list[dict[str, Any]] | None = None

    async def __aenter__(self) -> MCPToolbox:
        """Connect and initialize within `connect_timeout_s`. The client lives in its own task (`_hold`): its
        task groups must outlive this call, so no cancel scope of ours can wrap the connect here."""

        ready = asyncio.get_running_loop().create_future()
        self._scope, self.dead = anyio.CancelScope(), None
        self._holder = asyncio.ensure_future(self._hold(ready))
        try:
            done, _ = await asyncio.wait({self._holder, ready}, timeout=self.connect_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            await self._close()
            raise
        if ready.done():
            self._client = ready.result()
            return self
        error = _leaf(self._holder.exception()) if self._holder.done() else None
        await self._close()
        if error is not None:
            raise MCPConnectError(f"could not open MCP server {describe_server(self.server)}: "
                                  f"{type(error).__name__}: {error}; check its command / URL and that it speaks "
                                  f"MCP") from error
        raise MCPConnectTimeout(f"MCP server {describe_server(self.server)} did not finish connecting "
                                f"(initialize) within {self.connect_timeout_s:g} s; check that it starts and "
                                f"answers, or raise connect_timeout_s")

    async def __aexit__(self, *exc_info) -> None:
        await self._close()

    async def list_tools(self) -> list[dict[str, Any]]:
        """OpenAI-style function schemas of the server's tools, sorted by name (stable prompt text). Raises
        `MCPConnectTimeout` when `tools/list` takes longer than `connect_timeout_s`, `MCPConnectError` when it
        fails."""

        if self._tools is None:
            session, tools, cursor = self._session(), [], None
            try:
                with anyio.fail_after(self.connect_timeout_s):
                    while True:
                        page = await session.list_tools(cursor=cursor) if cursor else await session.list_tools()
                        tools += page.tools
                        cursor = getattr(page, "next_cursor", None)
                        if not cursor:
                            break
            except TimeoutError:
                raise MCPConnectTimeout(f"MCP server {describe_server(self.server)} did not answer tools/list "
                                        f"within {self.connect_timeout_s:g} s; check the server, or raise "
                                        f"connect_timeout_s") from None
            except Exception as error:  # noqa: BLE001 (any failure to list: the episode cannot start)
                if _is_transport_failure(error):
                    self.dead = f"{type(error).__name__}: {error}"
                raise MCPConnectError(f"MCP server {describe_server(self.server)} failed tools/list: "
                                      f"{type(error).__name__}: {error}") from error
            self._tools = [openai_schema(t.name, t.description, t.input_schema)
                           for t in sorted(tools, key=lambda t: t.name)]
        return self._tools

    async def call(self, call: ToolCall) -> ToolObservation:
        """Execute one parsed call (unless it has errors or the server is dead) and return its observation; never
        raises for tool failures, timeouts, protocol or transport errors."""

        if not call.ok:
            return ToolObservation(call.name, call.error_message(), is_error=True, executed=False)
        session = self._session()
        if self.dead is not None:
            return ToolObservation(call.name, f"Error: tool {call.name!r} is unavailable (its server is gone)",
                                   is_error=True, executed=False, failure=f"server gone: {self.dead}")
        try:
            with anyio.fail_after(self.call_timeout_s):
                result = await session.call_tool(call.name, call.arguments)
        except TimeoutError:
            return ToolObservation(call.name, f"Error: tool {call.name!r} did not answer within "
                                   f"{self.call_timeout_s:g} s", is_error=True, executed=True,
                                   failure=f"tool {call.name!r} timed out after {self.call_timeout_s:g} s")
        except Exception as error:  # noqa: BLE001 (protocol errors from the server become observations)
            observation = ToolObservation(call.name, f"Error calling tool {call.name!r}: {error}", is_error=True,
                                          executed=True)
            if _is_transport_failure(error):
                self.dead = f"{type(error).__name__}: {error}"
                return dataclasses.replace(observation, failure=f"transport: {self.dead}")
            if not _is_server_answer(error):  # e.g. a reply that does not parse
                return dataclasses.replace(observation, failure=f"bad reply: {type(error).__name__}: {error}")
            return observation
        return ToolObservation(call.name, cap_text(result_text(result), self.max_result_chars),
                               is_error=bool(result.is_error), executed=True)

    async def call_all(self, calls: Sequence[ToolCall]) -> list[ToolObservation]:
        """Each call in order (later calls may depend on the effects of earlier ones)."""
        return [await self.call(c) for c in calls]

    def _session(self):
        if self._client is None:
            raise RuntimeError("MCPToolbox is not open: use `async with MCPToolbox(server) as toolbox:`")
        return self._client

    async def _hold(self, ready: asyncio.Future) -> None:
        """The client's whole life in one task: open, hand the client over, wait to be cancelled, close."""
        with self._scope:
            async with Client(self.server) as client:
                if not ready.done():
                    ready.set_result(client)
                await anyio.sleep_forever()

    async def _close(self) -> None:
        """Cancel the holder's scope (the transport winds down, shielded, e.g. the stdio server is stopped) and
        wait up to `close_timeout_s` for it; then abandon it."""
        holder, self._holder, self._client = self._holder, None, None
        if holder is None:
            return
        self._scope.cancel()
        done, _ = await asyncio.wait({holder}, timeout=self.close_timeout_s)
        if not done:
            holder.cancel()
            await asyncio.wait({holder}, timeout=1.0)
        if holder.done() and not holder.cancelled():
            holder.exception()  # retrieved: a transport that failed while closing is not the caller's error


def openai_schema(name: str, description: str | None, input_schema: Mapping[str, Any] | None) -> dict[str, Any]:
    """An MCP tool as an OpenAI-style function schema, without pydantic's `title` noise."""
    function: dict[str, Any] = {"name": name}
    if description:
        function["description"] = description.strip()
    function["parameters"] = _without_titles(dict(input_schema or {"type": "object", "properties": {}}))
    return {"type": "function", "function": function}


def describe_server(server: Any) -> str:
    """A short name for error messages: the command line, the URL, or the in-process server's name."""
    if isinstance(server, str):
        return server
    if hasattr(server, "command"):
        return " ".join([server.command, *getattr(server, "args", ())])
    return repr(getattr(server, "name", None) or type(server).__name__)


def cap_text(text: str, max_chars: int | None) -> str:
    """`text` cut to its first `max_chars` characters, with a note saying so (None: no cap)."""
    if max_chars is None or len(text) <= max_chars:
        return text
    return (text[:max_chars] + f"\n[truncated: the tool result has {len(text):,} characters; only the first "
            f"{max_chars:,} are shown. Ask for less, e.g. a narrower query or fewer lines.]")


def result_text(result: Any) -> str:
    """The text of a `CallToolResult`: its text blocks joined; other blocks named; structured content as JSON
    when there is no text."""
    parts = []
    for block in result.content or ():
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource" and hasattr(block.resource, "text"):
            parts.append(block.resource.text)
        elif kind == "resource_link":
            parts.append(f"[resource {block.uri}]")
        else:
            parts.append(f"[{kind or 'unknown'} content: {getattr(block, 'mime_type', '')}]".replace(": ]", "]"))
    if not parts and getattr(result, "structured_content", None) is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


def _leaf(error: BaseException | None) -> BaseException | None:
    """The first innermost exception of (nested) exception groups: what actually went wrong."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


def _is_transport_failure(error: BaseException) -> bool:
    """The connection is gone: closed (the SDK's `MCPError` with code CONNECTION_CLOSED), a closed or broken
    stream, an OS error."""

    if isinstance(error, MCPError):
        return error.code == _CONNECTION_CLOSED
    return isinstance(error, (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, OSError))


def _is_server_answer(error: BaseException) -> bool:
    """The server answered with a JSON-RPC error (unknown tool, bad parameters): an ordinary observation. Not the
    SDK's own read timeout (REQUEST_TIMEOUT), which means no answer came."""

    return isinstance(error, MCPError) and error.code not in (_CONNECTION_CLOSED, _REQUEST_TIMEOUT)


def _without_titles(schema: Any, *, in_names: bool = False) -> Any:
    """Drop schema `title`s (kept where "title" is a property name, inside `properties` / `$defs`)."""
    if isinstance(schema, dict):
        if in_names:
            return {k: _without_titles(v) for k, v in schema.items()}
        return {k: _without_titles(v, in_names=k in ("properties", "$defs", "definitions", "patternProperties"))
                for k, v in schema.items() if not (k == "title" and isinstance(v, str))}
    if isinstance(schema, list):
        return [_without_titles(v) for v in schema]
    return schema
