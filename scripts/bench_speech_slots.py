#!/usr/bin/env python
"""How many utterances one speech worker decodes at once in real time: K streams of
flite speech, every slot talking all the time (the worst case), driven the way the
worker's SpeechCore drives them: every stream's audio of a 20 ms tick first, then every
hypothesis and final; with the decoders in child processes each slot is waited for on a
thread of its own and a final pass runs on while the other slots go on.

For each K: the lag of partials behind the audio (when a tick's hypothesis came back,
minus the tick's time) and the time to each final after its last audio, p50 / p95, and
the CPU the decoders used. Run with the model's engine.toml (decoders in child
processes) and, with ``--in-process``, with all decoders in this process.

    python -m scripts.bench_speech_slots [--slots 1,2,3,4] [--in-process]
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor

import psutil

from scripts.procstats import cpu_s, family
from streamfleet.devkit.speech import SENTENCES, flite_missing, silence, speech
from streamfleet.shared.modelrepo import ModelRepository
from streamfleet.workers.engines.speech_loader import load_speech_engine

TICK_MS = 20
STEP = 16000 * TICK_MS // 1000 * 2


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))] if s else float("nan")


def run(k: int, in_process: bool) -> dict:
    spec = ModelRepository().get("asr-en")
    engine = load_speech_engine(spec, slots=k, processes=not in_process)
    decoders = [engine.acquire() for _ in range(k)]
    pool = ThreadPoolExecutor(max_workers=k) if engine.concurrent and k > 1 else None
    # each stream: the six sentences, 0.3 s apart, starting at a different sentence; an
    # utterance's audio becomes available in real time, and a stream whose decoder is still
    # on the last final pass holds it (as a queued utterance waits for a slot) and feeds
    # the backlog at once when the decoder is free
    streams = []
    for j in range(k):
        order = SENTENCES[j % len(SENTENCES):] + SENTENCES[:j % len(SENTENCES)]
        utts = [speech(s) + silence(300) for s in order]
        starts = [sum(len(u) for u in utts[:i]) / 32000 for i in range(len(utts))]
        streams.append({"utts": utts, "starts": starts, "i": 0, "fed": 0, "begun": False, "finishing": None})
    lags, finals = [], []
    me = psutil.Process()
    cpu0 = cpu_s(family(me))
    t0 = time.monotonic()
    tick = 0

    def finished(st: dict) -> None:
        finals.append(time.monotonic() - (t0 + st["starts"][st["i"]] + len(st["utts"][st["i"]]) / 32000))
        st.update(i=st["i"] + 1, fed=0, begun=False, finishing=None)

    def conclude(j: int) -> None:
        st, dec = streams[j], decoders[j]
        if st["fed"] >= len(st["utts"][st["i"]]):
            if pool is not None:
                st["finishing"] = pool.submit(dec.finish)  # collected in a later tick
            else:
                dec.finish()
                finished(st)
        else:
            dec.hypothesis()
            lags.append(time.monotonic() - (t0 + st["starts"][st["i"]] + st["fed"] / 32000))

    while any(st["i"] < len(st["utts"]) for st in streams):
        due = t0 + tick * TICK_MS / 1000
        now = time.monotonic()
        if due > now:
            time.sleep(due - now)
        live = []
        for j, st in enumerate(streams):  # every stream's audio first
            if st["finishing"] is not None:
                if not st["finishing"].done():
                    continue
                finished(st)
            if st["i"] >= len(st["utts"]):
                continue
            available = int((time.monotonic() - t0 - st["starts"][st["i"]]) * 16000) * 2
            pcm = st["utts"][st["i"]][st["fed"]:max(st["fed"], available)]
            if not pcm:
                continue
            if not st["begun"]:
                decoders[j].begin()
                st["begun"] = True
            for at in range(0, len(pcm), STEP):
                decoders[j].feed(pcm[at:at + STEP])
            st["fed"] += len(pcm)
            live.append(j)
        if pool is not None:  # then hypotheses and finals, each slot waited for on its own thread
            list(pool.map(conclude, live))
        else:
            for j in live:
                conclude(j)
        tick += 1
    wall = time.monotonic() - t0
    cpu = cpu_s(family(me)) - cpu0
    if pool is not None:
        pool.shutdown()
    for d in decoders:
        engine.release(d)
    engine.close()
    return {"k": k, "lag50": pct(lags, 50), "lag95": pct(lags, 95), "fin50": pct(finals, 50),
            "fin95": pct(finals, 95), "cores": cpu / wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", default="1,2,3,4", help="slot counts to try, comma-separated")
    ap.add_argument("--in-process", action="store_true", help="all decoders in this process (the GIL)")
    args = ap.parse_args()
    if (why := flite_missing()) is not None:
        raise SystemExit(why)
    where = "in this process" if args.in_process else "in child processes"
    print(f"asr-en, decoders {where}, {os.cpu_count()} cores; every slot talking in real time, {TICK_MS} ms ticks")
    print(f"{'K':>3} {'partial lag p50 / p95':>24} {'time to final p50 / p95':>26} {'cores used':>11}")
    for k in (int(x) for x in args.slots.split(",")):
        r = run(k, args.in_process)
        print(f"{k:>3} {r['lag50'] * 1000:>10.0f} / {r['lag95'] * 1000:<8.0f} ms "
              f"{r['fin50'] * 1000:>10.0f} / {r['fin95'] * 1000:<8.0f} ms {r['cores']:>11.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
