"""`env.name=verifiers`: train on a `verifiers` environment (its tasks, harness and rewards) through the agent env.

    env.name=verifiers env.kwargs.id=TASKSET [env.kwargs.args={...}] [env.kwargs.env={...}]

verifiers (PyPI `verifiers`, its `verifiers.v1` stack; `pip install 'async-rl[verifiers]'`) builds an environment
from a taskset id: `vf.load_environment(vf.resolve_env_config({"taskset": {"id": TASKSET, **args}, **env}))`, the
same config `vf-eval` builds from `--env.taskset.*` and `--env.*`. This env is a thin adapter on `env.name=agent`
(rollout/agents/env.py, whose factory it extends): the tasks are the taskset's (a held-out share of them for
evaluation), and each trajectory's agent is verifiers' own `Env.run_episode(task, ModelContext)` for one task,
its model client the trajectory's base URL on the worker's OpenAI-compatible endpoint. The harness's every chat
completion is thus one stage (through verifiers' interception server, which relays each request as it is), and
the episode's score is the outcome: the mean over its traces of `trace.reward` (the weighted sum of the task's
`@reward` functions; one trace for a single-agent env), success when it reaches `env.kwargs.threshold`, and the
traces' `@metric` values as info. verifiers v1 scores whole traces, not turns: no stage rewards come from it.

The verifiers env and its serving resources (interception server, shared tool servers) live on one event loop
thread of the worker, started with the first trajectory. An episode that ends with errors (its harness or scoring
raised) loses its trajectory, counted as agent_errors; the agent env's time limit between model calls
(`env.kwargs.timeout_s`) cancels an episode that stalls.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import math
import sys
import threading
from typing import Any

import msgspec

from async_rl.env_types import Task
from rollout.agents.env import DEFAULT_TIMEOUT_S, AgentFactory
from rollout.envs.base import EnvError, settings_from_kwargs

log = logging.getLogger("async_rl.rollout")

ENV = "verifiers"
EXTRA = "pip install 'async-rl[verifiers]'"


class VerifiersSettings(msgspec.Struct, forbid_unknown_fields=True):
    id: str  # the verifiers taskset id (`--env.taskset.id`): an installed package, or a module on PYTHONPATH
    args: dict[str, Any] = {}  # the taskset's own config fields (`--env.taskset.*`)
    env: dict[str, Any] = {}  # the rest of verifiers' env config (`--env.*`: "id", "agent": {"harness", "runtime"})
    threshold: float = 1.0  # an episode succeeds when its reward reaches this
    eval_fraction: float = 0.2  # the share of the taskset held out for evaluation
    seed: int = 0  # the split's shuffle
    max_tasks: int = 100_000  # the tasks read from an infinite taskset
    timeout_s: float = DEFAULT_TIMEOUT_S  # the longest an episode may work without a model call (as env.name=agent)
    model: str = "policy"  # the model name verifiers is given

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("id: the verifiers taskset id, e.g. env.kwargs.id=my-taskset")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"eval_fraction: expected 0 < f < 1, got {self.eval_fraction}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: expected > 0, got {self.timeout_s}")
        if self.max_tasks < 2:
            raise ValueError(f"max_tasks: expected >= 2, got {self.max_tasks}")
        if "taskset" in self.env:
            raise ValueError("env: the taskset is env.kwargs.id and env.kwargs.args, not env.kwargs.env.taskset")

    @property
    def entry(self) -> str:  # how the agent env's messages name the agent
        return f"verifiers taskset {self.id!r}"

    @property
    def judge(self) -> None:
        return None


def env_config(settings: VerifiersSettings) -> dict[str, Any]:
    """The verifiers env config (raw, before `vf.resolve_env_config`) the settings name."""
    return {**settings.env, "taskset": {**settings.args, "id": settings.id}}


def outcome(episode: Any, threshold: float) -> dict[str, Any]:
    """An episode's outcome for the agent env: {"reward", "success", the traces' mean metrics}; an error when the
    episode failed (its errors named) or scored nothing."""
    errors = list(getattr(episode, "errors", []) or []) + [e for t in episode.traces for e in (t.errors or [])]
    if errors or not episode.ok:
        why = "; ".join(f"{e.type}: {e.message}"[:300] for e in errors) or "the episode is not ok"
        raise RuntimeError(f"the verifiers episode failed: {why}")
    if not episode.traces:
        raise RuntimeError("the verifiers episode has no trace")
    reward = sum(float(t.reward) for t in episode.traces) / len(episode.traces)
    if not math.isfinite(reward):
        raise RuntimeError(f"the verifiers episode scored {reward}")
    info: dict[str, list[float]] = {}
    for trace in episode.traces:
        for name, value in (trace.metrics or {}).items():
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                info.setdefault(str(name), []).append(float(value))
    return {**{k: sum(v) / len(v) for k, v in info.items() if k not in ("reward", "success")},
            "reward": reward, "success": reward >= threshold - 1e-9}


class VerifiersFactory(AgentFactory):
    """The verifiers env, its tasks split, and the loop its episodes run on; the rest is the agent env's."""

    name = ENV

    def __init__(self, settings: VerifiersSettings) -> None:
        for package, why in (("openai", "the endpoint's client"), ("verifiers", "the environments")):
            if importlib.util.find_spec(package) is None:
                raise EnvError(f"env.name={ENV}: {package} ({why}) is not installed ({EXTRA})")
        self.settings = settings  # type: ignore[assignment] - the fields the agent env reads, and the properties
        self.entry = self.run_episode
        self.judge_fn = None
        self.step_timeout_s = settings.timeout_s
        self.vf_env = load_env(settings)
        words = getattr(sys.modules.get(type(self.vf_env.taskset).__module__), "VOCABULARY", None)
        if words is not None:  # the tiny built-in model's words, as the agent env's VOCABULARY
            self.vocabulary = lambda: list(words)
        self.vf_tasks = taskset_tasks(self.vf_env, settings)
        tasks = [Task(id=_task_id(t, n), data={"index": n, "prompt": _prompt(t)}) for n, t in enumerate(self.vf_tasks)]
        self.serve(tasks, f"env.kwargs.id: verifiers taskset {settings.id!r} ({len(tasks)} task(s))")
        self.loop: asyncio.AbstractEventLoop | None = None
        self.serving: Any = None
        self.ready: asyncio.Future | None = None

    async def run_episode(self, task: dict, client: Any, model: str) -> dict[str, Any]:
        """One trajectory's agent (on its own thread and loop): verifiers' episode of the task on the shared loop,
        its model the trajectory's endpoint; cancelled with it when the agent env abandons the trajectory."""
        import verifiers.v1 as vf

        vf_task = self.vf_tasks[task["index"]]
        context = vf.ModelContext(model=model, client=vf.EvalClientConfig(
            base_url=str(client.base_url).rstrip("/"), api_key_var="ASYNC_RL_VERIFIERS_KEY"))  # the key is in the URL
        loop = self._loop()
        future = asyncio.run_coroutine_threadsafe(self._episode(vf_task, context), loop)
        episode = await asyncio.wrap_future(future)
        return outcome(episode, self.settings.threshold)

    async def _episode(self, vf_task: Any, context: Any) -> Any:
        assert self.ready is not None
        try:
            await asyncio.shield(self.ready)
            return await self.vf_env.run_episode(vf_task, context)
        except SystemExit as exc:  # verifiers exits where it wants a login (`prime login`: its default runtime)
            raise RuntimeError(f"verifiers exited: {exc}") from None

    def _loop(self) -> asyncio.AbstractEventLoop:
        """The loop verifiers serves on, started with the first episode (a config check starts nothing)."""
        with self.lock:
            if self.loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=_run, args=(loop,), name="verifiers", daemon=True).start()
                self.ready = asyncio.run_coroutine_threadsafe(self._serve(), loop).result()
                self.loop = loop
            return self.loop

    async def _serve(self) -> asyncio.Future:
        """Enter the env's `serving()` on its loop; a future that is done once its resources are up."""
        self.serving = self.vf_env.serving()
        return asyncio.ensure_future(self.serving.__aenter__())

    def close(self) -> None:
        with self.lock:
            loop, self.loop = self.loop, None
        if loop is not None:
            async def down() -> None:
                try:
                    if self.ready is not None and self.ready.done() and self.ready.exception() is None:
                        await self.serving.__aexit__(None, None, None)
                    elif self.ready is not None:
                        self.ready.cancel()
                except SystemExit as exc:
                    raise RuntimeError(f"verifiers exited: {exc}") from None

            try:
                asyncio.run_coroutine_threadsafe(down(), loop).result(timeout=30)
            except Exception as exc:  # noqa: BLE001 - a teardown that fails must not stop the worker's
                log.warning("verifiers env teardown: %s", exc)
            loop.call_soon_threadsafe(loop.stop)
        super().close()


