#!/usr/bin/env python
"""A Redis Cluster primary SIGKILLed under load, and two back-to-back worker kills, as
the clients see them (issue 37; docs/failures.md, "A Redis Cluster shard fails").

The setup: a local Redis Cluster of 3 primaries with one replica each
(``EmbeddedCluster``, ``cluster-node-timeout`` ``--node-timeout-ms``), one gateway and
one echo worker (``--delay-ms`` per step), driven over WebSockets from this process.
Connections are sorted by the shard their reply channel lives on (a connection's
request ids start with its shard tag, docs/cluster.md, so its requests' logs are there
too): ``--per-shard`` connections on each primary, ``--streams`` streams on each.

  shard-kill    SIGKILL a primary that holds none of the model's keys (its lanes, its
                wake/cancel channels), only reply channels and request logs.
  lanes-kill    SIGKILL the primary holding the model's lanes (the worker's intake, its
                acks, its control channel).
  shard-kill-full-coverage
                shard-kill with ``cluster-require-full-coverage yes`` (Redis's default;
                the others run with ``no``): from the moment the cluster marks the
                primary failed until its replica is elected, every shard refuses key
                commands (CLUSTERDOWN), so no request log can be written anywhere.
  worker-kills  SIGKILL the worker and start a replacement at once; once every stream
                runs again, once more.

Per shard (named by the primary that owned it before the kill): its streams, the
longest inter-token gap after the kill, tokens lost and duplicated (each stream's
indices must be 0..n-1, each once), streams that did not complete. For the killed
shard also the election (kill until its replica answers ``ROLE`` as master) and the
resume (election until every one of its streams delivered a token again). Per worker
kill: the pause (the longest gap across streams), and its parts: the replacement's
start (spawned until its heartbeat is written), the takeover (until it claimed the dead
worker's tasks), and the regeneration (the echo engine regenerates a taken-over stream
from index 0, one step per token already sent, before it sends a new one).

Goals (issue 37): streams on surviving shards <= 0.5 s longest gap; the failed shard's
streams resume <= 2 s after the election; nothing lost, nothing duplicated.

After each shard kill the killed node is started again (it rejoins as the new
primary's replica) before the next scenario. The processes' logs go to a temporary
folder (``--logs DIR`` keeps them).

    python -m scripts.bench_cluster_failover [--only shard-kill,lanes-kill,shard-kill-full-coverage,worker-kills]
                                             [--json [FILE]] [--logs DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import redis
import websockets
from redis.crc import key_slot

from scripts.bench_cluster import fleet_env
from scripts.bench_fleet import MODEL, write_model
from scripts.fleetstack import wait_until
from streamfleet.launcher import EmbeddedCluster, free_port, spawn, stop_processes
from streamfleet.shared.keys import GROUP, TAG_LEN, Keys
from streamfleet.shared.redis import sync_client

SCENARIOS = ("shard-kill", "lanes-kill", "shard-kill-full-coverage", "worker-kills")
PROMPT = "Once upon a time there was a fleet of workers"
#: goals of issue 37
GOAL_GAP_S = 0.5
GOAL_RESUME_S = 2.0


@dataclass
class Plan:
    node_timeout_ms: int = 1000
    delay_ms: float = 20.0
    per_shard: int = 3  # connections per primary
    streams: int = 3  # streams per connection
    tokens: int = 400  # per stream, shard kills (about 8 s at 20 ms/step)
    worker_tokens: int = 300  # per stream, worker kills
    worker_settings: dict = field(default_factory=dict)  # extra SF_* settings of the workers


# -- the fleet ------------------------------------------------------------------------------
class FailoverBench:
    """A local 3x2 cluster, one gateway and one echo worker (replaced in ``worker_kills``)."""

    def __init__(self, plan: Plan, logs: Path) -> None:
        self.plan = plan
        self.logs = logs
        self.cluster: EmbeddedCluster | None = None
        self.procs: list[subprocess.Popen] = []
        self.worker: subprocess.Popen | None = None
        self.gateways: list[subprocess.Popen] = []
        self.port = 0
        self.env: dict[str, str] = {}
        self.keys = Keys("sf", cluster=True)
        self._n = 0

    # processes
    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        self._n += 1
        fh = open(self.logs / f"{self._n:02d}-{name}.log", "wb")
        p = spawn([sys.executable, "-m", "streamfleet", *args], env=env, stdout=fh, stderr=subprocess.STDOUT)
        fh.close()
        self.procs.append(p)
        return p

    def dead(self) -> list[str]:
        return [f"pid {p.pid}" for p in (self.worker, *self.gateways) if p is not None and p.poll() is not None]

    def start(self) -> FailoverBench:
        self.cluster = EmbeddedCluster(3, 1, node_timeout_ms=self.plan.node_timeout_ms).start()
        engines = write_model(Path(tempfile.mkdtemp(prefix="sf-bench-failover-")))
        self.env = fleet_env(self.cluster.url, True, engines, self.plan.delay_ms, log_level="info",
                             log_format="json", max_batch=512)
        self.port = free_port()
        self.gateways = [self._spawn("gateway", ["gateway", "--port", str(self.port)], self.env)]
        self.worker = self.start_worker()
        self.wait_registered(self.worker)
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{self.port}/readyz", timeout=1).status_code == 200, 90,
                   "the gateway", self.dead)
        return self

    def start_worker(self) -> subprocess.Popen:
        env = dict(self.env, **{f"SF_{k.upper()}": str(v) for k, v in self.plan.worker_settings.items()})
        self.worker = self._spawn("worker", ["worker"], env)
        return self.worker

    def client(self):
        return sync_client(self.cluster.url, cluster=True)

    def heartbeat_of(self, proc: subprocess.Popen, r) -> str | None:
        """The worker id of ``proc`` once its heartbeat is written."""
        for wid, blob in r.hgetall(self.keys.workers(MODEL)).items():
            if orjson.loads(blob).get("pid") == proc.pid:
                return wid.decode()
        return None

    def wait_registered(self, proc: subprocess.Popen, timeout: float = 90) -> str:
        r = self.client()
        try:
            wait_until(lambda: self.heartbeat_of(proc, r), timeout, "the worker", self.dead)
            return self.heartbeat_of(proc, r)
        finally:
            r.close()

    def stop(self) -> None:
        stop_processes(self.procs)
        if self.cluster is not None:
            self.cluster.stop()

    # the cluster
    def owner(self, key: str | bytes) -> int:
        r = self.client()
        try:
            return int(r.nodes_manager.get_node_from_slot(key_slot(key.encode() if isinstance(key, str) else key))
                       .port)
        finally:
            r.close()

    def lanes_port(self) -> int:
        return self.owner(self.keys.lane(MODEL, "normal"))

    def replica_of(self, port: int) -> int:
        r = redis.Redis(port=port)
        try:
            me = r.execute_command("CLUSTER MYID").decode()
            for addr, node in r.execute_command("CLUSTER NODES").items():  # (redis-py parses it)
                if "slave" in node["flags"] and node["master_id"] == me:
                    return int(addr.split("@")[0].rsplit(":", 1)[1])
        finally:
            r.close()
        raise RuntimeError(f"no replica of {port}")

    def restore(self, port: int) -> None:
        """Start a killed node again (it rejoins as a replica) and wait until all is well."""
        self.cluster.start_node(port)
        self.cluster.wait_ok(30, replicated=True)

    def full_coverage(self, on: bool) -> None:
        """``cluster-require-full-coverage`` on every live node: with it on (Redis's
        default) every shard refuses key commands while any slot has no primary."""
        for port, proc in self.cluster.procs.items():
            if proc.poll() is None:
                r = redis.Redis(port=port)
                try:
                    r.config_set("cluster-require-full-coverage", "yes" if on else "no")
                finally:
                    r.close()


def watch_role(port: int, until: float) -> float | None:
    """When (monotonic) the node at ``port`` first answers ``ROLE`` as master."""
    r = redis.Redis(port=port, socket_timeout=0.5)
    try:
        while time.monotonic() < until:
            try:
                if r.execute_command("ROLE")[0] in (b"master", "master"):
                    return time.monotonic()
            except redis.RedisError:
                pass
            time.sleep(0.01)
        return None
    finally:
        r.close()


# -- the clients -----------------------------------------------------------------------------
@dataclass
class Stream:
    id: str
    port: int  # the primary its connection's slot was on at the start
    tokens: int
    request_id: str = ""
    arrivals: list[float] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    end: dict | None = None

    def longest_gap(self, after: float) -> float:
        """The longest silence between two tokens that ends after ``after`` (from ``after``
        on when the stream is still silent)."""
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:]) if b > after]
        return max(gaps, default=0.0)

    def first_after(self, t: float) -> float | None:
        return next((a for a in self.arrivals if a > t), None)

    def last_before(self, t: float) -> float | None:
        before = [a for a in self.arrivals if a <= t]
        return before[-1] if before else None

    @property
    def completed(self) -> bool:
        return self.end is not None and self.end.get("type") == "done"

    @property
    def duplicated(self) -> int:
        return len(self.indices) - len(set(self.indices))

    @property
    def lost(self) -> int:
        return self.tokens - len({i for i in self.indices if 0 <= i < self.tokens})

    @property
    def in_order(self) -> bool:
        return self.indices == sorted(self.indices)


class Conn:
    """One WebSocket; frames routed to its streams by id."""

    def __init__(self, ws, streams: dict[str, Stream]) -> None:
        self.ws = ws
        self.streams = streams
        self.accepted: asyncio.Queue = asyncio.Queue()
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                now = time.monotonic()
                msg = orjson.loads(raw)
                kind = msg.get("type")
                s = self.streams.get(msg.get("id"))
                if kind == "accepted":
                    if s is not None:
                        s.request_id = msg["request_id"]
                    await self.accepted.put(msg)
                elif s is None:
                    continue
                elif kind == "token":
                    s.arrivals.append(now)
                    s.indices.append(msg["index"])
                elif kind in ("done", "error"):
                    s.end = msg
        except websockets.ConnectionClosed:
            pass

    async def send(self, frame: dict) -> None:
        await self.ws.send(orjson.dumps(frame).decode())

    async def close(self) -> None:
        await self.ws.close()
        self.reader.cancel()


async def open_streams(bench: FailoverBench, plan: Plan, tokens: int, name: str) -> tuple[list[Conn], list[Stream]]:
    """``plan.per_shard`` connections on each primary, ``plan.streams`` streams on each;
    returns once every stream delivered a few tokens."""
    url = f"ws://127.0.0.1:{bench.port}/v1/stream"
    r = bench.client()
    primaries = sorted({int(n.port) for n in r.get_primaries()})
    owner_of_tag = lambda tag: int(r.nodes_manager.get_node_from_slot(key_slot(tag.encode())).port)  # noqa: E731
    conns: dict[int, list[Conn]] = {p: [] for p in primaries}
    streams: list[Stream] = []
    try:
        for _attempt in range(40 * plan.per_shard):
            if all(len(v) >= plan.per_shard for v in conns.values()):
                break
            ws = await websockets.connect(url, max_size=None)
            conn = Conn(ws, {})
            await conn.send({"type": "generate", "id": "probe", "prompt": "x", "max_tokens": 1})
            accepted = await asyncio.wait_for(conn.accepted.get(), 30)
            port = owner_of_tag(accepted["request_id"][:TAG_LEN])
            if len(conns[port]) < plan.per_shard:
                conns[port].append(conn)
            else:
                await conn.close()
        else:
            raise RuntimeError(f"could not place {plan.per_shard} connections on every shard")
    finally:
        r.close()
    n = 0
    for port, cs in conns.items():
        for conn in cs:
            for _ in range(plan.streams):
                s = Stream(f"{name}{n}", port, tokens)
                n += 1
                conn.streams[s.id] = s
                streams.append(s)
                await conn.send({"type": "generate", "id": s.id, "prompt": PROMPT, "max_tokens": tokens,
                                 "ignore_eos": True, "seed": n})
    deadline = time.monotonic() + 60
    while not all(len(s.indices) >= 5 for s in streams):
        if time.monotonic() > deadline:
            raise RuntimeError("the streams did not start")
        await asyncio.sleep(0.02)
    return [c for cs in conns.values() for c in cs], streams


async def finish(conns: list[Conn], streams: list[Stream], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(s.end is None for s in streams) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for c in conns:
        await c.close()


def integrity(streams: list[Stream]) -> dict:
    return {"streams": len(streams), "completed": sum(s.completed for s in streams),
            "lost": sum(s.lost for s in streams), "duplicated": sum(s.duplicated for s in streams),
            "out_of_order": sum(not s.in_order for s in streams),
            "errors": sorted({s.end.get("code", "") for s in streams if s.end and s.end.get("type") == "error"})}


# -- scenarios -----------------------------------------------------------------------------
async def shard_kill(bench: FailoverBench, lanes: bool, full_coverage: bool = False) -> dict:
    """SIGKILL one primary mid-stream (``lanes``: the one holding the model's lanes, else
    one holding none of the model's keys) and measure every shard's streams
    (``full_coverage``: with ``cluster-require-full-coverage yes``)."""
    plan = bench.plan
    bench.full_coverage(full_coverage)
    lanes_port = bench.lanes_port()
    workers_port = bench.owner(bench.keys.workers(MODEL))
    primaries = bench.cluster.primary_ports()
    if lanes:
        victim = lanes_port
    else:  # one with no model key at all, else at least not the lanes'
        others = [p for p in primaries if p != lanes_port]
        victim = next((p for p in others if p != workers_port), others[0])
    replica = bench.replica_of(victim)
    conns, streams = await open_streams(bench, plan, plan.tokens, "k" if lanes else "s")
    await asyncio.sleep(0.5)
    killed_at = time.monotonic()
    bench.cluster.kill(victim)
    election = asyncio.ensure_future(asyncio.to_thread(watch_role, replica, killed_at + 30))
    await finish(conns, streams, 120)
    elected_at = await election
    shards = []
    for port in primaries:
        mine = [s for s in streams if s.port == port]
        row = {"primary": port, "killed": port == victim, "holds": _holds(port, lanes_port, workers_port),
               "longest_gap_s": max(s.longest_gap(killed_at) for s in mine), **integrity(mine)}
        if port == victim:
            row["election_s"] = None if elected_at is None else elected_at - killed_at
            if elected_at is not None:
                firsts = [s.first_after(elected_at) for s in mine]
                row["resume_after_election_s"] = None if None in firsts else max(firsts) - elected_at
        shards.append(row)
    bench.restore(victim)
    name = "lanes-kill" if lanes else "shard-kill-full-coverage" if full_coverage else "shard-kill"
    return {"scenario": name, "victim": victim, "full_coverage": full_coverage, "shards": shards,
            **integrity(streams)}


def _holds(port: int, lanes_port: int, workers_port: int) -> str:
    held = ["reply channels", "logs"]
    if port == lanes_port:
        held.append("lanes")
    if port == workers_port:
        held.append("heartbeats")
    return ", ".join(held)


def _watch_claim(bench: FailoverBench, proc: subprocess.Popen, until: float, out: dict) -> None:
    """Record when ``proc`` wrote its heartbeat (``registered``) and first held a
    delivery of the lanes (``claimed``)."""
    r = bench.client()
    lanes = list(bench.keys.lanes(MODEL).values())
    try:
        while time.monotonic() < until and "claimed" not in out:
            try:
                wid = out.get("worker_id") or bench.heartbeat_of(proc, r)
                if wid and "registered" not in out:
                    out["worker_id"], out["registered"] = wid, time.monotonic()
                if wid:
                    for lane in lanes:
                        pending = r.xpending(lane, GROUP)
                        if any((c["name"].decode() if isinstance(c["name"], bytes) else c["name"]) == wid
                               for c in pending.get("consumers") or ()):
                            out["claimed"] = time.monotonic()
                            break
            except redis.RedisError:
                pass
            time.sleep(0.01)
    finally:
        r.close()


async def worker_kills(bench: FailoverBench, kills: int = 2) -> dict:
    """SIGKILL the worker and start a replacement at once; again once every stream runs.
    A kill's pause is, per stream, the silence around the moment the replacement claimed
    the dead worker's tasks (tokens already on their way when the worker died still
    arrive after the kill); its parts: the replacement's start, its takeover, and the
    regeneration of the tokens already sent (the echo engine's)."""
    plan = bench.plan
    conns, streams = await open_streams(bench, plan, plan.worker_tokens, "w")
    rows = []
    for k in range(kills):
        await asyncio.sleep(0.5)
        bench.worker.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        replacement = bench.start_worker()
        parts: dict = {}
        await asyncio.to_thread(_watch_claim, bench, replacement, killed_at + 60, parts)
        claimed = parts.get("claimed")
        if claimed is not None:  # resumed: every stream delivered a token after the claim
            deadline = claimed + 60
            while not all(s.end is not None or s.first_after(claimed) for s in streams):
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.02)
        at = claimed if claimed is not None else killed_at
        resumed = [s.first_after(at) for s in streams]
        row = {"kill": k + 1,
               "pause_s": max(((f - (s.last_before(at) or killed_at)) if f else float("inf"))
                              for s, f in zip(streams, resumed) if s.end is None or f),
               "start_s": parts["registered"] - killed_at if "registered" in parts else None,
               "takeover_s": claimed - parts["registered"] if claimed is not None else None,
               "regenerate_s": max(f for f in resumed if f) - claimed
               if claimed is not None and any(resumed) else None}
        rows.append(row)
    await finish(conns, streams, 120)
    return {"scenario": "worker-kills", "kills": rows, **integrity(streams)}


