"""Inter-token latency under load, measured on the real model (SmolLM2-135M-Instruct)
through a real fleet: a private Redis, one gateway, one ONNX Runtime worker on all the
cores, requests over the OpenAI chat endpoint (SSE).

``--streams`` requests decode (ignoring EOS) for the whole run. After ``--steady-s``
seconds of them alone, an uncached prompt of ``--long-tokens`` tokens arrives every
``--long-every-s`` seconds, ``--long-count`` times (0: none). Reported per stream: the
gap between two of its tokens, p50 and p99, while the streams run alone ("steady") and
over the whole run, and its longest gap, overall and while a long prompt was being
prefilled (from its arrival to its first token); each long prompt's time to first token;
the worker's step target and the step costs it learned (its heartbeat: what
`streamfleet status` shows); and the CPU. With ``--baseline`` the same load runs again
on a worker that prefills a prompt in one step (``SF_MAX_STEP_TOKENS`` 8192, no step
target), for the long prompt's one-step TTFT and the freeze it costs the streams.

    python -m scripts.bench_itl                          # 4 streams, 3 long prompts, baseline
    python -m scripts.bench_itl --streams 16 --long-count 0
    python -m scripts.bench_itl --step-target-ms 60,100,150 --no-baseline

Goals (issue 49), on 2 cores: with a long prompt arriving, a stream's longest gap <= 250
ms and <= 3x its steady p50; the long prompt's TTFT <= 1.5x the one-step TTFT; at c=16,
each stream's p99 <= 2x its p50. The figures are ratios within one run (these machines
are shared and noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import statistics
import sys
import time

import httpx
import orjson
import redis

from scripts import benchtable
from scripts.bench_prefix import WORDS, chat, log, pctl
from scripts.fleetstack import ModelStack, chat_chunks, threads
from scripts.procstats import cpu_line
from streamfleet.shared.keys import Keys
from streamfleet.shared.modelrepo import ModelRepository, ensure_artifacts, load_tokenizer
from streamfleet.shared.schema import Heartbeat

MODEL = "smollm2-135m"


def long_text(tokenizer, n_tokens: int, seed: int) -> str:
    """Words of about ``n_tokens`` tokens (with the chat template's), different per seed:
    no worker's prefix cache holds any of it."""
    rnd = random.Random(seed)
    words = [f"Ticket {seed}-{rnd.randrange(10**9)}:"]
    while len(tokenizer.encode(" ".join(words))) < n_tokens - 40:
        words.extend(rnd.choice(WORDS) for _ in range(50))
    text = " ".join(words)
    while len(tokenizer.encode(text)) > n_tokens - 40:
        text = text[: int(len(text) * 0.98)]
    return text


def heartbeat(stack: ModelStack) -> Heartbeat | None:
    r = redis.Redis.from_url(stack.redis.url)
    try:
        raw = r.hgetall(Keys("sf").workers(MODEL))
    finally:
        r.close()
    for wid, blob in raw.items():
        return Heartbeat.decode(blob, wid)
    return None


async def stream_arrivals(stack: ModelStack, tokenizer, args) -> dict:
    """The streams, and the long prompts among them: each stream's token arrival times
    (kept as they come: the streams are stopped when the run is over), when each long
    prompt arrived and had its first token, and the worker's last heartbeat."""
    gap_s = 0.03
    total_s = args.steady_s + max(0, args.long_count - 1) * args.long_every_s + 30.0
    max_tokens = min(3500, int(total_s / gap_s))
    prompts = [long_text(tokenizer, args.long_tokens, 1000 + seed) for seed in range(args.long_count)]
    arrivals: list[list[float]] = [[] for _ in range(args.streams)]

    async def stream(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count from {i} to 10000."}],
                "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
        async for chunk in chat_chunks(client, stack.url, body):
            for choice in chunk.get("choices", []):
                if (choice.get("delta") or {}).get("content"):
                    arrivals[i].append(time.perf_counter())

    beats: list[tuple[float, Heartbeat]] = []

    async def sample() -> None:  # the worker's heartbeat (its step_ms, last chunk and costs), for --trace
        while True:
            hb = await asyncio.to_thread(heartbeat, stack)
            if hb is not None:
                beats.append((time.perf_counter(), hb))
            await asyncio.sleep(0.5)

    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=httpx.Limits(max_connections=256)) as client:
        await chat(client, stack.url, [{"role": "user", "content": "warm up"}], 8)
        tasks = [asyncio.create_task(stream(client, i)) for i in range(args.streams)]
        sampler = asyncio.create_task(sample()) if args.trace else None
        # every stream has its first tokens: the steady part starts
        while not all(len(a) >= 3 for a in arrivals):
            if any(t.done() for t in tasks):
                for t in tasks:
                    if t.done():
                        t.result()
            await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        await asyncio.sleep(args.steady_s)
        steady_until = time.perf_counter()
        longs: list[tuple[float, float]] = []
        for i, text in enumerate(prompts):
            if i:
                await asyncio.sleep(max(0.0, args.long_every_s - (time.perf_counter() - longs[-1][0])))
            sent = time.perf_counter()
            ttft, _, _ = await chat(client, stack.url, [{"role": "user", "content": text}], 2)
            longs.append((sent, sent + ttft))
            log(f"long prompt {i + 1}/{len(prompts)}: TTFT {ttft:.2f} s")
        await asyncio.sleep(2.0)
        end = time.perf_counter()
        beat = heartbeat(stack)
        for t in [*tasks, *([sampler] if sampler else [])]:
            t.cancel()
        await asyncio.gather(*tasks, *([sampler] if sampler else []), return_exceptions=True)
    if args.trace:
        for t, hb in beats:
            c = hb.step_costs
            print(f"  {t - t0:7.2f}s step_ms(max of 16) {hb.step_ms:7.1f} last chunk {int(c.get('chunk', 0)):4d}  "
                  f"base {c.get('base_ms', 0):.1f} seq {c.get('seq_ms', 0):.2f} chunk {c.get('chunk_ms', 0):.1f} "
                  f"token {c.get('token_ms', 0):.3f} +{c.get('token_kpos_ms', 0):.3f}/kpos "
                  f"kpos {c.get('kpos_ms', 0):.2f}",
                  file=sys.stderr)
    return {"t0": t0, "steady_until": steady_until, "end": end, "longs": longs, "arrivals": arrivals,
            "heartbeat": beat}


def gaps(times: list[float], lo: float, hi: float) -> list[float]:
    """Gaps between consecutive arrivals that both fall in [lo, hi]."""
    inside = [t for t in times if lo <= t <= hi]
    return [b - a for a, b in itertools.pairwise(inside)]


def summarize(r: dict) -> dict:
    streams = []
    for times in r["arrivals"]:
        steady = gaps(times, r["t0"], r["steady_until"])
        every = gaps(times, r["t0"], r["end"])
        during = [g for lo, hi in r["longs"] for g in gaps(times, lo - 0.5, hi + 0.5)]
        streams.append({"steady_p50_ms": 1000 * statistics.median(steady) if steady else float("nan"),
                        "steady_p99_ms": 1000 * pctl(steady, 0.99),
                        "p50_ms": 1000 * statistics.median(every) if every else float("nan"),
                        "p99_ms": 1000 * pctl(every, 0.99),
                        "longest_ms": 1000 * max(every, default=float("nan")),
                        "longest_during_long_ms": 1000 * max(during, default=float("nan")),
                        "tokens": len(times)})
    ttfts = [b - a for a, b in r["longs"]]
    hb = r.get("heartbeat")
    return {"streams": streams, "long_ttft_s": ttfts,
            "step_target_ms": hb.step_target_ms if hb else None, "step_costs": hb.step_costs if hb else None}


def report(name: str, s: dict) -> list[str]:
    lines = [f"\n{name}"]
    head = (f"{'stream':>6} {'steady p50':>11} {'steady p99':>11} {'p50':>8} {'p99':>8} {'longest':>9}"
            f" {'longest while a long prompt is fed':>36} {'tokens':>7}")
    lines += [head, "-" * len(head)]
    for i, st in enumerate(s["streams"]):
        lines.append(f"{i:>6} {st['steady_p50_ms']:>9.1f}ms {st['steady_p99_ms']:>9.1f}ms {st['p50_ms']:>6.1f}ms"
                     f" {st['p99_ms']:>6.1f}ms {st['longest_ms']:>7.1f}ms {st['longest_during_long_ms']:>34.1f}ms"
                     f" {st['tokens']:>7}")
    if s["long_ttft_s"]:
        lines.append("long prompts' TTFT: " + ", ".join(f"{t:.2f} s" for t in s["long_ttft_s"])
                     + f" (median {statistics.median(s['long_ttft_s']):.2f} s)")
    if s.get("step_costs"):
        from streamfleet.status import step_costs_line

        lines.append(f"worker steps: {step_costs_line(s['step_target_ms'] or 0.0, s['step_costs'])}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=4, help="requests decoding throughout (c)")
    ap.add_argument("--steady-s", type=float, default=8.0, help="seconds the streams run alone first")
    ap.add_argument("--long-tokens", type=int, default=4000)
    ap.add_argument("--long-every-s", type=float, default=15.0, help="seconds between long prompts' arrivals (a "
                    "prompt that takes longer than this is followed at once by the next)")
    ap.add_argument("--long-count", type=int, default=3, help="long prompts (0: none)")
    ap.add_argument("--step-target-ms", default="", help="SF_STEP_TARGET_MS of the worker, or several, "
                    "comma-separated, one run each (default: the setting's default)")
    ap.add_argument("--no-baseline", dest="baseline", action="store_false",
                    help="skip the run with a one-step prefill (SF_MAX_STEP_TOKENS 8192, SF_STEP_TARGET_MS 0)")
    ap.add_argument("--trace", action="store_true", help="print the worker's heartbeat every 0.5 s (its longest "
                    "recent step, last chunk and learned costs) to stderr")
    ap.add_argument("--json", help="also write the figures to this file")
    benchtable.add_argument(ap)
    args = ap.parse_args()

    spec = ModelRepository().get(MODEL)
    ensure_artifacts(spec)
    tokenizer = load_tokenizer(spec)
    cpu = cpu_line()
    lines = [f"bench_itl: {MODEL}, {args.streams} streams, "
             + (f"{args.long_count} prompts of {args.long_tokens} tokens every {args.long_every_s:g} s after "
                f"{args.steady_s:g} s" if args.long_count else f"no long prompt, {args.steady_s:g} s"), cpu]
    results: dict = {"cpu": cpu, "args": vars(args)}
    targets = [t.strip() for t in args.step_target_ms.split(",") if t.strip()] or [None]
    runs = [(f"step target {t} ms" if t else "step target (default)", {"SF_STEP_TARGET_MS": t} if t else {})
            for t in targets]
    if args.baseline and args.long_count:
        runs.append(("one-step prefill (SF_MAX_STEP_TOKENS 8192, SF_STEP_TARGET_MS 0)",
                     {"SF_MAX_STEP_TOKENS": "8192", "SF_STEP_TARGET_MS": "0"}))
    summaries = {}
    for name, env in runs:
        log(f"run: {name}")
        share = threads(os.cpu_count() or 2)
        with ModelStack([(MODEL, share)], MODEL, env) as stack:
            s = summarize(asyncio.run(stream_arrivals(stack, tokenizer, args)))
        summaries[name] = s
        results[name] = s
        lines += report(name, s)
    lines.append("")
    base = summaries.get(runs[-1][0]) if args.baseline and args.long_count else None
    for name, s in summaries.items():
        if s is base:
            continue
        worst = max((st["longest_during_long_ms"] for st in s["streams"]), default=float("nan"))
        ratio = max((st["longest_during_long_ms"] / st["steady_p50_ms"] for st in s["streams"]), default=float("nan"))
        spread = max((st["p99_ms"] / st["p50_ms"] for st in s["streams"]), default=float("nan"))
        line = f"{name}: p99/p50 at most {spread:.2f}x (goal at c=16: <= 2x)"
        if args.long_count:
            line += (f"; longest gap while a long prompt is fed {worst:.0f} ms (goal <= 250), {ratio:.1f}x the "
                     f"steady p50 (goal <= 3x)")
            if base is not None and base["long_ttft_s"] and s["long_ttft_s"]:
                t = statistics.median(s["long_ttft_s"]) / statistics.median(base["long_ttft_s"])
                line += f"; long prompt's TTFT {t:.2f}x the one-step prefill's (goal <= 1.5x)"
        lines.append(line)
    if base is not None:
        worst = max((st["longest_during_long_ms"] for st in base["streams"]), default=float("nan"))
        lines.append(f"one-step prefill: the streams' longest gap {worst:.0f} ms, long prompt's TTFT median "
                     f"{statistics.median(base['long_ttft_s']):.2f} s")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "wb") as fh:
            fh.write(orjson.dumps(results, option=orjson.OPT_INDENT_2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(benchtable.main(main))
