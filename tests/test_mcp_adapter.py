"""MCP adapter: async tools on an in-process MCP server, schemas for rendering, calls -> observation text
(results, ToolErrors visible, other exceptions hidden, timeouts, malformed calls not executed), external servers."""
import asyncio
import sys
import textwrap

import pytest
from loop_heartbeat import frozen_heap, heartbeat
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


# -- misbehaving servers --

HANG_AT_INITIALIZE = """
import sys
for line in sys.stdin:  # reads every request, answers none
    pass
"""

HANG_AT_TOOLS_LIST = """
import json, sys
for line in sys.stdin:
    message = json.loads(line)
    if message.get("method") == "initialize":
        result = {"protocolVersion": message["params"]["protocolVersion"], "capabilities": {"tools": {}},
                  "serverInfo": {"name": "stuck", "version": "0"}}
        print(json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result}), flush=True)
    elif "id" in message and message.get("method") != "tools/list":
        print(json.dumps({"jsonrpc": "2.0", "id": message["id"],
                          "error": {"code": -32601, "message": "method not found"}}), flush=True)
"""

DIES_MID_SESSION = """
import os
from mcp.server.mcpserver import MCPServer
server = MCPServer("fragile")

@server.tool()
async def echo(text: str) -> str:
    '''Echo the text.'''
    return text

@server.tool()
async def die() -> str:
    '''Exit the server process.'''
    os._exit(1)

server.run("stdio")
"""


def stdio_config(tmp_path, source, **limits):
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent(source))
    return {"transport": "stdio", "command": sys.executable, "args": [str(script)], **limits}


@pytest.mark.parametrize("source, stage", [(HANG_AT_INITIALIZE, "initialize"), (HANG_AT_TOOLS_LIST, "tools/list")],
                         ids=["initialize", "tools_list"])
def test_hung_server_raises_a_named_error_within_the_connect_timeout(tmp_path, source, stage):
    import time

    from mercury_jax.envs.mcp_adapter import MCPConnectTimeout

    async def main():
        async with asyncio.timeout(20):  # a regression hangs: fail instead of blocking the suite
            async with connect_external(stdio_config(tmp_path, source, connect_timeout_s=1.0)) as toolbox:
                await toolbox.list_tools()

    start = time.perf_counter()
    with pytest.raises(MCPConnectTimeout, match=f"{stage}.*within 1 s"):
        run(main())
    # 1 s of waiting, then the SDK stops the server process (closes stdin; it exits at EOF): well under 5 s
    assert time.perf_counter() - start < 5.0


def test_server_that_exits_at_start_raises_a_connect_error(tmp_path):
    from mercury_jax.envs.mcp_adapter import MCPConnectError, MCPConnectTimeout

    async def main():
        async with connect_external(stdio_config(tmp_path, "raise SystemExit(3)")):
            pass

    with pytest.raises(MCPConnectError, match="could not open MCP server .*server.py") as raised:
        run(main())
    assert not isinstance(raised.value, MCPConnectTimeout)


def test_dead_server_is_marked_and_not_called_again(tmp_path):
    async def main():
        async with connect_external(stdio_config(tmp_path, DIES_MID_SESSION)) as toolbox:
            tools = await toolbox.list_tools()
            text = call_text("echo", text="before") + call_text("die") + call_text("echo", text="after")
            return await toolbox.call_all(calls_of(text, tools)), toolbox.dead
    (before, died, after), dead = run(main())
    assert (before.text, before.failure) == ("before", None)
    assert died.is_error and died.failure.startswith("transport:") and "Connection closed" in dead
    # not attempted: the agent reads that the server is gone, the runner marks the trajectory
    assert after.is_error and not after.executed and after.failure.startswith("server gone:")
    assert "unavailable" in after.text


