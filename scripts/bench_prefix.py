"""The prefix cache, prefix-aware routing and chunked prefill, measured on the real model
(SmolLM2-135M-Instruct) through a real fleet: a private Redis, one gateway, one or two
ONNX Runtime workers, requests over the OpenAI chat endpoint (SSE).

Part 1, conversations: ``--conversations`` chats run at once, each ``--turns`` turns
long, every one with the same system prompt of about ``--system-tokens`` tokens (an
application's instructions) and its own growing history: each turn re-sends the earlier
turns and the model's replies (the text each turn streamed back, as the assistant's
message), as chat clients do. Run with the prefix cache off, on,
and on two workers (``--workers``) without and with prefix-aware routing. Per run: time to first token
p50/p99 for each turn, prompt tokens computed vs requested (the workers' own counters),
the cache's hit rate (tokens it had / tokens looked up), completion tokens/s, the
routed tasks another worker took after they waited ``SF_AFFINITY_WAIT_MS`` ("taken"), and
the reply tokens the workers prefilled into their caches while idle ("idle": finished
replies kept for the next turn, docs/scheduling.md, "Prefix cache").

Part 2, a long prompt beside running streams: ``--streams`` requests decode (ignoring
EOS); once they run, an uncached prompt of ``--long-tokens`` tokens arrives. Reported:
the running streams' longest gap between two tokens while it is prefilled, and its own
time to first token, with ``SF_MAX_STEP_TOKENS`` at its default (chunked) and above the
prompt's length (one step).

    python -m scripts.bench_prefix                  # both parts (about 6 minutes on 2 cores)
    python -m scripts.bench_prefix --part chunked   # part 2 only

The figures are ratios within one run (these machines are shared and noisy). Goals
(issues 40 and 49): a cached turn's TTFT p50 at least 5x lower than with the cache off
(8x when users pause: ``--think-s``); with two workers, routing keeps the hit rate within
5 points of one worker's; chunked prefill makes the streams' longest gap at least 5x
shorter, and the long prompt's own TTFT at most 1.5x longer.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import statistics
import sys
import time

import httpx

from scripts import benchtable
from scripts.fleetstack import ModelStack, chat_chunks, threads
from streamfleet.shared.modelrepo import ModelRepository, ensure_artifacts, load_tokenizer

MODEL = "smollm2-135m"
RUNS = ("off", "on", "shared", "routing")
WORDS = ("policy", "customer", "refund", "shipping", "warranty", "account", "invoice", "order", "delivery",
         "return", "support", "product", "service", "billing", "address", "payment", "discount", "tracking",
         "exchange", "receipt", "subscription", "cancel", "upgrade", "priority", "escalate", "verify", "identity")
QUESTIONS = ("How do I return a damaged item?", "What is the refund window?", "Can I change my address?",
             "Why was my card charged twice?", "How long does shipping take?", "Is there a warranty?",
             "Can I upgrade my plan?", "How do I cancel?", "Where is my order?", "Do you ship abroad?")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def system_prompt(tokenizer, n_tokens: int) -> str:
    """Support-desk instructions of about ``n_tokens`` tokens (deterministic)."""
    rnd = random.Random(40)
    lines = ["You are the support assistant of an online shop. Follow these rules."]
    while len(tokenizer.encode("\n".join(lines))) < n_tokens:
        words = " ".join(rnd.choice(WORDS) for _ in range(12))
        lines.append(f"Rule {len(lines)}: for any {words}, answer briefly.")
    return "\n".join(lines)


def pctl(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def counters(stack: ModelStack) -> dict[str, float]:
    """The workers' prompt-token and prefix-cache counters, summed."""
    total: dict[str, float] = {}
    pattern = re.compile(r'^(streamfleet_worker_(?:prompt_tokens_total|prefix_cache_lookups_total)'
                         r'\{[^}]*(?:source|result)="(\w+)"[^}]*\}) ([0-9.e+]+)$', re.MULTILINE)
    taken = re.compile(r'^streamfleet_worker_affinity_taken_total\{[^}]*\} ([0-9.e+]+)$', re.MULTILINE)
    idle = re.compile(r'^streamfleet_worker_prefix_cache_reply_tokens_total\{[^}]*\} ([0-9.e+]+)$', re.MULTILINE)
    for text in stack.metrics():
        for m in pattern.finditer(text):
            key = m.group(2)
            total[key] = total.get(key, 0.0) + float(m.group(3))
        for m in taken.finditer(text):
            total["taken"] = total.get("taken", 0.0) + float(m.group(1))
        for m in idle.finditer(text):
            total["idle"] = total.get("idle", 0.0) + float(m.group(1))
    return total


