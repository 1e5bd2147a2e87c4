"""The agent env's OpenAI-compatible endpoint over real HTTP (issue 70): each bad request refused in OpenAI's error
shape, the key and Content-Length before the body, timeouts and slow clients, tokens streamed as the engine samples
them; and what an agent is not handed (issue 71): no key material in completion ids, a hung synchronous agent
abandoned and counted, its client with a timeout."""

from __future__ import annotations

import http.client
import json
import socket
import time
from pathlib import Path

import openai
import pytest
from test_openai_agent import run_agents

from rollout.agents.endpoint import ChatEndpoint, EndpointLimits
from rollout.agents.trajectory import AgentEnv
from rollout.engines.torch_engine import TorchEngine
from rollout.envs.base import load_factory

REPO = Path(__file__).resolve().parent.parent
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def served(tmp_path):
    """An endpoint with one real trajectory routed (not started: a request that reached it would wait)."""
    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"question": "a"}\n{"question": "b"}\n')
    factory = load_factory("agent", {"entry": "outside_agents:two_turns", "tasks": str(tasks)})
    endpoint = ChatEndpoint("policy", limits=EndpointLimits(max_body_bytes=2**20, body_timeout_s=0.5,
                                                            idle_timeout_s=0.5))
    trajectory = AgentEnv(factory)
    key, url = endpoint.add(trajectory)
    yield endpoint, key, trajectory, factory
    endpoint.close()


def exchange(endpoint: ChatEndpoint, head: str, body: bytes = b"") -> tuple[int, dict, dict]:
    """Send `head` (and `body`) on a fresh connection; the reply's status, headers and JSON."""
    with socket.create_connection((endpoint.host, endpoint.port), timeout=10) as sock:
        sock.sendall(head.encode() + b"\r\n" + body)
        reply = http.client.HTTPResponse(sock)
        reply.begin()
        return reply.status, dict(reply.getheaders()), json.loads(reply.read())


def post(path: str, length: int, key: str | None = None) -> str:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\nContent-Length: {length}\r\n"


def openai_shape(payload: dict, code: str) -> None:
    assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}, payload
    assert payload["error"]["code"] == code and payload["error"]["message"], payload


def test_a_request_without_a_trajectorys_key_is_refused_before_its_body(served):
    endpoint, key, trajectory, _ = served
    for auth in (None, "not-a-trajectory"):  # no body follows the head: the refusal cannot have waited for it
        status, headers, payload = exchange(endpoint, post("/v1/chat/completions", 50_000, auth))
        assert status == 401 and headers["connection"] == "close"
        openai_shape(payload, "invalid_api_key")
    status, _, payload = exchange(endpoint, post("/t/nobody/v1/chat/completions", 50_000))
    assert status == 404
    openai_shape(payload, "unknown_trajectory")
    assert trajectory.incoming is None


def test_a_body_over_the_limit_is_refused_on_its_content_length(served):
    endpoint, key, trajectory, _ = served
    status, headers, payload = exchange(endpoint, post(f"/t/{key}/v1/chat/completions", 10**12))  # never sent
    assert status == 413 and headers["connection"] == "close"
    openai_shape(payload, "request_too_large")
    status, _, payload = exchange(endpoint, post("/v1/async-rl/reward", 2**20 + 1, key))
    assert status == 413
    assert trajectory.incoming is None


def test_malformed_or_too_deeply_nested_json_gets_400_in_openais_shape(served):
    endpoint, key, trajectory, factory = served
    deep = b"[" * 100_000 + b"]" * 100_000  # deeper than the decoder recurses
    nested = json.dumps(dict(CHAT, tools=[{"type": "function", "function": {"name": "f", "parameters": json.loads(
        "[" * 70 + "]" * 70)}}])).encode()  # decodes, but past max_json_depth
    for body in (b'{"model": "policy", "messages": [', deep, nested, b"\xff\xfe"):
        status, _, payload = exchange(endpoint, post(f"/t/{key}/v1/chat/completions", len(body)), body)
        assert status == 400, payload
        openai_shape(payload, "invalid_json")
    status, _, payload = exchange(endpoint, "GET /v1/models HTTP/1.1\r\nHost: x\r\n")  # the server is still up
    assert status == 200 and payload["data"][0]["id"] == "policy"
    assert trajectory.incoming is None and factory.counts["bad_requests"] == 0


def test_an_unknown_model_gets_404_in_openais_shape(served):
    endpoint, key, trajectory, _ = served
    client = openai.OpenAI(base_url=f"{endpoint.url}", api_key=key, max_retries=0, timeout=10)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=CHAT["messages"])
    assert caught.value.code == "model_not_found" and "'policy'" in caught.value.message
    status, _, payload = exchange(endpoint, "POST /v1/no/such HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n")
    assert status == 404
    openai_shape(payload, "not_found")
    assert trajectory.incoming is None