# -- the report ---------------------------------------------------------------------------------
def _f(v, unit: str = " s") -> str:
    return "-" if v is None else f"{v:.2f}{unit}"


def table(results: list[dict], plan: Plan) -> str:
    lines = []
    for res in results:
        if res["scenario"] == "worker-kills":
            lines.append(f"worker-kills: {res['streams']} streams; {res['completed']} completed, lost "
                         f"{res['lost']}, duplicated {res['duplicated']}, out of order {res['out_of_order']}"
                         + (f", errors {res['errors']}" if res["errors"] else ""))
            head = f"  {'kill':<6}{'pause':>9}{'start':>9}{'takeover':>10}{'regenerate':>12}"
            lines += [head, "  " + "-" * (len(head) - 2)]
            for k in res["kills"]:
                lines.append(f"  {k['kill']:<6}{_f(k['pause_s']):>9}{_f(k['start_s']):>9}{_f(k['takeover_s']):>10}"
                             f"{_f(k['regenerate_s']):>12}")
            continue
        lines.append(f"{res['scenario']}: primary {res['victim']} SIGKILLed (cluster-require-full-coverage "
                     f"{'yes' if res['full_coverage'] else 'no'}); {res['streams']} streams, "
                     f"{res['completed']} completed, lost {res['lost']}, duplicated {res['duplicated']}, "
                     f"out of order {res['out_of_order']}" + (f", errors {res['errors']}" if res["errors"] else ""))
        head = (f"  {'primary':<9}{'holds':<42}{'streams':>8}{'longest gap':>13}{'election':>10}"
                f"{'resume':>9}{'lost':>6}{'dup':>5}")
        lines += [head, "  " + "-" * (len(head) - 2)]
        for sh in res["shards"]:
            name = f"{sh['primary']}{'*' if sh['killed'] else ''}"
            lines.append(f"  {name:<9}{sh['holds']:<42}{sh['streams']:>8}{_f(sh['longest_gap_s']):>13}"
                         f"{_f(sh.get('election_s')) if sh['killed'] else '':>10}"
                         f"{_f(sh.get('resume_after_election_s')) if sh['killed'] else '':>9}"
                         f"{sh['lost']:>6}{sh['duplicated']:>5}")
    lines.append(f"(* killed; longest gap: after the kill; resume: after the election. Goals: surviving shards "
                 f"<= {GOAL_GAP_S} s, resume <= {GOAL_RESUME_S} s, nothing lost or duplicated)")
    return "\n".join(lines)


