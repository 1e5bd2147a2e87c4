"""async-rl: asynchronous off-policy RL for long-horizon LLM agents. The names an environment is written against
are exported here (async_rl/env_types.py; docs/environments.md)."""

from async_rl.env_types import Action, Env, EnvFactory, Judgement, StepResult, Task, ToolCall, ToolResult

__all__ = ["Action", "Env", "EnvFactory", "Judgement", "StepResult", "Task", "ToolCall", "ToolResult"]
