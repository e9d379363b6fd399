"""The gRPC door (streamfleet.v1.Inference, health, reflection) through real gateway and
worker processes, with a grpcio client."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import grpc
import httpx
import orjson
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from streamfleet.shared.schema import LogEntry, TokenEvent
from streamfleet.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc
from tests.support.grpcclient import aio_channel, sync_channel
from tests.support.keys import TIERS, add_key
from tests.support.wait import until_async
from tests.support.wsclient import Client

PROMPT = "Once upon a time"
SERVICE = "streamfleet.v1.Inference"


class Call:
    """One Generate or Resume call, read to its end."""

    def __init__(self) -> None:
        self.accepted: pb.Accepted | None = None
        self.tokens: list[pb.Token] = []
        self.done: pb.Done | None = None
        self.error: grpc.aio.AioRpcError | None = None

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)

    @property
    def indices(self) -> list[int]:
        return [t.index for t in self.tokens]

    @property
    def code(self) -> grpc.StatusCode:
        return self.error.code() if self.error is not None else grpc.StatusCode.OK

    def trailer(self, key: str):
        return dict(self.error.trailing_metadata() or ()).get(key) if self.error is not None else None

    async def read(self, call, upto: int | None = None) -> Call:
        """Read events (until ``upto`` tokens when given); a failed call's status is kept."""
        try:
            async for ev in call:
                kind = ev.WhichOneof("event")
                if kind == "accepted":
                    assert self.accepted is None and not self.tokens, "Accepted comes first, once"
                    self.accepted = ev.accepted
                elif kind == "token":
                    assert self.done is None
                    self.tokens.append(ev.token)
                    if upto is not None and len(self.tokens) >= upto:
                        return self
                else:
                    assert self.done is None, "exactly one terminal event"
                    self.done = ev.done
        except grpc.aio.AioRpcError as exc:
            self.error = exc
        return self


async def generate(stub, metadata=None, timeout=None, **fields) -> Call:
    return await Call().read(stub.Generate(pb.GenerateRequest(**fields), metadata=metadata, timeout=timeout))


def channel(gw) -> grpc.aio.Channel:
    return aio_channel(gw.grpc)


def status_details(err: grpc.aio.AioRpcError) -> dict:
    """The ErrorInfo and RetryInfo of a failed call's google.rpc.Status."""
    raw = dict(err.trailing_metadata())["grpc-status-details-bin"]
    status = status_pb2.Status.FromString(raw)
    assert status.code == err.code().value[0] and status.message == err.details()
    out = {}
    for d in status.details:
        if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            d.Unpack(info)
            out["reason"], out["domain"], out["metadata"] = info.reason, info.domain, dict(info.metadata)
        elif d.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            d.Unpack(retry)
            out["retry_ms"] = retry.retry_delay.seconds * 1000 + retry.retry_delay.nanos // 1_000_000
    return out


