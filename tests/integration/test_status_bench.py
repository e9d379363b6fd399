"""`streamfleet status` and `streamfleet bench` against a real fleet (echo worker).

Functional checks only (what the commands report, their exit codes); no timing
assertions, so they hold on a slow or busy CI machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from streamfleet.bench_stats import percentile, summarize
from streamfleet.status import mask_url
from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def sf(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "streamfleet", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_status_json_shows_lanes_worker_gateway_and_dead_letters(fleet, rds, key_prefix):
    worker = fleet.worker(backend="echo")
    gw = fleet.gateway()
    gateway_id = httpx.get(gw.http + "/healthz").json()["gateway_id"]
    rds.xadd(f"{key_prefix}:{{tiny-gpt}}:dead", {"task": json.dumps({"request_id": "r-dead"}),
                                                   "reason": "delivered 4 times", "lane": "normal"})

    res = sf(["status", "--json"], fleet.env())
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    assert st["key_prefix"] == key_prefix
    assert gateway_id in st["gateways"] and st["gateway_count"] >= 1
    assert st["cancel_listeners"] >= 1
    model = next(m for m in st["models"] if m["name"] == "tiny-gpt")
    lanes = {lane["lane"]: lane for lane in model["lanes"]}
    assert set(lanes) == {"high", "normal"}
    for lane in lanes.values():
        assert lane["key"] == f"{key_prefix}:{{tiny-gpt}}:tasks:{lane['lane']}"
        assert lane["exists"] and lane["length"] == 0 and lane["pending"] == 0 and lane["lag"] == 0
    [w] = model["workers"]
    assert w["pid"] == worker.popen.pid and not w["stale"] and w["max_batch"] == 16
    assert w["heartbeat_age_s"] is not None
    assert model["live_workers"] == 1
    assert model["dead_count"] == 1
    assert model["dead_latest"][0]["reason"] == "delivered 4 times"
    assert model["dead_latest"][0]["request_id"] == "r-dead"

    # --model narrows it; the text report names the same things
    res = sf(["status", "--model", "tiny-gpt"], fleet.env())
    assert res.returncode == 0, res.stderr
    assert "model tiny-gpt" in res.stdout and "bench-gpt" not in res.stdout
    assert gateway_id in res.stdout and str(worker.popen.pid) in res.stdout
    assert "delivered 4 times" in res.stdout


def test_status_marks_stale_workers_and_shows_backlog(fleet, rds, key_prefix):
    key = f"{key_prefix}:workers:ghost-model"
    rds.hset(key, "w-old", json.dumps({"heartbeat": 1.0, "slots_used": 3, "max_batch": 8, "tokens_per_s": 0,
                                       "pid": 1, "host": "gone", "draining": False}))
    lane = f"{key_prefix}:{{ghost-model}}:tasks:high"
    rds.xgroup_create(lane, "workers", id="0", mkstream=True)
    for _ in range(3):
        rds.xadd(lane, {"task": "{}"})
    rds.xreadgroup("workers", "w-old", {lane: ">"}, count=1)

    res = sf(["status", "--json", "--model", "ghost-model"], fleet.env())
    assert res.returncode == 0, res.stderr
    [model] = json.loads(res.stdout)["models"]
    assert model["workers"][0]["stale"] and model["live_workers"] == 0 and model["stale_workers"] == 1
    high = next(x for x in model["lanes"] if x["lane"] == "high")
    assert (high["length"], high["pending"], high["lag"]) == (3, 1, 2)
    assert high["oldest_pending"]["consumer"] == "w-old" and high["oldest_pending"]["deliveries"] == 1
    assert high["oldest_queued"] is not None
    res = sf(["status", "--model", "ghost-model"], fleet.env())
    assert "STALE" in res.stdout


@pytest.mark.slow
def test_status_counts_the_workers_reading_each_lane(fleet, rds, key_prefix):
    """A lane's consumers are its live workers, including a speech worker that has had no
    utterance yet (Redis adds a group consumer only at its first delivery), and not a
    worker that is gone (its consumer stays in the group: ``group_consumers``)."""
    fleet.worker(model="asr-en")
    fleet.worker(backend="echo")
    ghost = f"{key_prefix}:{{ghost-model}}:tasks:high"
    rds.xgroup_create(ghost, "workers", id="0", mkstream=True)
    rds.xadd(ghost, {"task": "{}"})
    rds.xreadgroup("workers", "w-gone", {ghost: ">"}, count=1)

    res = sf(["status", "--json"], fleet.env())
    assert res.returncode == 0, res.stderr
    models = {m["name"]: m for m in json.loads(res.stdout)["models"]}
    for name in ("asr-en", "tiny-gpt"):
        assert models[name]["live_workers"] == 1
        for lane in models[name]["lanes"]:
            assert lane["consumers"] == 1, (name, lane)
            assert lane["group_consumers"] == 0, (name, lane)  # neither has had a task yet
    res = sf(["status", "--json", "--model", "ghost-model"], fleet.env())
    [ghost_model] = json.loads(res.stdout)["models"]
    high = next(x for x in ghost_model["lanes"] if x["lane"] == "high")
    assert (high["consumers"], high["group_consumers"], high["pending"]) == (0, 1, 1)

    text = sf(["status", "--model", "asr-en"], fleet.env()).stdout
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["high"], ["normal"])]
    assert [row[4] for row in rows] == ["1", "1"], text


def test_status_without_redis_fails_clearly(fleet):
    env = fleet.env()
    env["SF_REDIS_URL"] = f"redis://127.0.0.1:{free_port()}/0"
    res = sf(["status"], env)
    assert res.returncode == 2
    assert "cannot read the fleet from Redis" in res.stderr


def check_bench_json(out: dict, transport: str, requests: int, max_tokens: int) -> None:
    """One closed-loop run of ``requests`` requests, every one ok, as ``--json`` reports it."""
    assert out["requests"] == {"total": requests, "ok": requests, "failed": 0}
    assert out["errors"] == {}
    assert out["tokens"] == requests * max_tokens
    assert out["config"]["transport"] == transport and out["config"]["mode"] == "closed"
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        for p in ("p50", "p90", "p99", "mean", "max"):
            assert out[key][p] is not None and out[key][p] >= 0, (key, p)
    assert out["ttft_ms"]["count"] == requests and out["e2e_ms"]["count"] == requests
    assert out["itl_ms"]["count"] > 0
    assert out["tokens_per_s"] > 0 and out["requests_per_s"] > 0
    assert isinstance(out["sample"], str) and out["sample"], "the first request's text is shown"


@pytest.fixture(scope="module")
def bench_fleet(module_fleets):
    """``(fleet, gateway)``: an echo worker and a gateway shared by the bench runs that only
    send requests to them."""
    fleet = module_fleets()
    fleet.worker(backend="echo")
    return fleet, fleet.gateway()


@pytest.mark.parametrize("transport", ["ws", "sse", "grpc"])
def test_bench_json(bench_fleet, transport):
    fleet, gw = bench_fleet
    res = sf(["bench", "--url", gw.http, "--grpc-target", gw.grpc, "--transport", transport, "--requests", "20",
              "--concurrency", "4", "--max-tokens", "8", "--json"], fleet.env())
    assert res.returncode == 0, res.stderr + res.stdout
    out = json.loads(res.stdout)
    check_bench_json(out, transport, 20, 8)
    # the gRPC target is reported where it is used
    assert out["config"].get("grpc_target") == (gw.grpc if transport == "grpc" else None)


def test_bench_compares_transports(bench_fleet, tmp_path):
    """``--transport ws,sse,grpc``: the same load over each in turn, one table."""
    fleet, gw = bench_fleet
    args = ["bench", "--url", gw.http, "--grpc-target", gw.grpc, "--transport", "sse,grpc,ws", "--requests", "12",
            "--concurrency", "3", "--max-tokens", "6"]
    res = sf([*args, "--json"], fleet.env())
    assert res.returncode == 0, res.stderr + res.stdout
    out = json.loads(res.stdout)
    assert [r["config"]["transport"] for r in out["runs"]] == ["sse", "grpc", "ws"]
    for run in out["runs"]:
        check_bench_json(run, run["config"]["transport"], 12, 6)
    assert out["baseline"] == "ws"
    rows = {row["transport"]: row for row in out["table"]}
    assert set(rows) == {"ws", "sse", "grpc"}
    assert rows["ws"]["ratios"] == {"ttft_p50_ms": 1.0, "ttft_p99_ms": 1.0, "itl_p50_ms": 1.0, "tokens_per_s": 1.0}
    for row in rows.values():
        assert (row["ok"], row["failed"]) == (12, 0)
        assert row["tokens_per_s"] > 0 and row["ttft_p50_ms"] > 0 and row["ttft_p99_ms"] >= row["ttft_p50_ms"]
        assert row["ratios"]["tokens_per_s"] == pytest.approx(row["tokens_per_s"] / rows["ws"]["tokens_per_s"])

    res = sf([*args, "--png", str(tmp_path / "cmp.png")], fleet.env())
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == f"streamfleet bench: sse, grpc, ws -> {gw.http}, gRPC {gw.grpc}"
    assert "ratio to ws" in res.stdout and "errors    none" in res.stdout
    table = [ln.split() for ln in lines if ln.split()[:1] in (["ws"], ["sse"], ["grpc"])]
    assert [(row[0], row[1], row[2]) for row in table] == [("sse", "12", "0"), ("grpc", "12", "0"), ("ws", "12", "0")]
    assert table[2][-3:] == ["1.00", "1.00", "1.00"]
    assert (tmp_path / "cmp.png").exists() or "matplotlib is not installed" in res.stderr


@pytest.mark.slow
def test_bench_grpc_api_key_and_error_codes(fleet):
    """Over gRPC the key goes as ``authorization`` metadata, and a refusal counts under the
    fleet's error code (the ``streamfleet-error-code`` trailer), as over SSE (a WebSocket
    without a key is closed: ``connection_closed``)."""
    fleet.worker(backend="echo")
    gw = fleet.gateway(auth_enabled="true")
    keys = sf(["keys", "add", "bencher", "--tier", "paid"], fleet.env())
    assert keys.returncode == 0, keys.stderr
    args = ["bench", "--url", gw.http, "--grpc-target", gw.grpc, "--requests", "4", "--concurrency", "2",
            "--max-tokens", "4", "--json"]

    res = sf([*args, "--transport", "grpc"], {**fleet.env(), "SF_API_KEY": keys.stdout.strip()})
    assert res.returncode == 0, res.stderr + res.stdout
    check_bench_json(json.loads(res.stdout), "grpc", 4, 4)

    res = sf([*args, "--transport", "sse,grpc"], fleet.env())
    assert res.returncode == 1, "no request succeeded"
    out = json.loads(res.stdout)
    assert [run["errors"] for run in out["runs"]] == [{"unauthorized": 4}, {"unauthorized": 4}]


def test_bench_open_loop_mixed_lanes_text_report(bench_fleet, tmp_path):
    fleet, gw = bench_fleet
    res = sf(["bench", "--url", gw.ws, "--rate", "50", "--requests", "10", "--concurrency", "2", "--max-tokens",
              "4", "--lane", "mixed", "--png", str(tmp_path / "lat.png")], fleet.env())
    assert res.returncode == 0, res.stderr
    assert "10 ok, 0 failed" in res.stdout and "open loop at 50 req/s" in res.stdout
    assert "TTFT" in res.stdout and "errors    none" in res.stdout
    # the plot is written when matplotlib is there, else a message says why not
    assert (tmp_path / "lat.png").exists() or "matplotlib is not installed" in res.stderr


def test_bench_unreachable_gateway_exits_nonzero(fleet):
    url, target = f"http://127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    for transport, where in (("ws", url), ("sse", url), ("grpc", target), ("ws,grpc", url)):
        res = sf(["bench", "--url", url, "--grpc-target", target, "--transport", transport, "--requests", "2"],
                 fleet.env(), timeout=60)
        assert res.returncode == 2
        assert f"cannot reach the gateway at {where}" in res.stderr
        assert "Traceback" not in res.stderr


def test_bench_rejects_bad_settings(fleet):
    res = sf(["bench", "--transport", "pigeon"], fleet.env())
    assert res.returncode == 2 and "transport must be one of ws, sse, grpc" in res.stderr
    res = sf(["bench", "--transport", "ws,grpc,ws"], fleet.env())
    assert res.returncode == 2 and "names a transport twice" in res.stderr


def test_percentiles_and_masking():
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 90) == 90.0
    s = summarize([1.0, 3.0])
    assert s["count"] == 2 and s["mean"] == 2.0 and s["max"] == 3.0
    assert mask_url("redis://:secret@h:6379/0") == "redis://:***@h:6379/0"
    assert mask_url("redis://u:pw@h/0") == "redis://u:***@h/0"
    assert mask_url("redis://h:6379/0") == "redis://h:6379/0"
