"""MCP tools for the `tasks` env (rollout/agents/mcp_tools.py): a real MCP server written here (mcp's MCPServer, FastMCP
in mcp 1) run over stdio as a subprocess; listing, calls, errors, a crash mid-run, a bad command, and the docs'
training command through real processes."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from async_rl import Action, Task  # noqa: E402
from rollout.agents.mcp_tools import McpSettings, McpTools, ServerFailed  # noqa: E402
from rollout.envs.base import EnvError, checked_step, load_factory, tools_of  # noqa: E402
from rollout.tool_parser import parse_hermes, tool_names  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

SERVER = '''
import os, sys, time
from mcp.server.mcpserver import MCPServer

server = MCPServer("test")
if os.environ.get("PID_FILE"):
    with open(os.environ["PID_FILE"], "a") as f:
        f.write(f"{os.getpid()}\\n")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def pid() -> int:
    """This server's process id."""
    return os.getpid()


@server.tool()
def nap(seconds: float) -> str:
    """Sleep, then say so."""
    time.sleep(seconds)
    return "awake"


@server.tool()
def freeze() -> str:
    """Stop this whole server (SIGSTOP): it answers nothing any more, pings included."""
    import signal
    os.kill(os.getpid(), signal.SIGSTOP)
    return "never"


@server.tool()
def fail(why: str) -> str:
    """Raise an error."""
    raise ValueError(why)


if __name__ == "__main__":
    print("test server up", file=sys.stderr, flush=True)
    if len(sys.argv) > 1:  # an HTTP port
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
    else:
        server.run()
