"""What a `streamfleet bench` run measured, and its report.

``RequestRecord`` is one request as the client saw it (its start, every token's arrival,
its end or error); ``BenchResult`` is a run's records, with the TTFT, inter-token and
end-to-end latencies' p50/p90/p99, tokens/s, requests/s and the errors by code, as text
(``render``) or a dict (``to_dict``, the ``--json`` output); ``Comparison`` sets several
transports' runs side by side; ``write_png`` plots the latency distributions.
``percentile`` and ``summarize`` are the statistics they use, and scripts use them too.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from streamfleet.bench_config import BenchConfig

__all__ = ["BenchResult", "Comparison", "RequestRecord", "percentile", "summarize", "write_png"]


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it (times in seconds, ``perf_counter`` clock)."""

    lane: str
    start: float
    end: float | None = None
    #: arrival time of every token (WebSocket, gRPC: each token frame; SSE: each chunk with text)
    token_times: list[float] = field(default_factory=list)
    #: completion tokens the server reported (``usage``), else the token frames counted
    tokens: int = 0
    error: str | None = None
    #: the streamed text, kept for the run's first request only (shown as its sample)
    text: list[str] | None = None

    @property
    def first(self) -> float | None:
        """When the first token arrived."""
        return self.token_times[0] if self.token_times else None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def ttft_ms(self) -> float | None:
        return (self.first - self.start) * 1000 if self.first is not None else None

    @property
    def e2e_ms(self) -> float | None:
        return (self.end - self.start) * 1000 if self.end is not None else None

    def itl_ms(self) -> list[float]:
        t = self.token_times
        return [(b - a) * 1000 for a, b in itertools.pairwise(t)]


def percentile(values: list[float], p: float) -> float | None:
    """Linear-interpolated percentile (numpy's default) of ``values``; None when empty."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(values: list[float]) -> dict[str, float | int | None]:
    """count, mean, min, p50, p90, p99, max of ``values``."""
    if not values:
        return {"count": 0, "mean": None, "min": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {"count": len(values), "mean": sum(values) / len(values), "min": min(values),
            "p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
            "max": max(values)}


@dataclass
class BenchResult:
    """One run: its settings, every request it measured (in the order they started) and
    its wall time, from the start of measuring to the last request's end."""

    config: BenchConfig
    records: list[RequestRecord]
    wall_s: float

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]

    @property
    def errors(self) -> dict[str, int]:
        return dict(Counter(r.error for r in self.records if r.error is not None))

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.records)

    def ttft_ms(self) -> list[float]:
        return [r.ttft_ms for r in self.ok if r.ttft_ms is not None]

    def itl_ms(self) -> list[float]:
        return [x for r in self.ok for x in r.itl_ms()]

    def e2e_ms(self) -> list[float]:
        return [r.e2e_ms for r in self.ok if r.e2e_ms is not None]

    def sample(self) -> str | None:
        """The text the first request streamed (None when it kept none)."""
        first = self.records[0] if self.records else None
        return "".join(first.text) if first is not None and first.text is not None else None

    def to_dict(self) -> dict[str, Any]:
        ok = len(self.ok)
        wall = max(self.wall_s, 1e-9)
        cfg = asdict(self.config)
        cfg.pop("api_key", None)
        cfg["api_key_set"] = self.config.api_key is not None
        if self.config.transport != "grpc":
            del cfg["grpc_target"]
        cfg["mode"] = "open" if self.config.rate else "closed"
        return {
            "config": cfg,
            "requests": {"total": len(self.records), "ok": ok, "failed": len(self.records) - ok},
            "errors": self.errors,
            "tokens": self.tokens,
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens / wall,
            "requests_per_s": ok / wall,
            "ttft_ms": summarize(self.ttft_ms()),
            "itl_ms": summarize(self.itl_ms()),
            "e2e_ms": summarize(self.e2e_ms()),
            "sample": self.sample(),
        }

    def render(self) -> str:
        d = self.to_dict()
        c = self.config
        lines = [
            f"streamfleet bench: {c.transport} -> {c.grpc_target if c.transport == 'grpc' else c.url}",
            f"  {c.describe()}",
            f"  requests  {d['requests']['ok']} ok, {d['requests']['failed']} failed in {d['wall_s']:.2f} s"
            f"  ({d['requests_per_s']:.1f} req/s)",
            f"  tokens    {d['tokens']} completion tokens  ({d['tokens_per_s']:.1f} tokens/s)",
            "",
            f"  {'':10}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}{'max':>10}   (ms)",
        ]
        for name, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
            s = d[key]
            cells = "".join(f"{s[k]:10.1f}" if s[k] is not None else f"{'-':>10}"
                            for k in ("p50", "p90", "p99", "mean", "max"))
            lines.append(f"  {name:10}{cells}")
        errs = d["errors"]
        lines.append("")
        lines.append("  errors    " + (", ".join(f"{k}: {v}" for k, v in sorted(errs.items())) if errs else "none"))
        if d["sample"]:
            text = d["sample"].replace("\n", " ")
            lines.append(f"  sample    {text[:100]!r}{'…' if len(text) > 100 else ''}  (the first request's text)")
        return "\n".join(lines)


