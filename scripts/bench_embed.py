"""Embeddings served by a fleet, measured on the real model (all-MiniLM-L6-v2, ``minilm-l6-v2``):
a private Redis, one gateway and real ONNX Runtime workers, requests over HTTP
``POST /v1/embeddings`` (a minimal keep-alive HTTP/1.1 client on asyncio streams, one
connection a client, ``encoding_format: "base64"``), one text a request as a RAG query
sends it (``--per-request N``: N texts a request, as an indexing job sends its chunks).

Part 1, throughput and latency: texts/s and latency p50/p99 at concurrency ``--concurrency``
(default 1, 16, 64 clients, each sending its next request when its last one is answered)
for texts of exactly 32 and 256 tokens (``--lengths``; the model's tokenizer, [CLS] and
[SEP] included), through streamfleet (one gateway, one embedding worker) and through a
one-process loop on the same graph with the same batching: the same number of simulated
clients (asyncio tasks) in this process hand their texts to a batcher that takes up to
``max_batch`` waiting texts within ``max_batch_tokens`` in the order they came, as
``workers/embedcore.py`` does, and runs ``OnnxEmbeddingEngine.embed`` on them in a thread;
a text's latency runs from its hand-over to its batch's end. Both use all the machine's
cores (the worker's ``SF_THREADS``, the loop's ``threads=``). The table gives both, the
mean texts a batch of each (the worker's ``streamfleet_worker_batch_size`` histogram over
the run, warm-up included) and the ratio of texts/s. The clients of the fleet run in this process too, so on a small
machine they take CPU from the gateway and the worker: the ratio is a lower bound on
what separate client machines would see.

Part 2, beside chat: one gateway, a text worker (``smollm2-135m``) and an embedding worker,
each with ``SF_THREADS=1`` (they share the cores). ``--chat-streams`` chat completions stream
(SSE, ``ignore_eos``, ``--chat-tokens`` tokens each, started again as each ends) for
``--seconds``, first alone and then while ``--flood`` clients send 32-token texts to
``/v1/embeddings`` without pause. Reported: the streams' inter-token latency p50/p99
(the gaps between a stream's successive content chunks, its first token excluded) in
both runs and the ratio of the p99s, and the flood's texts/s.

    python -m scripts.bench_embed                        # both parts (about 5 minutes on 2 cores, estimated)
    python -m scripts.bench_embed --part throughput      # part 1 only
    python -m scripts.bench_embed --part chat --json out.json
    python -m scripts.bench_embed --seconds 2 --concurrency 1,16 --lengths 32   # a smoke run

The figures are ratios within one run (these machines are shared and noisy). Goals
(issue 41): at c = 64 streamfleet serves at least 90 % of the one-process loop's texts/s;
an embedding flood makes the chat streams' inter-token latency p99 at most 1.5x longer.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import itertools
import json
import os
import random
import re
import statistics
import sys
import time

import httpx
import orjson

from scripts import benchtable
from scripts.fleetstack import ModelStack, chat_chunks, threads
from streamfleet.shared.modelrepo import ModelRepository, ensure_artifacts, load_tokenizer

EMBED_MODEL = "minilm-l6-v2"
CHAT_MODEL = "smollm2-135m"
WARMUP_S = 2.0
PROMPTS = ("Count slowly from one to a hundred.", "Tell me a long story about a lighthouse keeper.",
           "List the countries of Europe with their capitals.", "Describe how a bicycle works, in detail.",
           "Write a poem about the sea.", "Explain photosynthesis step by step.")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pctl(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


# -- texts ----------------------------------------------------------------------------------
def make_texts(tokenizer, n_tokens: int, count: int, seed: int) -> list[str]:
    """``count`` distinct texts of exactly ``n_tokens`` tokens each ([CLS] and [SEP] included):
    words the tokenizer keeps whole, one token each, chosen at random."""
    rnd = random.Random(seed)
    vocab = tokenizer.get_vocab()
    words = sorted(w for w in vocab if w.isalpha() and w.isascii() and w.islower() and 3 <= len(w) <= 9)
    words = [w for w in words if len(tokenizer.encode(w)) == 3][:4000]  # [CLS] w [SEP]
    if len(words) < 100:
        raise RuntimeError("the tokenizer has too few one-token words to build texts from")
    texts = []
    while len(texts) < count:
        text = " ".join(rnd.choice(words) for _ in range(n_tokens - 2))
        if len(tokenizer.encode(text)) == n_tokens:
            texts.append(text)
    return texts


# -- the fleet ------------------------------------------------------------------------------
def batch_counters(stack: ModelStack, model: str) -> tuple[float, float]:
    """The worker's ``streamfleet_worker_batch_size`` histogram: (sum, count) of its steps."""
    [text] = stack.metrics(model)
    got = {m.group(1): float(m.group(2)) for m in
           re.finditer(r'^streamfleet_worker_batch_size_(sum|count)\{[^}]*\} ([0-9.e+]+)$', text, re.MULTILINE)}
    return got.get("sum", 0.0), got.get("count", 0.0)


