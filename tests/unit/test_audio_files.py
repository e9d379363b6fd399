"""The transcription door's pure parts: audio files decoded (or refused by name), the form
read within its limits and its fields checked, the utterances a file is cut into, and
the transcript rendered as json, text, verbose_json, SRT and WebVTT."""

from __future__ import annotations

import struct

import httpx
import numpy as np
import orjson
import pytest

from streamfleet.gateway.edge.multipart_form import FormLimits, FormReader
from streamfleet.gateway.protocols.transcription_mapping import (
    Segment,
    check_form,
    delta_event,
    done_event,
    full_text,
    render,
    srt,
    timestamp,
    vtt,
)
from streamfleet.gateway.services.audio_files import decode_audio, resample_pcm16, sniff_format
from streamfleet.gateway.services.transcription import split_utterances
from streamfleet.shared.errors import ValidationError
from tests.support.audiofiles import (
    flac_bytes,
    wav_bytes as wav,  # (short: the tests build many)
)


def tone(seconds: float, rate: int = 16000, hz: float = 440.0) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return (np.sin(2 * np.pi * hz * t) * 8000).astype("<i2").tobytes()


def refused(data: bytes, *words: str, max_seconds: float = 60.0, param: str = "file") -> ValidationError:
    with pytest.raises(ValidationError) as info:
        decode_audio(data, 16000, max_seconds)
    assert info.value.param == param and info.value.status == 400
    for w in words:
        assert w in info.value.message, info.value.message
    return info.value


# -- decoding ----------------------------------------------------------------------------------
def test_mono_16k_pcm16_wav_is_taken_as_it_is():
    pcm = tone(1.0)
    out = decode_audio(wav(pcm), 16000, 60)
    assert out.pcm == pcm and out.format == "wav" and out.duration_s == 1.0
    assert (out.source_rate, out.source_channels) == (16000, 1)


