"""What logits processing and log probabilities cost per step, side by side.

For a batch of B sequences over a vocabulary of V, with 0 %, 50 % and 100 % of the rows
asking for every penalty at once (presence, frequency, repetition, logit_bias, min_p,
min_tokens) and, separately, for 5 log probabilities, it times the step's processing
(``workers.logits.process`` / ``Logprobs``) and, for scale, the per-row samplers of the
same batch (the part of the step that exists anyway) and a row-by-row Python version of
the penalties. Each sequence has generated ``--history`` tokens (half of them distinct).

    python -m scripts.bench_logits --batch 32 --vocab 32000 128000
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from streamfleet.shared.schema import SamplingParams
from streamfleet.workers.logits import Logprobs, Penalties, process
from streamfleet.workers.sampling import Sampler

PARAMS = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2, "min_p": 0.05, "min_tokens": 1,
              "logit_bias": [[7, 2.0], [11, -5.0]], "temperature": 0.8, "seed": 1}


def timed(fn, repeat: int) -> float:
    """Median ms of ``fn()``."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return float(np.median(out))


def row_by_row(logits: np.ndarray, states: list) -> None:
    """The loop the batched version replaces: each row, each token, in Python."""
    for i, st in enumerate(states):
        if st is None:
            continue
        row = logits[i]
        p = st.p
        for t, b in p.logit_bias:
            row[int(t)] += b
        for t in st.repeated_ids.tolist():
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        for t, n in zip(st.generated_ids.tolist(), st.generated_counts.tolist()):
            row[t] -= p.frequency_penalty * n + p.presence_penalty
        floor = row.max() + p.temperature * np.log(p.min_p)
        row[row < floor] = -np.inf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 128000])
    ap.add_argument("--history", type=int, default=200, help="tokens each sequence has generated")
    ap.add_argument("--repeat", type=int, default=30)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"batch {a.batch}, {a.history} generated tokens per sequence, {os.cpu_count()} cores; median ms per step")
    print(f"{'vocab':>7} {'share':>6} {'samplers':>9} {'process':>8} {'ratio':>6} {'logprobs':>9} {'row-by-row':>11}")
    for vocab in a.vocab:
        base = (rng.standard_normal((a.batch, vocab)) * 3).astype(np.float32)
        prompt = rng.integers(0, vocab, 100).tolist()
        samplers = [Sampler(SamplingParams(**{k: v for k, v in PARAMS.items() if k in ("temperature", "seed")}),
                        vocab) for _ in range(a.batch)]
        sample_ms = timed(lambda: [s.sample(base[i]) for i, s in enumerate(samplers)], a.repeat)
        for share in (0.0, 0.5, 1.0):
            n = round(a.batch * share)
            states = []
            for i in range(a.batch):
                if i < n:
                    st = Penalties(SamplingParams(**PARAMS), prompt, frozenset({0}))
                    for t in rng.integers(0, a.history // 2, a.history).tolist():
                        st.push(t)
                    states.append(st)
                else:
                    states.append(None)
            emitted = [a.history] * a.batch

            def batched():
                if n:
                    x = np.array(base, dtype=np.float32)
                    process(x, states, emitted)

            proc_ms = timed(batched, a.repeat)
            lp_ms = timed(lambda: Logprobs(base, list(range(n)), [5] * n), a.repeat) if n else 0.0
            loop_ms = timed(lambda: row_by_row(np.array(base), states), max(3, a.repeat // 5)) if n else 0.0
            print(f"{vocab:>7} {share:>6.0%} {sample_ms:>9.2f} {proc_ms:>8.2f} {proc_ms / sample_ms:>6.2f} "
                  f"{lp_ms:>9.2f} {loop_ms:>11.2f}")


if __name__ == "__main__":
    main()
