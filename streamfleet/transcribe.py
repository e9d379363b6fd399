"""`streamfleet transcribe FILE.wav`: stream a WAV file to the voice WebSocket
(``/v1/audio/stream``, docs/voice.md) in real time, or as fast as the gateway takes audio
(``--fast``: just under its default real-time limit, ``SF_AUDIO_MAX_REALTIME``), printing
partials as they change and each utterance's final."""

from __future__ import annotations

import asyncio
import sys
import time
import wave
from typing import TextIO

import orjson
import websockets

from streamfleet.client import urls

__all__ = ["transcribe", "read_wav"]

#: audio per frame: 20 ms in real time; 100 ms (the most a frame may carry) with --fast
FRAME_MS, FAST_FRAME_MS = 20, 100
#: --fast sends this many seconds of audio a second: under the gateway's default
#: real-time limit (SF_AUDIO_MAX_REALTIME, 1.5; faster audio is dropped, docs/voice.md)
FAST_REALTIME = 1.4


class WavError(Exception):
    pass


def read_wav(path: str) -> tuple[bytes, int]:
    """``(pcm, sample_rate)`` of a mono 16-bit PCM WAV.

    Raises:
        WavError: not such a file (the message says what it is instead).
    """
    try:
        with wave.open(path, "rb") as w:
            if w.getnchannels() != 1 or w.getsampwidth() != 2 or w.getcomptype() != "NONE":
                kind = "PCM" if w.getcomptype() == "NONE" else w.getcomptype()
                raise WavError(f"{path}: {w.getnchannels()} channel(s) of {8 * w.getsampwidth()}-bit {kind} audio; "
                               f"streamfleet takes mono 16-bit PCM. Convert it with sox (Debian: apt-get install "
                               f"sox): `sox {path} -c 1 -b 16 -r 16000 mono.wav`, or ffmpeg: `ffmpeg -i {path} "
                               f"-ac 1 -ar 16000 -sample_fmt s16 mono.wav`")
            return w.readframes(w.getnframes()), w.getframerate()
    except (OSError, EOFError, wave.Error) as exc:
        raise WavError(f"{path}: not a readable WAV file ({exc})") from exc


async def transcribe(url: str, path: str, *, fast: bool = False, model: str | None = None,
                     language: str | None = None, api_key: str | None = None, out: TextIO = sys.stdout,
                     err: TextIO = sys.stderr) -> int:
    """Returns an exit code: 0 done, 1 refused or failed, 2 unreachable or a bad file."""
    try:
        pcm, rate = read_wav(path)
    except WavError as exc:
        print(f"error: {exc}", file=err)
        return 2
    ws_url = urls(url)[0].replace("/v1/stream", "/v1/audio/stream")
    start = {"type": "start", "id": "file", "sample_rate": rate, "encoding": "pcm_s16le"}
    if model:
        start["model"] = model
    if language:
        start["language"] = language
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    frame_ms = FAST_FRAME_MS if fast else FRAME_MS
    step = rate * 2 * frame_ms // 1000
    pace = frame_ms / 1000 / (FAST_REALTIME if fast else 1.0)
    failed = False
    try:
        async with websockets.connect(ws_url, max_size=None, additional_headers=headers) as ws:
            await ws.send(orjson.dumps(start).decode())
            first = orjson.loads(await ws.recv())
            if first.get("type") == "error":
                print(f"error {first.get('code')}: {first.get('message')}", file=err)
                return 1

            async def send() -> None:
                t0 = time.monotonic()
                for n, i in enumerate(range(0, len(pcm), step), 1):
                    await ws.send(pcm[i:i + step])
                    await asyncio.sleep(max(0.0, t0 + n * pace - time.monotonic()))
                await ws.send(orjson.dumps({"type": "stop"}).decode())

            sender = asyncio.create_task(send())
            live = err.isatty()  # partials redrawn in place on a terminal only; no escape codes in a log
            async for raw in ws:
                msg = orjson.loads(raw)
                kind = msg.get("type")
                if kind == "partial":
                    if live:
                        print(f"\r\033[K… {msg['text']}", end="", file=err, flush=True)
                elif kind == "final":
                    if live:
                        print("\r\033[K", end="", file=err, flush=True)
                    print(f"[{msg['start_ms'] / 1000:7.2f} – {msg['end_ms'] / 1000:7.2f}] {msg['text']}", file=out,
                          flush=True)
                elif kind == "warning":
                    print(f"\nwarning {msg.get('code')}: {msg.get('message')}", file=err)
                elif kind == "error":
                    failed = True
                    print(f"\nerror {msg.get('code')}: {msg.get('message')}", file=err)
                elif kind == "stopped":
                    break
            await sender
    except (OSError, websockets.WebSocketException) as exc:
        print(f"cannot reach {ws_url}: {exc}", file=err)
        return 2
    return 1 if failed else 0
