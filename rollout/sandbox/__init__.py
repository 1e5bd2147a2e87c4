"""The sandbox: run untrusted Python against tests in a fresh, limited, offline process (`Sandbox.run`)."""

from rollout.sandbox.parent import Sandbox
from rollout.sandbox.results import ERROR, FAILED, NOT_RUN, PASSED, TIMEOUT, ExecutionResult, Limits, Test, TestOutcome

__all__ = ["ERROR", "FAILED", "NOT_RUN", "PASSED", "TIMEOUT", "ExecutionResult", "Limits", "Sandbox", "Test",
           "TestOutcome"]
