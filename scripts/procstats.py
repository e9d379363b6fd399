"""What the benchmarks read of the processes they start: CPU seconds and memory of a
process and its children (psutil), and a polite stop. Benchmark code only."""

from __future__ import annotations

import subprocess

import psutil

__all__ = ["family", "tree", "cpu_s", "rss_mib", "stop"]


def family(proc: psutil.Process) -> list[psutil.Process]:
    """A process and all its children (a speech worker decodes in child processes)."""
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return [proc]


def tree(pids: list[int]) -> list[psutil.Process]:
    """The processes of ``pids`` (the gone ones left out) and all their children."""
    out = []
    for pid in pids:
        try:
            out += family(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    return out


def _total(procs: list[psutil.Process], measure) -> float:
    """The sum of ``measure(p)`` over ``procs`` (a process that is gone counts 0)."""
    total = 0.0
    for p in procs:
        try:
            total += measure(p)
        except psutil.NoSuchProcess:
            pass
    return total


def cpu_s(procs: list[psutil.Process]) -> float:
    """User + system CPU seconds of ``procs`` (a process that is gone counts 0)."""
    def seconds(p: psutil.Process) -> float:
        t = p.cpu_times()
        return t.user + t.system

    return _total(procs, seconds)


def rss_mib(procs: list[psutil.Process]) -> float:
    return _total(procs, lambda p: p.memory_info().rss) / 2**20


def stop(p: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds."""
    p.terminate()
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def cpu_line() -> str:
    """The CPU a benchmark's figures were taken on: lscpu's model name, the instruction
    sets that choose ONNX Runtime's and llama.cpp's kernels, and the cores."""
    from streamfleet.shared.execution import cpu_signature

    sig = cpu_signature()
    return f"CPU: {sig['model']}; {' '.join(sig['isa']) or 'no SIMD flags read'}; {sig['cores']} cores"
