"""async-rl: asynchronous off-policy RL for long-horizon LLM agents. The names an environment is written against
are exported here (async_rl/env_types.py; docs/environments.md), and `reward`, which an agent trained as it is
calls on its OpenAI client (async_rl/agent_client.py)."""

from async_rl.agent_client import reward
from async_rl.env_types import (
    Action,
    Env,
    EnvDefaults,
    EnvFactory,
    EnvFactoryDefaults,
    Judgement,
    StepResult,
    Task,
    ToolCall,
    ToolResult,
)

__all__ = ["Action", "Env", "EnvDefaults", "EnvFactory", "EnvFactoryDefaults", "Judgement", "StepResult", "Task",
           "ToolCall", "ToolResult", "reward"]