@dataclass
class Comparison:
    """The same load over several transports, one after another."""

    results: list[BenchResult]

    @property
    def baseline(self) -> BenchResult:
        """The run the ratios divide by: the WebSocket's, else the first."""
        return next((r for r in self.results if r.config.transport == "ws"), self.results[0])

    @staticmethod
    def _figures(result: BenchResult) -> dict[str, float | None]:
        ttft = result.ttft_ms()
        return {"ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
                "itl_p50_ms": percentile(result.itl_ms(), 50),
                "tokens_per_s": result.tokens / max(result.wall_s, 1e-9)}

    def to_dict(self) -> dict[str, Any]:
        base = self._figures(self.baseline)
        table = []
        for r in self.results:
            figures = self._figures(r)
            ratios = {k: (v / b if v is not None and (b := base[k]) else None) for k, v in figures.items()}
            table.append({"transport": r.config.transport, "ok": len(r.ok), "failed": len(r.records) - len(r.ok),
                          **figures, "ratios": ratios})
        return {"baseline": self.baseline.config.transport, "table": table, "runs": [r.to_dict() for r in self.results]}

    #: the table's columns: heading, key of a row of ``to_dict()["table"]``
    FIGURES = (("TTFT p50", "ttft_p50_ms"), ("TTFT p99", "ttft_p99_ms"), ("ITL p50", "itl_p50_ms"),
               ("tokens/s", "tokens_per_s"))
    RATIOS = (("TTFT p50", "ttft_p50_ms"), ("TTFT p99", "ttft_p99_ms"), ("tokens/s", "tokens_per_s"))

    def render(self) -> str:
        d = self.to_dict()
        c = self.results[0].config
        names = ", ".join(r.config.transport for r in self.results)
        where = c.url + "".join(f", gRPC {r.config.grpc_target}" for r in self.results if r.config.transport == "grpc")
        columns = self.FIGURES + self.RATIOS
        lines = [
            f"streamfleet bench: {names} -> {where}",
            f"  {c.describe()}; the transports one after another",
            "",
            f"  {'':{24 + 10 * len(self.FIGURES)}}{'ratio to ' + d['baseline']:^{10 * len(self.RATIOS)}}".rstrip(),
            f"  {'transport':10}{'ok':>6}{'failed':>8}" + "".join(f"{heading:>10}" for heading, _ in columns),
        ]

        def cell(v: float | None, fmt: str) -> str:
            return f"{v:10{fmt}}" if v is not None else f"{'-':>10}"

        for row in d["table"]:
            lines.append(f"  {row['transport']:10}{row['ok']:6d}{row['failed']:8d}"
                         + "".join(cell(row[key], ".1f") for _, key in self.FIGURES)
                         + "".join(cell(row["ratios"][key], ".2f") for _, key in self.RATIOS))
        lines += ["", "  (ms; a ratio above 1 is a slower TTFT, or more tokens/s)"]
        errors = {f"{r.config.transport} {k}": v for r in self.results for k, v in r.errors.items()}
        lines.append("  errors    " + (", ".join(f"{k}: {v}" for k, v in sorted(errors.items())) if errors else "none"))
        return "\n".join(lines)


def write_png(results: BenchResult | Sequence[BenchResult], path: str) -> str | None:
    """Plot the latency distributions (CDFs of TTFT, ITL, E2E) of one run, or of several
    runs (a comparison) on the same axes, to ``path``; returns an error message instead
    when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed, so no plot was written (pip install matplotlib)"
    runs = [results] if isinstance(results, BenchResult) else list(results)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (name, series) in zip(axes, (("TTFT", BenchResult.ttft_ms), ("inter-token latency", BenchResult.itl_ms),
                                         ("end-to-end", BenchResult.e2e_ms))):
        counts = []
        for result in runs:
            values = series(result)
            counts.append(str(len(values)))
            if not values:
                continue
            s = sorted(values)
            ys = [(i + 1) / len(s) for i in range(len(s))]
            p50, p99 = percentile(s, 50), percentile(s, 99)
            if len(runs) == 1:
                ax.plot(s, ys, drawstyle="steps-post")
                for p, v, style in ((50, p50, ":"), (99, p99, "--")):
                    ax.axvline(v, linestyle=style, color="grey")
                    ax.text(v, 0.02 + (0.1 if p == 99 else 0), f" p{p} {v:.1f}", fontsize=8)
            else:
                ax.plot(s, ys, drawstyle="steps-post", label=f"{result.config.transport}: p50 {p50:.1f}, p99 {p99:.1f}")
        if len(runs) > 1:
            ax.legend(fontsize=8)
        ax.set_title(f"{name} ({'/'.join(counts)} samples)")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction ≤ x")
        ax.grid(alpha=0.3)
    c = runs[0].config
    fig.suptitle(f"streamfleet bench: {', '.join(r.config.transport for r in runs)}, concurrency {c.concurrency}"
                 + (f", {c.rate:g} req/s" if c.rate else "") + f", {c.max_tokens} tokens/request")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
