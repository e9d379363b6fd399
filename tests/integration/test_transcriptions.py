"""OpenAI's ``POST /v1/audio/transcriptions`` through the whole fleet: real speech (flite),
the official ``openai`` SDK unchanged, the gateway's decoding and VAD, a speech worker on
PocketSphinx (docs/openai.md, "Audio transcriptions")."""

from __future__ import annotations

import re
import time

import httpx
import numpy as np
import openai
import pytest

from streamfleet.devkit.speech import SENTENCES, flite_missing, silence, speech, wer
from streamfleet.gateway.services.audio_files import resample_pcm16
from streamfleet.shared.keys import Keys
from tests.support.audiofiles import flac_bytes, wav_bytes
from tests.support.keys import TIERS, add_key
from tests.support.wait import until

pytestmark = [pytest.mark.slow,  # speech synthesized by flite, decoded by PocketSphinx in real processes
              pytest.mark.skipif(flite_missing() is not None, reason=flite_missing() or "")]

MAX_BYTES = 1_000_000
MAX_SECONDS = 60
REFS = SENTENCES[:3]


def clip(refs=REFS, gap_ms: int = 1000) -> tuple[bytes, list[tuple[float, float]]]:
    """The sentences a second apart after 500 ms, and where each is spoken (seconds)."""
    pcm, spans = silence(500), []
    for ref in refs:
        s = speech(ref)
        spans.append((len(pcm) / 32000, (len(pcm) + len(s)) / 32000))
        pcm += s + silence(gap_ms)
    return pcm, spans


@pytest.fixture(scope="module")
def fleet_parts(module_fleets):
    """One fleet for the module: a gateway with auth off, one with auth on (same lanes), a
    speech worker."""
    fleet = module_fleets()
    limits = {"transcription_max_bytes": MAX_BYTES, "transcription_max_duration_s": MAX_SECONDS}
    gw = fleet.gateway(**limits)
    authed = fleet.gateway(auth_enabled=True, tiers=TIERS, **limits)
    fleet.worker(model="asr-en")
    return fleet, gw, authed


@pytest.fixture(scope="module")
def gw(fleet_parts):
    return fleet_parts[1]


def sdk(gw, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.http + "/v1", api_key=key, max_retries=0, timeout=120)


def lane_entries(rds, prefix: str) -> int:
    lane = f"{prefix}:{{asr-en}}:tasks:normal"
    return rds.xinfo_stream(lane)["entries-added"] if rds.exists(lane) else 0


@pytest.fixture(scope="module")
def speech_wav(tmp_path_factory):
    pcm, spans = clip()
    path = tmp_path_factory.mktemp("audio") / "speech.wav"
    path.write_bytes(wav_bytes(pcm))
    return path, spans


