"""Fair share inside a lane, measured (docs/admission.md, "Fair share"): light keys beside a
heavy one, Jain's index over keys that all keep a backlog, and a lone key's throughput,
with fair share on and off side by side, on one fleet (a private Redis, the model's
workers, and two gateways with auth on: one with ``SF_FAIR_SHARE`` on, one with it off).

    python -m scripts.bench_fairness                         # smollm2-135m, 1 worker
    python -m scripts.bench_fairness --model tiny-gpt --window-s 20

* **light beside heavy**: a heavy key keeps ``--heavy-streams`` (40) streams of long
  prompts (``--long-tokens``) going, four light keys one short request each at a time; each light
  key's TTFT p50 beside it, over its TTFT p50 alone (goal: at most 1.5);
* **Jain's index** over the weighted tokens (prompt + 2 x generated) served to four keys of
  the same tier that keep 16, 24, 32 and 48 streams going, so that all of them always
  have requests waiting (goal: at least 0.95);
* **one key**: 16 streams of one key, tokens generated per second (goal: within 5%);
* **embeddings flood** (``--embed-model``, default ``minilm-l6-v2``; ``none``: skipped): a
  heavy key sends requests of ``--embed-inputs`` (2,048) texts of ``--embed-tokens``
  tokens one after another, a light key one text at a time; the light key's latency p50
  beside it, over alone (goal: at most 1.5), and the heavy key's texts per second.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from scripts import benchtable
from scripts.fleetstack import StackLife, chat_chunks, clean_env, threads, wait_fleet
from streamfleet.launcher import EmbeddedRedis, Fleet, free_port

LIGHT_KEYS = 4
#: streams each of the Jain run's keys keeps going: every key more than a worker's batch
#: (16), so all four always have requests waiting, first come, first served serving them
#: in proportion to these
JAIN_STREAMS = (16, 24, 32, 48)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class FairStack(StackLife):
    """A private Redis, ``workers`` workers of ``model`` sharing the cores, and two
    gateways with auth on: ``urls["on"]`` with fair share, ``urls["off"]`` without."""

    model: str
    workers: int
    embed_model: str | None = None
    embed_step_ms: float | None = None
    redis: EmbeddedRedis | None = None
    fleet: Fleet = field(default_factory=Fleet)
    urls: dict[str, str] = field(default_factory=dict)

    def env(self, **extra: str) -> dict[str, str]:
        return clean_env(**({"SF_REDIS_URL": self.redis.url, "SF_LOG_LEVEL": "warning", "SF_MODEL": self.model,
                             "SF_DEFAULT_MODEL": self.model, "SF_GRPC_PORT": "0", "SF_METRICS_PORT": "0"} | extra))

    def _start(self) -> None:
        share = threads(max(1, (os.cpu_count() or 2) // self.workers))
        for i in range(self.workers):
            self.fleet.start(f"worker {i}", ["worker"], self.env(**share))
        if self.embed_model:  # its own worker, idle but for the embeddings runs
            step = {} if self.embed_step_ms is None else {"SF_EMBED_STEP_MS": str(self.embed_step_ms)}
            self.fleet.start("embedding worker", ["worker"], self.env(SF_MODEL=self.embed_model, **step,
                                                                      **threads(os.cpu_count() or 2)))
        for mode in ("on", "off"):
            port = free_port()
            self.urls[mode] = f"http://127.0.0.1:{port}"
            self.fleet.start(f"gateway {mode}", ["gateway", "--port", str(port)],
                             self.env(SF_AUTH_ENABLED="true", SF_FAIR_SHARE="true" if mode == "on" else "false"))
        workers = {self.model: self.workers} | ({self.embed_model: 1} if self.embed_model else {})
        wait_fleet(self.redis.url, workers, list(self.urls.values()), self.fleet.dead,
                   worker_timeout=600, gateway_timeout=60)

    def key(self, name: str) -> str:
        """A new API key of the unlimited ``internal`` tier (``streamfleet keys add``)."""
        out = subprocess.run([sys.executable, "-m", "streamfleet", "keys", "add", name, "--tier", "internal"],
                             env=self.env(), capture_output=True, text=True, timeout=60, check=True)
        return out.stdout.strip()


@dataclass
class Done:
    ttft_s: float
    prompt_tokens: int
    completion_tokens: int
    ended: float


async def chat(client: httpx.AsyncClient, url: str, key: str, model: str, prompt: str, max_tokens: int) -> Done:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, usage = None, {}
    async for chunk in chat_chunks(client, url, body, {"Authorization": f"Bearer {key}"}):
        if ttft is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
            ttft = time.perf_counter() - t0
        usage = chunk.get("usage") or usage
    now = time.perf_counter()
    return Done(ttft if ttft is not None else now - t0, usage.get("prompt_tokens", 0),
                usage.get("completion_tokens", 0), now)


async def closed_loop(client: httpx.AsyncClient, url: str, key: str, model: str, prompt: str, max_tokens: int,
                      until: float, out: list[Done]) -> None:
    while time.perf_counter() < until:
        out.append(await chat(client, url, key, model, prompt, max_tokens))


async def embed(client: httpx.AsyncClient, url: str, key: str, model: str, texts: list[str]) -> float:
    """One embeddings request; its latency (s)."""
    t0 = time.perf_counter()
    r = await client.post(url + "/v1/embeddings", json={"model": model, "input": texts},
                          headers={"Authorization": f"Bearer {key}"})
    r.raise_for_status()
    return time.perf_counter() - t0


async def run_embeddings(url: str, keys: dict[str, str], args: argparse.Namespace) -> dict[str, float]:
    """A light key's one-text requests, alone and beside a heavy key's requests of
    ``--embed-inputs`` texts sent one after another."""
    words = ["fleet", "lane", "worker", "token", "stream", "tenant", "share", "model", "queue", "vector"]
    heavy_texts = [" ".join(words[(i + j) % len(words)] for j in range(args.embed_tokens - 2))
                   for i in range(args.embed_inputs)]
    out: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=600) as client:
        await embed(client, url, keys["elight"], args.embed_model, ["warm up"])
        alone = [await embed(client, url, keys["elight"], args.embed_model, ["a short text to embed"])
                 for _ in range(args.alone_requests * 2)]
        flood_alone = p50([await embed(client, url, keys["eheavy"], args.embed_model, heavy_texts)
                           for _ in range(3)])
        stop = asyncio.Event()
        heavy_done: list[float] = []

        async def heavy() -> None:
            while not stop.is_set():
                heavy_done.append(await embed(client, url, keys["eheavy"], args.embed_model, heavy_texts))

        t0 = time.perf_counter()
        flood = asyncio.create_task(heavy())
        await asyncio.sleep(0.5)  # (the first large request is running)
        beside: list[float] = []
        until = time.perf_counter() + args.window_s / 2
        while time.perf_counter() < until or not beside:
            beside.append(await embed(client, url, keys["elight"], args.embed_model, ["a short text to embed"]))
        stop.set()
        await flood
        elapsed = time.perf_counter() - t0
    out["embeddings: light latency p50 alone (s)"] = p50(alone)
    out["embeddings: light latency p50 beside a flood (s)"] = p50(beside)
    out["embeddings: light beside / alone"] = p50(beside) / p50(alone)
    out["embeddings: flood alone, texts/s"] = args.embed_inputs / flood_alone
    out["embeddings: flood beside the light key, texts/s"] = len(heavy_done) * args.embed_inputs / elapsed
    return out


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def jain(x: list[float]) -> float:
    return sum(x) ** 2 / (len(x) * sum(v * v for v in x)) if any(x) else float("nan")


async def run_mode(url: str, keys: dict[str, str], args: argparse.Namespace) -> dict[str, float]:
    long_prompt = " ".join(["The fleet serves many tenants at once, and each one expects a fair turn."] *
                           max(1, args.long_tokens // 16))
    short = "Name a colour."
    out: dict[str, float] = {}
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        # each light key alone
        alone: dict[str, float] = {}
        for i in range(LIGHT_KEYS):
            done = [await chat(client, url, keys[f"light{i}"], args.model, short, args.light_tokens)
                    for _ in range(args.alone_requests)]
            alone[f"light{i}"] = p50([d.ttft_s for d in done])
        # beside the heavy key
        until = time.perf_counter() + args.window_s
        heavy: list[Done] = []
        light: dict[str, list[Done]] = {f"light{i}": [] for i in range(LIGHT_KEYS)}
        await asyncio.gather(
            *(closed_loop(client, url, keys["heavy"], args.model, long_prompt, args.heavy_tokens, until, heavy)
              for _ in range(args.heavy_streams)),
            *(closed_loop(client, url, keys[name], args.model, short, args.light_tokens, until, light[name])
              for name in light))
        ratios = [p50([d.ttft_s for d in light[n]]) / alone[n] for n in light]
        out["light TTFT p50 alone (s)"] = p50(list(alone.values()))
        out["light TTFT p50 beside heavy (s)"] = p50([p50([d.ttft_s for d in light[n]]) for n in light])
        out["worst light key: beside / alone"] = max(ratios)
        out["heavy requests done"] = len(heavy)
        out["light requests done"] = sum(len(v) for v in light.values())
        # Jain's index over keys that all keep a backlog
        until = time.perf_counter() + args.window_s
        served: dict[str, list[Done]] = {f"jain{i}": [] for i in range(len(JAIN_STREAMS))}
        await asyncio.gather(*(closed_loop(client, url, keys[name], args.model, long_prompt, args.heavy_tokens,
                                           until, served[name])
                               for name, n in zip(served, JAIN_STREAMS, strict=True) for _ in range(n)))
        weighted = [sum(d.prompt_tokens + 2 * d.completion_tokens for d in v if d.ended <= until)
                    for v in served.values()]
        out["Jain's index, 4 backlogged keys"] = jain([float(w) for w in weighted])
        out["their shares (%)"] = " / ".join(f"{100 * w / max(1, sum(weighted)):.0f}" for w in weighted)  # type: ignore[assignment]
        # one key alone
        until = time.perf_counter() + args.window_s / 2
        t0 = time.perf_counter()
        lone: list[Done] = []
        await asyncio.gather(*(closed_loop(client, url, keys["lone"], args.model, long_prompt, args.heavy_tokens,
                                           until, lone) for _ in range(16)))
        out["one key, 16 streams: tokens/s"] = sum(d.completion_tokens for d in lone) / (time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--window-s", type=float, default=40.0, help="length of the light-beside-heavy and Jain runs")
    ap.add_argument("--heavy-streams", type=int, default=40, help="the heavy key's streams: 10 x the light keys' "
                    "requests, and more than a worker's batch, so that its requests wait")
    ap.add_argument("--long-tokens", type=int, default=400, help="about how long the heavy key's prompts are")
    ap.add_argument("--heavy-tokens", type=int, default=32, help="max_tokens of a long prompt's request")
    ap.add_argument("--light-tokens", type=int, default=8, help="max_tokens of a light key's request")
    ap.add_argument("--alone-requests", type=int, default=5)
    ap.add_argument("--embed-model", default="minilm-l6-v2", help="the embedding model of the embeddings flood "
                    "('none': no embeddings run)")
    ap.add_argument("--embed-inputs", type=int, default=2048, help="texts in one of the flood's requests")
    ap.add_argument("--embed-tokens", type=int, default=32, help="tokens of each of them")
    ap.add_argument("--embed-step-ms", type=float, default=None, help="the embedding worker's SF_EMBED_STEP_MS "
                    "(default: its own default)")
    ap.add_argument("--parts", default="text,embeddings", help="what to run: text, embeddings or both")
    benchtable.add_argument(ap)
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if args.embed_model == "none" or "embeddings" not in parts:
        args.embed_model = None
    log(f"starting {args.workers} worker(s) of {args.model} and two gateways ...")
    with FairStack(args.model, args.workers, args.embed_model, args.embed_step_ms) as st:
        names = ["heavy", "lone", *(f"light{i}" for i in range(LIGHT_KEYS)),
                 *(f"jain{i}" for i in range(len(JAIN_STREAMS))), "eheavy", "elight"]
        results = {}
        for mode in ("on", "off"):
            keys = {name: st.key(f"{mode}-{name}") for name in names}
            results[mode] = {}
            if "text" in parts:
                log(f"fair share {mode} ...")
                results[mode] = asyncio.run(run_mode(st.urls[mode], keys, args))
            if args.embed_model:
                log(f"embeddings, fair share {mode} ...")
                results[mode] |= asyncio.run(run_embeddings(st.urls[mode], keys, args))
    goals = {"worst light key: beside / alone": "<= 1.5", "Jain's index, 4 backlogged keys": ">= 0.95",
             "one key, 16 streams: tokens/s": "on within 5% of off", "embeddings: light beside / alone": "<= 1.5"}
    print(f"\nfair share inside a lane: {args.model}, {args.workers} worker(s), {os.cpu_count()} cores, "
          f"{args.window_s:.0f} s windows; heavy key {args.heavy_streams} streams of ~{args.long_tokens}-token "
          f"prompts, {LIGHT_KEYS} light keys one request at a time"
          + (f"; embeddings: {args.embed_model}, a flood of {args.embed_inputs} x {args.embed_tokens}-token texts "
             f"a request beside one text at a time" if args.embed_model else "") + "\n")
    print(f"| {'':40} | fair share on | fair share off | goal |")
    print("| --- | ---: | ---: | --- |")
    for metric in results["on"]:
        row = [results[m][metric] for m in ("on", "off")]
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in row]
        print(f"| {metric:40} | {cells[0]} | {cells[1]} | {goals.get(metric, '')} |")
    if "text" in parts:
        on, off = results["on"]["one key, 16 streams: tokens/s"], results["off"]["one key, 16 streams: tokens/s"]
        print(f"\none key's throughput, on / off: {on / off:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(benchtable.main(main))
