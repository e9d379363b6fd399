#!/usr/bin/env python
"""Regenerate docs/benchmarks.md: the project's current figures, measured by one command.

    python -m scripts.benchmarks                 # every benchmark below, about 3 minutes on 2 cores
    python -m scripts.benchmarks --only fleet    # some of them (fleet, peers, real)
    python -m scripts.benchmarks --out /tmp/b.md # somewhere else

Each benchmark is one of the project's own commands, run as a subprocess on this machine
(its own private Redis and processes), and its printed report goes into the page as is,
under a note of what it measures, with the machine (cores, CPU), the commit and the date
at the top. The page is replaced, never appended to: what it shows is what the code does
now, and how a figure moved over time is in git's history of the page. Code comments
cite the page's sections by their headings instead of quoting figures.

The machines these run on are shared and noisy: every benchmark compares side by side in
one run (ratios against a one-process loop on the same work), and the load average
before and after each run is printed beside it, so a figure taken under load shows.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "benchmarks.md"


@dataclass(frozen=True)
class Benchmark:
    key: str
    title: str
    argv: tuple[str, ...]
    what: str
    timeout_s: float = 900.0


BENCHMARKS = (
    Benchmark(
        "fleet", "The fleet's own cost — `scripts/bench_fleet.py`",
        ("-m", "scripts.bench_fleet", "--quick"),
        "On the echo engine (no model cost; a fixed sleep per engine call stands in for the "
        "model's step), over real WebSockets: **overhead** — one gateway and one worker against "
        "one process doing the same without Redis (`scripts/baseline_server.py`), TTFT and "
        "inter-token latency at concurrency 1 and 64 and what the fleet adds; **throughput** — "
        "tokens/s one gateway process delivers to 256 streams; **scaleout** — 2 gateways × 2 "
        "workers against 1 × 1 where the workers are the limit; **arq** — the same workload with "
        "arq as the task queue against the fleet's Redis Streams."),
    Benchmark(
        "peers", "Beside the peers, echo engine — `scripts/bench_peers.py`",
        ("-m", "scripts.bench_peers", "--concurrency", "1,64,256", "--rounds", "3"),
        "Each server's own overhead on the same echo engine, 16 tokens per request, over OpenAI "
        "SSE and the WebSocket: the one-process FastAPI app with the batching loop in its own "
        "event loop (`scripts/peer_app.py`, the limit a fleet is measured against), Ray Serve "
        "when installed (`pip install -e '.[peers]'`), and streamfleet (one gateway, one worker, "
        "a private Redis). \"srv µs/tok\" is the CPU of every server process per delivered token, "
        "\"client µs/tok\" the benchmark client's own (it shares the cores)."),
    Benchmark(
        "real", "A real model — `scripts/bench_peers.py --engine smollm2-135m`",
        ("-m", "scripts.bench_peers", "--engine", "smollm2-135m", "--concurrency", "4,16", "--rounds", "1"),
        "SmolLM2-135M-Instruct (the default model, the Q4_1 GGUF file imported to ONNX) served by "
        "the one-process loop on the same graph and by streamfleet, and by llama.cpp's "
        "llama-server on the same GGUF file where one is built (`--llama-server PATH`; the row "
        "says skipped otherwise): decode tokens/s at c=1, TTFT of a 512-token prompt, aggregate "
        "tokens/s under load, CPU per token and memory, with ratios.",
        timeout_s=1800.0),
)


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(next(l for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemTotal")).split()[1])
        mem = f", {kb / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{os.cpu_count()} cores ({cpu}){mem}, Python {platform.python_version()}"


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        # what is measured is the code: edits to the docs (this page among them) do not count
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs",
                                ":!README.md"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(bench: Benchmark) -> tuple[str, float, float, float, int]:
    """Run one benchmark: (its printed report, seconds, load average before and after, exit code)."""
    print(f"== {bench.key}: python {' '.join(bench.argv)}", flush=True)
    load0, t0 = os.getloadavg()[0], time.monotonic()
    try:
        proc = subprocess.run([sys.executable, *bench.argv], cwd=REPO, capture_output=True, text=True,
                              timeout=bench.timeout_s)
        out, code = proc.stdout, proc.returncode
        if code:
            out += "\n" + proc.stderr[-3000:]
    except subprocess.TimeoutExpired as exc:
        out, code = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
            else (exc.stdout or ""), -1
        out += f"\n(stopped after {bench.timeout_s:.0f} s)"
    took = time.monotonic() - t0
    print(out, flush=True)
    return out.rstrip(), took, load0, os.getloadavg()[0], code


def render(results: list[tuple[Benchmark, tuple[str, float, float, float, int]]], when: str) -> str:
    parts = [
        "# Benchmarks\n",
        "<!-- Generated by `python -m scripts.benchmarks`; edit scripts/benchmarks.py, not this page. -->\n",
        "The project's current figures, every one measured by the command beside it. "
        "Regenerate the whole page with `python -m scripts.benchmarks` (or a part with "
        "`--only`); the page is replaced, never appended to, so git's history of it is the "
        "history of the figures. The machines are shared and noisy: read the ratios within "
        "one run, and the load average beside each run.\n",
        f"* machine: {_machine()}",
        f"* commit: {_commit()}",
        f"* measured: {when}\n",
    ]
    for bench, (out, took, load0, load1, code) in results:
        parts.append(f"## {bench.title}\n")
        parts.append(bench.what + "\n")
        status = "" if code == 0 else f"; **exit code {code}**"
        parts.append(f"`python {' '.join(bench.argv)}` — {took:.0f} s, load average {load0:.2f} before, "
                     f"{load1:.2f} after{status}\n")
        parts.append("```text\n" + out + "\n```\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated: " + ",".join(b.key for b in BENCHMARKS))
    ap.add_argument("--out", type=Path, default=PAGE, help=f"default {PAGE.relative_to(REPO)}")
    args = ap.parse_args(argv)
    wanted = [k for k in args.only.split(",") if k] or [b.key for b in BENCHMARKS]
    unknown = sorted(set(wanted) - {b.key for b in BENCHMARKS})
    if unknown:
        ap.error(f"unknown benchmark(s): {', '.join(unknown)}")
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    results = [(b, run(b)) for b in BENCHMARKS if b.key in wanted]
    args.out.write_text(render(results, when))
    print(f"wrote {args.out}")
    return 0 if all(r[4] == 0 for _, r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