def test_sdk_formats_are_accurate_and_agree(gw, speech_wav):
    path, spans = speech_wav
    client = sdk(gw)
    t0 = time.monotonic()
    with open(path, "rb") as f:
        plain = client.audio.transcriptions.create(model="asr-en", file=f)
    took = time.monotonic() - t0
    errors = sum(wer(r, plain.text) * len(r.split()) for r in [" ".join(REFS)])
    assert errors / len(" ".join(REFS).split()) <= 0.2, plain.text
    assert plain.usage.type == "duration" and plain.usage.seconds == int(np.ceil(spans[-1][1] + 1.0))

    with open(path, "rb") as f:
        verbose = client.audio.transcriptions.create(model="asr-en", file=f, response_format="verbose_json",
                                                     timestamp_granularities=["segment"], temperature=0,
                                                     language="en")
    assert verbose.text == plain.text and verbose.language == "english"
    assert verbose.duration == pytest.approx(spans[-1][1] + 1.0, abs=0.01)
    assert [s.id for s in verbose.segments] == [0, 1, 2]
    for seg, (start, end), ref, nxt in zip(verbose.segments, spans, REFS, [s[0] for s in spans[1:]] + [99]):
        # each segment is one sentence's utterance: its span covers the speech (the VAD's
        # pre-roll and hangover around it), and ends before the next sentence
        assert start - 0.45 <= seg.start <= start + 0.15 and end - 0.15 <= seg.end <= min(end + 0.5, nxt), \
            (seg, start, end)
        assert wer(ref, seg.text) <= 0.34, (ref, seg.text)
    assert " ".join(s.text for s in verbose.segments) == plain.text

    with open(path, "rb") as f:
        text = client.audio.transcriptions.create(model="asr-en", file=f, response_format="text")
    assert isinstance(text, str) and text == plain.text + "\n"

    with open(path, "rb") as f:
        srt = client.audio.transcriptions.create(model="asr-en", file=f, response_format="srt")
    cues = srt.strip().split("\n\n")
    assert len(cues) == 3
    stamp = r"\d\d:\d\d:\d\d,\d\d\d"
    for n, (cue, seg) in enumerate(zip(cues, verbose.segments), 1):
        number, times, words = cue.split("\n")
        assert number == str(n) and re.fullmatch(f"{stamp} --> {stamp}", times) and words == seg.text
        _h, m, s = times.split(" --> ")[0].replace(",", ".").split(":")
        assert float(s) + 60 * int(m) == pytest.approx(seg.start, abs=0.001)

    with open(path, "rb") as f:
        vtt = client.audio.transcriptions.create(model="asr-en", file=f, response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n") and vtt.count(" --> ") == 3
    assert re.search(r"00:00:00\.\d\d\d --> 00:00:0\d\.\d\d\d\n" + re.escape(verbose.segments[0].text), vtt)
    print(f"json transcription of {spans[-1][1] + 1:.1f} s of audio: {took:.2f} s")


def test_sdk_stream_sends_deltas_then_done(gw, speech_wav):
    path, _ = speech_wav
    client = sdk(gw)
    with open(path, "rb") as f:
        events = list(client.audio.transcriptions.create(model="asr-en", file=f, stream=True))
    assert [e.type for e in events] == ["transcript.text.delta"] * 3 + ["transcript.text.done"], events
    assert "".join(e.delta for e in events[:-1]) == events[-1].text
    assert wer(" ".join(REFS), events[-1].text) <= 0.2, events[-1].text


async def test_grpc_transcribe_gives_the_http_doors_segments(gw, speech_wav):
    """streamfleet.v1.Inference/Transcribe: the same decoding, utterances and workers as
    the HTTP door, a TranscriptSegment per utterance, then TranscribeDone."""
    import grpc

    from streamfleet.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc
    from tests.support.grpcclient import aio_channel

    path, spans = speech_wav
    with open(path, "rb") as f:
        verbose = sdk(gw).audio.transcriptions.create(model="asr-en", file=f, response_format="verbose_json")
    async with aio_channel(gw.grpc) as ch:
        stub = pb_grpc.InferenceStub(ch)
        events = [ev async for ev in stub.Transcribe(pb.TranscribeRequest(file=path.read_bytes(), model="asr-en"),
                                                     timeout=120)]
        segments = [ev.segment for ev in events[:-1]]
        assert all(ev.HasField("segment") for ev in events[:-1]) and events[-1].HasField("done")
        assert [(s.index, s.text) for s in segments] == [(s.id, s.text) for s in verbose.segments]
        assert [s.start_ms / 1000 for s in segments] == pytest.approx([s.start for s in verbose.segments], abs=0.001)
        done = events[-1].done
        assert done.text == verbose.text and done.language == "en-US"  # the model's, as engine.toml says it
        assert done.duration_s == pytest.approx(spans[-1][1] + 1.0, abs=0.01)
        for request, code, param in ((pb.TranscribeRequest(), grpc.StatusCode.INVALID_ARGUMENT, "file"),
                                     (pb.TranscribeRequest(file=b"not audio at all" * 10),
                                      grpc.StatusCode.INVALID_ARGUMENT, "file"),
                                     (pb.TranscribeRequest(file=path.read_bytes(), model="tiny-gpt"),
                                      grpc.StatusCode.INVALID_ARGUMENT, "model"),
                                     (pb.TranscribeRequest(file=path.read_bytes(), model="nope"),
                                      grpc.StatusCode.NOT_FOUND, "model")):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                [ev async for ev in stub.Transcribe(request, timeout=60)]
            assert e.value.code() == code, (request.model, e.value.details())
            assert dict(e.value.trailing_metadata()).get("streamfleet-error-param", param) == param


def test_other_rates_channels_and_flac(gw):
    pcm, _ = clip(REFS[:1])
    up = np.frombuffer(resample_pcm16(pcm, 16000, 44100), dtype="<i2")
    stereo = wav_bytes(np.stack([up, up], axis=1).astype("<i2").tobytes(), rate=44100, channels=2)
    client = sdk(gw)
    for name, data in [("speech.wav", stereo), ("speech.flac", flac_bytes(pcm)),
                       ("speech22k.wav", wav_bytes(resample_pcm16(pcm, 16000, 22050), rate=22050))]:
        out = client.audio.transcriptions.create(model="asr-en", file=(name, data))
        assert wer(REFS[0], out.text) <= 0.2, (name, out.text)


def test_silence_is_an_empty_transcript_and_no_task(gw, rds):
    before = lane_entries(rds, gw.prefix)
    out = sdk(gw).audio.transcriptions.create(model="asr-en", file=("quiet.wav", wav_bytes(silence(3000))),
                                              response_format="verbose_json")
    assert out.text == "" and out.segments == [] and out.duration == pytest.approx(3.0)
    assert lane_entries(rds, gw.prefix) == before


def test_bad_input_is_refused_by_name_and_nothing_reaches_redis(gw, rds):
    client = sdk(gw)
    good = wav_bytes(speech(REFS[0]))
    before, audio_before = lane_entries(rds, gw.prefix), set(rds.keys(f"{gw.prefix}:audio:*"))
    cases = [
        (dict(file=("notes.txt", b"these are not the samples you are looking for" * 20)), "file", "not audio"),
        (dict(file=("cut.wav", good[:len(good) // 2])), "file", "truncated"),
        (dict(file=("u8.wav", wav_bytes(b"\x80" * 16000, width=1))), "file", "8-bit"),
        (dict(file=("long.wav", wav_bytes(silence(1000)[:16000] * (MAX_SECONDS + 1), rate=8000))), "file",
         "limit is 60 s"),
        (dict(file=("s.wav", good), response_format="docx"), "response_format", "must be one of"),
        (dict(file=("s.wav", good), response_format="verbose_json", timestamp_granularities=["word"]),
         "timestamp_granularities", "'word' is not supported"),
        (dict(file=("s.wav", good), temperature=0.7), "temperature", "deterministic"),
        (dict(file=("s.wav", good), prompt="Pizza order"), "prompt", "not supported"),
        (dict(file=("s.wav", good), language="de"), "language", "transcribes en-US"),
        (dict(file=("s.wav", good), stream=True, response_format="srt"), "response_format", "cannot be streamed"),
        (dict(file=("s.wav", good), model="tiny-gpt"), "model", "not a speech model"),
    ]
    for kwargs, param, words in cases:
        kwargs.setdefault("model", "asr-en")
        with pytest.raises(openai.BadRequestError) as info:
            client.audio.transcriptions.create(**kwargs)
        assert info.value.param == param and words in info.value.message, (kwargs.get("response_format"), info.value)
    with pytest.raises(openai.NotFoundError) as info:
        client.audio.transcriptions.create(model="no-such-model", file=("s.wav", good))
    assert info.value.status_code == 404 and info.value.param == "model"
    # too big: refused by the declared length, before the body is read
    with pytest.raises(openai.APIStatusError) as info:
        client.audio.transcriptions.create(model="asr-en", file=("big.wav", wav_bytes(silence(40_000))))
    assert info.value.status_code == 413 and info.value.param == "file" and "SF_TRANSCRIPTION_MAX_BYTES" in \
        info.value.message
    # not a form; a form without a file
    url = gw.http + "/v1/audio/transcriptions"
    r = httpx.post(url, json={"model": "asr-en"})
    assert r.status_code == 400 and "multipart/form-data" in r.json()["error"]["message"]
    r = httpx.post(url, files={"model": (None, "asr-en")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "file" and r.json()["error"]["code"] == \
        "missing_field"
    assert lane_entries(rds, gw.prefix) == before
    assert set(rds.keys(f"{gw.prefix}:audio:*")) <= audio_before


def test_auth_first_and_each_utterance_charged_to_the_rate_limit(fleet_parts):
    fleet, _, authed = fleet_parts
    url = authed.http + "/v1/audio/transcriptions"
    # no key: 401 before the body (not even a form) is looked at
    r = httpx.post(url, content=b"nothing", headers={"content-type": "text/plain"})
    assert r.status_code == 401
    key = add_key(fleet, "transcriber", "test")  # a burst of 6 requests, then 1 a minute
    client = sdk(authed, key)
    out = client.audio.transcriptions.create(model="asr-en", file=("s.wav", wav_bytes(clip()[0])))
    assert wer(" ".join(REFS), out.text) <= 0.2  # three utterances: three requests of the six
    # four utterances: the fourth is refused mid-file, and the transcription with it (the
    # utterances still running are cancelled; the error is the refusal's)
    four = wav_bytes(clip(SENTENCES[:4])[0])
    with pytest.raises(openai.RateLimitError) as info:
        client.audio.transcriptions.create(model="asr-en", file=("s.wav", four))
    assert info.value.code == "rate_limited"
    # and now the burst is spent: refused before the file is decoded, with Retry-After
    with pytest.raises(openai.RateLimitError) as info:
        client.audio.transcriptions.create(model="asr-en", file=("s.wav", four), stream=True)
    assert info.value.code == "rate_limited" and int(info.value.response.headers["retry-after"]) >= 1


def test_a_client_that_leaves_cancels_its_utterances(fleet_parts, rds):
    _, gw, _ = fleet_parts
    pcm, _ = clip(SENTENCES, gap_ms=800)
    before = lane_entries(rds, gw.prefix)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw.http + "/v1/audio/transcriptions", files={"file": ("s.wav", wav_bytes(pcm))},
                   data={"model": "asr-en"}, timeout=httpx.Timeout(30, read=1.5))
    keys = Keys(gw.prefix)
    held, waiting, _ = keys.voice_slots("asr-en")
    lane = keys.lane("asr-en", "normal")
    def pending() -> int:
        return rds.xpending(lane, "workers")["pending"] if rds.exists(lane) else 0

    # every utterance it started is cancelled, acknowledged, its slot given back
    until(lambda: pending() == 0 and rds.zcard(held) == 0 and rds.zcard(waiting) == 0,
          lambda: f"the utterances ended: {pending()} pending, held {rds.zrange(held, 0, -1)}", timeout=20)
    # and the utterances after those were never submitted
    assert lane_entries(rds, gw.prefix) - before < len(SENTENCES)
    # the fleet is free for the next request
    out = sdk(gw).audio.transcriptions.create(model="asr-en", file=("s.wav", wav_bytes(clip(REFS[:1])[0])))
    assert wer(REFS[0], out.text) <= 0.2


def test_no_speech_worker_is_the_voice_doors_error(module_fleets):
    fleet = module_fleets()
    gw = fleet.gateway(no_worker_grace_s=0.5)
    time.sleep(0.6)  # a real clock window: past the 0.5 s grace, counted from the gateway's start
    with pytest.raises(openai.APIStatusError) as info:
        sdk(gw).audio.transcriptions.create(model="asr-en", file=("s.wav", wav_bytes(speech(REFS[0]))))
    assert info.value.status_code == 503 and info.value.code == "no_workers"
    assert info.value.response.headers["retry-after"] == "5"