# -- load -----------------------------------------------------------------------------------
class Window:
    """What completes between the end of the warm-up and the end of the measurement (texts/s:
    the texts answered in it; each one's latency from its send, which may precede the window:
    counting only the texts sent and answered inside it would drop the slow ones)."""

    def __init__(self, warmup: float, seconds: float) -> None:
        self.start = time.perf_counter() + warmup
        self.end = self.start + seconds
        self.latencies: list[float] = []  # a request's
        self.texts = 0

    def record(self, sent: float, done: float, texts: int = 1) -> None:
        if self.start <= done <= self.end:
            self.latencies.append(done - sent)
            self.texts += texts

    def over(self) -> bool:
        return time.perf_counter() >= self.end

    def result(self) -> dict:
        lat = self.latencies
        return {"texts": self.texts, "texts_per_s": self.texts / (self.end - self.start),
                "p50_ms": 1000 * statistics.median(lat) if lat else float("nan"),
                "p99_ms": 1000 * pctl(lat, 0.99)}


class RawConnection:
    """One keep-alive HTTP/1.1 connection that posts JSON and reads a ``Content-Length``
    reply, written on asyncio streams: the load's own CPU per request is a small fraction
    of httpx's, which on a small machine would otherwise take the cores from the fleet it
    measures (at c = 64 an httpx client took most of a core and became the bottleneck)."""

    def __init__(self, url: str) -> None:
        u = httpx.URL(url)
        self.host, self.port = u.host, u.port or 80
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(), self.port,
                                                                len(body), body))
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        length = next((int(v) for k, _, v in (ln.partition(b":") for ln in lines[1:])
                       if k.strip().lower() == b"content-length"), None)
        if length is None:
            raise RuntimeError(f"HTTP {status} without a Content-Length: {head[:300]!r}")
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()


async def embed_request(conn: RawConnection, texts: str | list[str], dimensions: int) -> None:
    status, body = await conn.post("/v1/embeddings", orjson.dumps(
        {"model": EMBED_MODEL, "input": texts, "encoding_format": "base64"}))
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {body[:300]!r}")
    data = orjson.loads(body)["data"]
    n = 1 if isinstance(texts, str) else len(texts)
    if len(data) != n or any(len(base64.b64decode(d["embedding"])) != 4 * dimensions for d in data):
        raise RuntimeError(f"unexpected response: {body[:300]!r}")


def request_texts(texts: list[str], i: int, per: int) -> str | list[str]:
    """The ``i``-th request's input: one text (``per`` 1), or a list of ``per``."""
    if per == 1:
        return texts[i % len(texts)]
    return [texts[(i * per + j) % len(texts)] for j in range(per)]


