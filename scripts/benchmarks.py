#!/usr/bin/env python
"""Rerun the benchmarks whose tables are under docs/benchmarks/, each writing its own.

    python -m scripts.benchmarks                     # the quick ones (about 4 minutes on 2 cores)
    python -m scripts.benchmarks --only fleet,echo   # some of them, by key
    python -m scripts.benchmarks --all               # the long ones too (about 25 minutes)
    python -m scripts.benchmarks --list              # the keys, commands and times

Each benchmark is one of the project's own commands run as a subprocess with
``--write docs/benchmarks/FILE.md#KEY`` (scripts/benchtable.py): it writes its printed
report into its own section, with the CPU, cores, date, command and commit, and leaves
the other sections as they are; a benchmark that fails writes nothing. docs/benchmarks.md
is the index of these tables, and the README and the docs link to them rather than
copying figures. The machines these run on are shared and noisy: every benchmark
compares side by side in one run, and the load average before and after is written
beside it.

``--llama-server PATH`` adds llama.cpp's own server to the real-model run (build one with
``python -m scripts.llama_server build``); ``--llama-bin DIR`` runs the quality
comparison against llama.cpp's tools in DIR.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TABLES = "docs/benchmarks"


@dataclass(frozen=True)
class Benchmark:
    key: str
    file: str
    argv: tuple[str, ...]
    minutes: float
    #: run by default (a few minutes at most, and nothing to build)
    quick: bool = True

    def command(self, extra: tuple[str, ...] = ()) -> list[str]:
        return [sys.executable, *self.argv, *extra, "--write", f"{TABLES}/{self.file}#{self.key}"]


BENCHMARKS = (
    Benchmark("fleet", "fleet.md", ("-m", "scripts.bench_fleet", "--quick"), 1),
    Benchmark("echo", "peers.md", ("-m", "scripts.bench_peers", "--concurrency", "1,64,256", "--rounds", "3"), 1),
    Benchmark("smollm2", "peers.md",
              ("-m", "scripts.bench_peers", "--engine", "smollm2-135m", "--concurrency", "4,16", "--rounds", "1"), 1),
    Benchmark("structured", "structured.md", ("-m", "scripts.bench_structured"), 1),
    Benchmark("llama-server", "peers.md",
              ("-m", "scripts.bench_peers", "--engine", "smollm2-135m", "--concurrency", "4,16"), 4, quick=False),
    Benchmark("quality", "quality.md", ("-m", "scripts.llama_quality"), 3, quick=False),
    Benchmark("prefix", "prefix.md", ("-m", "scripts.bench_prefix"), 6, quick=False),
    Benchmark("itl", "itl.md", ("-m", "scripts.bench_itl"), 4, quick=False),
    Benchmark("itl-c16", "itl.md", ("-m", "scripts.bench_itl", "--streams", "16", "--long-count", "0",
                                    "--steady-s", "15", "--no-baseline"), 1, quick=False),
    Benchmark("embed", "embed.md", ("-m", "scripts.bench_embed"), 5, quick=False),
    Benchmark("bench_fairness", "fairness.md", ("-m", "scripts.bench_fairness"), 6, quick=False),
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated keys: " + ",".join(b.key for b in BENCHMARKS))
    ap.add_argument("--all", action="store_true", help="every benchmark, the long ones too")
    ap.add_argument("--list", action="store_true", help="print the keys and commands, run nothing")
    ap.add_argument("--llama-server", metavar="PATH", help="llama.cpp's llama-server, for the llama-server run")
    ap.add_argument("--llama-bin", metavar="DIR", help="llama.cpp's tools (llama-perplexity), for the quality run")
    args = ap.parse_args(argv)
    keys = [k for k in args.only.split(",") if k]
    unknown = sorted(set(keys) - {b.key for b in BENCHMARKS})
    if unknown:
        ap.error(f"unknown benchmark(s): {', '.join(unknown)}")
    chosen = [b for b in BENCHMARKS if (b.key in keys if keys else (args.all or b.quick))]
    extra = {"llama-server": ("--llama-server", args.llama_server) if args.llama_server else (),
             "quality": ("--bin", args.llama_bin) if args.llama_bin else ()}
    if args.list:
        for b in BENCHMARKS:
            print(f"{b.key:<13} ~{b.minutes:g} min{'' if b.quick else ' (--all)':<9} "
                  f"python {' '.join(b.command(extra.get(b.key, ()))[1:])}")
        return 0
    failed = []
    for b in chosen:
        if b.key == "llama-server" and not args.llama_server:
            print("== llama-server: skipped (--llama-server PATH; `python -m scripts.llama_server build` makes one)")
            continue
        cmd = b.command(extra.get(b.key, ()))
        print(f"== {b.key}: python {' '.join(cmd[1:])}", flush=True)
        t0 = time.monotonic()
        code = subprocess.run(cmd, cwd=REPO).returncode
        print(f"== {b.key}: exit status {code} after {time.monotonic() - t0:.0f} s", flush=True)
        if code:
            failed.append(b.key)
    if failed:
        print(f"failed (their sections unchanged): {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
