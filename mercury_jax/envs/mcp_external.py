"""External MCP servers from configuration: the same `MCPToolbox`, over stdio or streamable HTTP.

    {"transport": "stdio", "command": "python", "args": ["-m", "my_server"], "env": {...}, "cwd": "..."}
    {"transport": "streamable_http", "url": "http://localhost:8000/mcp"}     # "http" is accepted too
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mercury_jax.envs.mcp_adapter import MCPToolbox


def external_server(config: Mapping[str, Any]) -> Any:
    """What `mcp.Client` connects to for `config`: `StdioServerParameters` or a URL string."""
    transport = config.get("transport", "stdio" if "command" in config else "streamable_http")
    if transport == "stdio":
        from mcp import StdioServerParameters

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


def connect_external(config: Mapping[str, Any], *, call_timeout_s: float | None = None) -> MCPToolbox:
    """An (unopened) toolbox on the external server of `config`; open it with `async with`."""
    timeout = call_timeout_s if call_timeout_s is not None else float(config.get("call_timeout_s", 30.0))
    return MCPToolbox(external_server(config), call_timeout_s=timeout)
