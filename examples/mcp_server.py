"""An MCP server with two arithmetic tools, for the `tasks` env's MCP option (docs/environments.md, "MCP tools").

Run over stdio by the rollout worker: `env.kwargs.mcp={"command": ["python", "examples/mcp_server.py"]}`.
"""
from mcp.server.mcpserver import MCPServer

server = MCPServer("arithmetic")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


if __name__ == "__main__":
    server.run()  # stdio
