"""A benchmark's printed report written as Markdown under docs/benchmarks/, with what it ran on.

Every benchmark whose figures the README or the docs quote takes ``--write PATH``: the
report it prints goes into PATH as a section of Markdown, with the CPU (``lscpu``'s model
name and the flags that decide the kernels: avx2, fma, avx512*, amx*, avx_vnni), the core
count, the date, the exact command and the commit, so a figure in the docs always says
where it came from and nobody copies it by hand::

    python -m scripts.bench_fleet --quick --write docs/benchmarks/fleet.md
    python -m scripts.bench_itl --streams 16 --long-count 0 --write 'docs/benchmarks/itl.md#c16'

A file holds one or more sections, each between ``<!-- benchtable: KEY ... -->`` and
``<!-- /benchtable: KEY -->``; ``PATH#KEY`` names the section (default: the script's
name), and writing replaces that section only (appended when the file lacks it; the file
is made, with a heading, when missing). The report is written only when the benchmark
ends with exit status 0, so a failed run never replaces figures. docs/benchmarks.md is
the index of these files.

A script takes part with two lines: ``benchtable.add_argument(parser)`` where it builds
its parser (so ``--write`` shows in ``--help``), and ``sys.exit(benchtable.main(main))``
in place of ``sys.exit(main())``. Rendering and the section replacement are pure
functions (tests/unit/test_benchtable.py).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: the CPU flags that decide which kernels ONNX Runtime and llama.cpp run
FLAG = re.compile(r"^(avx2|fma|avx512\w*|amx\w*|avx_vnni)$")


@dataclass(frozen=True)
class Machine:
    cpu: str
    #: None: not recorded (a section copied from a run before this writer)
    flags: tuple[str, ...] | None
    cores: int

    def describe(self) -> str:
        if self.flags is None:
            return f"{self.cpu}, {self.cores} cores (flags not recorded)"
        flags = ", ".join(self.flags) or "none of avx2, fma, avx512*, amx*"
        return f"{self.cpu} ({flags}), {self.cores} cores"


@dataclass(frozen=True)
class Run:
    """What a section says about the run that produced it."""

    command: str
    machine: Machine
    when: str
    commit: str
    took_s: float | None = None
    load: tuple[float, float] | None = None
    #: cores busy on average over the run, and how many of them by processes other than
    #: the benchmark and its children (a shared machine's noise, said beside the figures)
    busy: tuple[float, float] | None = None


def kernel_flags(flags: str) -> tuple[str, ...]:
    """The flags of ``FLAG`` among a whitespace-separated list, sorted."""
    return tuple(sorted({f for f in flags.split() if FLAG.match(f)}))


def machine() -> Machine:
    """This machine's CPU model name and kernel flags (lscpu, else /proc/cpuinfo) and core count."""
    fields: dict[str, str] = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True,
                             env={**os.environ, "LC_ALL": "C"}).stdout
        for line in out.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields.setdefault(key.strip().lower(), value.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    if "model name" not in fields or "flags" not in fields:
        with contextlib.suppress(OSError):
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                key, sep, value = line.partition(":")
                if sep:
                    fields.setdefault(key.strip().lower(), value.strip())
    try:
        cores = len(os.sched_getaffinity(0))  # what this process may run on (taskset), not the host's count
    except (AttributeError, OSError):
        cores = os.cpu_count() or 0
    return Machine(cpu=fields.get("model name", "unknown CPU"), flags=kernel_flags(fields.get("flags", "")),
                   cores=cores)


def commit() -> str:
    """HEAD's short hash, saying so when the code (not the docs) has uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs",
                                ":!README.md"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command(argv: list[str]) -> str:
    """The command line as typed from the repository root: ``python -m scripts.NAME ARGS``."""
    script = Path(argv[0])
    with contextlib.suppress(ValueError):
        rel = script.resolve().relative_to(REPO)
        if rel.suffix == ".py":
            return shlex.join(["python", "-m", ".".join(rel.with_suffix("").parts), *argv[1:]])
    return shlex.join(["python", *argv])


def split_target(target: str, default_key: str) -> tuple[Path, str]:
    """``PATH#KEY`` → (PATH, KEY); KEY defaults to ``default_key``."""
    path, _, key = target.partition("#")
    key = key or default_key
    if not re.fullmatch(r"[\w.-]+", key):
        raise ValueError(f"a section key is letters, digits, '_', '-' and '.': {key!r}")
    return Path(path), key


def begin_marker(key: str) -> str:
    return f"<!-- benchtable: {key} (written by scripts/benchtable.py: rerun the command below, do not edit) -->"


def end_marker(key: str) -> str:
    return f"<!-- /benchtable: {key} -->"


def render_section(key: str, title: str, report: str, run: Run, note: str = "", fenced: bool = True) -> str:
    """One section: its heading, the run's facts as a list, the printed report verbatim
    (``fenced``: in a text block; else ``report`` is Markdown already, a table say)."""
    facts = [
        f"* command: `{run.command}`",
        f"* CPU: {run.machine.describe()}",
        f"* date: {run.when}",
        f"* commit: {run.commit}",
    ]
    if run.took_s is not None:
        took = f"* took: {run.took_s:.0f} s"
        if run.load is not None:
            took += f", load average {run.load[0]:.2f} before, {run.load[1]:.2f} after"
        facts.append(took)
    if run.busy is not None:
        facts.append(f"* machine during the run: {run.busy[0]:.2f} of {run.machine.cores} cores busy, "
                     f"{run.busy[1]:.2f} of them by other work")
    body = report.rstrip("\n")
    fence = "```"
    while fence in body:
        fence += "`"
    parts = [begin_marker(key), f"## {title}", "", *facts, ""]
    if note:
        parts += [note.strip(), ""]
    if fenced:
        parts += ["<!-- snippet: skip: a benchmark's printed report -->", f"{fence}text", body, fence]
    else:
        parts += [body]
    parts.append(end_marker(key))
    return "\n".join(parts) + "\n"


def replace_section(text: str, key: str, section: str, heading: str) -> str:
    """``text`` with section ``key`` replaced by ``section`` (which carries its markers):
    in place when ``text`` has it, appended otherwise; a new file (empty ``text``) gets
    ``heading`` first. Other sections and the text around them are kept as they are."""
    begin = re.compile(r"^<!-- benchtable: " + re.escape(key) + r"(?: [^\n]*)? -->$", re.MULTILINE)
    end = re.compile(r"^" + re.escape(end_marker(key)) + r"\n?", re.MULTILINE)
    m = begin.search(text)
    if m:
        e = end.search(text, m.end())
        if e is None:
            raise ValueError(f"section {key!r} has no end marker ({end_marker(key)})")
        return text[:m.start()] + section + text[e.end():]
    if not text.strip():
        return f"# {heading}\n\n{section}"
    return text.rstrip("\n") + "\n\n" + section


def write(target: str, default_key: str, title: str, report: str, run: Run, note: str = "") -> Path:
    """Write ``report`` as section KEY of PATH (``target`` is ``PATH`` or ``PATH#KEY``)."""
    path, key = split_target(target, default_key)
    if not path.is_absolute():
        path = Path.cwd() / path
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    heading = f"Benchmark: `scripts/{default_key}.py`"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(replace_section(old, key, render_section(key, title, report, run, note), heading),
                    encoding="utf-8")
    return path


def _cpu_s() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, of this process and its reaped children)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    tick = os.sysconf("SC_CLK_TCK")
    t = os.times()
    return (sum(fields[:8]) - idle) / tick, t.user + t.system + t.children_user + t.children_system


