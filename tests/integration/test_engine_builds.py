"""Engine builds as arq jobs, with a real redis-server: `streamfleet engines build
--queue` enqueues, an arq worker (the build step replaced by a CPU function that writes
a fake plan) builds and records the plan in Redis, `streamfleet engines list` shows it."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from streamfleet.shared.modelrepo import ModelSpec
from streamfleet.shared.schema import decode_plan_record
from streamfleet.workers.enginebuild import (
    JOB_NAME,
    enqueue_build,
    list_plans,
    make_worker,
    plans_key,
    queue_key,
    validate_queue,
)
from streamfleet.workers.engines import trt_plan

REPO = Path(__file__).resolve().parents[2]
FAKE_TRT = "10.99.0.1"


@pytest.fixture
def engines_dir(tiny_spec, tmp_path) -> Path:
    """A model repository holding a copy of tiny-gpt (its plans are written there)."""
    d = tmp_path / "engines" / "tiny-gpt"
    d.mkdir(parents=True)
    for name in ("engine.toml", tiny_spec.onnx, tiny_spec.tokenizer):
        shutil.copy(tiny_spec.path / name, d / name)
    return d.parent


def fake_builder(calls: list):
    """Stands in for TensorRT: the real plan path and key, a fake plan file."""

    def build(spec: ModelSpec, force: bool, options: dict) -> trt_plan.BuildResult:
        calls.append((spec.name, force, dict(options)))
        request = trt_plan.plan_request(spec, FAKE_TRT, "90", options)
        if request.path.exists() and not force:
            return trt_plan.BuildResult.from_sidecar(request)
        return trt_plan.write_plan(request, b"fake plan for " + spec.name.encode(), 0.25)

    return build


def cli(args: list[str], redis_url: str, prefix: str, engines_dir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SF_") and k != "REDIS_URL"}
    env.update(SF_REDIS_URL=redis_url, SF_KEY_PREFIX=prefix, SF_ENGINES_DIR=str(engines_dir))
    return subprocess.run([sys.executable, "-m", "streamfleet", "engines", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


async def run_worker_until_empty(redis_url: str, prefix: str, queue: str, builder, engines_dir: Path) -> None:
    worker = make_worker(redis_url=redis_url, prefix=prefix, queue=queue, builder=builder,
                         engines_dir=str(engines_dir), host="gpu-host-1", burst=True, handle_signals=False,
                         poll_delay=0.05)
    try:
        await worker.async_run()
    finally:
        await worker.close()


async def test_build_job_round_trip(redis_server, key_prefix, engines_dir):
    from arq import create_pool
    from arq.connections import RedisSettings

    calls: list = []
    pool = await create_pool(RedisSettings.from_dsn(redis_server.url))
    try:
        job = await enqueue_build(pool, key_prefix, "sm90", "tiny-gpt", options={"tf32": True})
        assert await pool.zcard(queue_key(key_prefix, "sm90")) == 1
        assert await pool.zcard(queue_key(key_prefix, "sm89")) == 0
        await run_worker_until_empty(redis_server.url, key_prefix, "sm90", fake_builder(calls), engines_dir)
        record = await job.result(timeout=10)
        assert calls == [("tiny-gpt", False, {"tf32": True})]
        assert record["host"] == "gpu-host-1" and record["cc"] == "90" and record["trt_version"] == FAKE_TRT
        assert record["queue"] == "sm90" and record["built"] is True and record["seconds"] == 0.25
        plan = Path(record["path"])
        assert plan.read_bytes() == b"fake plan for tiny-gpt"
        assert plan.parent == engines_dir / "tiny-gpt" / "plans"
        assert plan.name == f"10.99-sm90-{record['key'][:16]}.plan"
        stored = await pool.hgetall(plans_key(key_prefix, "tiny-gpt"))
        assert list(stored) == [record["key"].encode()]
        assert decode_plan_record(stored[record["key"].encode()]) == record
        # and `streamfleet engines list` reads the same record back
        assert await list_plans(pool, key_prefix, "tiny-gpt") == [record]

        # a second build of the same plan finds it; --force builds again
        again = await enqueue_build(pool, key_prefix, "sm90", "tiny-gpt", options={"tf32": True})
        forced = await enqueue_build(pool, key_prefix, "sm90", "tiny-gpt", force=True, options={"tf32": True})
        await run_worker_until_empty(redis_server.url, key_prefix, "sm90", fake_builder(calls), engines_dir)
        assert (await again.result(timeout=10))["built"] is False
        assert (await forced.result(timeout=10))["built"] is True
        assert await pool.hlen(plans_key(key_prefix, "tiny-gpt")) == 1  # same key, one record
    finally:
        await pool.aclose()


async def test_failed_build_is_reported_and_not_recorded(redis_server, key_prefix, engines_dir):
    from arq import create_pool
    from arq.connections import RedisSettings

    def broken(spec, force, options):
        raise RuntimeError("TensorRT's ONNX parser rejected the graph")

    pool = await create_pool(RedisSettings.from_dsn(redis_server.url))
    try:
        job = await enqueue_build(pool, key_prefix, "sm90", "tiny-gpt")
        missing = await enqueue_build(pool, key_prefix, "sm90", "no-such-model")
        await run_worker_until_empty(redis_server.url, key_prefix, "sm90", broken, engines_dir)
        with pytest.raises(RuntimeError, match="parser rejected"):
            await job.result(timeout=10)
        with pytest.raises(Exception, match="no-such-model"):
            await missing.result(timeout=10)
        assert await pool.exists(plans_key(key_prefix, "tiny-gpt")) == 0
    finally:
        await pool.aclose()


def test_cli_enqueue_then_list(redis_server, key_prefix, engines_dir):
    import asyncio

    proc = cli(["build", "tiny-gpt", "--queue", "sm90", "--option", "builder_optimization_level=4"],
               redis_server.url, key_prefix, engines_dir)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip()
    assert f"{key_prefix}:arq:build:sm90" in proc.stderr and job_id
    r = redis.Redis.from_url(redis_server.url)
    try:
        assert r.zcard(queue_key(key_prefix, "sm90")) == 1
        queued = cli(["list", "--json"], redis_server.url, key_prefix, engines_dir)
        assert queued.returncode == 0, queued.stderr
        doc = json.loads(queued.stdout)
        assert doc["plans"] == [] and doc["queues"][0]["queue"] == "sm90" and doc["queues"][0]["queued"] == 1

        calls: list = []
        asyncio.run(run_worker_until_empty(redis_server.url, key_prefix, "sm90", fake_builder(calls), engines_dir))
        assert calls == [("tiny-gpt", False, {"builder_optimization_level": 4})]
        assert r.zcard(queue_key(key_prefix, "sm90")) == 0
    finally:
        r.close()

    listed = cli(["list"], redis_server.url, key_prefix, engines_dir)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split()[:5] == ["MODEL", "KEY", "HOST", "TRT", "ARCH"]
    row = lines[1].split()
    assert row[0] == "tiny-gpt" and row[2] == "gpu-host-1" and row[3] == FAKE_TRT and row[4] == "sm90"
    as_json = json.loads(cli(["list", "tiny-gpt", "--json", "--local"], redis_server.url, key_prefix,
                             engines_dir).stdout)
    (plan,) = as_json["plans"]
    assert plan["model"] == "tiny-gpt" and Path(plan["path"]).exists()
    assert [f["key"] for f in as_json["local"]] == [plan["key"]]
    assert row[1] == plan["key"][:16]


def test_cli_refusals(redis_server, key_prefix, engines_dir):
    bad = cli(["build", "tiny-gpt", "--queue", "sm 90"], redis_server.url, key_prefix, engines_dir)
    assert bad.returncode == 2 and "queue" in bad.stderr
    nobody = cli(["list"], "redis://127.0.0.1:1/0", key_prefix, engines_dir)
    assert nobody.returncode == 1 and "cannot reach Redis" in nobody.stderr
    if importlib.util.find_spec("tensorrt") is None:
        # building here needs TensorRT: a clear message on a machine without it
        here = cli(["build", "tiny-gpt"], redis_server.url, key_prefix, engines_dir)
        assert here.returncode == 1 and "needs the 'tensorrt' package" in here.stderr
    if shutil.which("nvidia-smi") is None:
        worker = cli(["worker", "--queue", "sm90"], redis_server.url, key_prefix, engines_dir)
        assert worker.returncode == 1 and "no NVIDIA GPU" in worker.stderr


def test_queue_names():
    assert validate_queue("sm90") == "sm90" and queue_key("sf", "sm100") == "sf:arq:build:sm100"
    assert plans_key("sf", "tiny-gpt") == "sf:plans:tiny-gpt"
    for bad in ("", "sm 90", "a" * 65, "sm90/x", "sm*"):
        with pytest.raises(ValueError):
            validate_queue(bad)
    assert JOB_NAME == "build_engine"