def model_stack(workers: int, worker_env: dict[str, str], gateway_env: dict[str, str] | None = None) -> ModelStack:
    """A private Redis, one gateway and ``workers`` workers of the model sharing the cores."""
    share = threads(max(1, (os.cpu_count() or 2) // workers))
    return ModelStack([(MODEL, share)] * workers, MODEL, worker_env, gateway_env or {})


async def chat(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int, **extra
               ) -> tuple[float, str, list[float]]:
    """One streamed chat completion: (TTFT s, its text, the arrival time of each content chunk)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            **extra}
    t0 = time.perf_counter()
    ttft, text, arrivals = None, [], []
    async for chunk in chat_chunks(client, url, body):
        for choice in chunk.get("choices", []):
            content = (choice.get("delta") or {}).get("content")
            if content is not None and (content or choice.get("finish_reason")):
                now = time.perf_counter()
                arrivals.append(now)
                if ttft is None:
                    ttft = now - t0
                text.append(content)
    return (ttft if ttft is not None else time.perf_counter() - t0), "".join(text), arrivals


async def conversations(stack: ModelStack, system: str, n: int, turns: int, max_tokens: int,
                        think_s: float = 0.0) -> dict:
    ttft: list[list[float]] = [[] for _ in range(turns)]
    tokens = 0
    async with httpx.AsyncClient(timeout=600) as client:
        # the application's first request ever: from now on its system prompt is cached
        # (on the worker that served it; with two, routing sends the others there)
        await chat(client, stack.url, [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}], 4)
        # a worker advertises its blocks with its next heartbeat (0.5 s) and a gateway reads
        # the adverts at most every 0.5 s: the steady state of an application is measured
        await asyncio.sleep(1.5)
        before = counters(stack)

        async def one(c: int) -> None:
            nonlocal tokens
            rnd = random.Random(c)
            messages = [{"role": "system", "content": system}]
            for t in range(turns):
                if t and think_s:  # the user reads the reply and types (the same pauses in every run)
                    await asyncio.sleep(rnd.uniform(0, think_s))
                messages.append({"role": "user", "content": f"Customer {c}, turn {t}: {rnd.choice(QUESTIONS)} "
                                                            f"My order number is {rnd.randrange(10**6)}."})
                s, text, arrivals = await chat(client, stack.url, messages, max_tokens)
                ttft[t].append(s)
                tokens += len(arrivals)
                messages.append({"role": "assistant", "content": text})

        t0 = time.perf_counter()
        await asyncio.gather(*(one(c) for c in range(n)))
        wall = time.perf_counter() - t0
        after = counters(stack)
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("computed", "cached", "hit", "miss", "taken", "idle")}
    requested = d["computed"] + d["cached"]
    return {"ttft_p50": [statistics.median(x) for x in ttft], "ttft_p99": [pctl(x, 0.99) for x in ttft],
            "computed": d["computed"], "requested": requested,
            "hit_rate": d["cached"] / requested if requested else 0.0, "tokens_per_s": tokens / wall,
            "taken_elsewhere": d["taken"], "idle_reply_tokens": d["idle"],
            "wall_s": wall}


async def long_prompt(stack: ModelStack, tokenizer, n_streams: int, long_tokens: int) -> dict:
    rnd = random.Random(7)
    words = []
    while len(tokenizer.encode(" ".join(words))) < long_tokens - 40:
        words.extend(rnd.choice(WORDS) for _ in range(50))
    text = " ".join(words)
    while len(tokenizer.encode(text)) > long_tokens - 40:
        text = text[: int(len(text) * 0.98)]
    async with httpx.AsyncClient(timeout=600) as client:
        await chat(client, stack.url, [{"role": "user", "content": "warm up"}], 4)
        streams = [asyncio.create_task(chat(client, stack.url, [{"role": "user", "content": f"Count to {i + 50}."}],
                                            120, ignore_eos=True)) for i in range(n_streams)]
        await asyncio.sleep(3.0)  # they are decoding
        sent = time.perf_counter()
        ttft, _, _ = await chat(client, stack.url, [{"role": "user", "content": text}], 4)
        first = sent + ttft
        results = await asyncio.gather(*streams)
    gaps = []
    for _, _, arrivals in results:
        during = [t for t in arrivals if sent - 1.0 <= t <= first + 1.0]
        gaps += [b - a for a, b in itertools.pairwise(during)]
    return {"longest_gap_s": max(gaps) if gaps else float("nan"), "long_ttft_s": ttft,
            "prompt_tokens": len(tokenizer.encode(text))}


def f(v: float, digits: int = 2) -> str:
    return f"{v:.{digits}f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("all", "prefix", "chunked"), default="all")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--think-s", type=float, default=0.0, help="each user pauses a random 0..THINK_S seconds "
                    "before each next turn (default 0: at once, so the conversations' turns arrive together)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--long-tokens", type=int, default=4000)
    ap.add_argument("--step-tokens", type=int, help="SF_MAX_STEP_TOKENS of the chunked run (default: the "
                    "setting's default)")
    ap.add_argument("--runs", type=lambda v: [x.strip() for x in v.split(",") if x.strip()], default=list(RUNS),
                    help=f"the conversation runs, comma-separated, of {','.join(RUNS)} (cache off on one worker, "
                         "on on one, on --workers workers through the shared lanes, on as many with routing; "
                         "default all)")
    ap.add_argument("--workers", type=int, default=2, help="workers of the shared and routing runs, sharing the "
                    "cores (default 2)")
    ap.add_argument("--affinity-wait-ms", type=int, help="the workers' SF_AFFINITY_WAIT_MS in the routing run "
                    "(default: the setting's default)")
    ap.add_argument("--json", help="also write the figures to this file")
    benchtable.add_argument(ap)
    args = ap.parse_args()

    spec = ModelRepository().get(MODEL)
    ensure_artifacts(spec)
    tokenizer = load_tokenizer(spec)
    results: dict = {"cores": os.cpu_count()}
    lines = [f"bench_prefix: {MODEL}, {os.cpu_count()} cores"]
    if args.part in ("all", "prefix"):
        system = system_prompt(tokenizer, args.system_tokens)
        wait = {"SF_AFFINITY_WAIT_MS": str(args.affinity_wait_ms)} if args.affinity_wait_ms is not None else {}
        many = args.workers
        runs = [("cache off, 1 worker", 1, {"SF_PREFIX_CACHE_MB": "0"}, {}),
                ("cache on, 1 worker", 1, {}, {}),
                (f"cache on, {many} workers, no routing", many, {}, {"SF_PREFIX_ROUTING": "false"}),
                (f"cache on, {many} workers, routing", many, wait, {"SF_PREFIX_ROUTING": "true"})]
        runs = [r for r, key in zip(runs, RUNS) if key in args.runs]
        rows = []
        for name, workers, env, gw_env in runs:
            log(f"conversations: {name}")
            with model_stack(workers, env, gw_env) as stack:
                r = asyncio.run(conversations(stack, system, args.conversations, args.turns, args.max_tokens,
                                              args.think_s))
            results[name] = r
            rows.append((name, r))
        off = results.get("cache off, 1 worker")
        lines.append(f"\n{args.conversations} conversations x {args.turns} turns, system prompt "
                     f"{len(tokenizer.encode(system))} tokens, {args.max_tokens} tokens a reply (greedy)"
                     + (f", users pause 0-{args.think_s:g} s before each next turn" if args.think_s else ""))
        head = "run".ljust(34) + "".join(f"TTFT t{t + 1} p50/p99 s".rjust(20) for t in range(args.turns)) + \
            "  computed/requested  hit rate  tokens/s  taken   idle"
        lines += [head, "-" * len(head)]
        for name, r in rows:
            cells = "".join(f"{f(r['ttft_p50'][t])}/{f(r['ttft_p99'][t])}".rjust(20) for t in range(args.turns))
            lines.append(name.ljust(34) + cells + f"  {int(r['computed']):>8}/{int(r['requested']):<9}"
                         f"  {r['hit_rate']:>7.0%}  {r['tokens_per_s']:>8.1f}  {int(r['taken_elsewhere']):>5}"
                         f"  {int(r['idle_reply_tokens']):>5}")
        on = results.get("cache on, 1 worker")
        if off and on:
            later = range(1, args.turns)
            speedup = statistics.median(off["ttft_p50"][t] / on["ttft_p50"][t] for t in later) if args.turns > 1 \
                else 0
            first = off["ttft_p50"][0] / on["ttft_p50"][0]
            goal = "8x, users pausing" if args.think_s else "5x"
            lines.append(f"cached turns (2..{args.turns}): TTFT p50 {speedup:.1f}x lower with the cache "
                         f"(goal >= {goal}); turn 1 (only the system prompt cached): {first:.1f}x")
            results["summary_prefix"] = {"cached_turn_ttft_speedup": speedup, "first_turn_speedup": first}
        routed = results.get(f"cache on, {many} workers, routing", {}).get("hit_rate")
        spread = results.get(f"cache on, {many} workers, no routing", {}).get("hit_rate")
        if routed is not None and spread is not None:
            one = f"{on['hit_rate']:.0%}" if on else "not run"
            lines.append(f"{many} workers: hit rate {routed:.0%} with routing, {spread:.0%} without, one worker "
                         f"{one} (goal: routing within 5 points of one worker)")
    if args.part in ("all", "chunked"):
        rows = []
        chunked = f"chunked (SF_MAX_STEP_TOKENS {args.step_tokens or 'default'})"
        for name, budget in ((chunked, str(args.step_tokens) if args.step_tokens else None),
                             ("one step (SF_MAX_STEP_TOKENS 8192)", "8192")):
            log(f"long prompt: {name}")
            env = {"SF_PREFIX_CACHE_MB": "0"} | ({"SF_MAX_STEP_TOKENS": budget} if budget else {})
            with model_stack(1, env) as stack:
                r = asyncio.run(long_prompt(stack, tokenizer, args.streams, args.long_tokens))
            results[name] = r
            rows.append((name, r))
        (_cn, c), (_on, o) = rows
        lines.append(f"\n{args.streams} streams decoding while a {c['prompt_tokens']}-token prompt arrives")
        head = "run".ljust(40) + "streams' longest gap s".rjust(24) + "long prompt TTFT s".rjust(22)
        lines += [head, "-" * len(head)]
        for name, r in rows:
            lines.append(name.ljust(40) + f(r["longest_gap_s"]).rjust(24) + f(r["long_ttft_s"]).rjust(22))
        lines.append(f"longest gap {o['longest_gap_s'] / c['longest_gap_s']:.1f}x shorter chunked (goal >= 5x); "
                     f"long prompt's TTFT x{c['long_ttft_s'] / o['long_ttft_s']:.2f} (goal <= 1.5x)")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(benchtable.main(main))
