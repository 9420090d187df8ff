"""External MCP servers from configuration: the same `MCPToolbox`, over stdio or streamable HTTP.

    {"transport": "stdio", "command": "python", "args": ["-m", "my_server"], "env": {...}, "cwd": "..."}
    {"transport": "streamable_http", "url": "http://localhost:8000/mcp"}     # "http" is accepted too

Optional limits in the same mapping (or as keyword arguments, which win): `call_timeout_s` (30: one tool call),
`connect_timeout_s` (30: connect + initialize, and tools/list; past it `MCPConnectTimeout`), `max_result_chars`
(32768: longer results are cut with a note; null for no cap). See `mcp_adapter.py` for what a dead or hung server
does to an episode.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mcp import StdioServerParameters

from mercury_jax.envs.mcp_adapter import DEFAULT_MAX_RESULT_CHARS, MCPToolbox

_UNSET = object()


def external_server(config: Mapping[str, Any]) -> Any:
    """What `mcp.Client` connects to for `config`: `StdioServerParameters` or a URL string."""
    transport = config.get("transport", "stdio" if "command" in config else "streamable_http")
    if transport == "stdio":

        if not config.get("command"):
            raise ValueError(f"stdio MCP server config {dict(config)!r} needs a 'command'")
        return StdioServerParameters(command=config["command"], args=list(config.get("args", ())),
                                     env=dict(config["env"]) if config.get("env") else None,
                                     cwd=config.get("cwd"))
    if transport in ("streamable_http", "http"):
        url = config.get("url")
        if not url or not str(url).startswith(("http://", "https://")):
            raise ValueError(f"streamable-HTTP MCP server config needs an http(s) 'url', got {url!r}")
        return str(url)
    raise ValueError(f"unknown MCP transport {transport!r}; use 'stdio' or 'streamable_http'")


def connect_external(config: Mapping[str, Any], *, call_timeout_s: float | None = None,
                     connect_timeout_s: float | None = None, max_result_chars: Any = _UNSET) -> MCPToolbox:
    """An (unopened) toolbox on the external server of `config`; open it with `async with` (raises
    `MCPConnectTimeout` / `MCPConnectError` when the server does not come up)."""
    def pick(value, key, default):
        return value if value is not None else float(config.get(key, default))

    cap = config.get("max_result_chars", DEFAULT_MAX_RESULT_CHARS) if max_result_chars is _UNSET else max_result_chars
    return MCPToolbox(external_server(config), call_timeout_s=pick(call_timeout_s, "call_timeout_s", 30.0),
                      connect_timeout_s=pick(connect_timeout_s, "connect_timeout_s", 30.0),
                      max_result_chars=None if cap is None else int(cap))