def test_stereo_is_mixed_down_and_other_rates_resampled():
    left = np.frombuffer(tone(0.5, 44100), dtype="<i2")
    stereo = np.stack([left, left], axis=1).astype("<i2").tobytes()  # both channels the tone
    out = decode_audio(wav(stereo, 44100, 2), 16000, 60)
    assert out.sample_rate == 16000 and (out.source_rate, out.source_channels) == (44100, 2)
    assert abs(len(out.pcm) // 2 - 8000) <= 2
    # the 440 Hz tone survives the conversion (its peak is where it was)
    samples = np.frombuffer(out.pcm, dtype="<i2").astype(float)
    spectrum = np.abs(np.fft.rfft(samples))
    assert abs(np.argmax(spectrum) * 16000 / len(samples) - 440) < 5
    # two different channels: their mean
    a, b = np.full(100, 1000, "<i2"), np.full(100, -3000, "<i2")
    out = decode_audio(wav(np.stack([a, b], axis=1).tobytes(), 16000, 2), 16000, 60)
    assert set(np.frombuffer(out.pcm, dtype="<i2")) == {-1000}


def test_8k_audio_is_upsampled():
    out = decode_audio(wav(tone(2.0, 8000), 8000), 16000, 60)
    assert abs(out.duration_s - 2.0) < 0.01 and out.source_rate == 8000
    assert resample_pcm16(b"", 8000, 16000) == b""


def test_flac_is_decoded_and_a_truncated_one_refused():
    pcm = tone(1.5)
    data = flac_bytes(pcm)
    assert sniff_format(data) == "flac"
    out = decode_audio(data, 16000, 60)
    assert out.pcm == pcm and out.format == "flac"
    refused(data[: len(data) // 2], "FLAC", "truncated")
    refused(data[:30], "not valid FLAC audio")
    refused(data, "limit is 1 s", "SF_TRANSCRIPTION_MAX_DURATION_S", max_seconds=1.0)


def test_bad_wav_files_are_refused_by_name():
    good = wav(tone(1.0))
    refused(b"", "empty")
    refused(b"hello, this is text and not audio at all", "not audio")
    refused(good[: len(good) // 2], "truncated", "declares 32000 bytes")
    refused(good[:40], "truncated")
    refused(good[:16], "no 'fmt ' chunk")
    refused(good[:20], "'fmt ' chunk is cut short")
    refused(good[:-1], "truncated", "declares 32000 bytes, 31999 are present")
    # a WAV written to a pipe: its data runs to the end of the file, whatever its size says
    streamed = bytearray(good)
    struct.pack_into("<I", streamed, 40, 0xFFFFFFFF)
    assert decode_audio(bytes(streamed), 16000, 60).pcm == good[44:]
    refused(bytes(streamed[:-1]), "truncated", "not whole 2-byte sample frames")
    refused(wav(b"\x80" * 16000, width=1), "8-bit PCM WAV is not supported", "16-bit")
    refused(wav(b"\0\0\0" * 16000, width=3), "24-bit PCM WAV is not supported")
    refused(b"RIFF\0\0\0\0AVI LIST", "not WAVE")
    refused(b"RIFX" + good[4:], "RIFX")
    # IEEE float WAV: the same header with format 3
    floats = bytearray(wav(b"\0" * 64000, channels=1, width=4))
    struct.pack_into("<H", floats, 20, 3)
    refused(bytes(floats), "floating-point WAV is not supported")
    # a header that lies about its block size
    bad = bytearray(good)
    struct.pack_into("<H", bad, 32, 4)
    refused(bytes(bad), "malformed")
    refused(wav(tone(3.0)), "3.0 s long", "limit is 2 s", max_seconds=2.0)


def test_other_containers_are_named():
    refused(b"\0\0\0\x20ftypM4A \0\0\0\0" + b"\0" * 64, "MP4/M4A audio is not supported")
    refused(b"\x1a\x45\xdf\xa3" + b"\0" * 64, "WebM/Matroska")
    refused(b"OggS\0\x02" + b"\0" * 22 + b"\x01\x13OpusHead" + b"\0" * 32, "Ogg Opus")
    refused(b"OggS" + b"\0" * 200, "not valid Ogg Vorbis audio")
    refused(b"ID3\x04\0\0\0\0\0\0" + b"\0" * 300, "MP3")
    assert sniff_format(b"\xff\xfb\x90\x64" + b"\0" * 10) == "mp3"


# -- segments ----------------------------------------------------------------------------------
def test_segment_times_without_vad_are_fixed_spans():
    pcm = b"\0\0" * 16000 * 65
    spans = split_utterances(pcm, 16000, "off", hangover_ms=200, preroll_ms=300, end_silence_ms=600,
                             max_utterance_ms=30_000)
    assert spans == [(0, 30_000), (30_000, 60_000), (60_000, 65_000)]
    # at a rate the detectors do not take, the same
    assert split_utterances(b"\0\0" * 8000 * 3, 8000, "silero", hangover_ms=200, preroll_ms=300, end_silence_ms=600,
                            max_utterance_ms=2000) == [(0, 2000), (2000, 3000)]


@pytest.mark.parametrize("vad", ["silero", "webrtc"])
def test_segment_times_follow_the_speech(vad):
    from streamfleet.devkit.speech import SENTENCES, flite_missing, silence, speech

    if flite_missing():
        pytest.skip(flite_missing())
    pcm, known = silence(700), []
    for ref in SENTENCES[:3]:
        s = speech(ref)
        known.append((len(pcm) // 32, (len(pcm) + len(s)) // 32))
        pcm += s + silence(1200)
    spans = split_utterances(pcm, 16000, vad, hangover_ms=200, preroll_ms=300, end_silence_ms=600,
                             max_utterance_ms=30_000)
    assert len(spans) == 3, spans
    for (start, end), (a, b) in zip(spans, known):
        assert a - 400 <= start <= a + 100 and b - 100 <= end <= b + 400, (spans, known)
    assert split_utterances(silence(4000), 16000, vad, hangover_ms=200, preroll_ms=300, end_silence_ms=600,
                            max_utterance_ms=30_000) == []


# -- rendering ---------------------------------------------------------------------------------
SEGMENTS = [Segment(0, 200, 3040, "the quick brown fox"), Segment(1, 3500, 3800, ""),
            Segment(2, 61_010, 3_725_999, "please call me back")]


def test_timestamps_srt_and_vtt():
    assert timestamp(0) == "00:00:00,000" and timestamp(3_725_999) == "01:02:05,999"
    assert timestamp(61_010, ".") == "00:01:01.010"
    assert srt(SEGMENTS) == ("1\n00:00:00,200 --> 00:00:03,040\nthe quick brown fox\n\n"
                             "2\n00:01:01,010 --> 01:02:05,999\nplease call me back\n\n")
    assert vtt(SEGMENTS) == ("WEBVTT\n\n00:00:00.200 --> 00:00:03.040\nthe quick brown fox\n\n"
                             "00:01:01.010 --> 01:02:05.999\nplease call me back\n\n")
    assert vtt([]) == "WEBVTT\n\n" and srt([]) == ""


def test_render_every_format():
    text = "the quick brown fox please call me back"
    assert full_text(SEGMENTS) == text
    body, kind = render("json", SEGMENTS, duration_s=3725.2, language="en-US")
    assert orjson.loads(body) == {"text": text, "usage": {"type": "duration", "seconds": 3726}}
    assert kind == "application/json"
    body, kind = render("text", SEGMENTS, duration_s=1, language="en-US")
    assert body == (text + "\n").encode() and kind.startswith("text/plain")
    assert render("srt", SEGMENTS, duration_s=1, language="en-US")[0] == srt(SEGMENTS).encode()
    body, kind = render("vtt", SEGMENTS, duration_s=1, language="en-US")
    assert body == vtt(SEGMENTS).encode() and kind.startswith("text/vtt")
    verbose = orjson.loads(render("verbose_json", SEGMENTS, duration_s=3725.2, language="en-US")[0])
    assert verbose["language"] == "english" and verbose["duration"] == 3725.2 and verbose["text"] == text
    assert verbose["segments"] == [
        {"id": 0, "seek": 20, "start": 0.2, "end": 3.04, "text": "the quick brown fox", "tokens": [],
         "temperature": 0.0},
        {"id": 1, "seek": 6101, "start": 61.01, "end": 3725.999, "text": "please call me back", "tokens": [],
         "temperature": 0.0}]
    # the streamed events add up to the done event's text
    deltas = [delta_event(s, first=i == 0) for i, s in enumerate(s for s in SEGMENTS if s.text)]
    assert "".join(d["delta"] for d in deltas) == done_event(SEGMENTS)["text"] == text
    assert deltas[0] == {"type": "transcript.text.delta", "delta": "the quick brown fox"}


# -- the form ----------------------------------------------------------------------------------
def test_form_fields_are_checked_by_name():
    form = check_form({"model": ["asr-en"], "response_format": ["verbose_json"],
                       "timestamp_granularities[]": ["segment"], "temperature": ["0.0"], "language": ["en"],
                       "stream": ["false"], "prompt": [""], "chunking_strategy": ["auto"], "user": ["whoever"]})
    assert (form.model, form.response_format, form.stream, form.language) == ("asr-en", "verbose_json", False, "en")
    assert check_form({}).response_format == "json" and check_form({"stream": ["true"]}).stream
    cases = [
        ({"response_format": ["docx"]}, "response_format"),
        ({"response_format": ["diarized_json"]}, "response_format"),
        ({"stream": ["maybe"]}, "stream"),
        ({"stream": ["true"], "response_format": ["vtt"]}, "response_format"),
        ({"temperature": ["0.2"]}, "temperature"),
        ({"temperature": ["warm"]}, "temperature"),
        ({"prompt": ["spell it Zoë"]}, "prompt"),
        ({"response_format": ["verbose_json"], "timestamp_granularities[]": ["word"]}, "timestamp_granularities"),
        ({"response_format": ["verbose_json"], "timestamp_granularities[]": ["segment", "word"]},
         "timestamp_granularities"),
        ({"timestamp_granularities[]": ["segment"]}, "timestamp_granularities"),
        ({"chunking_strategy[type]": ["server_vad"]}, "chunking_strategy"),
        ({"include[]": ["logprobs"]}, "include"),
        ({"known_speaker_names[]": ["agent"]}, "known_speaker_names"),
        ({"model": ["a", "b"]}, "model"),
    ]
    for fields, param in cases:
        with pytest.raises(ValidationError) as info:
            check_form(fields)
        assert info.value.param == param and info.value.status == 400, (fields, info.value)


def form_body(files=None, data=None) -> tuple[str, bytes]:
    req = httpx.Request("POST", "http://gw/", files=files, data=data)
    return req.headers["content-type"], req.read()


def test_the_form_is_read_within_its_limits():
    audio = wav(tone(0.2))
    ctype, body = form_body({"file": ("a.wav", audio, "audio/wav")}, {"model": "asr-en", "x[]": ["1", "2"]})
    reader = FormReader(ctype, FormLimits(max_file_bytes=len(audio)))
    for i in range(0, len(body), 13):  # in any chunking
        reader.feed(body[i:i + 13])
    form = reader.finish()
    assert form.file == audio and form.filename == "a.wav" and form.content_type == "audio/wav"
    assert form.fields == {"model": ["asr-en"], "x[]": ["1", "2"]}

    def refusal(limits: FormLimits, content_type: str = ctype, data: bytes = body) -> ValidationError:
        with pytest.raises(ValidationError) as info:
            reader = FormReader(content_type, limits)
            reader.feed(data)
            reader.finish()
        return info.value

    err = refusal(FormLimits(max_file_bytes=len(audio) - 1))
    assert err.status == 413 and err.param == "file" and "SF_TRANSCRIPTION_MAX_BYTES" in err.message
    err = refusal(FormLimits(max_file_bytes=10**6, max_field_bytes=3))
    assert err.status == 413 and err.param == "model"
    assert "more than 2 parts" in refusal(FormLimits(max_file_bytes=10**6, max_parts=2)).message
    assert "cut short" in refusal(FormLimits(max_file_bytes=10**6), data=body[:-20]).message
    assert "multipart/form-data" in refusal(FormLimits(10**6), content_type="application/json").message
    assert "boundary" in refusal(FormLimits(10**6), content_type="multipart/form-data").message
    ctype2, two = form_body([("file", ("a.wav", audio)), ("file", ("b.wav", audio))])
    assert "more than one 'file'" in refusal(FormLimits(10**6), ctype2, two).message
    ctype3, none = form_body({"model": (None, "asr-en")})
    err = refusal(FormLimits(10**6), ctype3, none)
    assert err.code == "missing_field" and err.param == "file"
    ctype4, latin = form_body({"file": ("a.wav", audio), "language": (None, b"\xff\xfe")})
    assert "not UTF-8" in refusal(FormLimits(10**6), ctype4, latin).message
    long_header = body.replace(b'name="model"', b'name="model"; x="' + b"y" * 5000 + b'"')
    assert "malformed" in refusal(FormLimits(10**6), ctype, long_header).message
