"""`async-rl train --ray ADDRESS`, the flow of a run on a Ray cluster: the same roles as `async-rl train`, each a Ray
actor running the command a pod runs (launch/ray_actor.py): one replay (on the driver's node when it fits), the
learner's ranks in one placement group (torch.distributed over the ranks' own node addresses), and the rollout
workers spread over the nodes. This process is the driver: it shows the same live table and writes the same run
directory and summary.json as the local launcher (launch/train.py), which must be on storage every node sees.

Ray supervises the replay and the workers: a role that fails ends its actor and Ray starts it again (on another
node when its node is gone) within `run.max_restarts`; the replay resumes from its write-ahead log, a worker with
fresh leases. The learner's ranks fail together (a collective cannot lose a member), so the driver starts the whole
placement group again, within the same count; the learner resumes from its latest checkpoint. When the replay's or
the learner's address changes, the roles that connect to it start again with the new one. A role past its restarts,
or stopped by a config error, stops the run with its own log's last lines. The CURVE keys are made here and handed
to each actor (its own secret and its peers' public keys): no TCP between nodes runs without them unless
security.insecure says so."""

from __future__ import annotations

import json
import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import yaml
from rich.console import Console
from rich.markup import escape

from async_rl.config import Config
from async_rl.config_load import config_to_dict
from async_rl.durable import write_atomically
from async_rl.errors import CONFIG_EXIT_CODE, AsyncRLError, ConfigError
from async_rl.security import worker_identity
from launch.dashboard import Dashboard
from launch.preflight import preflight
from launch.ray_checks import check_ray_config, check_resources, connect, curve_keys
from launch.rundir import fresh_run_name
from launch.supervise import STOP_GRACE_S
from launch.train import _result
from replay.log_format import check_format
from rollout.envs.base import load_factory

log = logging.getLogger("launch.ray_run")

POLL_S = 0.5
DEAD_AFTER_ERRORS = 3


class RoleState:
    """What the live table reads of a role (as of `subprocess.Popen`): `poll()` is its exit code or None."""

    def __init__(self) -> None:
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


@dataclass
class Slot:
    """One role's actor and what the driver last learned of it."""

    name: str
    log_path: Path
    actor: object = None
    process: RoleState = field(default_factory=RoleState)
    info: dict | None = None
    pending: object = None  # the info call in flight
    dead: str | None = None  # why Ray gave the actor up
    errors: int = 0  # calls failed in a row (a call in flight when the actor died fails even if Ray restarts it)
    since: float = field(default_factory=time.monotonic)  # created (or restarted) at


def train_on_ray(config: Config, address: str, resume: bool = False) -> int:
    """Run every role on the Ray cluster at `address` until the learner stops; returns the exit code."""
    check_ray_config(config)
    preflight(config, resume)
    if resume and config.replay.durable:
        check_format(config.run_dir / "replay")
    load_factory(config.env.name, config.env.kwargs)
    import ray

    connect(address, config.ray.connect_timeout_s)
    try:
        code, result = _drive(config, resume)
    finally:
        ray.shutdown()
    if result is not None:  # after the shutdown: Ray's own messages (a node lost) print until then
        print(json.dumps(result), flush=True)
    return code


def _drive(config: Config, resume: bool) -> tuple[int, dict | None]:
    """The run on the cluster this process joined: (exit code, the result line or None)."""
    console = Console(stderr=True)
    check_resources(config)
    if not resume:
        config = msgspec.structs.replace(config, run=msgspec.structs.replace(config.run, name=fresh_run_name(config)))
    run = RayRun(config, resume, console)
    try:
        failed, interrupted = run.supervise()
    finally:
        run.stop_all()
    if failed is not None:
        console.print(run.failure(failed), soft_wrap=True)
        return 1, None
    result = _result(run.config, run.slots[0], console)
    if result is None:
        return 1, None
    result["nodes"] = run.placement()
    if config.run.eval_samples_per_task > 0 and not interrupted:
        result.update(run.evaluate())
    return (130 if interrupted else 0), result