@pytest.mark.slow
@pytest.mark.both_brokers
async def test_same_seed_same_text_over_websocket_sse_and_grpc(fleet):
    gw = fleet.gateway()
    fleet.worker()  # the demo model on ONNX Runtime: sampled text, so the seed decides it
    params = dict(max_tokens=24, temperature=0.9, seed=7, ignore_eos=True)
    ws = await Client.connect(gw.ws)
    ref = await ws.generate("w", PROMPT, **params)
    await ws.close()
    assert ref.end["type"] == "done" and len(ref.tokens) == 24
    sse_text = ""
    async with httpx.AsyncClient(timeout=60) as http, http.stream(
            "POST", gw.http + "/v1/completions", json={"prompt": PROMPT, "stream": True, **params}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                sse_text += "".join(c["text"] for c in orjson.loads(line[6:])["choices"])
    async with channel(gw) as ch:
        stub = pb_grpc.InferenceStub(ch)
        g = await generate(stub, prompt=PROMPT, **params)
        assert g.code == grpc.StatusCode.OK, g.error
        # Stream carries the same request under the client's id
        call = stub.Stream()
        await call.write(pb.ClientFrame(id="s", generate=pb.GenerateRequest(prompt=PROMPT, **params)))
        await call.done_writing()
        frames = [f async for f in call]
        assert await call.code() == grpc.StatusCode.OK
    assert ref.text == sse_text == g.text == "".join(f.token.text for f in frames if f.HasField("token"))
    assert g.indices == list(range(24)) and g.accepted.request_id and g.accepted.resume_token
    # the terminal event has the WebSocket done frame's fields and values
    done = ref.end
    assert g.done.finish_reason == done["finish_reason"] == "length"
    assert (g.done.usage.prompt_tokens, g.done.usage.completion_tokens) == \
        (done["usage"]["prompt_tokens"], done["usage"]["completion_tokens"])
    assert g.done.request_id == g.accepted.request_id and g.done.model_version == done["model_version"]
    assert g.done.timing.total_ms > 0 and set(done["timing"]) == {"queue_ms", "ttft_ms", "total_ms"}
    assert frames[0].WhichOneof("frame") == "accepted" and frames[-1].HasField("done")
    assert all(f.id == "s" for f in frames)


@pytest.mark.slow
async def test_many_requests_on_one_stream_call_with_cancel_and_bad_frames(fleet):
    gw = fleet.gateway(max_inflight_per_connection=40)
    fleet.worker(backend="echo", echo_delay_ms=5)
    n = 32
    async with channel(gw) as ch:
        call = pb_grpc.InferenceStub(ch).Stream()
        for i in range(n):
            await call.write(pb.ClientFrame(id=f"r{i}", generate=pb.GenerateRequest(
                prompt=f"{PROMPT} {i}", max_tokens=20, ignore_eos=True)))
        await call.write(pb.ClientFrame(id="long", generate=pb.GenerateRequest(prompt=PROMPT, max_tokens=240,
                                                                               ignore_eos=True)))
        await call.write(pb.ClientFrame(id="r0", generate=pb.GenerateRequest(prompt=PROMPT)))  # in flight
        await call.write(pb.ClientFrame(id="nobody", cancel=pb.Cancel()))
        await call.write(pb.ClientFrame(id="x"))  # no frame
        await call.write(pb.ClientFrame(id="bad", generate=pb.GenerateRequest(prompt=PROMPT, top_p=0)))
        by_id: dict[str, list] = {}
        cancelled = False
        async for f in call:
            by_id.setdefault(f.id, []).append(f)
            long_tokens = [x for x in by_id.get("long", []) if x.HasField("token")]
            if not cancelled and len(long_tokens) >= 3:
                await call.write(pb.ClientFrame(id="long", cancel=pb.Cancel()))
                cancelled = True
            if f.id == "long" and f.HasField("done"):
                await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
    for i in range(n):
        frames = by_id[f"r{i}"]
        if i == 0:  # the duplicate's error went under its id too, without ending the first
            dup = [f for f in frames if f.HasField("error")]
            assert len(dup) == 1 and dup[0].error.code == "duplicate_id" and dup[0].error.status == 400
            frames = [f for f in frames if not f.HasField("error")]
        assert frames[0].HasField("accepted") and frames[-1].HasField("done")
        assert [f.token.index for f in frames if f.HasField("token")] == list(range(20))
        assert frames[-1].done.usage.completion_tokens == 20
    long = by_id["long"]
    assert long[-1].done.finish_reason == "cancelled" and long[-1].done.usage.completion_tokens < 240
    assert by_id["nobody"][0].error.code == "unknown_id"
    assert by_id["x"][0].error.code == "invalid_frame"
    assert by_id["bad"][0].error.code == "out_of_range" and by_id["bad"][0].error.param == "top_p"


async def test_every_error_code_from_its_bad_input(fleet, rds, key_prefix):
    gw = fleet.gateway(auth_enabled="true", tiers=TIERS, lane_capacity='{"high": 4, "normal": 4}',
                       overload_fraction=0.5)
    key = add_key(fleet, "carol", "test")  # normal lane only, no stream cap
    bearer = (("authorization", f"Bearer {key}"),)
    async with channel(gw) as ch:
        stub = pb_grpc.InferenceStub(ch)
        # no key, a wrong key
        c = await generate(stub, prompt=PROMPT)
        assert c.code == grpc.StatusCode.UNAUTHENTICATED and c.trailer("streamfleet-error-code") == "unauthorized"
        c = await generate(stub, metadata=(("authorization", "Bearer sf-000000000000-nope"),), prompt=PROMPT)
        assert c.code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.ListModels(pb.ListModelsRequest())
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # bad arguments: the same codes as the WebSocket's error frames, nothing enqueued
        for fields, code, param in [
            (dict(prompt=PROMPT, max_tokens=0), "out_of_range", "max_tokens"),
            (dict(prompt=PROMPT, temperature=3.5), "out_of_range", "temperature"),
            (dict(prompt=PROMPT, seed=2**63), "out_of_range", "seed"),
            (dict(), "missing_field", "prompt"),
            (dict(prompt=PROMPT, messages=[pb.ChatMessage(role="user", content="hi")]), "missing_field", "prompt"),
            (dict(messages=[pb.ChatMessage(role="robot", content="hi")]), "invalid_request", "messages"),
            (dict(prompt=PROMPT, priority=7), "out_of_range", "priority"),
            (dict(prompt=PROMPT, stop=[""]), "out_of_range", "stop"),
        ]:
            c = await generate(stub, metadata=bearer, **fields)
            assert c.code == grpc.StatusCode.INVALID_ARGUMENT, (fields, c.error)
            assert c.trailer("streamfleet-error-code") == code and c.trailer("streamfleet-error-param") == param
            assert status_details(c.error) == {"reason": code, "domain": "streamfleet", "metadata": {"param": param}}
        c = await generate(stub, metadata=bearer, prompt=PROMPT, model="no-such-model")
        assert c.code == grpc.StatusCode.NOT_FOUND and c.trailer("streamfleet-error-code") == "unknown_model"
        # the tier may not use the high lane
        c = await generate(stub, metadata=bearer, prompt=PROMPT, priority=pb.PRIORITY_HIGH)
        assert c.code == grpc.StatusCode.PERMISSION_DENIED and c.trailer("streamfleet-error-code") == "forbidden"
        # no worker: the normal lane (capacity 4, refused from 2) fills, then refuses with a retry delay
        held = [stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=2), metadata=bearer) for _ in range(2)]
        for h in held:
            ev = await h.read()
            assert ev.HasField("accepted")
        c = await generate(stub, metadata=bearer, prompt=PROMPT)
        assert c.code == grpc.StatusCode.RESOURCE_EXHAUSTED and c.trailer("streamfleet-error-code") == "overloaded"
        assert int(c.trailer("retry-after-ms")) == 1000 and status_details(c.error)["retry_ms"] == 1000
        for h in held:
            h.cancel()
        # resume: a request nobody has
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Resume(pb.ResumeRequest(request_id="0" * 32, from_index=0), metadata=bearer).read()
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Resume(pb.ResumeRequest(request_id="not-an-id!", from_index=0), metadata=bearer).read()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # a message over max_frame_bytes is refused by gRPC itself before any of it is handled
        c = await generate(stub, metadata=bearer, prompt="x" * (2 << 20))
        assert c.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # nothing invalid reached a lane: only the two held requests were ever enqueued
    lane = f"{key_prefix}:{{tiny-gpt}}:tasks:normal"
    waiting = f"{key_prefix}:{{tiny-gpt}}:fair:normal:queued"  # (the second waits its turn: fair share)
    assert rds.xinfo_stream(lane)["entries-added"] + rds.llen(waiting) == 2