'''


@pytest.fixture
def server(tmp_path: Path) -> list[str]:
    path = tmp_path / "server.py"
    path.write_text(SERVER)
    return [sys.executable, str(path)]


def tasks_factory(tmp_path: Path, command: list[str], **mcp):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"question": f"What is {a} + {b}?", "answer": a + b}) + "\n"
                             for a, b in [(2, 3), (20, 22), (7, 8), (1, 1)]))
    return load_factory("tasks", {"tasks_file": str(tasks), "tools": [],
                                  "mcp": {"command": command, "env": {"PID_FILE": str(tmp_path / "pids")}, **mcp}})


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pid: int, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while alive(pid):
        assert time.monotonic() < deadline, f"MCP server pid {pid} still running"
        time.sleep(0.05)


def marked_processes(marker: str) -> list[int]:
    """The processes whose environment holds `marker` (the docs' server is started with it in its env)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return [pid for pid in found if alive(pid)]


def hermes(name: str, arguments: dict, names: list[str]) -> Action:
    action, errors = parse_hermes(f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>',
                                  names)
    return action


# (a) listed as OpenAI specs, a call executed, its result returned ------------------------------------------------


def test_tools_are_listed_as_openai_specs_and_called(server):
    tools = McpTools(McpSettings(command=server))
    try:
        specs = {s["function"]["name"]: s for s in tools.specs()}
        assert set(specs) == {"add", "pid", "nap", "freeze", "fail"}
        add = specs["add"]
        assert add["type"] == "function" and add["function"]["description"] == "Add two integers."
        assert add["function"]["parameters"]["type"] == "object"
        assert set(add["function"]["parameters"]["properties"]) == {"a", "b"}
        assert add["function"]["parameters"]["required"] == ["a", "b"]
        text, ok, generation = tools.call("add", {"a": 2, "b": 40})
        assert (text, ok, generation) == ("42", True, 1)
        # bad arguments, an unlisted tool, a tool's own error: error results naming the problem
        text, ok, _ = tools.call("add", {"a": "two", "b": 40})
        assert not ok and text.startswith("error:") and "a" in text and "integer" in text
        text, ok, _ = tools.call("subtract", {"a": 1})
        assert not ok and text == "error: the MCP server has no tool 'subtract' (it has: add, pid, nap, freeze, fail)"
        text, ok, _ = tools.call("fail", {"why": "the disk is full"})
        assert not ok and "the disk is full" in text
        assert tools.metrics()["mcp_calls"] == 4 and tools.metrics()["mcp_call_errors"] == 3
        assert tools.metrics()["mcp_starts"] == 1
        pid = int(tools.call("pid", {})[0])
    finally:
        tools.close()
    wait_gone(pid)
    with pytest.raises(EnvError, match="used after the env factory was closed"):
        tools.specs()


def test_a_call_past_its_time_limit_is_an_error_result_and_the_server_goes_on(server):
    tools = McpTools(McpSettings(command=server, call_timeout_s=0.5))
    try:
        assert tools.call("add", {"a": 0, "b": 0})[:2] == ("0", True)  # the server's start is not the call's time
        started = time.monotonic()
        text, ok, generation = tools.call("nap", {"seconds": 5})
        assert time.monotonic() - started < 4.5  # given up at its limit, not waited out
        assert not ok and text == "error: the tool 'nap' did not answer within 0.5 s"
        assert tools.call("add", {"a": 1, "b": 2}, generation) == ("3", True, 1)  # the same server: it answers pings
        assert tools.metrics()["mcp_timeouts"] == 1 and tools.metrics()["mcp_failures"] == 0
    finally:
        tools.close()


def test_a_server_that_hangs_is_taken_as_failed_and_replaced(server):
    """A call past its limit on a server that then does not answer a ping either: that call's trajectory is
    abandoned (ServerFailed), the hung process is killed, and the next call gets a new server."""
    tools = McpTools(McpSettings(command=server, call_timeout_s=1))
    try:
        pid = int(tools.call("pid", {})[0])
        started = time.monotonic()
        with pytest.raises(ServerFailed, match="a call to 'freeze' ran past 1 s and the server did not answer a ping"):
            tools.call("freeze", {}, 1)
        assert time.monotonic() - started < 15
        wait_gone(pid, within_s=15)  # mcp's shutdown: stdin closed, SIGTERM, then SIGKILL
        assert tools.call("add", {"a": 1, "b": 1}) == ("2", True, 2)
        counts = tools.metrics()
        assert counts["mcp_timeouts"] == 1 and counts["mcp_failures"] == 1 and counts["mcp_starts"] == 2
    finally:
        tools.close()


# (b) a model's tool call through the env's step ---------------------------------------------------------------


def test_a_hermes_tool_call_goes_through_the_tasks_env_step(tmp_path, server):
    factory = tasks_factory(tmp_path, server)
    assert not (tmp_path / "pids").exists(), "nothing starts before the first trajectory"
    try:
        env = factory.make()
        prompt = env.reset(Task("t", {"question": "What is 2 + 3?", "answer": "5"}))
        assert "You may call a tool" in prompt
        specs = tools_of("tasks", env)
        names = tool_names(specs)
        assert names == ["add", "pid", "nap", "freeze", "fail"]
        result = checked_step("tasks", env, hermes("add", {"a": 2, "b": 3}, names))
        assert not result.done and [(r.content, r.name, r.call_id) for r in result.observation] == [
            ("5", "add", "call_0")]
        result = checked_step("tasks", env, Action("<answer>5</answer>", []))
        assert result.done and result.reward == pytest.approx(0.1)  # the answer used the tool's result
        judgement = env.judge()
        assert judgement.success and judgement.info["tool_calls"] == 1 and judgement.info["used_tool_result"] == 1
        # a call with bad arguments is answered, the episode goes on
        env = factory.make()
        env.reset(Task("t", {"question": "What is 2 + 3?", "answer": "5"}))
        result = checked_step("tasks", env, hermes("add", {"a": "x"}, tool_names(tools_of("tasks", env))))
        assert not result.done and result.observation[0].content.startswith("error:")
        assert factory.metrics()["mcp_starts"] == 1
    finally:
        factory.close()
    (pid,) = map(int, (tmp_path / "pids").read_text().split())
    wait_gone(pid)


# (c) the server killed mid-run --------------------------------------------------------------------------------


def test_a_crash_mid_run_abandons_only_the_trajectories_using_it(tmp_path, server):
    factory = tasks_factory(tmp_path, server)
    task = Task("t", {"question": "What is 2 + 3?", "answer": "5"})
    try:
        using, listing = factory.make(), factory.make()
        for env in (using, listing):
            env.reset(task)
        names = tool_names(tools_of("tasks", using))
        tools_of("tasks", listing)  # it saw the tools but has not called the server yet
        first = checked_step("tasks", using, hermes("pid", {}, names))
        pid = int(first.observation[0].content)
        os.kill(pid, signal.SIGKILL)
        wait_gone(pid)
        # the trajectory that was using it: abandoned (an EnvError out of step), naming the server
        with pytest.raises(EnvError, match="MCP server .*server.py.* failed") as failed:
            checked_step("tasks", using, hermes("add", {"a": 2, "b": 3}, names))
        assert isinstance(failed.value.__cause__, ServerFailed) or isinstance(failed.value, ServerFailed)
        # one that had not called it goes on with a new server; so does a later trajectory
        result = checked_step("tasks", listing, hermes("add", {"a": 2, "b": 3}, names))
        assert result.observation[0].content == "5"
        later = factory.make()
        later.reset(task)
        assert checked_step("tasks", later, hermes("add", {"a": 20, "b": 22}, names)).observation[0].content == "42"
        second = int(checked_step("tasks", later, hermes("pid", {}, names)).observation[0].content)
        assert second != pid
        counts = factory.metrics()
        assert counts["mcp_starts"] == 2 and counts["mcp_failures"] == 1 and counts["mcp_abandoned"] == 1
    finally:
        factory.close()
    wait_gone(second)


# (d) bad server commands --------------------------------------------------------------------------------------


def test_a_bad_server_command_is_a_clear_env_error(tmp_path):
    with pytest.raises(EnvError, match="env.kwargs.mcp.command: 'no-such-mcp-server' is not a command found on PATH"):
        tasks_factory(tmp_path, ["no-such-mcp-server", "--stdio"])
    with pytest.raises(EnvError, match="env.kwargs.mcp: .*command must be a non-empty list"):
        tasks_factory(tmp_path, [])
    with pytest.raises(EnvError, match="env.kwargs.mcp"):
        load_factory("tasks", {"tools": [], "mcp": {"command": ["python"], "port": 3}})
    crashing = [sys.executable, "-c", "import sys; print('no API key configured', file=sys.stderr); sys.exit(3)"]
    factory = tasks_factory(tmp_path, crashing)
    try:
        env = factory.make()
        env.reset(Task("t", {"question": "q", "answer": "a"}))
        with pytest.raises(EnvError, match=r"MCP server .*sys.exit\(3\).* did not start: .*its stderr ends: "
                                           "no API key configured"):
            tools_of("tasks", env)
        assert factory.metrics()["mcp_start_failures"] == 1
    finally:
        factory.close()
    pid_file = tmp_path / "silent.pid"
    silent = [sys.executable, "-c",  # never answers initialize
              f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"]
    tools = McpTools(McpSettings(command=silent, start_timeout_s=1))
    try:
        started = time.monotonic()
        with pytest.raises(EnvError, match="did not start: TimeoutError: no answer to initialize and list_tools "
                                           "within 1 s; it wrote nothing to stderr"):
            tools.specs()
        assert time.monotonic() - started < 15
        wait_gone(int(pid_file.read_text()))  # killed, not left behind
    finally:
        tools.close()


# the docs' command, through real processes ---------------------------------------------------------------------


@pytest.mark.slow
def test_the_docs_mcp_training_command_runs_as_printed(tmp_path):
    """Slow: `async-rl train` with the docs' MCP line for a few versions: the server starts in the worker (on the
    first trajectory: `mcp_starts`), the run trains, and no server is left when the run ends (found by a marker in
    its environment, `env.kwargs.mcp.env`)."""
    page = (REPO / "docs" / "environments.md").read_text()
    section = page.split("### MCP tools", 1)[1]
    line = section.split("```bash\n", 1)[1].split("```", 1)[0].strip()
    argv = shlex.split(line)
    assert argv[:2] == ["async-rl", "train"]
    pids = tmp_path / "pids"
    mcp_option = [a for a in argv if a.startswith("env.kwargs.mcp=")]
    assert len(mcp_option) == 1
    # Questions with one-digit answers, so that the untrained tiny model's last number is sometimes right and its
    # groups have something to learn from (the page's questions have two- and three-digit answers).
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"question": f"What is {a} + {b}?", "answer": a + b}) + "\n"
                             for a in range(1, 4) for b in range(1, 4)))
    overrides = [f"run.dir={tmp_path}", "run.name=t", "wandb.mode=disabled", "run.target_success=null",
                 "run.max_versions=3", "rollout.workers=1", "rollout.group_size=4", "learner.min_batch_items=2",
                 "learner.batch_wait_s=0.2", "run.eval_samples_per_task=1", "run.eval_max_tasks=1",
                 "rollout.max_new_tokens=12", "env.kwargs.max_turns=2", f"env.kwargs.tasks_file={tasks}",
                 f"env.kwargs.mcp.env={{PID_FILE: {pids}}}"]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    done = subprocess.run([sys.executable, "-m", "launch.cli", *argv[1:], *overrides], capture_output=True, text=True,
                          timeout=150, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["versions"] == 3
    assert marked_processes(str(pids)) == [], "an MCP server outlived the run"
    rollout = [json.loads(x) for x in (tmp_path / "t" / "metrics" / "rollout-0.jsonl").read_text().splitlines()]
    assert rollout[-1]["mcp_starts"] == 1 and rollout[-1]["mcp_start_failures"] == 0 and rollout[-1]["env_errors"] == 0


# the crash through the episode runner: a worker's trajectories, scripted ------------------------------------------


class ScriptedEngine:
    """A stand-in for the policy (named as such): each turn calls `add` until the context holds a tool result, then
    calls it again (the second turn) or answers; with `kill_pid_file` set, the second turn first kills the server."""

    version, weights_refused = 0, 0

    def __init__(self, tokenizer, kill_pid_file: Path | None = None) -> None:
        self.tokenizer, self.kill_pid_file = tokenizer, kill_pid_file

    def generate(self, prompts, params):
        from rollout.engines import Generation

        out = []
        for prompt in prompts:
            seen = self.tokenizer.decode(prompt).count("<tool_response>")
            if seen == 1 and self.kill_pid_file is not None:
                for pid in map(int, self.kill_pid_file.read_text().split()):
                    with __import__("contextlib").suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                text = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
            elif seen == 0:
                text = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
            else:
                text = "<answer>5</answer>"
            tokens = self.tokenizer.encode(text, add_special_tokens=False)
            out.append(Generation(tokens, [-1.0] * len(tokens), [0] * len(tokens), "stop"))
        return out

    def update_weights(self, version, path):
        pass

    def close(self):
        pass


def test_a_crash_through_the_episode_runner_abandons_that_group_and_the_next_group_works(tmp_path, server):
    from async_rl.model import byte_tokenizer
    from rollout.engines import SamplingParams
    from rollout.runner import EpisodeRunner

    class Outcomes:
        def __init__(self):
            self.outcomes = []

        def stage(self, episode, generation, reward, terminal):
            pass

        def outcome(self, episode, judgement, reason):
            self.outcomes.append((judgement, reason))

    factory = tasks_factory(tmp_path, server)
    tokenizer = byte_tokenizer()
    task = Task("t", {"question": "What is 2 + 3?", "answer": "5"})
    params = SamplingParams(max_new_tokens=128, stop_token_ids=[tokenizer.eos_token_id])
    try:
        for kill, group in ((True, "g0"), (False, "g1")):
            sink = Outcomes()
            engine = ScriptedEngine(tokenizer, tmp_path / "pids" if kill else None)
            runner = EpisodeRunner("tasks", factory, engine, tokenizer, params, 8192, sink, 4)
            runner.start_group(group, task, 2)
            deadline = time.monotonic() + 60
            try:
                while not runner.idle():
                    assert time.monotonic() < deadline, "the episodes did not finish"
                    runner.pump(0.05)
                stats, errors = runner.take_stats(), runner.env_errors
            finally:
                runner.close()
            if kill:  # both trajectories were using the server that died: abandoned, counted, naming the server
                assert len(sink.outcomes) == 2 and errors == 2
                assert all("MCP server" in str(reason) and "failed" in str(reason) for _, reason in sink.outcomes)
            else:  # a later group: a new server, solved
                assert [(j.success, reason) for j, reason in sink.outcomes] == [(True, ""), (True, "")], stats
        counts = factory.metrics()
        assert counts["mcp_failures"] == 1 and counts["mcp_starts"] == 2
    finally:
        factory.close()


# over HTTP: a running server, reached by url -----------------------------------------------------------------------


def http_server(command: list[str], port: int) -> subprocess.Popen:
    import socket

    process = subprocess.Popen([*command, str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return process
        assert process.poll() is None and time.monotonic() < deadline, "the HTTP MCP server did not come up"
        time.sleep(0.1)


def test_a_server_over_http_is_listed_called_and_reconnected_after_it_restarts(server):
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    process = http_server(server, port)
    tools = McpTools(McpSettings(url=f"http://127.0.0.1:{port}/mcp", call_timeout_s=5))
    try:
        assert "add" in {s["function"]["name"] for s in tools.specs()}
        assert tools.call("add", {"a": 2, "b": 40}) == ("42", True, 1)
        process.kill()
        process.wait()
        with pytest.raises(ServerFailed, match=f"MCP server at http://127.0.0.1:{port}/mcp failed"):
            tools.call("add", {"a": 1, "b": 1}, 1)
        with pytest.raises(EnvError, match="did not start"):  # nothing listens: the reconnection fails, named
            tools.call("add", {"a": 1, "b": 1})
        process = http_server(server, port)
        assert tools.call("add", {"a": 1, "b": 1}) == ("2", True, 3)
    finally:
        tools.close()
        process.kill()
        process.wait()
    with pytest.raises(EnvError, match="env.kwargs.mcp: .*not both"):
        load_factory("tasks", {"tools": [], "mcp": {"command": ["python"], "url": "http://127.0.0.1:1/mcp"}})