def busy_cores(before: tuple[float, float] | None, after: tuple[float, float] | None,
               wall_s: float, cores: int) -> tuple[float, float] | None:
    """Cores busy on average between two ``_cpu_s`` readings, and those not the benchmark's."""
    if before is None or after is None or wall_s <= 0:
        return None
    total = max(0.0, after[0] - before[0]) / wall_s
    own = max(0.0, after[1] - before[1]) / wall_s
    total = min(total, float(cores)) if cores else total
    return total, max(0.0, total - own)


def add_argument(parser: argparse.ArgumentParser) -> None:
    """``--write PATH[#KEY]`` on a benchmark's parser (``main`` below acts on it)."""
    parser.add_argument("--write", metavar="PATH[#KEY]", default=None,
                        help="also write the printed report as Markdown to section KEY (default: the script's name) "
                             "of PATH, e.g. docs/benchmarks/NAME.md, with the CPU, cores, date, command and commit "
                             "(scripts/benchtable.py)")


class _Tee(io.TextIOBase):
    def __init__(self, out: io.TextIOBase) -> None:
        self.out, self.buf = out, io.StringIO()

    def write(self, s: str) -> int:
        self.buf.write(s)
        return self.out.write(s)

    def flush(self) -> None:
        self.out.flush()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.out, "encoding", "utf-8")


def title_of(doc: str | None, fallback: str) -> str:
    """A section's title: the script docstring's first sentence (up to a colon), on one line."""
    first = " ".join((doc or "").strip().split("\n\n")[0].split())
    first = re.split(r"(?<=[a-z)])[.:] ", first + " ", maxsplit=1)[0]
    return first.strip().rstrip(".:") or fallback


def main(entry: Callable[[], int | None], argv: list[str] | None = None) -> int:
    """Run a benchmark's ``main`` with ``--write`` honoured: what it prints to stdout
    is shown as usual and, when it returns 0 (or None), written as its section."""
    argv = list(sys.argv if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--write", default=None)
    known, _ = pre.parse_known_args(argv[1:])
    if known.write is None or any(a in ("-h", "--help") for a in argv[1:]):
        return entry() or 0
    name = Path(argv[0]).stem
    module = sys.modules.get(entry.__module__)
    run_cmd, when = command(argv), dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load0, t0, cpu0 = os.getloadavg()[0], time.monotonic(), _cpu_s()
    tee = _Tee(sys.stdout)  # type: ignore[arg-type]
    with contextlib.redirect_stdout(tee):
        code = entry() or 0
    if code:
        print(f"benchtable: exit status {code}, {known.write} not written", file=sys.stderr)
        return code
    took, here = time.monotonic() - t0, machine()
    run = Run(command=run_cmd, machine=here, when=when, commit=commit(), took_s=took, load=(load0, os.getloadavg()[0]),
              busy=busy_cores(cpu0, _cpu_s(), took, here.cores))
    title = title_of(getattr(module, "__doc__", None), name)
    _, key = split_target(known.write, name)
    if key != name:
        title += f" ({key})"
    path = write(known.write, name, title, tee.buf.getvalue(), run)
    print(f"wrote {path}", file=sys.stderr)
    if run.busy is not None and run.busy[1] > 0.25:
        print(f"benchtable: {run.busy[1]:.2f} of {here.cores} cores were other work during the run (the table says "
              "so): rerun on a quiet machine before quoting it", file=sys.stderr)
    return 0