@pytest.mark.slow
async def test_rate_limit_is_resource_exhausted_with_retry_info(fleet):
    tiers = '{"test": {"requests_per_minute": 1, "burst": 2, "max_streams": null, "max_lane": "normal"}}'
    gw = fleet.gateway(auth_enabled="true", tiers=tiers)
    fleet.worker(backend="echo")
    key = add_key(fleet, "dave", "test", tiers=tiers)
    bearer = (("authorization", f"Bearer {key}"),)
    async with channel(gw) as ch:
        stub = pb_grpc.InferenceStub(ch)
        codes = [(await generate(stub, metadata=bearer, prompt=PROMPT, max_tokens=2)) for _ in range(3)]
    assert [c.code for c in codes[:2]] == [grpc.StatusCode.OK] * 2
    assert codes[2].code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert codes[2].trailer("streamfleet-error-code") == "rate_limited"
    retry = int(codes[2].trailer("retry-after-ms"))
    assert 0 < retry <= 60_000 and status_details(codes[2].error)["retry_ms"] == retry


@pytest.mark.slow
async def test_a_revoked_key_ends_its_calls(fleet):
    gw = fleet.gateway(auth_enabled="true", tiers=TIERS, key_cache_s=1)
    fleet.worker(backend="echo", echo_delay_ms=50)  # 240 tokens: 12 s, past the revocation
    key = add_key(fleet, "erin", "test")
    bearer = (("authorization", f"Bearer {key}"),)
    long = pb.GenerateRequest(prompt=PROMPT, max_tokens=240, ignore_eos=True)
    async with channel(gw) as ch:
        stub = pb_grpc.InferenceStub(ch)
        gen = stub.Generate(long, metadata=bearer)
        g = await Call().read(gen, upto=2)
        stream = stub.Stream(metadata=bearer)
        await stream.write(pb.ClientFrame(id="a", generate=long))
        assert (await stream.read()).HasField("accepted")
        out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "streamfleet", "keys", "revoke", "erin"],
                                      env=fleet.env(), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        await asyncio.wait_for(g.read(gen), 15)
        assert g.code == grpc.StatusCode.UNAUTHENTICATED and g.trailer("streamfleet-error-code") == "unauthorized"
        assert len(g.tokens) < 240
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(_drain(stream), 15)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def _drain(call) -> None:
    while await call.read() is not grpc.aio.EOF:
        pass


