"""SpeechCore (workers/speechcore.py) without flite or a real recognizer: a scripted
decoder behind the real ``SpeechEngine`` pool, so the core's rules are checked in
process and in milliseconds — partials only when the hypothesis changes, the final after
the end marker, cancels, refusals by name, idle audio, decoder failures that end one
utterance and not the others, abandoned utterances whose decoders go back to the pool."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from streamfleet.shared.modelrepo import ModelSpec
from streamfleet.shared.schema import (
    AudioInput,
    DoneEvent,
    ErrorEvent,
    SamplingParams,
    SpeechTask,
    Task,
    TranscriptEvent,
)
from streamfleet.workers.coreset import Core
from streamfleet.workers.engines.speech import SpeechDecoder, SpeechEngine
from streamfleet.workers.speechcore import AUDIO_IDLE_S, SpeechCore

RATE = 16000
#: 100 ms of PCM16 at 16 kHz
CHUNK = b"\x01\x00" * 1600


class WordsDecoder(SpeechDecoder):
    """Hears one word per 100 ms chunk ("w1 w2 ..."); fails on a chunk of b"\\xff\\xff"."""

    def __init__(self) -> None:
        super().__init__()
        self.words: list[str] = []
        self.aborted = 0

    def _begin(self) -> None:
        self.words = []

    def _feed(self, pcm: bytes) -> None:
        if pcm.startswith(b"\xff\xff"):
            raise RuntimeError("decoder broke")
        self.words += [f"w{len(self.words) + 1 + i}" for i in range(len(pcm) // len(CHUNK))]

    def _hypothesis(self) -> str:
        return " ".join(self.words)

    def _finish(self) -> str:
        return " ".join(self.words).upper()

    def _abort(self) -> None:
        self.aborted += 1


class WordsEngine(SpeechEngine):
    pass


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def make_core(slots: int = 2) -> tuple[SpeechCore, WordsEngine, Clock]:
    spec = ModelSpec(name="asr-test", path=Path("/nonexistent"), kind="asr", slots=slots, sample_rate=RATE)
    engine = WordsEngine(spec, [WordsDecoder() for _ in range(slots)])
    clock = Clock()
    return SpeechCore(engine, clock=clock), engine, clock


def utterance(rid: str, *, rate: int = RATE, encoding: str = "pcm_s16le", deadline: float | None = None,
              audio: bool = True) -> SpeechTask | Task:
    """An utterance's task; ``audio=False``: a text task sent to the speech model."""
    now = time.time()
    deadline = deadline if deadline is not None else now + 60
    if not audio:
        return Task(request_id=rid, model="asr-test", lane="normal", reply_to="conn", client_id=rid,
                    prompt_ids=[1, 2], params=SamplingParams(), created_at=now, deadline=deadline)
    return SpeechTask(request_id=rid, model="asr-test", lane="normal", reply_to="conn", client_id=rid,
                      audio=AudioInput(sample_rate=rate, encoding=encoding), created_at=now, deadline=deadline)


def events(out) -> list:
    return [ev for _, ev in out.events]


def test_partials_then_final():
    core, engine, _ = make_core()
    assert isinstance(core, Core)
    core.add(utterance("u1"))
    assert core.listening() == ["u1"] and core.ready()
    first = events(core.step())  # the start: partial 0, empty (the gateway stops its slot wait)
    assert first == [TranscriptEvent("u1", 0, "")]
    assert not core.ready()
    assert events(core.step()) == []  # nothing fed, nothing changed: no event
    core.feed("u1", [CHUNK, CHUNK], ended=False)
    assert events(core.step()) == [TranscriptEvent("u1", 1, "w1 w2")]
    core.feed("u1", [CHUNK], ended=True)
    assert core.listening() == []
    out = core.step()
    final, done = events(out)
    assert final == TranscriptEvent("u1", 2, "W1 W2 W3", final=True)
    assert isinstance(done, DoneEvent) and done.finish_reason == "stop"
    assert done.completion_tokens == 3 and out.finished == ["u1"]  # the gateway checks every index came
    assert done.audio_s == 0.3  # three chunks of 0.1 s: what its tenant is charged
    assert "u1" not in core and core.free_slots == 2 and engine.in_use == 0 and not core.has_work()


def test_cancel_ends_with_the_hypothesis_so_far():
    core, engine, _ = make_core()
    core.add(utterance("u1"))
    core.step()
    core.feed("u1", [CHUNK], ended=False)
    core.step()
    assert core.cancel("u1") and not core.cancel("nope")
    final, done = events(core.step())
    assert final == TranscriptEvent("u1", 2, "w1", final=True) and done.finish_reason == "cancelled"
    assert engine.in_use == 0


@pytest.mark.parametrize("task,code,words", [
    (utterance("a", audio=False), "invalid_request", "this is a text task"),
    (utterance("b", rate=8000), "invalid_request", "8000 Hz"),
    (utterance("c", encoding="opus"), "invalid_request", "'opus'"),
    (utterance("d", deadline=1.0), "timeout", "deadline"),
])
def test_refused_by_name_without_a_decoder(task, code, words):
    core, engine, _ = make_core()
    core.add(task)
    assert engine.in_use == 0 and task.request_id not in core
    (err,) = events(core.step())
    assert isinstance(err, ErrorEvent) and err.code == code and words in err.message


def test_slots_are_the_engines_decoders():
    core, _, _ = make_core(slots=1)
    core.add(utterance("u1"))
    assert core.free_slots == 0
    with pytest.raises(ValueError, match="no free decoder slot"):
        core.add(utterance("u2"))
    with pytest.raises(ValueError, match="already running"):
        core.add(utterance("u1"))


def test_a_broken_decoder_ends_its_utterance_only():
    core, engine, _ = make_core()
    core.add(utterance("bad"))
    core.add(utterance("good"))
    core.step()
    core.feed("bad", [b"\xff\xff" * 1600], ended=False)
    core.feed("good", [CHUNK], ended=False)
    got = {e.request_id: e for e in events(core.step())}
    assert isinstance(got["bad"], ErrorEvent)
    assert got["bad"].code == "engine_error" and "decoder broke" in got["bad"].message
    assert got["good"] == TranscriptEvent("good", 1, "w1")
    assert "bad" not in core and "good" in core and engine.in_use == 1


def test_audio_that_stops_arriving_times_out():
    core, engine, clock = make_core()
    core.add(utterance("u1"))
    core.step()
    clock.now += AUDIO_IDLE_S + 1
    (err,) = events(core.step())
    assert isinstance(err, ErrorEvent) and err.code == "timeout" and "no audio" in err.message
    assert engine.in_use == 0


def test_abandoned_utterances_say_nothing_and_give_their_decoder_back():
    core, engine, _ = make_core()
    core.add(utterance("u1"))
    core.add(utterance("u2"))
    core.step()
    assert core.abandon("u1") and not core.abandon("u1")
    assert engine.in_use == 2 and core.free_slots == 0  # back in the next step, never mid-call
    out = core.step()
    assert [e.request_id for e in events(out)] == [] and engine.in_use == 1 and core.free_slots == 1
    assert [t.request_id for t in core.abandon_all()] == ["u2"]
    assert engine.in_use == 0 and not core.has_work()