async def run(plan: Plan, only: list[str], logs: Path, progress=print) -> list[dict]:
    bench = FailoverBench(plan, logs)
    results = []
    try:
        bench.start()
        for name in only:
            if name == "worker-kills":
                bench.full_coverage(False)
                results.append(await worker_kills(bench))
            else:
                results.append(await shard_kill(bench, lanes=name == "lanes-kill",
                                                full_coverage=name == "shard-kill-full-coverage"))
            progress(f"  {name}: done", flush=True)
    finally:
        bench.stop()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(SCENARIOS))
    ap.add_argument("--node-timeout-ms", type=int, default=Plan.node_timeout_ms)
    ap.add_argument("--delay-ms", type=float, default=Plan.delay_ms, help="echo engine time per step")
    ap.add_argument("--per-shard", type=int, default=Plan.per_shard, help="connections per primary")
    ap.add_argument("--streams", type=int, default=Plan.streams, help="streams per connection")
    ap.add_argument("--tokens", type=int, default=Plan.tokens, help="tokens per stream (shard kills)")
    ap.add_argument("--logs", help="keep the processes' logs in this folder")
    ap.add_argument("--json", nargs="?", const="-", help="write the figures as JSON to FILE (stdout: -)")
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s]
    for s in only:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r} (one of {', '.join(SCENARIOS)})")
    plan = Plan(node_timeout_ms=args.node_timeout_ms, delay_ms=args.delay_ms, per_shard=args.per_shard,
                streams=args.streams, tokens=args.tokens)
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="sf-failover-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    quiet = args.json == "-"
    say = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if quiet else print
    say(f"machine: {platform.machine()}, {os.cpu_count()} cores; 3 primaries + 3 replicas, cluster-node-timeout "
        f"{plan.node_timeout_ms} ms; 1 gateway, 1 echo worker at {plan.delay_ms:g} ms/step; "
        f"{plan.per_shard} connections x {plan.streams} streams per shard; logs in {logs}", flush=True)
    started = time.monotonic()
    results = asyncio.run(run(plan, only, logs, say))
    if args.json:
        blob = orjson.dumps({"plan": plan.__dict__, "results": results}, option=orjson.OPT_INDENT_2)
        if quiet:
            sys.stdout.write(blob.decode() + "\n")
        else:
            Path(args.json).write_bytes(blob)
    if not quiet:
        print(table(results, plan))
    say(f"({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