async def fleet_clients(url: str, texts: list[str], c: int, window: Window, dimensions: int,
                        stop: asyncio.Event | None = None, per: int = 1) -> None:
    """``c`` clients, each on its own keep-alive connection, sending ``per`` texts a
    request, the next when its last is answered, until the window is over (or ``stop``
    is set)."""
    async def one(k: int) -> None:
        conn = RawConnection(url)
        i = k
        try:
            while not window.over() and not (stop is not None and stop.is_set()):
                sent = time.perf_counter()
                await embed_request(conn, request_texts(texts, i, per), dimensions)
                window.record(sent, time.perf_counter(), per)
                i += c
        finally:
            await conn.close()

    await asyncio.gather(*(one(k) for k in range(c)))


async def one_process(engine, tokenizer, texts: list[str], c: int, window: Window, per: int = 1) -> float:
    """The same clients against a batcher in this process: whole requests (``per`` texts
    each) up to ``max_batch`` waiting texts within ``max_batch_tokens``, in the order they
    came (a larger one alone), one ``engine.embed`` call a batch in a thread, as the
    worker's EmbeddingCore does. Returns the mean batch (texts)."""
    ids = [tokenizer.encode(t) for t in texts]
    waiting: list[tuple[list[list[int]], asyncio.Future]] = []
    wake = asyncio.Event()
    sizes: list[int] = []
    loop = asyncio.get_running_loop()

    async def batcher() -> None:
        while not window.over() or waiting:
            if not waiting:
                wake.clear()
                try:
                    await asyncio.wait_for(wake.wait(), 0.1)
                except TimeoutError:
                    pass
                continue
            batch, rest, n, tokens = [], [], 0, 0
            for item in waiting:
                m, k = len(item[0]), sum(len(x) for x in item[0])
                if batch and (n + m > engine.max_batch or tokens + k > engine.max_batch_tokens):
                    rest.append(item)
                    continue
                batch.append(item)
                n, tokens = n + m, tokens + k
            waiting[:] = rest
            sizes.append(n)
            vectors = await asyncio.to_thread(engine.embed, [x for b in batch for x in b[0]])
            row = 0
            for group, fut in batch:
                fut.set_result(vectors[row:row + len(group)])
                row += len(group)

    async def one(k: int) -> None:
        i = k
        while not window.over():
            sent = time.perf_counter()
            fut = loop.create_future()
            waiting.append(([ids[(i * per + j) % len(ids)] for j in range(per)], fut))
            wake.set()
            await fut
            window.record(sent, time.perf_counter(), per)
            i += c

    task = asyncio.create_task(batcher())
    await asyncio.gather(*(one(k) for k in range(c)))
    await task
    return statistics.mean(sizes) if sizes else 0.0


