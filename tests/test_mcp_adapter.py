"""MCP adapter: async tools on an in-process MCP server, schemas for rendering, calls -> observation text
(results, ToolErrors visible, other exceptions hidden, timeouts, malformed calls not executed), external servers."""
import asyncio
import sys
import textwrap

import pytest
from mcp.server.mcpserver.exceptions import ToolError

from mercury_jax.chat import parse_assistant, render
from mercury_jax.envs import MCPToolbox, build_server, connect_external, external_server

CALLS: list[str] = []


async def search_tickets(query: str, limit: int = 5, status: str | None = None) -> list[dict]:
    """Search tickets by text."""
    CALLS.append("search_tickets")
    return [{"id": 42, "title": f"{query} ({status})", "limit": limit}]


async def close_ticket(ticket_id: int, note: str = "") -> str:
    """Close a ticket."""
    CALLS.append("close_ticket")
    if ticket_id != 42:
        raise ToolError(f"no ticket {ticket_id}; search first")
    return f"ticket {ticket_id} closed{': ' + note if note else ''}"


async def crash(title: str) -> str:
    """Always fails with a hidden internal error."""
    raise RuntimeError("database password is hunter2")


async def sleepy() -> str:
    """Takes too long."""
    await asyncio.sleep(30)
    return "late"


def run(coro):
    return asyncio.run(coro)


def calls_of(text, tools):
    return parse_assistant(text, tools).tool_calls


