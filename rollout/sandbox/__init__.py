"""The sandbox: run untrusted Python (an agent's code) in a fresh, limited, offline process, and judge it from a
process of its own that sees only plain values (`Sandbox.run`)."""

from rollout.sandbox.parent import Sandbox, SandboxError, isolation_counts
from rollout.sandbox.results import ERROR, FAILED, NOT_RUN, PASSED, TIMEOUT, ExecutionResult, Limits, Test, TestOutcome

__all__ = ["ERROR", "FAILED", "NOT_RUN", "PASSED", "TIMEOUT", "ExecutionResult", "Limits", "Sandbox", "SandboxError",
           "Test", "TestOutcome", "isolation_counts"]