@pytest.mark.slow
async def test_cancelled_call_frees_the_worker_slot(fleet, rds, key_prefix):
    gw = fleet.gateway()
    fleet.worker(backend="echo", echo_delay_ms=20)
    lane = f"{key_prefix}:{{tiny-gpt}}:tasks:normal"
    async with channel(gw) as ch:
        call = pb_grpc.InferenceStub(ch).Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=240,
                                                                      ignore_eos=True))
        c = await Call().read(call, upto=3)
        assert rds.xpending(lane, "workers")["pending"] == 1
        call.cancel()
        t0 = time.monotonic()
        while rds.xpending(lane, "workers")["pending"] and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.01)
        assert rds.xpending(lane, "workers")["pending"] == 0
        assert time.monotonic() - t0 < 2.0
    # the worker stopped it at once: its log holds a few tokens, not 2000
    entries = rds.xrange(f"{key_prefix}:log:{c.accepted.request_id}")
    assert len(entries) < 200


async def test_deadline_shorter_than_the_queue_wait(fleet, rds, key_prefix):
    gw = fleet.gateway()  # no worker yet: the request waits in the lane
    lane = f"{key_prefix}:{{tiny-gpt}}:tasks:normal"
    async with channel(gw) as ch:
        t0 = time.monotonic()
        c = await generate(pb_grpc.InferenceStub(ch), timeout=1.0, prompt=PROMPT, max_tokens=5)
        waited = time.monotonic() - t0
    assert c.code == grpc.StatusCode.DEADLINE_EXCEEDED and c.accepted is not None and not c.tokens
    assert waited < 3
    rid = c.accepted.request_id
    fleet.worker(backend="echo")
    # the worker is done with it: deleted from the lane, nothing pending (it writes the
    # request's log before it acks)
    await until_async(lambda: rds.xlen(lane) == 0 and rds.xpending(lane, "workers")["pending"] == 0,
                      "the worker done with the task", timeout=10)
    # the task never ran: whatever the worker did with it (a cancel, or its deadline at
    # admission), the request's log holds no token
    events = [LogEntry.decode(fields).event for _, fields in rds.xrange(f"{key_prefix}:log:{rid}")]
    assert not [e for e in events if isinstance(e, TokenEvent)], events


@pytest.mark.slow
@pytest.mark.both_brokers
async def test_resume_on_another_gateway_after_the_first_dies(fleet):
    a, b = fleet.gateway(), fleet.gateway()
    fleet.worker(backend="echo", echo_delay_ms=20)
    n = 80
    async with channel(b) as chb:
        ref = await generate(pb_grpc.InferenceStub(chb), prompt=PROMPT, max_tokens=n, ignore_eos=True,
                             temperature=0.9, seed=5)
    cha = channel(a)
    first = await Call().read(pb_grpc.InferenceStub(cha).Generate(pb.GenerateRequest(
        prompt=PROMPT, max_tokens=n, ignore_eos=True, temperature=0.9, seed=5)), upto=10)
    a.popen.send_signal(signal.SIGKILL)  # the whole gateway dies mid-stream
    async with channel(b) as chb:
        rest = await Call().read(pb_grpc.InferenceStub(chb).Resume(pb.ResumeRequest(
            request_id=first.accepted.request_id, from_index=10, resume_token=first.accepted.resume_token)))
        # another client's token does not open it
        other = await Call().read(pb_grpc.InferenceStub(chb).Resume(pb.ResumeRequest(
            request_id=first.accepted.request_id, from_index=0, resume_token="f" * 32)))
        # a Stream call resumes it too, under the client's id (a replay of its log by now)
        call = pb_grpc.InferenceStub(chb).Stream()
        await call.write(pb.ClientFrame(id="again", resume=pb.ResumeRequest(
            request_id=first.accepted.request_id, from_index=40, resume_token=first.accepted.resume_token)))
        await call.done_writing()
        frames = [f async for f in call]
    await cha.close(grace=None)
    assert frames[0].accepted.resumed_from == 40 and frames[-1].done.usage.completion_tokens == n
    assert [f.token.index for f in frames if f.HasField("token")] == list(range(40, n))
    assert "".join(f.token.text for f in frames if f.HasField("token")) == \
        "".join(t.text for t in (first.tokens + rest.tokens)[40:])
    assert rest.code == grpc.StatusCode.OK, rest.error
    assert rest.accepted.resumed_from == 10 and rest.accepted.request_id == first.accepted.request_id
    assert first.indices + rest.indices == list(range(n))
    assert first.text + rest.text == ref.text
    assert rest.done.finish_reason == "length" and rest.done.usage.completion_tokens == n
    assert other.code == grpc.StatusCode.NOT_FOUND


