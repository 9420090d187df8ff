"""Environments: tools served over MCP (in process, or external servers), worlds and rewards."""
from mercury_jax.envs.mcp_adapter import MCPToolbox, ToolObservation, build_server, openai_schema, result_text
from mercury_jax.envs.mcp_external import connect_external, external_server

__all__ = ["MCPToolbox", "ToolObservation", "build_server", "connect_external", "external_server",
           "openai_schema", "result_text"]
