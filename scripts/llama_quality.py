#!/usr/bin/env python
"""The anchor of the quality gate (docs/models.md, "Execution modes"): llama.cpp's own
``llama-perplexity --kl-divergence`` on the same GGUF file and text as ``streamfleet
engines quality``, beside that command's figures.

llama.cpp measures a quantized file against a reference run of the same model: here the
reference is the file itself dequantized to F32 (``llama-quantize --allow-requantize
FILE F32``: the values the fp32 graph holds), evaluated once with
``--kl-divergence-base`` to save its logits, then the file with ``--kl-divergence``.
Both with ``-c 512`` over ``shared/corpus/alice.txt`` (11 chunks, 255 scored tokens
each), ``-t THREADS``. The binaries come from the same ``llama-cpp-python`` 0.3.36 source
as ``llama-server`` (``python -m scripts.llama_server build`` builds all three; an
AVX2-only build for CPUs without AVX-512: ``--avx2``)::

    python -m scripts.llama_quality [--bin /tmp/lcpp-build/bin] [--gguf FILE] [--threads 2]

Prints llama.cpp's perplexity of the F32 reference and of the file, its mean KL divergence
(with llama.cpp's ±), same-top-1 rate, and the CPU it ran on. Benchmark code only.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts import benchtable
from scripts.procstats import cpu_line
from streamfleet.shared.quality import QUALITY_TEXT

REPO = Path(__file__).resolve().parent.parent


def run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({proc.returncode}):\n{out[-3000:]}")
    return out


def figures(text: str) -> dict[str, str]:
    """llama-perplexity's closing figures: the final PPL estimate, and with
    --kl-divergence its 'Mean PPL(Q)', 'Mean KLD' and 'Same top p' lines."""
    out = {}
    m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", text)
    if m:
        out["ppl"] = f"{m.group(1)} ± {m.group(2)}"
    for key, label in (("ppl_q", r"Mean PPL\(Q\)"), ("ppl_base", r"Mean PPL\(base\)"), ("kld", r"Mean\s+KLD"),
                       ("same_top", r"Same top p"), ("ppl_ratio", r"Mean PPL\(Q\)/PPL\(base\)")):
        m = re.search(label + r"\s*:\s*([^\n]+)", text)
        if m:
            out[key] = m.group(1).strip()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", type=Path, default=Path("/tmp/lcpp-build/bin"),
                    help="folder with llama-perplexity and llama-quantize")
    ap.add_argument("--gguf", type=Path, default=None, help="default: smollm2-135m's cached file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512)
    benchtable.add_argument(ap)
    args = ap.parse_args()
    gguf = args.gguf
    if gguf is None:
        from scripts.smollm2_agreement import gguf_file

        gguf = gguf_file()
    with tempfile.TemporaryDirectory(prefix="sf-llq-") as tmp:
        f32 = Path(tmp) / "f32.gguf"
        run([str(args.bin / "llama-quantize"), "--allow-requantize", str(gguf), str(f32), "F32"])
        base = Path(tmp) / "base.kld"
        common = ["-f", str(QUALITY_TEXT), "-c", str(args.ctx), "-t", str(args.threads)]
        ref = figures(run([str(args.bin / "llama-perplexity"), "-m", str(f32), *common,
                           "--kl-divergence-base", str(base)]))
        q = figures(run([str(args.bin / "llama-perplexity"), "-m", str(gguf), *common, "--kl-divergence-base",
                         str(base), "--kl-divergence"]))
    print(f"llama.cpp ({args.bin}), {QUALITY_TEXT.name}, -c {args.ctx}, {args.threads} threads")
    print(f"  F32 reference   PPL {ref.get('ppl', '?')}")
    print(f"  {gguf.name:<15} PPL {q.get('ppl_q', q.get('ppl', '?'))}; PPL(Q)/PPL(base) {q.get('ppl_ratio', '?')}")
    print(f"                  mean KLD {q.get('kld', '?')}; same top p {q.get('same_top', '?')}")
    print(f"  {cpu_line()}")


if __name__ == "__main__":
    sys.exit(benchtable.main(main))
