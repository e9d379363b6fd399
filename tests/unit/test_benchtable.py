"""A benchmark's report written as Markdown (scripts/benchtable.py): the section it renders,
and replacing one section of a file while keeping the rest. Pure logic: no benchmark runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from scripts import benchtable
from scripts.benchtable import Machine, Run, kernel_flags, render_section, replace_section, split_target

RUN = Run(command="python -m scripts.bench_fleet --quick --write docs/benchmarks/fleet.md",
          machine=Machine(cpu="AMD EPYC", flags=("avx2", "avx512f", "fma"), cores=2),
          when="2026-12-07 12:00 UTC", commit="abc1234", took_s=54.6, load=(0.19, 0.91))


def test_kernel_flags_keeps_those_that_pick_kernels():
    flags = "fpu sse4_2 avx avx2 fma avx512f avx512_vnni avx512bw amx_tile amx_int8 avx_vnni f16c"
    assert kernel_flags(flags) == ("amx_int8", "amx_tile", "avx2", "avx512_vnni", "avx512bw", "avx512f", "avx_vnni",
                                   "fma")
    assert kernel_flags("fpu sse2") == ()


def test_section_has_the_run_and_the_report_verbatim():
    report = "setup     tokens/s\n1 x 1       360.6\n"
    text = render_section("bench_fleet", "What the fleet costs", report, RUN)
    lines = text.splitlines()
    assert lines[0] == benchtable.begin_marker("bench_fleet")
    assert lines[-1] == benchtable.end_marker("bench_fleet")
    assert "## What the fleet costs" in lines
    assert f"* command: `{RUN.command}`" in lines
    assert "* CPU: AMD EPYC (avx2, avx512f, fma), 2 cores" in lines
    assert "* date: 2026-12-07 12:00 UTC" in lines
    assert "* commit: abc1234" in lines
    assert "* took: 55 s, load average 0.19 before, 0.91 after" in lines
    # the report between a skip marker (the docs' code-block rule) and its fence, unchanged
    i = lines.index("```text")
    assert lines[i - 1].startswith("<!-- snippet: skip: ")
    assert lines[i + 1:i + 3] == ["setup     tokens/s", "1 x 1       360.6"]
    assert lines[i + 3] == "```"


def test_a_report_holding_a_fence_gets_a_longer_one():
    text = render_section("k", "T", "a\n```\nb", RUN)
    assert "````text\na\n```\nb\n````\n" in text


def test_a_note_goes_before_the_report():
    text = render_section("k", "T", "x", RUN, note="Copied from the previous run; rerun with the command.")
    assert text.index("Copied from the previous run") < text.index("```text")


def test_a_new_file_gets_a_heading_then_the_section():
    section = render_section("k", "T", "x", RUN)
    assert replace_section("", "k", section, "Benchmark: `scripts/k.py`") == "# Benchmark: `scripts/k.py`\n\n" + section


def test_replacing_keeps_the_other_sections_and_text():
    a1, b1 = render_section("a", "A", "one", RUN), render_section("b", "B", "two", RUN)
    page = "# Page\n\nIntro.\n\n" + a1 + "\nBetween.\n\n" + b1 + "\nAfter.\n"
    a2 = render_section("a", "A", "three", RUN)
    out = replace_section(page, "a", a2, "unused")
    assert out == "# Page\n\nIntro.\n\n" + a2 + "\nBetween.\n\n" + b1 + "\nAfter.\n"
    b2 = render_section("b", "B", "four", RUN)
    assert replace_section(out, "b", b2, "unused") == "# Page\n\nIntro.\n\n" + a2 + "\nBetween.\n\n" + b2 + "\nAfter.\n"


def test_a_key_that_prefixes_another_is_not_confused_with_it():
    page = replace_section("", "itl-c16", render_section("itl-c16", "C16", "x", RUN), "H")
    out = replace_section(page, "itl", render_section("itl", "I", "y", RUN), "H")
    assert out.count("<!-- benchtable: itl-c16 ") == 1 and out.count("<!-- benchtable: itl ") == 1
    assert out.index("<!-- benchtable: itl-c16 ") < out.index("<!-- benchtable: itl ")


def test_a_section_without_its_end_is_refused():
    broken = benchtable.begin_marker("a") + "\n## A\n"
    with pytest.raises(ValueError, match="end marker"):
        replace_section(broken, "a", render_section("a", "A", "x", RUN), "H")


def test_target_names_the_file_and_the_section():
    assert split_target("docs/benchmarks/itl.md#c16", "bench_itl") == (Path("docs/benchmarks/itl.md"), "c16")
    assert split_target("docs/benchmarks/itl.md", "bench_itl") == (Path("docs/benchmarks/itl.md"), "bench_itl")
    with pytest.raises(ValueError):
        split_target("x.md#a b", "k")


def test_command_is_what_one_types_from_the_repository_root():
    script = str(benchtable.REPO / "scripts" / "bench_fleet.py")
    assert benchtable.command([script, "--quick", "--write", "docs/b.md#x y"]) == \
        "python -m scripts.bench_fleet --quick --write 'docs/b.md#x y'"


def test_main_writes_only_after_a_clean_exit(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(benchtable, "machine", lambda: RUN.machine)
    monkeypatch.setattr(benchtable, "commit", lambda: "abc1234")
    script = str(benchtable.REPO / "scripts" / "bench_x.py")
    target = tmp_path / "x.md"

    def failing() -> int:
        print("half a table")
        return 1

    assert benchtable.main(failing, [script, "--write", str(target)]) == 1
    assert not target.exists()

    def ok() -> None:
        print("the table")

    assert benchtable.main(ok, [script, "--write", str(target)]) == 0
    text = target.read_text()
    assert text.startswith("# Benchmark: `scripts/bench_x.py`\n")
    assert "\nthe table\n```\n" in text and "* commit: abc1234" in text
    assert "the table" in capsys.readouterr().out  # still printed as usual
    assert sys.stdout is not None


def test_busy_cores_says_how_much_was_other_work():
    assert benchtable.busy_cores((100.0, 10.0), (116.0, 22.0), 10.0, 2) == pytest.approx((1.6, 0.4))
    assert benchtable.busy_cores(None, (1.0, 1.0), 10.0, 2) is None
    run = Run(RUN.command, RUN.machine, RUN.when, RUN.commit, busy=(1.6, 0.4))
    assert "* machine during the run: 1.60 of 2 cores busy, 0.40 of them by other work" in \
        render_section("k", "T", "x", run).splitlines()
