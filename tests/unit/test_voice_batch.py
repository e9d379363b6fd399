"""The gateway's batched Silero decisions (``gateway.services.voice.SileroBatch``): connections
whose audio arrives together are decided in one call, with exactly the decisions each
would get frame by frame."""

from __future__ import annotations

import asyncio
import random

import pytest

from streamfleet.devkit.speech import SENTENCES, flite_missing, noise, silence, speech
from streamfleet.gateway.services.silero import SileroBatch, SileroDetector
from streamfleet.gateway.services.vad import Segmenter
from streamfleet.gateway.services.vad_detectors import AlwaysSpeech
from streamfleet.gateway.services.voice import new_detector

pytestmark = pytest.mark.skipif(flite_missing() is not None, reason=flite_missing() or "")


def _streams(n: int) -> list[bytes]:
    # different speech at different offsets, so the streams' states differ
    return [silence(100 * k) + speech(SENTENCES[k % len(SENTENCES)]) + noise(400, seed=k) for k in range(n)]


async def _feed_all(batch: SileroBatch, streams: list[bytes], chunk_bytes: list[int]) -> list[list]:
    async def one(k: int) -> list:
        seg, events, pcm, at = Segmenter(SileroDetector()), [], streams[k], 0
        while at < len(pcm):
            piece = pcm[at:at + chunk_bytes[k]]
            at += len(piece)
            frames = seg.frames(piece)
            events += seg.decide(frames, await batch.decide(seg.detector, frames))
            await asyncio.sleep(0)  # as a socket read would: the other connections go too
        return events + seg.flush()

    return await asyncio.gather(*(one(k) for k in range(len(streams))))


def _frame_by_frame(pcm: bytes, chunk: int) -> list:
    seg = Segmenter(SileroDetector())
    events = []
    for at in range(0, len(pcm), chunk):
        events += seg.feed(pcm[at:at + chunk])
    return events + seg.flush()


async def test_batched_decisions_equal_frame_by_frame():
    streams = _streams(12)
    rnd = random.Random(7)
    chunks = [rnd.choice([320, 640, 1600, 3200]) for _ in streams]  # 10, 20, 50, 100 ms
    expected = [_frame_by_frame(pcm, chunk) for pcm, chunk in zip(streams, chunks)]
    batch = SileroBatch()
    got = await _feed_all(batch, streams, chunks)
    assert got == expected
    assert all(any(type(e).__name__ == "UtteranceEnd" for e in ev) for ev in got)
    # connections reading together share calls: far fewer calls than stream decisions
    assert batch.streams > 0 and batch.batches < batch.streams / 4, (batch.batches, batch.streams)


async def test_batches_are_capped_and_a_gone_connection_is_skipped():
    streams = _streams(5)
    batch = SileroBatch(max_streams=2)
    got = await _feed_all(batch, streams, [640] * 5)
    assert got == [_frame_by_frame(pcm, 640) for pcm in streams]
    assert batch.streams / batch.batches <= 2

    # a waiter cancelled before its batch runs is left out, the others are decided
    d1, d2 = SileroDetector(), SileroDetector()
    frame = silence(32)
    t1 = asyncio.ensure_future(batch.decide(d1, [frame]))
    t2 = asyncio.ensure_future(batch.decide(d2, [frame, frame]))
    await asyncio.sleep(0)
    t1.cancel()
    assert await t2 == [False, False]
    assert t1.cancelled()
    assert await batch.decide(d1, []) == []


def test_vad_off_is_every_frame_speech():
    det = new_detector("off")
    assert isinstance(det, AlwaysSpeech)
    seg = Segmenter(det)
    events = seg.feed(silence(2000)) + seg.flush()
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "SpeechStarted" and kinds[-1] == "UtteranceEnd" and kinds.count("UtteranceEnd") == 1
    assert events[-1].start_ms == 0 and events[-1].end_ms == 2000
    assert isinstance(new_detector("silero"), SileroDetector)
    with pytest.raises(ValueError, match="unknown voice activity detector"):
        new_detector("vosk")