def _run(loop: asyncio.AbstractEventLoop) -> None:
    """The verifiers loop's thread: a SystemExit that a task of verifiers raises (it exits where it wants a login)
    ends that task, not the loop every other episode runs on."""
    while True:
        try:
            loop.run_forever()
            return
        except BaseException as exc:  # noqa: BLE001 - the loop goes on; the task that raised has its exception
            log.warning("verifiers: %s: %s", type(exc).__name__, exc)


def load_env(settings: VerifiersSettings) -> Any:
    """verifiers' env for the settings; an EnvError naming an unknown taskset id or the load that raised."""
    import verifiers.v1 as vf

    try:
        config = vf.resolve_env_config(env_config(settings))
    except ModuleNotFoundError as exc:
        raise EnvError(f"env.kwargs.id: no verifiers taskset {settings.id!r}: {exc}") from None
    except Exception as exc:
        raise EnvError(f"env.kwargs: verifiers refused the env config {env_config(settings)!r:.300}: "
                       f"{type(exc).__name__}: {str(exc)[:600]}") from None
    try:
        return vf.load_environment(config)
    except ModuleNotFoundError as exc:
        raise EnvError(f"env.kwargs.id: verifiers taskset {settings.id!r}: {exc}") from None
    except (Exception, SystemExit) as exc:
        raise EnvError(f"env.kwargs.id: loading verifiers taskset {settings.id!r} raised {type(exc).__name__}: "
                       f"{str(exc)[:600]}") from None


def taskset_tasks(vf_env: Any, settings: VerifiersSettings) -> list[Any]:
    taskset = vf_env.taskset
    if not taskset.bounded:
        taskset = taskset.take(settings.max_tasks)
    try:
        tasks = list(taskset)
    except Exception as exc:
        raise EnvError(f"env.kwargs.id: verifiers taskset {settings.id!r} raised {type(exc).__name__} loading its "
                       f"tasks: {str(exc)[:600]}") from None
    if len(tasks) < 2:
        raise EnvError(f"env.kwargs.id: verifiers taskset {settings.id!r} has {len(tasks)} task(s); a train and an "
                       "eval split need one each")
    return tasks


def _task_id(task: Any, n: int) -> str:
    data = task.data
    return str(data.id or data.name or f"task{data.idx if data.idx is not None else n}")


def _prompt(task: Any) -> str:
    try:
        return str(task.data.prompt_text)[:500]  # a label for the records: the episode reads the task itself
    except Exception:  # noqa: BLE001 - only a label
        return ""


def factory(**kwargs: Any) -> VerifiersFactory:
    """`env.name=verifiers` with `env.kwargs` (VerifiersSettings)."""
    return VerifiersFactory(settings_from_kwargs(ENV, VerifiersSettings, kwargs))