class RayRun:
    """The run's actors: slots [learner, learner-1, ..., replay, rollout-0, ...] (the live table's order)."""

    def __init__(self, config: Config, resume: bool, console: Console) -> None:
        import ray

        self.console, self.keys = console, curve_keys(config)
        run_dir = config.run_dir
        try:
            (run_dir / "logs").mkdir(parents=True, exist_ok=resume)
            (run_dir / "ray").mkdir(exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"run.dir: cannot create the run directory {run_dir}: {exc}") from None
        self.config_path = run_dir / "config.yaml"
        self.env = {"ASYNC_RL_RUN_START": str(time.time()), "OMP_NUM_THREADS": str(config.run.threads_per_process)}
        self.driver_node = ray.get_runtime_context().get_node_id()
        self.restarts = {"learner": 0}
        self.history: list[dict] = []  # every placement seen: role, node, when (_record)
        ranks = [("learner" if i == 0 else f"learner-{i}") for i in range(config.ray.learner_ranks)]
        names = [*ranks, "replay", *(f"rollout-{i}" for i in range(config.rollout.workers))]
        self.slots = [Slot(name, run_dir / "logs" / f"{name}.log") for name in names]
        self.by_name = {slot.name: slot for slot in self.slots}
        self.pg = None
        console.print(f"[bold]async-rl[/] on Ray {'resuming' if resume else 'run dir'} [cyan]{run_dir}[/] (logs in "
                      f"{run_dir / 'logs'})")
        self.config = config
        # The learner's ranks are placed first: the config every role reads (the replay's too) names rank 0's PUB.
        starts = self._place_learner()
        self._start_replay()
        self._start_ranks(starts)
        self._start_rollouts()

    # --- starting the roles -----------------------------------------------------------------------------------

    def _write_config(self) -> None:
        text = yaml.safe_dump(config_to_dict(self.config), sort_keys=False)
        write_atomically(self.config_path, text, durable=False)

    def _with(self, section: str, **values: object) -> None:
        part = msgspec.structs.replace(getattr(self.config, section), **values)
        self.config = msgspec.structs.replace(self.config, **{section: part})

    def _actor(self, name: str, cpus: float, gpus: float, restarts: int, strategy: object, argv: list[str],
               identity: str | None, **kwargs: object) -> object:
        import ray

        from launch.ray_actor import RoleActor

        options = {"name": None, "num_cpus": cpus, "num_gpus": gpus, "max_restarts": restarts,
                   "scheduling_strategy": strategy}
        if self.config.ray.runtime_env:
            options["runtime_env"] = dict(self.config.ray.runtime_env)
        keys = None if self.keys is None or identity is None else self.keys[identity]
        actor_class = ray.remote(RoleActor)
        return actor_class.options(**options).remote(name, argv, str(self.config_path), self.env, keys, **kwargs)

    def _start_replay(self) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        slot = self.by_name["replay"]
        restarts = self.config.run.max_restarts if self.config.replay.durable else 0  # its state died with it
        slot.actor = self._actor("replay", self.config.ray.replay_cpus, 0, restarts,
                                 NodeAffinitySchedulingStrategy(self.driver_node, soft=True), ["replay"], "replay",
                                 endpoint="replay.endpoint")
        info = self._placed([slot])[0]
        self._with("replay", endpoint=info["endpoint"])
        self._write_config()

    def _placed(self, slots: list[Slot], method: str = "info") -> list[dict]:
        """Each actor's `method` answer once it is placed; an AsyncRLError naming the resources if one is not
        within ray.placement_timeout_s."""
        import ray

        refs = [getattr(slot.actor, method).remote() for slot in slots]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.config.ray.placement_timeout_s)
        if len(ready) < len(refs):
            waiting = [slot.name for slot, ref in zip(slots, refs, strict=True) if ref not in ready]
            raise AsyncRLError(f"{', '.join(waiting)} not placed on the Ray cluster within "
                               f"ray.placement_timeout_s={self.config.ray.placement_timeout_s:g} s; it has "
                               f"{ray.available_resources()} free of {ray.cluster_resources()}")
        infos = ray.get(refs)
        for slot, info in zip(slots, infos, strict=True):
            if method == "info":
                slot.info = info
            self._record(slot, info)
        return infos

    def _place_learner(self) -> list[dict]:
        """The placement group (one bundle per rank) and a rank actor in each; the config then names rank 0's
        weight PUB. Returns each rank's environment: torch.distributed's rendezvous at rank 0's node."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        r = self.config.ray
        bundle = {"CPU": r.learner_cpus, **({"GPU": r.learner_gpus} if r.learner_gpus else {})}
        self.pg = placement_group([dict(bundle) for _ in range(r.learner_ranks)], strategy=r.learner_placement)
        ready, _ = ray.wait([self.pg.ready()], timeout=r.placement_timeout_s)
        if not ready:
            ray.util.remove_placement_group(self.pg)
            self.pg = None
            raise AsyncRLError(f"the learner's placement group ({r.learner_ranks} x {bundle}, {r.learner_placement}) "
                               f"was not placed within ray.placement_timeout_s={r.placement_timeout_s:g} s; the "
                               f"cluster has {ray.available_resources()} free of {ray.cluster_resources()}")
        slots = self._ranks()
        for i, slot in enumerate(slots):
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)
            publishes = {"endpoint": "learner.publish_endpoint"} if i == 0 else {}  # rank 0 binds the PUB
            slot.actor = self._actor(slot.name, r.learner_cpus, r.learner_gpus, 0, strategy, ["learner"], "learner",
                                     start=False, **publishes)
            slot.process.returncode, slot.dead, slot.info, slot.since = None, None, None, time.monotonic()
        places = self._placed(slots, "place")
        master = places[0]
        # The same PUB address as before when rank 0 is back on its node: the workers need not start again.
        self._with("learner", publish_endpoint=master["endpoint"])
        self._write_config()
        master_port = self._other_port(slots[0], int(master["endpoint"].rsplit(":", 1)[1]))
        envs = []
        for i, place in enumerate(places):
            # LOCAL_RANK 0: Ray shows each rank only its own GPUs (CUDA_VISIBLE_DEVICES), which it sees as cuda:0.
            env = {"RANK": str(i), "WORLD_SIZE": str(len(slots)), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": master["node_ip"], "MASTER_PORT": str(master_port)}
            if place["interface"]:  # gloo and NCCL bind to the interface of the node's own address
                env.update(GLOO_SOCKET_IFNAME=place["interface"], NCCL_SOCKET_IFNAME=place["interface"])
            envs.append(env)
        return envs

    def _start_ranks(self, envs: list[dict]) -> None:
        import ray

        ray.get([slot.actor.start.remote([], env) for slot, env in zip(self._ranks(), envs, strict=True)])

    def _ranks(self) -> list[Slot]:
        return [slot for slot in self.slots if slot.name.startswith("learner")]

    @staticmethod
    def _other_port(slot: Slot, taken: int) -> int:
        import ray

        while (port := ray.get(slot.actor.place.remote())["free_port"]) == taken:
            pass
        return port

    def _start_rollouts(self) -> None:
        r = self.config.ray
        for i in range(self.config.rollout.workers):
            slot = self.by_name[f"rollout-{i}"]
            slot.actor = self._actor(slot.name, r.rollout_cpus, r.rollout_gpus, self.config.run.max_restarts,
                                     "SPREAD", ["rollout", "--index", str(i)], worker_identity(i))
            slot.process.returncode, slot.dead, slot.info, slot.since = None, None, None, time.monotonic()

    # --- supervising ------------------------------------------------------------------------------------------

    def supervise(self) -> tuple[Slot | None, bool]:
        """Until the learner finishes (None, False), a role fails for good (it, False), or Ctrl-C / SIGTERM
        (None, True)."""
        previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            with Dashboard(self.config, self.console) as dashboard:
                while True:
                    self._poll()
                    dashboard.update(self.slots)
                    if self.slots[0].process.returncode == 0:
                        return None, False
                    failed = self._step()
                    if failed is not None:
                        return failed, False
        except KeyboardInterrupt:
            self.console.print("[yellow]interrupted: stopping every role[/]")
            return None, True
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _poll(self) -> None:
        """One info call in flight per actor; what came back within POLL_S updates its slot."""
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError

        for slot in self.slots:
            if slot.pending is None and slot.dead is None and slot.actor is not None:
                slot.pending = slot.actor.info.remote()
        refs = [slot.pending for slot in self.slots if slot.pending is not None]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=POLL_S) if refs else ([], [])
        time.sleep(max(0.0, POLL_S - 0.05) if len(ready) == len(refs) else 0)
        for slot in self.slots:
            if slot.pending is None or slot.pending not in ready:
                continue
            ref, slot.pending = slot.pending, None
            try:
                info = ray.get(ref)
            except ActorUnavailableError:
                continue  # restarting: asked again next round
            except RayActorError as exc:
                # Calls to an actor Ray is restarting wait for it; only one given up for good fails each time.
                slot.errors += 1
                if slot.errors >= DEAD_AFTER_ERRORS or slot.name.startswith("learner"):  # ranks: never restarted
                    slot.dead = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    slot.process.returncode = -9 if slot.process.returncode is None else slot.process.returncode
                continue
            slot.errors = 0
            if slot.info is not None and info["pid"] != slot.info["pid"]:
                self._restarted(slot, info)
            elif slot.info is None and slot.name.startswith("rollout"):  # the others' placing was recorded
                self._record(slot, info)
            slot.info, slot.process.returncode = info, info["exit"]

    def _record(self, slot: Slot, info: dict, **extra: object) -> None:
        """Where a role was placed: <run dir>/ray/placement.json lists every placement of the run, in order."""
        self.history.append({"role": slot.name, "node_ip": info["node_ip"], "node_id": info["node_id"],
                             "at": time.time(), **extra})
        write_atomically(self.config.run_dir / "ray" / "placement.json", json.dumps(self.history, indent=1),
                         durable=False)

    def _restarted(self, slot: Slot, info: dict) -> None:
        self.restarts[slot.name] = self.restarts.get(slot.name, 0) + 1
        self._record(slot, info, restart=self.restarts[slot.name])
        log.warning("%s was started again by Ray on %s", slot.name, info["node_ip"])
        self.console.print(f"[yellow]{slot.name} died; Ray started it again on {info['node_ip']} (restart "
                           f"{self.restarts[slot.name]} of {self.config.run.max_restarts})[/]")
        if slot.name == "replay" and info["endpoint"] != self.config.replay.endpoint:
            self._with("replay", endpoint=info["endpoint"])
            self._write_config()  # the learner and the workers start again to reach it where it is now
            self._restart_learner(f"the replay moved to {info['endpoint']}", count=False)

    def _step(self) -> Slot | None:
        """Act on what the last poll saw; returns the role that stops the run, or None."""
        learner = [slot for slot in self.slots if slot.name.startswith("learner")]
        for slot in self.slots:
            config_error = slot.process.returncode == CONFIG_EXIT_CODE
            if slot in learner:
                if config_error:
                    return slot
                if slot.dead is not None or slot.process.returncode not in (None, 0):
                    if self.restarts["learner"] >= self.config.run.max_restarts:
                        return slot
                    self.restarts["learner"] += 1
                    why = f"lost its actor ({slot.dead})" if slot.dead else f"exited {slot.process.returncode}"
                    self._restart_learner(f"{slot.name} {why}")
                    return None
            elif slot.dead is not None or config_error:
                return slot
            elif slot.info is None and time.monotonic() - slot.since > self.config.ray.placement_timeout_s:
                import ray

                slot.dead = (f"not placed within ray.placement_timeout_s={self.config.ray.placement_timeout_s:g} s "
                             f"(the cluster has {ray.available_resources()} free)")
                return slot
        return None

    def _restart_learner(self, why: str, count: bool = True) -> None:
        """Every rank again in a new placement group (the survivors of a collective cannot go on); the workers
        too when rank 0's address changed."""
        import ray

        old = self.config.learner.publish_endpoint
        if count:
            self.console.print(f"[yellow]learner: {why}; starting every rank again (restart "
                               f"{self.restarts['learner']} of {self.config.run.max_restarts})[/]")
        log.warning("learner: %s; starting every rank again", why)
        for slot in self.slots:
            if slot.name.startswith("learner"):
                ray.kill(slot.actor, no_restart=True)
                slot.pending, slot.info = None, None
        ray.util.remove_placement_group(self.pg)
        self._start_ranks(self._place_learner())
        if self.config.learner.publish_endpoint != old or not count:
            for slot in self.slots:
                if slot.name.startswith("rollout"):
                    ray.kill(slot.actor, no_restart=True)
                    slot.pending = None
            self._start_rollouts()

    # --- the end ----------------------------------------------------------------------------------------------

    def stop_all(self) -> None:
        """The learner first (it writes the summary), then the workers (they deliver what they sent), then the
        replay; then their actors and the placement group go."""
        import ray

        groups = ([s for s in self.slots if s.name.startswith("learner")],
                  [s for s in self.slots if s.name.startswith("rollout")], [self.by_name["replay"]])
        for group in groups:
            refs = [slot.actor.stop.remote(STOP_GRACE_S) for slot in group if slot.actor is not None and not slot.dead]
            try:
                ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_S + 5)
            except Exception:  # noqa: BLE001 - an actor that died meanwhile has nothing left to stop
                log.debug("stop", exc_info=True)
        for slot in self.slots:
            if slot.actor is not None:
                ray.kill(slot.actor, no_restart=True)
        if self.pg is not None:
            ray.util.remove_placement_group(self.pg)

    def evaluate(self) -> dict:
        """The final weights on every task: `async-rl evaluate` in an actor of its own (a rollout worker's
        resources), its JSON line from logs/evaluate.json; {} (said) when it fails."""
        import ray
        from ray.exceptions import RayActorError

        self.console.print("evaluating the final weights on every task ...")
        out = self.config.run_dir / "logs" / "evaluate.json"
        r = self.config.ray
        actor = self._actor("evaluate", r.rollout_cpus, r.rollout_gpus, 0, "DEFAULT", ["evaluate"], None,
                            stdout_path=str(out))
        try:
            while (code := ray.get(actor.info.remote())["exit"]) is None:
                time.sleep(POLL_S)
        except RayActorError:
            code = None
        finally:
            ray.kill(actor, no_restart=True)
        lines = out.read_text().splitlines() if code == 0 and out.exists() else []
        if not lines:
            self.console.print(f"[red]evaluation failed; see {self.config.run_dir / 'logs' / 'evaluate.log'}[/]")
            return {}
        return json.loads(lines[-1])

    def failure(self, slot: Slot) -> str:
        code = slot.process.returncode
        why = slot.dead or f"exit code {code}"
        if code == CONFIG_EXIT_CODE:
            why = "a config error, not restarted"
        restarts = self.restarts.get("learner" if slot.name.startswith("learner") else slot.name, 0)
        return (f"[red bold]{slot.name} failed ({escape(why)}) after {restarts} restart(s); the run is stopped[/] "
                f"(continue it with async-rl train --ray ADDRESS --resume {self.config.run_dir}). Last lines of "
                f"{slot.log_path}:\n{escape(_tail(slot.log_path))}")

    def placement(self) -> dict[str, str]:
        """Role -> the address of the node it ran on last."""
        return {slot.name: slot.info["node_ip"] for slot in self.slots if slot.info is not None}


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