def test_blocking_tool_times_out_while_the_loop_keeps_ticking():
    """A plain-`def` tool that blocks: its call gives the timeout observation on time, and a heartbeat task (another
    episode's view of the loop) never waits much longer than its 10 ms tick."""
    import threading
    import time

    from mercury_jax.envs.tool_threads import TOOL_THREADS

    release = threading.Event()

    def stuck(x: str) -> str:
        """Blocks its thread until released."""
        release.wait(20)
        return x

    gaps = []

    async def main():
        beat = asyncio.ensure_future(heartbeat(gaps))
        try:
            async with MCPToolbox(build_server([stuck, search_tickets]), call_timeout_s=0.3) as toolbox:
                tools = await toolbox.list_tools()
                await asyncio.sleep(0.05)
                gaps.clear()
                start = time.perf_counter()
                slow = await toolbox.call(calls_of(call_text("stuck", x="q"), tools)[0])
                elapsed = time.perf_counter() - start
                abandoned = TOOL_THREADS.stats()["abandoned"]
                after = await toolbox.call(calls_of(call_text("search_tickets", query="next"), tools)[0])
                return slow, elapsed, abandoned, after
        finally:
            beat.cancel()

    try:
        with frozen_heap():
            slow, elapsed, abandoned, after = run(main())
    finally:
        release.set()
    assert slow.is_error and "did not answer within 0.3 s" in slow.text and "timed out" in slow.failure
    assert elapsed < 0.5 and max(gaps) < 0.1, (elapsed, max(gaps))
    assert abandoned >= 1  # the runaway thread is counted until it returns
    assert not after.is_error and after.failure is None  # the server is alive: only that call failed
    deadline = time.time() + 5
    while TOOL_THREADS.stats()["abandoned"] and time.time() < deadline:
        time.sleep(0.01)
    assert TOOL_THREADS.stats()["abandoned"] == 0


@pytest.mark.parametrize("cap", [None, 1000, "default"])
def test_a_huge_result_becomes_a_capped_observation_with_a_note(cap):
    from mercury_jax.envs.mcp_adapter import DEFAULT_MAX_RESULT_CHARS

    size = 10 * 2**20

    async def flood() -> str:
        """Ten MiB of text."""
        return "x" * size

    limit = DEFAULT_MAX_RESULT_CHARS if cap == "default" else cap

    async def main():
        options = {} if cap == "default" else {"max_result_chars": cap}
        async with MCPToolbox(build_server([flood]), **options) as toolbox:
            return await toolbox.call(calls_of(call_text("flood"), await toolbox.list_tools())[0])
    observation = run(main())
    assert not observation.is_error and observation.failure is None
    if limit is None:
        assert observation.text == "x" * size
    else:
        shown, note = observation.text.split("\n", 1)
        assert shown == "x" * limit
        assert note.startswith("[truncated:") and f"{size:,} characters" in note and f"first {limit:,}" in note


def test_external_config_limits():
    toolbox = connect_external({"command": "python", "call_timeout_s": 5, "connect_timeout_s": 2,
                                "max_result_chars": 100})
    assert (toolbox.call_timeout_s, toolbox.connect_timeout_s, toolbox.max_result_chars) == (5.0, 2.0, 100)
    toolbox = connect_external({"command": "python", "max_result_chars": None}, connect_timeout_s=7)
    assert (toolbox.connect_timeout_s, toolbox.max_result_chars) == (7.0, None)
    with pytest.raises(ValueError, match="connect_timeout_s must be a positive"):
        MCPToolbox(build_server([search_tickets]), connect_timeout_s=0)


def test_tool_threads_are_bounded_and_abandoned_threads_hold_their_slot():
    import threading

    from mercury_jax.envs.tool_threads import ToolThreads

    pool, release = ToolThreads(max_threads=2), threading.Event()

    async def main():
        for _ in range(2):  # two runaways fill the pool
            with pytest.raises(TimeoutError):
                await pool.run(release.wait, 20, timeout_s=0.05)
        assert pool.stats() == {"running": 2, "abandoned": 2, "workers": 2, "max_threads": 2}
        with pytest.raises(TimeoutError, match="all 2 tool threads stayed busy"):
            await pool.run(lambda: "never started", timeout_s=0.1)
        release.set()
        return await pool.run(lambda: "ran", timeout_s=5)  # a slot frees when a runaway returns

    try:
        assert run(main()) == "ran"
    finally:
        release.set()
    assert pool.stats()["abandoned"] == 0