def throughput(args, tokenizer, cores: int) -> tuple[dict, list[str]]:
    from streamfleet.workers.engines.embedding import OnnxEmbeddingEngine

    spec = ModelRepository().get(EMBED_MODEL)
    results: dict = {}
    rows = []
    texts = {n: make_texts(tokenizer, n, 512, seed=n) for n in args.lengths}
    engine = OnnxEmbeddingEngine(spec, threads=cores)
    for n in args.lengths:  # the one-process loop first, while no fleet runs
        for c in args.concurrency:
            log(f"one process: {n} tokens, c={c}")
            w = Window(WARMUP_S, args.seconds)
            mean_batch = asyncio.run(one_process(engine, tokenizer, texts[n], c, w, args.per_request))
            results[f"oneprocess {n} c{c}"] = w.result() | {"mean_batch": mean_batch}
    engine.close()
    with ModelStack([(EMBED_MODEL, threads(cores))], EMBED_MODEL) as stack:
        for n in args.lengths:
            for c in args.concurrency:
                log(f"streamfleet: {n} tokens, c={c}")
                w = Window(WARMUP_S, args.seconds)
                s0, n0 = batch_counters(stack, EMBED_MODEL)
                asyncio.run(fleet_clients(stack.url, texts[n], c, w, spec.dimensions, per=args.per_request))
                s1, n1 = batch_counters(stack, EMBED_MODEL)
                results[f"streamfleet {n} c{c}"] = w.result() | {"mean_batch": (s1 - s0) / (n1 - n0) if n1 > n0
                                                                 else 0.0}
    for n in args.lengths:
        for c in args.concurrency:
            o, s = results[f"oneprocess {n} c{c}"], results[f"streamfleet {n} c{c}"]
            ratio = s["texts_per_s"] / o["texts_per_s"] if o["texts_per_s"] else float("nan")
            results[f"ratio {n} c{c}"] = ratio
            rows.append((n, c, o, s, ratio))
    per = "one text" if args.per_request == 1 else f"{args.per_request} texts"
    lines = [f"\nthroughput: {per} a request, {cores} threads (the worker's SF_THREADS, the loop's threads=), "
             f"{args.seconds:g} s a run after {WARMUP_S:g} s warm-up, max_batch {spec.max_batch}, "
             f"max_batch_tokens {spec.options.get('max_batch_tokens', 2048)}"]
    head = ("tokens".rjust(6) + "c".rjust(5) + "one process texts/s".rjust(21) + "p50/p99 ms".rjust(16)
            + "batch".rjust(7) + "streamfleet texts/s".rjust(21) + "p50/p99 ms".rjust(16) + "batch".rjust(7)
            + "ratio".rjust(8))
    lines += [head, "-" * len(head)]
    for n, c, o, s, ratio in rows:
        lines.append(f"{n:>6}{c:>5}{o['texts_per_s']:>21.1f}{o['p50_ms']:>8.1f}/{o['p99_ms']:<7.1f}"
                     f"{o['mean_batch']:>7.1f}{s['texts_per_s']:>21.1f}{s['p50_ms']:>8.1f}/{s['p99_ms']:<7.1f}"
                     f"{s['mean_batch']:>7.1f}{ratio:>8.0%}")
    top = max(args.concurrency)
    for n in args.lengths:
        lines.append(f"{n} tokens, c={top}: streamfleet {results[f'ratio {n} c{top}']:.0%} of the one-process "
                     f"texts/s (goal >= 90 % at c = 64)")
    return results, lines


# -- beside chat ----------------------------------------------------------------------------
async def chat_stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> list[float]:
    """One streamed chat completion: the arrival time of each content chunk."""
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    arrivals = []
    async for chunk in chat_chunks(client, url, body):
        for choice in chunk.get("choices", []):
            content = (choice.get("delta") or {}).get("content")
            if content:
                arrivals.append(time.perf_counter())
    return arrivals


async def beside_chat(stack: ModelStack, texts: list[str], streams: int, max_tokens: int, flood: int,
                      seconds: float, dimensions: int) -> dict:
    gaps: list[float] = []
    tokens = 0
    async with httpx.AsyncClient(timeout=600) as client:
        await chat_stream(client, stack.url, "warm up", 4)
        warm = RawConnection(stack.url)
        await embed_request(warm, texts[0], dimensions)
        await warm.close()
        stop = asyncio.Event()
        fw = Window(0.0, 1e9)  # the flood runs until stop is set
        flood_task = (asyncio.create_task(fleet_clients(stack.url, texts, flood, fw, dimensions, stop))
                      if flood else None)
        window = Window(WARMUP_S, seconds)

        async def one(k: int) -> None:
            nonlocal tokens
            i = k
            while not window.over():
                arrivals = await chat_stream(client, stack.url, PROMPTS[i % len(PROMPTS)], max_tokens)
                inside = [t for t in arrivals if window.start <= t <= window.end]
                gaps.extend(b - a for a, b in itertools.pairwise(inside))
                tokens += len(inside)
                i += streams

        await asyncio.gather(*(one(k) for k in range(streams)))
        flood_texts = fw.texts
        flood_s = time.perf_counter() - fw.start
        if flood_task is not None:
            stop.set()
            await flood_task
    return {"itl_p50_ms": 1000 * statistics.median(gaps) if gaps else float("nan"),
            "itl_p99_ms": 1000 * pctl(gaps, 0.99), "gaps": len(gaps), "tokens_per_s": tokens / seconds,
            "flood_texts_per_s": flood_texts / flood_s if flood else 0.0}