def call_text(name, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_tools_listed_as_sorted_openai_schemas():
    async def main():
        async with MCPToolbox(build_server([sleepy, search_tickets, close_ticket, crash])) as toolbox:
            return await toolbox.list_tools()
    tools = run(main())
    assert [t["function"]["name"] for t in tools] == ["close_ticket", "crash", "search_tickets", "sleepy"]
    search = tools[2]
    assert search["type"] == "function" and search["function"]["description"] == "Search tickets by text."
    params = search["function"]["parameters"]
    assert params["required"] == ["query"] and "title" not in params
    assert params["properties"]["limit"] == {"default": 5, "type": "integer"}
    assert params["properties"]["status"]["anyOf"] == [{"type": "string"}, {"type": "null"}]
    assert "<tools>" in render([{"role": "user", "content": "hi"}], tools)


def test_calls_become_observations():
    CALLS.clear()

    async def main():
        async with MCPToolbox(build_server([search_tickets, close_ticket, crash, sleepy]),
                              call_timeout_s=0.5) as toolbox:
            tools = await toolbox.list_tools()
            text = "".join([
                call_text("search_tickets", query="printer", status="None"),
                call_text("close_ticket", ticket_id="42", note="fixed"),
                call_text("close_ticket", ticket_id="7"),
                call_text("crash", title="x"),
                call_text("sleepy"),
                call_text("close_ticket", ticket_id="forty-two"),
                call_text("no_such_tool"),
                call_text("search_tickets", query="after timeout"),
            ])
            return await toolbox.call_all(calls_of(text, tools))
    found, closed, missing, crashed, slow, malformed, unknown, after = run(main())
    assert not found.is_error and '"title": "printer (None)"' in found.text and '"id": 42' in found.text
    assert (closed.text, closed.is_error) == ("ticket 42 closed: fixed", False)
    assert missing.is_error and "no ticket 7; search first" in missing.text  # ToolError reaches the agent
    assert crashed.is_error and "crash" in crashed.text and "hunter2" not in crashed.text
    assert slow.is_error and "did not answer within 0.5 s" in slow.text
    assert not malformed.executed and "expects an integer" in malformed.text
    assert not unknown.executed and "unknown tool 'no_such_tool'" in unknown.text
    assert not after.is_error and "after timeout" in after.text  # the session survives a timeout
    assert CALLS == ["search_tickets", "close_ticket", "close_ticket", "search_tickets"]


def test_server_side_unknown_tool_without_local_schemas():
    async def main():
        async with MCPToolbox(build_server([search_tickets])) as toolbox:
            return await toolbox.call(calls_of(call_text("nope", a="1"), None)[0])
    observation = run(main())
    assert observation.is_error and observation.executed and "nope" in observation.text


def test_build_server_rejects_duplicate_and_non_callable_tools():
    with pytest.raises(ValueError, match="unique"):
        build_server([search_tickets, search_tickets])
    with pytest.raises(TypeError, match="not a function"):
        build_server({"x": "not callable"})


def test_sync_tools_run_in_threads_with_the_same_schema():
    import threading

    loop_thread = []

    def add(a: int, b: int = 2) -> str:
        """Add two integers."""
        loop_thread.append(threading.current_thread() is threading.main_thread())
        if a < 0:
            raise ToolError("a must be >= 0")
        return str(a + b)

    async def main():
        async with MCPToolbox(build_server([add])) as toolbox:
            tools = await toolbox.list_tools()
            return tools, await toolbox.call_all(calls_of(call_text("add", a="3") + call_text("add", a="-1"), tools))
    tools, (ok, refused) = run(main())
    assert tools[0]["function"]["description"] == "Add two integers."
    assert tools[0]["function"]["parameters"]["properties"]["b"] == {"default": 2, "type": "integer"}
    assert (ok.text, ok.is_error, ok.failure) == ("5", False, None)
    assert refused.is_error and "a must be >= 0" in refused.text and refused.failure is None
    assert loop_thread == [False, False]  # never on the event loop's (main) thread


def test_toolbox_must_be_opened():
    with pytest.raises(RuntimeError, match="not open"):
        run(MCPToolbox(build_server([search_tickets])).list_tools())


@pytest.mark.parametrize("config, match", [
    ({"transport": "stdio"}, "command"), ({"transport": "http", "url": "ftp://x"}, "http"),
    ({"transport": "carrier-pigeon"}, "unknown MCP transport"),
])
def test_external_config_errors(config, match):
    with pytest.raises(ValueError, match=match):
        external_server(config)


def test_external_config_forms():
    assert external_server({"url": "http://localhost:9/mcp"}) == "http://localhost:9/mcp"
    params = external_server({"command": "python", "args": ["-m", "srv"], "env": {"A": "1"}})
    assert (params.command, params.args, params.env) == ("python", ["-m", "srv"], {"A": "1"})


def test_external_stdio_server(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent("""
        from mcp.server.mcpserver import MCPServer
        server = MCPServer("ext")

        @server.tool()
        async def shout(text: str, times: int = 1) -> str:
            '''Upper-case text.'''
            return (text.upper() + " ") * times

        server.run("stdio")
    """))

    async def main():
        async with connect_external({"transport": "stdio", "command": sys.executable, "args": [str(script)]},
                                    call_timeout_s=30) as toolbox:
            tools = await toolbox.list_tools()
            return tools, await toolbox.call_all(calls_of(call_text("shout", text="hi", times="2"), tools))
    tools, [observation] = run(main())
    assert [t["function"]["name"] for t in tools] == ["shout"]
    assert observation.text.strip() == "HI HI" and not observation.is_error


def test_external_streamable_http_server():
    import socket
    import threading
    import time

    uvicorn = pytest.importorskip("uvicorn")

    async def echo(text: str) -> str:
        """Echo the text."""
        return text

    app = build_server([echo]).streamable_http_app()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 20
        while not server.started and time.time() < deadline:
            time.sleep(0.02)

        async def main():
            async with connect_external({"transport": "streamable_http",
                                         "url": f"http://127.0.0.1:{port}/mcp"}) as toolbox:
                tools = await toolbox.list_tools()
                return await toolbox.call(calls_of(call_text("echo", text="over http"), tools)[0])
        observation = run(main())
        assert (observation.text, observation.is_error) == ("over http", False)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