def test_a_body_that_never_arrives_gets_408_and_a_silent_connection_is_closed(served):
    endpoint, key, trajectory, _ = served
    status, headers, payload = exchange(endpoint, post(f"/t/{key}/v1/chat/completions", 100), b'{"mo')
    assert status == 408 and headers["connection"] == "close"
    openai_shape(payload, "request_timeout")
    with socket.create_connection((endpoint.host, endpoint.port), timeout=10) as silent:
        silent.sendall(b"POST /v1/chat/comp")  # half a request head, then nothing
        assert silent.recv(100) == b""  # closed by the server (idle_timeout_s), not by our timeout
    assert trajectory.incoming is None


def test_200_connections_that_never_send_a_body_do_not_stop_a_completion(tmp_path):
    import outside_agents

    sink, _, counts, tokenizer = run_agents(tmp_path, "outside_agents:slow_clients",
                                            [{"id": "s0", "question": "slow"}, {"id": "s1", "question": "clients"}])
    assert [r for _, r in sink.outcomes.values()] == ["", ""], sink.outcomes
    for trajectory, stages in sink.stages.items():
        contents = [tokenizer.decode(act, skip_special_tokens=True) for _, act in stages]
        assert outside_agents.SEEN[sink.tasks[trajectory].id]["contents"] == contents
    assert counts["agent_completions"] == 2


class PausingEngine(TorchEngine):
    """The torch engine, pausing after each sampled token until the agent has a streamed piece (at most 1 s a
    token): whether the agent saw a piece before the generation returned is then not a matter of timing."""

    seen_while_generating: list[bool] = []

    def generate(self, prompts, params, on_token=None):
        import outside_agents

        first = outside_agents.STREAM["first_piece"]

        def pausing(row, token):
            on_token(row, token)
            if not first.is_set():
                first.wait(1.0)

        generations = super().generate(prompts, params, pausing if on_token is not None else None)
        self.seen_while_generating.append(first.is_set())
        first.clear()
        return generations


def test_stream_true_gets_the_tokens_as_the_engine_samples_them(tmp_path):
    import outside_agents
    from test_openai_agent import _byte_model_dir

    engine = PausingEngine(_byte_model_dir(), seed=0)
    sink, _, counts, tokenizer = run_agents(tmp_path, "outside_agents:streamed", [{"id": "t0", "question": "stream"},
                                                                             {"id": "t1", "question": "again"}],
                                            max_new_tokens=32, engine=engine)
    assert [r for _, r in sink.outcomes.values()] == ["", ""], sink.outcomes
    # a piece reached an agent inside each generate (2 trajectories x 2 turns: 2 to 4 calls)
    assert len(engine.seen_while_generating) >= 2 and all(engine.seen_while_generating)
    for trajectory, stages in sink.stages.items():
        seen = outside_agents.SEEN[sink.tasks[trajectory].id]
        # the pieces add up to the answer's content, token for token what the trajectory recorded; the second
        # request sent that content back and extended the trajectory (no history edit)
        assert seen["contents"] == [tokenizer.decode(act, skip_special_tokens=True) for _, act in stages]
        assert all(len(pieces) > 1 for pieces in seen["pieces"]), seen["pieces"]
    assert counts["agent_history_edits"] == 0 and counts["agent_completions"] == 4


# --- what an agent is handed (issue 71) ---------------------------------------------------------------------------


def test_completion_ids_carry_no_key_material(tmp_path):
    import outside_agents

    run_agents(tmp_path, "outside_agents:two_turns", [{"id": f"k{i}", "question": f"q{i}"} for i in range(3)])
    for seen in outside_agents.SEEN.values():
        key = seen["key"]
        pieces = {key[i:i + 4] for i in range(len(key) - 3)}
        assert len(set(seen["ids"])) == 2
        for completion_id in seen["ids"]:
            assert not any(piece in completion_id for piece in pieces), (completion_id, key)


def test_a_hung_synchronous_agent_is_abandoned_counted_and_its_client_times_out(tmp_path):
    import outside_agents

    release = outside_agents.HANG["release"]
    release.clear()
    factories: list = []
    try:
        sink, _, _, _ = run_agents(tmp_path, "outside_agents:sync_hangs", [{"id": "h0", "question": "x"},
                                                                                {"id": "h1", "question": "y"}],
                                            timeout_s=1.0, request_timeout_s=30.0, factory_out=factories)
        for _, reason in sink.outcomes.values():
            assert reason.startswith("timeout: env 'agent' step did not return within 1 s"), reason
        (factory,) = factories
        deadline = time.monotonic() + 10  # the trajectory is closed on a daemon thread (its env call hung)
        while factory.metrics()["agent_timeouts"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        counts = factory.metrics()
        assert counts["agent_timeouts"] == 2 and counts["agent_threads_abandoned"] == 2
        assert outside_agents.SEEN["h0"]["timeout"] == 30.0  # the agent's client gives up on a request
    finally:
        release.set()
    for thread in factory.abandoned_threads:
        thread.join(10)
    assert factory.metrics()["agent_threads_abandoned"] == 0  # counted while it ran, no longer


def test_the_docs_say_what_an_agent_is_trusted_with():
    section = (REPO / "docs" / "environments.md").read_text().split("**What an agent is trusted with.**", 1)[1]
    section = section.split("\n\n", 1)[0]
    for claim in ("worker's process", "route key", "crossed wires", "agent_threads_abandoned"):
        assert claim in section, claim