def chat_part(args, tokenizer) -> tuple[dict, list[str]]:
    spec = ModelRepository().get(EMBED_MODEL)
    texts = make_texts(tokenizer, 32, 512, seed=32)
    results: dict = {}
    with ModelStack([(CHAT_MODEL, threads(1)), (EMBED_MODEL, threads(1))], CHAT_MODEL) as stack:
        for name, flood in (("chat alone", 0), (f"chat + embedding flood (c={args.flood})", args.flood)):
            log(f"beside chat: {name}")
            results[name] = asyncio.run(beside_chat(stack, texts, args.chat_streams, args.chat_tokens, flood,
                                                    args.seconds, spec.dimensions))
    (an, a), (fn, fl) = results.items()
    ratio = fl["itl_p99_ms"] / a["itl_p99_ms"] if a["itl_p99_ms"] else float("nan")
    results["itl_p99_ratio"] = ratio
    lines = [f"\nbeside chat: {args.chat_streams} streams of {args.chat_tokens} tokens ({CHAT_MODEL}, ignore_eos), "
             f"text and embedding workers SF_THREADS=1 each, {args.seconds:g} s a run"]
    head = "run".ljust(36) + "ITL p50 ms".rjust(12) + "ITL p99 ms".rjust(12) + "chat tokens/s".rjust(15) + \
        "embed texts/s".rjust(15)
    lines += [head, "-" * len(head)]
    for name, r in ((an, a), (fn, fl)):
        lines.append(name.ljust(36) + f"{r['itl_p50_ms']:>12.1f}{r['itl_p99_ms']:>12.1f}{r['tokens_per_s']:>15.1f}"
                     f"{r['flood_texts_per_s']:>15.1f}")
    lines.append(f"inter-token latency p99 x{ratio:.2f} with the flood (goal <= 1.5x)")
    return results, lines


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("all", "throughput", "chat"), default="all")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds each measurement lasts (after a "
                    f"{WARMUP_S:g} s warm-up)")
    ap.add_argument("--concurrency", type=ints, default=[1, 16, 64], help="clients, comma-separated (1,16,64)")
    ap.add_argument("--lengths", type=ints, default=[32, 256], help="tokens a text, comma-separated (32,256)")
    ap.add_argument("--per-request", type=int, default=1, help="texts a request (1: as a RAG query sends them; "
                    "more: as an indexing job sends its chunks)")
    ap.add_argument("--chat-streams", type=int, default=4)
    ap.add_argument("--chat-tokens", type=int, default=64)
    ap.add_argument("--flood", type=int, default=16, help="embedding clients beside the chat streams")
    ap.add_argument("--json", help="also write the figures to this file")
    benchtable.add_argument(ap)
    args = ap.parse_args()

    cores = os.cpu_count() or 2
    spec = ModelRepository().get(EMBED_MODEL)
    ensure_artifacts(spec)
    tokenizer = load_tokenizer(spec)
    if any(not 3 <= n <= spec.max_context for n in args.lengths):
        ap.error(f"--lengths must lie within 3..{spec.max_context}")
    if args.part in ("all", "chat"):
        ensure_artifacts(ModelRepository().get(CHAT_MODEL))
    results: dict = {"cores": cores}
    lines = [f"bench_embed: {EMBED_MODEL}, {cores} cores"]
    if args.part in ("all", "throughput"):
        r, more = throughput(args, tokenizer, cores)
        results["throughput"] = r
        lines += more
    if args.part in ("all", "chat"):
        r, more = chat_part(args, tokenizer)
        results["chat"] = r
        lines += more
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(benchtable.main(main))
