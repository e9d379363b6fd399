"""Test speech: sentences synthesized with Debian's ``flite`` (voice ``slt``, 16 kHz mono
PCM16) at the time they are needed, silence and noise to put between them, and the word
error rate of a transcript. Used by the voice tests and benchmarks; nothing is
downloaded or committed.

    pcm = speech("the quick brown fox")             # bytes, PCM16 little-endian, 16 kHz
    clip = pcm + silence(1000) + speech("hello")    # two utterances a second apart
    write_wav("clip.wav", clip)
    wer("the quick brown fox", "the quick brown box")   # 0.25
"""

from __future__ import annotations

import functools
import os
import random
import re
import shutil
import struct
import subprocess
import tempfile
import wave
from pathlib import Path

__all__ = ["SAMPLE_RATE", "SENTENCES", "flite_missing", "speech", "silence", "noise", "write_wav", "read_wav",
           "wer", "words"]

SAMPLE_RATE = 16000
VOICE = "slt"
#: sentences flite says clearly and PocketSphinx's US-English model knows every word of
SENTENCES = (
    "the quick brown fox jumps over the lazy dog",
    "please call me back in ten minutes",
    "the weather is nice today",
    "i would like to order a large pizza",
    "turn off the lights in the kitchen",
    "what time does the train leave",
)


def flite_missing() -> str | None:
    """Why speech cannot be synthesized here (for a skip), or None."""
    if shutil.which("flite") is None:
        return "flite is not installed (Debian: apt-get install flite)"
    return None


@functools.lru_cache(maxsize=64)
def speech(text: str, voice: str = VOICE) -> bytes:
    """``text`` spoken by flite, as 16 kHz mono PCM16 (resampled if the voice is not 16 kHz)."""
    if flite_missing():
        raise RuntimeError(flite_missing())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s.wav"
        subprocess.run(["flite", "-voice", voice, "-t", text, "-o", str(path)], check=True, capture_output=True,
                       timeout=60)
        pcm, rate = read_wav(path)
    return pcm if rate == SAMPLE_RATE else _resample(pcm, rate, SAMPLE_RATE)


def silence(ms: int) -> bytes:
    return b"\0\0" * (SAMPLE_RATE * ms // 1000)


def noise(ms: int, amplitude: int = 60, seed: int = 0) -> bytes:
    """Low white noise (room hiss, not speech): ``amplitude`` in PCM16 units."""
    rng = random.Random(seed)
    n = SAMPLE_RATE * ms // 1000
    return struct.pack(f"<{n}h", *(rng.randint(-amplitude, amplitude) for _ in range(n)))


def write_wav(path: str | os.PathLike, pcm: bytes, rate: int = SAMPLE_RATE) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)
    return Path(path)


def read_wav(path: str | os.PathLike) -> tuple[bytes, int]:
    """``(pcm, sample_rate)`` of a mono PCM16 WAV."""
    with wave.open(str(path), "rb") as w:
        if w.getnchannels() != 1 or w.getsampwidth() != 2:
            raise ValueError(f"{path}: expected mono 16-bit PCM, got {w.getnchannels()} channels of "
                             f"{8 * w.getsampwidth()} bits")
        return w.readframes(w.getnframes()), w.getframerate()


def _resample(pcm: bytes, src: int, dst: int) -> bytes:
    """Linear-interpolation resampling (test speech only)."""
    n = len(pcm) // 2
    x = struct.unpack(f"<{n}h", pcm[: 2 * n])
    m = n * dst // src
    out = []
    for i in range(m):
        pos = i * src / dst
        j = int(pos)
        frac = pos - j
        a = x[j]
        b = x[j + 1] if j + 1 < n else a
        out.append(int(a + (b - a) * frac))
    return struct.pack(f"<{m}h", *out)


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def wer(reference: str, hypothesis: str) -> float:
    """Word error rate: (substitutions + deletions + insertions) / reference words."""
    ref, hyp = words(reference), words(hypothesis)
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1] / max(1, len(ref))
