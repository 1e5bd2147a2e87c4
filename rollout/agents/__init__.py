"""Your agent as it is: the `agent` env (an OpenAI-client agent on a thread of its own), the OpenAI-compatible endpoint
that serves it the worker's engine, the chat API's token-exact shapes, the `verifiers` env built on it, and the MCP
client that gives any env an MCP server's tools (docs/environments.md)."""
