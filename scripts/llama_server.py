#!/usr/bin/env python
"""llama.cpp's own ``llama-server`` for ``scripts/bench_peers.py --engine smollm2-135m``:
how to build it, where to find it, how it is started. Benchmark code only; none of
llama.cpp's code is kept in this repository.

The binary is built from the source distribution of ``llama-cpp-python`` 0.3.36, whose
``vendor/llama.cpp`` holds ``tools/server`` (about 15 minutes on 2 cores)::

    python -m scripts.llama_server build              # into /tmp/lcpp-build (--dir to change)

which runs::

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lcpp
    tar xzf /tmp/lcpp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcpp
    cmake -S /tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp -B /tmp/lcpp-build -G Ninja \\
          -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF \\
          -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \\
          -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    nice -n 19 cmake --build /tmp/lcpp-build --target llama-server llama-perplexity llama-quantize -j2

and leaves ``/tmp/lcpp-build/bin/llama-server`` (and the quality anchor's tools:
scripts/llama_quality.py). ``build --avx2 --dir /tmp/lcpp-avx2`` builds the kernels of an
AVX2-only CPU instead (``AVX2_OPTIONS``). The benchmark takes it from
``--llama-server PATH``, else ``$LLAMA_SERVER``, else ``llama-server`` on ``PATH``, else
that default build folder (``python -m scripts.llama_server which`` prints what it finds).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

__all__ = ["VERSION", "DEFAULT_BUILD_DIR", "find", "start", "build"]

#: the llama-cpp-python release whose vendored llama.cpp is built
VERSION = "0.3.36"
DEFAULT_BUILD_DIR = Path("/tmp/lcpp-build")
DEFAULT_SOURCE_DIR = Path("/tmp/lcpp")
CMAKE_OPTIONS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF",
                 "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
#: ``--avx2``: the kernels of a CPU with AVX2 and FMA but no AVX-512 (most AMD servers before
#: Zen 4, Intel client CPUs since 12th gen), on any x86 machine; also the way round a
#: machine whose CPU lists AMX but whose kernel does not grant it (the native build's
#: AMX matrix product then crashes: seen on a KVM guest)
AVX2_OPTIONS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF", "-DGGML_AMX_TILE=OFF",
                "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
#: what is built: the server, and the quality anchor's tools (scripts/llama_quality.py)
TARGETS = ["llama-server", "llama-perplexity", "llama-quantize"]


def find(explicit: str | None = None) -> Path | None:
    """The llama-server binary: ``explicit``, ``$LLAMA_SERVER``, ``llama-server`` on PATH,
    or the default build folder's; None when there is none (or it is not executable)."""
    for candidate in (explicit, os.environ.get("LLAMA_SERVER"), shutil.which("llama-server"),
                      str(DEFAULT_BUILD_DIR / "bin" / "llama-server")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def command(binary: Path, gguf: Path, port: int, *, threads: int, slots: int, ctx_per_slot: int) -> list[str]:
    """llama-server on ``gguf``: ``slots`` parallel sequences (continuous batching), each
    with ``ctx_per_slot`` tokens of KV cache, ``threads`` threads for decode and prompt
    alike, no prompt cache in RAM (every request is prefilled: the benchmark measures
    prefill), no web UI."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot),
            "--cache-ram", "0", "--no-webui"]


@contextmanager
def start(binary: Path, gguf: Path, port: int, *, threads: int, slots: int, ctx_per_slot: int,
          log: Path | None = None):
    """The server, stopped on exit: yields its ``subprocess.Popen``. Its output goes to
    ``log`` (a temporary file by default, printed on a failed start by the caller)."""
    log = log or Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "LLAMA_ARG_"))}
    from streamfleet.launcher import spawn  # dies with its parent

    with open(log, "wb") as out:
        p = spawn(command(binary, gguf, port, threads=threads, slots=slots, ctx_per_slot=ctx_per_slot), env=env,
                  stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        yield p
    finally:
        p.terminate()
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def build(build_dir: Path = DEFAULT_BUILD_DIR, source_dir: Path = DEFAULT_SOURCE_DIR, jobs: int = 2,
          avx2: bool = False) -> Path:
    """Download llama-cpp-python's source distribution and build ``TARGETS`` from its
    vendored llama.cpp (nice 19), for this CPU or (``avx2``) for AVX2 only; returns the
    server's binary."""
    source_dir.mkdir(parents=True, exist_ok=True)
    tarball = source_dir / f"llama_cpp_python-{VERSION}.tar.gz"
    if not tarball.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={VERSION}", "-d", str(source_dir)], check=True)
    src = source_dir / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if not src.exists():
        subprocess.run(["tar", "xzf", str(tarball), "-C", str(source_dir)], check=True)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["nice", "-n", "19", "cmake", "-S", str(src), "-B", str(build_dir), *generator, *CMAKE_OPTIONS,
                    *(AVX2_OPTIONS if avx2 else [])], check=True)
    subprocess.run(["nice", "-n", "19", "cmake", "--build", str(build_dir), "--target", *TARGETS, f"-j{jobs}"],
                   check=True)
    return build_dir / "bin" / "llama-server"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help=f"build llama-server from llama-cpp-python {VERSION}'s source distribution")
    b.add_argument("--dir", type=Path, default=DEFAULT_BUILD_DIR, help="build folder (outside the repository)")
    b.add_argument("--source", type=Path, default=DEFAULT_SOURCE_DIR, help="where the sdist is downloaded")
    b.add_argument("-j", "--jobs", type=int, default=2)
    b.add_argument("--avx2", action="store_true", help="AVX2 kernels only (no AVX-512, no AMX), on any x86 CPU")
    sub.add_parser("which", help="print the llama-server binary the benchmark would use")
    args = ap.parse_args()
    if args.cmd == "build":
        print(build(args.dir, args.source, args.jobs, args.avx2))
        return 0
    found = find()
    print(found or "no llama-server found (python -m scripts.llama_server build)")
    return 0 if found else 1


if __name__ == "__main__":
    raise SystemExit(main())