@pytest.mark.slow
async def test_health_flips_to_not_serving_while_draining_and_reflection_lists_the_service(fleet):
    gw = fleet.gateway(drain_timeout_s=20)
    async with channel(gw) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        # no live worker yet, and serving all the same, as /readyz says: readiness is about
        # the gateway and its Redis (requests queue for the workers)
        async def serving() -> bool:
            return (await health.Check(health_pb2.HealthCheckRequest(service=""))).status == \
                health_pb2.HealthCheckResponse.SERVING

        await until_async(serving, "SERVING", timeout=10)
        assert (await health.Check(health_pb2.HealthCheckRequest(service=SERVICE))).status == \
            health_pb2.HealthCheckResponse.SERVING
        fleet.worker(backend="echo", echo_delay_ms=20)

        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

        # reflection (a blocking client, as grpcurl-style tools use) lists and describes the service
        sync = sync_channel(gw.grpc)
        db = ProtoReflectionDescriptorDatabase(sync)
        services = await asyncio.to_thread(lambda: list(db.get_services()))
        assert SERVICE in services and "grpc.health.v1.Health" in services
        proto = await asyncio.to_thread(db.FindFileContainingSymbol, SERVICE)
        assert [m.name for m in proto.service[0].method] == ["Generate", "Stream", "Resume", "ListModels", "Transcribe",
                                                             "Listen", "Embed"]
        sync.close()

        stub = pb_grpc.InferenceStub(ch)
        models = await stub.ListModels(pb.ListModelsRequest())
        assert [(m.id, m.workers) for m in models.models] == [("tiny-gpt", 1)]
        # a long stream in flight keeps the drain going; health says NOT_SERVING meanwhile
        long = stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=150, ignore_eos=True))
        c = await Call().read(long, upto=2)
        gw.popen.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        while (await health.Check(health_pb2.HealthCheckRequest(service=SERVICE))).status != \
                health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() - t0 < 5
            await asyncio.sleep(0.05)
        refused = await generate(stub, prompt=PROMPT, max_tokens=2)
        assert refused.code == grpc.StatusCode.UNAVAILABLE
        assert refused.trailer("streamfleet-error-code") == "shutting_down"
        await c.read(long)  # the stream in flight finishes
        assert c.code == grpc.StatusCode.OK and c.done.usage.completion_tokens == 150
    assert gw.popen.wait(20) == 0


@pytest.mark.slow
async def test_broker_outage_is_unavailable(own_redis, tiny_spec, tmp_path):
    from tests.support.fleet import FleetFactory

    fleet = FleetFactory(own_redis.url, "sfgrpc", tmp_path)
    try:
        gw = fleet.gateway()
        own_redis.proc.terminate()
        own_redis.proc.wait(10)
        async with channel(gw) as ch:
            c = await generate(pb_grpc.InferenceStub(ch), prompt=PROMPT, max_tokens=2)
        assert c.code == grpc.StatusCode.UNAVAILABLE, c.error
        assert c.trailer("streamfleet-error-code") == "broker_unavailable"
    finally:
        fleet.close()


@pytest.mark.slow
async def test_traceparent_names_the_request_in_gateway_and_worker_logs(fleet):
    gw = fleet.gateway()
    worker = fleet.worker(backend="echo")
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    async with channel(gw) as ch:
        c = await generate(pb_grpc.InferenceStub(ch), prompt=PROMPT, max_tokens=2,
                           metadata=(("traceparent", f"00-{trace}-00f067aa0ba902b7-01"),))
    assert c.code == grpc.StatusCode.OK
    rid = c.accepted.request_id
    # (the worker logs the task's end just after publishing it)
    await until_async(lambda: any(rid in line and '"task finished"' in line
                                  for line in worker.log(tail=None).splitlines()),
                      "the worker's log of the task's end")
    for proc in (gw, worker):
        lines = [orjson.loads(line) for line in proc.log(tail=None).splitlines() if rid in line]
        assert lines and all(line["trace_id"] == trace for line in lines if "trace_id" in line), proc.name
