"""What `streamfleet bench` reports, without a fleet (streamfleet/bench_stats.py,
streamfleet/bench_config.py): the per-request timings, the percentiles (numpy's
linear interpolation), a run's figures and their text, the comparison's ratios, and
the settings a run refuses."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, strategies as st

from streamfleet.bench_config import BenchConfig, BenchError
from streamfleet.bench_stats import BenchResult, Comparison, RequestRecord, percentile, summarize, write_png


def record(start: float, tokens_at: list[float], end: float | None, *, error: str | None = None,
           tokens: int | None = None, lane: str = "normal") -> RequestRecord:
    return RequestRecord(lane=lane, start=start, end=end, token_times=list(tokens_at),
                         tokens=len(tokens_at) if tokens is None else tokens, error=error)


# -- percentile, summarize -----------------------------------------------------------------

@given(st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=1, max_size=60),
       st.floats(min_value=0, max_value=100))
def test_percentile_is_numpys_linear_interpolation(values: list[float], p: float) -> None:
    assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)), rel=1e-9, abs=1e-6)


def test_percentile_edges() -> None:
    assert percentile([], 50) is None
    assert percentile([7.0], 0) == percentile([7.0], 100) == 7.0
    values = [5.0, 1.0, 4.0, 2.0, 3.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile(values, 25) == 2.0 and percentile(values, 90) == pytest.approx(4.6)
    assert values == [5.0, 1.0, 4.0, 2.0, 3.0]  # not sorted in place


def test_summarize() -> None:
    assert summarize([]) == {"count": 0, "mean": None, "min": None, "p50": None, "p90": None, "p99": None,
                             "max": None}
    s = summarize([10.0, 0.0, 20.0, 30.0])
    assert s["count"] == 4 and s["mean"] == 15.0 and s["min"] == 0.0 and s["max"] == 30.0
    assert s["p50"] == 15.0 and s["p90"] == pytest.approx(27.0) and s["p99"] == pytest.approx(29.7)


# -- RequestRecord ---------------------------------------------------------------------------

def test_record_times_are_milliseconds_from_its_start() -> None:
    r = record(10.0, [10.25, 10.3, 10.45], 10.5)
    assert r.ok and r.first == 10.25
    assert r.ttft_ms == pytest.approx(250.0) and r.e2e_ms == pytest.approx(500.0)
    assert r.itl_ms() == pytest.approx([50.0, 150.0])


def test_record_without_tokens_or_end() -> None:
    silent = record(1.0, [], 2.0)
    assert silent.ok and silent.ttft_ms is None and silent.itl_ms() == []
    unfinished = record(1.0, [1.1], None)
    assert not unfinished.ok and unfinished.e2e_ms is None
    failed = record(1.0, [1.1], 1.2, error="timeout")
    assert not failed.ok and failed.e2e_ms == pytest.approx(200.0)


# -- BenchResult -----------------------------------------------------------------------------

def result(**config) -> BenchResult:
    cfg = BenchConfig(**{"requests": 4, "api_key": "sk-secret", **config})
    first = record(0.0, [0.1, 0.2, 0.3], 0.4, tokens=3)
    first.text = ["Hello", ",", " world"]
    records = [
        first,
        record(0.0, [0.2, 0.25], 0.3, tokens=2),
        record(0.0, [0.5], 0.6, error="overloaded", tokens=1),
        record(0.0, [], None, error="timeout", tokens=0),
    ]
    return BenchResult(config=cfg, records=records, wall_s=2.0)


def test_result_counts_only_successful_requests_in_the_latencies() -> None:
    res = result()
    assert [r.tokens for r in res.ok] == [3, 2]
    assert res.errors == {"overloaded": 1, "timeout": 1}
    assert res.tokens == 6  # every request's tokens, the failed ones' too
    assert res.ttft_ms() == pytest.approx([100.0, 200.0])
    assert res.itl_ms() == pytest.approx([100.0, 100.0, 50.0])
    assert res.e2e_ms() == pytest.approx([400.0, 300.0])
    assert res.sample() == "Hello, world"


def test_result_dict() -> None:
    d = result().to_dict()
    assert d["requests"] == {"total": 4, "ok": 2, "failed": 2}
    assert d["tokens_per_s"] == pytest.approx(3.0) and d["requests_per_s"] == pytest.approx(1.0)
    assert d["ttft_ms"]["p50"] == pytest.approx(150.0) and d["e2e_ms"]["max"] == pytest.approx(400.0)
    assert d["sample"] == "Hello, world"
    cfg = d["config"]
    assert "api_key" not in cfg and cfg["api_key_set"] is True  # the key itself never leaves
    assert "grpc_target" not in cfg and cfg["mode"] == "closed"
    grpc = result(transport="grpc", grpc_target="h:50051", rate=5.0).to_dict()["config"]
    assert grpc["grpc_target"] == "h:50051" and grpc["mode"] == "open"
    assert result(api_key=None).to_dict()["config"]["api_key_set"] is False


def test_result_render() -> None:
    text = result().render()
    assert text.splitlines()[0] == "streamfleet bench: ws -> http://127.0.0.1:8000"
    assert "2 ok, 2 failed in 2.00 s" in text and "(3.0 tokens/s)" in text
    ttft = next(line for line in text.splitlines() if line.strip().startswith("TTFT"))
    assert ttft.split()[1:] == ["150.0", "190.0", "199.0", "150.0", "200.0"]
    assert "errors    overloaded: 1, timeout: 1" in text
    assert "'Hello, world'" in text


def test_render_of_a_run_with_nothing_measured() -> None:
    res = BenchResult(config=BenchConfig(), records=[record(0.0, [], None, error="connection_closed")], wall_s=0.0)
    lines = res.render().splitlines()
    assert next(line for line in lines if line.strip().startswith("ITL")).split()[1:] == ["-"] * 5
    assert "  errors    connection_closed: 1" in lines
    assert res.sample() is None and BenchResult(BenchConfig(), [], 1.0).sample() is None


# -- Comparison ------------------------------------------------------------------------------

def run_of(transport: str, ttft_s: float, tokens: int) -> BenchResult:
    cfg = BenchConfig(transport=transport, grpc_target="h:50051" if transport == "grpc" else None)
    return BenchResult(config=cfg, records=[record(0.0, [ttft_s, ttft_s + 0.01], 1.0, tokens=tokens)], wall_s=1.0)


def test_comparison_ratios_are_to_the_websocket_run() -> None:
    comp = Comparison([run_of("sse", 0.2, 50), run_of("ws", 0.1, 100), run_of("grpc", 0.05, 200)])
    assert comp.baseline.config.transport == "ws"
    d = comp.to_dict()
    assert d["baseline"] == "ws" and [row["transport"] for row in d["table"]] == ["sse", "ws", "grpc"]
    sse, ws, grpc = d["table"]
    assert ws["ratios"]["ttft_p50_ms"] == pytest.approx(1.0)
    assert sse["ratios"]["ttft_p50_ms"] == pytest.approx(2.0) and sse["ratios"]["tokens_per_s"] == pytest.approx(0.5)
    assert grpc["ratios"]["tokens_per_s"] == pytest.approx(2.0) and grpc["ttft_p50_ms"] == pytest.approx(50.0)
    assert len(d["runs"]) == 3
    text = comp.render()
    assert text.splitlines()[0] == "streamfleet bench: sse, ws, grpc -> http://127.0.0.1:8000, gRPC h:50051"
    assert "ratio to ws" in text


def test_comparison_without_websocket_divides_by_the_first_run() -> None:
    comp = Comparison([run_of("sse", 0.2, 50), run_of("grpc", 0.1, 100)])
    assert comp.baseline.config.transport == "sse"
    assert comp.to_dict()["table"][1]["ratios"]["ttft_p50_ms"] == pytest.approx(0.5)


def test_a_ratio_to_nothing_measured_is_none() -> None:
    empty = BenchResult(config=BenchConfig(transport="ws"), records=[record(0.0, [], None, error="timeout")],
                        wall_s=1.0)
    row = Comparison([empty, run_of("sse", 0.2, 50)]).to_dict()["table"][1]
    assert row["ttft_p50_ms"] == pytest.approx(200.0) and row["ratios"]["ttft_p50_ms"] is None


# -- write_png -------------------------------------------------------------------------------

def test_write_png(tmp_path) -> None:
    path = tmp_path / "latency.png"
    problem = write_png([run_of("ws", 0.1, 100), run_of("sse", 0.2, 50)], str(path))
    if importlib.util.find_spec("matplotlib") is None:
        assert problem is not None and "matplotlib" in problem and not path.exists()
    else:
        assert problem is None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- BenchConfig -----------------------------------------------------------------------------

@pytest.mark.parametrize(("change", "message"), [
    ({"transport": "pigeon"}, "transport must be one of ws, sse, grpc"),
    ({"lane": "fast"}, "lane must be one of high, normal, mixed"),
    ({"concurrency": 0}, "concurrency"),
    ({"requests": 0}, "requests"),
    ({"duration": 0.0}, "duration"),
    ({"rate": -1.0}, "rate"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"prompt_tokens": 0}, "prompt_tokens"),
    ({"url": "127.0.0.1:8000"}, "url must start with"),
])
def test_config_refuses_what_cannot_run(change: dict, message: str) -> None:
    with pytest.raises(BenchError, match=message):
        replace(BenchConfig(), **change).check()


def test_config_defaults_and_prompt() -> None:
    BenchConfig().check()
    replace(BenchConfig(), prompt="hi", prompt_tokens=0).check()  # an explicit prompt needs no length
    assert BenchConfig().total_requests == 100
    assert BenchConfig(duration=5.0).total_requests is None
    assert BenchConfig(requests=7, duration=5.0).total_requests == 7
    assert BenchConfig(prompt_tokens=3).prompt_text() == "hello hello hello"
    assert BenchConfig(prompt="hi there", prompt_tokens=3).prompt_text() == "hi there"
    assert BenchConfig(rate=2.5).describe().startswith("open loop at 2.5 req/s")
    assert (BenchConfig(prompt="abc").describe()
            == "closed loop, concurrency 8, prompt 3 chars, 64 max tokens, lane normal")
