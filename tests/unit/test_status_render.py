"""`streamfleet status`'s text report (streamfleet/status.py ``render``) for models of each
kind: what a worker's figures mean depends on it (docs/status.md)."""

from __future__ import annotations

from streamfleet.status import FleetStatus, LaneStatus, ModelStatus, WorkerStatus


def _model(name: str, kind: str | None, tokens_per_s: float, max_batch: int) -> ModelStatus:
    lanes = [LaneStatus(lane=lane, key=f"sf:{{{name}}}:tasks:{lane}", exists=True, lag=0, consumers=1)
             for lane in ("high", "normal")]
    worker = WorkerStatus(id=f"w-{name}", slots_used=1, max_batch=max_batch, tokens_per_s=tokens_per_s,
                          heartbeat_age_s=0.5, pid=42, host="vm", draining=False, stale=False)
    return ModelStatus(name=name, kind=kind, lanes=lanes, workers=[worker])


def _workers_table(text: str, name: str) -> tuple[list[str], list[str]]:
    """The header and the row of ``name``'s worker table."""
    lines = text.splitlines()
    row = next(i for i, line in enumerate(lines) if line.strip().startswith(f"w-{name} "))
    return lines[row - 2].split("  "), lines[row].split()


def test_each_kind_shows_what_its_workers_report():
    st = FleetStatus(redis_url="redis://127.0.0.1:6379/0", key_prefix="sf", time=0.0, redis_version="7.2",
                     gateways=[], cancel_listeners=0, worker_ttl_s=10.0,
                     models=[_model("chat", "text", 630.0, 16), _model("vectors", "embedding", 1234.5, 64),
                             _model("speech", "asr", 0.0, 2), _model("ghost", None, 7.0, 8)])
    text = __import__("streamfleet.status", fromlist=["render"]).render(st)
    assert "model chat: backlog" in text and "model ghost: backlog" in text
    assert "model vectors (embedding): backlog" in text and "model speech (asr): backlog" in text

    def headers(name):
        return [h.strip() for h in _workers_table(text, name)[0] if h.strip()]

    # a text model (or one the repository lacks): generated tokens/s and the prefix cache
    for name in ("chat", "ghost"):
        assert headers(name) == ["worker", "state", "slots", "tokens/s", "prefix cache", "heartbeat", "pid", "host"]
    assert _workers_table(text, "chat")[1][:4] == ["w-chat", "live", "1/16", "630.0"]
    # an embedding model: the input tokens it embeds, no prefix cache
    assert headers("vectors") == ["worker", "state", "slots", "input tokens/s", "heartbeat", "pid", "host"]
    assert _workers_table(text, "vectors")[1][:4] == ["w-vectors", "live", "1/64", "1234.5"]
    # a speech model: no rate at all (it reports none)
    assert headers("speech") == ["worker", "state", "slots", "heartbeat", "pid", "host"]
    assert _workers_table(text, "speech")[1][:3] == ["w-speech", "live", "1/2"]
    assert st.to_dict()["models"][1]["kind"] == "embedding"


def test_the_execution_mode_each_worker_runs_is_said_once_with_why():
    chat = _model("chat", "text", 40.0, 16)
    chat.workers[0].execution, chat.workers[0].execution_why = "q4", "fastest passing the quality gate"
    second = WorkerStatus(id="w-chat2", slots_used=0, max_batch=16, tokens_per_s=0.0, heartbeat_age_s=0.1, pid=43,
                          host="vm2", draining=False, stale=False, execution="fp32", execution_why="pinned")
    chat.workers.append(second)
    st = FleetStatus(redis_url="redis://127.0.0.1:6379/0", key_prefix="sf", time=0.0, redis_version="7.2",
                     gateways=[], cancel_listeners=0, worker_ttl_s=10.0, models=[chat, _model("ghost", None, 7.0, 8)])
    text = __import__("streamfleet.status", fromlist=["render"]).render(st)
    assert "  execution (w-chat): q4: fastest passing the quality gate" in text
    assert "  execution (w-chat2): fp32: pinned" in text
    assert text.count("execution (") == 2  # a model whose workers say none: no line
    assert st.to_dict()["models"][0]["workers"][0]["execution"] == "q4"


def test_a_heartbeat_carries_the_execution_mode_only_when_there_is_one():
    from streamfleet.shared.schema import Heartbeat

    hb = Heartbeat(heartbeat=1.0, execution="q4-int8act", execution_why="fastest")
    back = Heartbeat.decode(hb.encode(), "w1")
    assert (back.execution, back.execution_why, back.worker_id) == ("q4-int8act", "fastest", "w1")
    assert b"execution" not in Heartbeat(heartbeat=1.0).encode()


def test_each_text_workers_step_target_and_learned_costs_are_shown():
    """A worker's heartbeat carries its step target and the step costs it learned
    (workers/stepcost.py); status shows them in a line per worker, and in its JSON."""
    from streamfleet.shared.schema import Heartbeat
    from streamfleet.workers.stepcost import StepCosts, StepShape

    costs = StepCosts()
    for n in range(20):
        s = StepShape()
        s.chunk(100 * n, 32 + n)
        s.decode(200)
        costs.observe(s, 0.01 + 0.0007 * (32 + n) + 0.002)
    hb = Heartbeat(heartbeat=1.0, step_target_ms=100.0, step_costs=costs.describe() | {"chunk": 51.0})
    back = Heartbeat.decode(hb.encode(), "w1")
    assert back.step_target_ms == 100.0 and back.step_costs == hb.step_costs and back.step_costs["steps"] == 20
    assert b"step_costs" not in Heartbeat(heartbeat=1.0).encode()
    assert Heartbeat.decode(b'{"heartbeat": 1, "step_costs": {"token_ms": "x", "seq_ms": 2}}').step_costs == \
        {"seq_ms": 2.0}

    chat = _model("chat", "text", 40.0, 16)
    chat.workers[0].step_target_ms, chat.workers[0].step_costs = back.step_target_ms, back.step_costs
    st = FleetStatus(redis_url="redis://127.0.0.1:6379/0", key_prefix="sf", time=0.0, redis_version="7.2",
                     gateways=[], cancel_listeners=0, worker_ttl_s=10.0, models=[chat])
    text = __import__("streamfleet.status", fromlist=["render"]).render(st)
    [line] = [ln for ln in text.splitlines() if ln.startswith("  steps (w-chat): ")]
    assert "target 100 ms; learned over 20 steps:" in line and "ms a prompt token" in line
    assert line.endswith("last chunk 51 tokens")
    assert st.to_dict()["models"][0]["workers"][0]["step_costs"]["chunk"] == 51.0
