"""The streaming speech interface and its PocketSphinx engine, on real speech synthesized
by flite (docs/voice.md, "Speech engines"): word error rate through the streaming path,
partials, decoder reuse, the slot pool, abort, silence, bad PCM; and the asr fields of
the model repository."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from streamfleet.devkit.speech import SENTENCES, flite_missing, silence, speech, wer, words
from streamfleet.shared.errors import ErrorCode, FatalError
from streamfleet.shared.modelrepo import ModelRepository, ModelSpec, ensure_artifacts, load_tokenizer
from streamfleet.workers.engines.speech import NoFreeDecoder, SpeechDecoder, SpeechStateError
from streamfleet.workers.engines.speech_loader import load_speech_engine
from streamfleet.workers.engines.speech_process import DecoderProcessDied, ProcessSpeechEngine

pytest.importorskip("pocketsphinx")


def spec() -> ModelSpec:
    return ModelRepository().get("asr-en")


@pytest.fixture(scope="module")
def engine():
    eng = load_speech_engine(spec())
    yield eng
    eng.close()


def need_flite() -> None:
    reason = flite_missing()
    if reason:
        pytest.skip(reason)


def chunks(pcm: bytes, chunk_ms: int) -> list[bytes]:
    step = 16000 * chunk_ms // 1000 * 2
    return [pcm[i:i + step] for i in range(0, len(pcm), step)]


def transcribe(dec: SpeechDecoder, pcm: bytes, chunk_ms: int) -> tuple[str, list[str]]:
    """``(final, hypotheses)``: the hypothesis after every chunk, then the final."""
    dec.begin()
    hyps = []
    for chunk in chunks(pcm, chunk_ms):
        dec.feed(chunk)
        hyps.append(dec.hypothesis())
    return dec.finish(), hyps


Streamed = Callable[[int], list[tuple[str, list[str]]]]


@pytest.fixture(scope="module")
def streamed(engine) -> Streamed:
    """``streamed(chunk_ms)``: ``(final, hypotheses)`` of every sentence, decoded once
    per chunk size on one of the engine's decoders and shared by the tests."""
    done: dict[int, list[tuple[str, list[str]]]] = {}

    def get(chunk_ms: int) -> list[tuple[str, list[str]]]:
        if chunk_ms not in done:
            need_flite()
            dec = engine.acquire()
            try:
                done[chunk_ms] = [transcribe(dec, speech(s), chunk_ms) for s in SENTENCES]
            finally:
                engine.release(dec)
        return done[chunk_ms]

    return get


def corpus_wer(finals: list[str]) -> float:
    errors = sum(wer(s, f) * len(words(s)) for s, f in zip(SENTENCES, finals))
    return errors / sum(len(words(s)) for s in SENTENCES)


# -- recognition ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("chunk_ms", [20, 100])
def test_wer_through_the_streaming_interface(streamed, chunk_ms):
    finals = [final for final, _ in streamed(chunk_ms)]
    assert corpus_wer(finals) <= 0.20, list(zip(SENTENCES, finals))


@pytest.mark.slow
@pytest.mark.parametrize("chunk_ms", [20, 100])
def test_partials_arrive_before_the_final_and_the_final_is_no_worse(streamed, chunk_ms):
    for sentence, (final, hyps) in zip(SENTENCES, streamed(chunk_ms)):
        seen = [h for h in hyps if h]
        assert seen, f"no partial before the end of {sentence!r}"
        assert len(set(seen)) >= 2, f"the partial of {sentence!r} never changed: {seen[0]!r}"
        assert hyps[0] == "" or len(words(hyps[0])) <= len(words(seen[-1]))
        assert wer(sentence, final) <= wer(sentence, hyps[-1]), (sentence, final, hyps[-1])


@pytest.mark.slow
def test_a_reused_decoder_gives_what_a_fresh_one_gives(streamed):
    """Every begin() starts from the model's initial state: neither the cepstral mean nor
    the noise estimate of earlier utterances (nor an aborted one) changes the text."""
    need_flite()
    eng = load_speech_engine(spec(), slots=1)
    try:
        dec = eng.acquire()
        target = speech(SENTENCES[0])
        fresh = transcribe(dec, target, 20)
        transcribe(dec, speech(SENTENCES[1]), 50)
        transcribe(dec, silence(500), 20)
        dec.begin()
        for chunk in chunks(speech(SENTENCES[2]), 100)[:8]:
            dec.feed(chunk)
        dec.abort()
        transcribe(dec, speech(SENTENCES[3]), 100)
        again = transcribe(dec, target, 20)
        assert again == fresh  # the final and every partial
    finally:
        eng.close()
    # and a decoder of the module's engine, after every sentence at two chunk sizes
    streamed(100)
    assert streamed(20)[0] == fresh


def test_begin_after_finish_and_after_abort(engine):
    need_flite()
    dec = engine.acquire()
    try:
        pcm = speech(SENTENCES[4])
        first, _ = transcribe(dec, pcm, 50)
        dec.begin()
        for chunk in chunks(pcm, 50)[:10]:
            dec.feed(chunk)
        dec.abort()
        assert not dec.active and dec.hypothesis() == ""
        dec.abort()  # idle: nothing to do
        assert transcribe(dec, pcm, 50)[0] == first
        assert wer(SENTENCES[4], first) <= 0.2
    finally:
        engine.release(dec)


def test_silence_gives_an_empty_transcript(engine):
    dec = engine.acquire()
    try:
        final, hyps = transcribe(dec, silence(1500), 20)
        assert final == "" and set(hyps) == {""}
        dec.begin()  # no audio at all
        assert dec.finish() == ""
        dec.begin()
        dec.feed(b"")
        dec.feed(b"\0\0")  # one sample
        assert dec.finish() == ""
    finally:
        engine.release(dec)


def test_odd_length_pcm_is_refused_and_the_utterance_goes_on(engine):
    need_flite()
    dec = engine.acquire()
    try:
        pcm = speech(SENTENCES[5])
        reference, _ = transcribe(dec, pcm, 100)
        dec.begin()
        with pytest.raises(ValueError, match="2-byte samples"):
            dec.feed(b"\0\0\0")
        with pytest.raises(TypeError):
            dec.feed("audio")  # type: ignore[arg-type]
        for chunk in chunks(pcm, 100):
            dec.feed(memoryview(chunk))
        assert dec.finish() == reference
    finally:
        engine.release(dec)


def test_calls_out_of_order_are_refused(engine):
    dec = engine.acquire()
    try:
        with pytest.raises(SpeechStateError):
            dec.feed(b"\0\0")
        with pytest.raises(SpeechStateError):
            dec.finish()
        assert dec.hypothesis() == ""
        dec.begin()
        with pytest.raises(SpeechStateError):
            dec.begin()
        dec.abort()
    finally:
        engine.release(dec)


@pytest.mark.slow
def test_a_long_utterance_keeps_the_streaming_final():
    """Past final_pass_max_s the audio is no longer kept: the final comes from the
    streaming pass, and the decoder is fine for the next utterance."""
    need_flite()
    eng = load_speech_engine(spec(), slots=1, final_pass_max_s=0.5)
    try:
        dec = eng.acquire()
        long, _hyps = transcribe(dec, speech(SENTENCES[0]), 100)
        assert words(long) and wer(SENTENCES[0], long) <= 0.5
        assert transcribe(dec, speech(SENTENCES[0]), 100)[0] == long
    finally:
        eng.close()


# -- decoders in child processes (speech_process.py) -------------------------------------


@pytest.mark.slow
def test_decoders_run_in_child_processes_with_the_same_text(engine, streamed):
    """asr-en puts each decoder in a child process of its own; the text is exactly what
    the same backend gives in this process."""
    need_flite()
    assert isinstance(engine, ProcessSpeechEngine)
    pids = engine.pids
    assert len(set(pids)) == engine.slots and os.getpid() not in pids
    local = load_speech_engine(spec(), slots=1, processes=False)
    try:
        assert not isinstance(local, ProcessSpeechEngine)
        dec = local.acquire()
        assert [transcribe(dec, speech(s), 20) for s in SENTENCES] == streamed(20)
    finally:
        local.close()


@pytest.mark.slow
def test_a_decoder_process_that_dies_fails_its_utterance_and_comes_back():
    need_flite()
    eng = load_speech_engine(spec(), slots=1)
    try:
        dec = eng.acquire()
        dec.begin()
        dec.feed(speech(SENTENCES[0])[:16000])
        victim = psutil.Process(eng.pids[0])
        victim.send_signal(signal.SIGKILL)
        while victim.status() != psutil.STATUS_ZOMBIE:  # gone before the next call (else it could answer it)
            time.sleep(0.01)
        with pytest.raises(DecoderProcessDied):
            dec.feed(speech(SENTENCES[0])[16000:])
            dec.hypothesis()
        eng.release(dec)  # aborting a dead child's utterance does not raise
        dec = eng.acquire()
        final, _ = transcribe(dec, speech(SENTENCES[1]), 50)  # begin() started a new child
        assert wer(SENTENCES[1], final) <= 0.2 and dec.restarts == 1 and eng.pids[0] is not None
    finally:
        eng.close()
    assert eng.pids == [None]  # close() stopped the child


@pytest.mark.slow
def test_calls_are_pipelined_and_an_aborted_utterance_leaves_nothing_behind(engine):
    """feed() does not wait for the child; hypothesis() and finish() wait for what was
    sent before them, and an abort drops the replies still to come."""
    need_flite()
    dec = engine.acquire()
    try:
        dec.begin()
        for chunk in chunks(speech(SENTENCES[2]), 20):
            dec.feed(chunk)  # returns at once: the child decodes meanwhile
        dec.abort()  # with replies outstanding
        final, _ = transcribe(dec, speech(SENTENCES[0]), 100)
        assert final == transcribe(dec, speech(SENTENCES[0]), 100)[0]
        assert wer(SENTENCES[0], final) <= 0.2
    finally:
        engine.release(dec)


@pytest.mark.slow
def test_a_long_backlog_of_feeds_never_blocks_the_pipe(engine):
    """A worker taking an utterance over feeds its whole retained audio in one step:
    thousands of feeds before the next hypothesis. Only hypothesis and finish answer, so
    neither side of the pipe fills up waiting for the other."""
    need_flite()
    dec = engine.acquire()
    result: list[str] = []
    pcm = (speech(SENTENCES[0]) + silence(300)) * 8  # about 24 s

    def feed_all() -> None:
        dec.begin()
        for at in range(0, len(pcm), 320):  # 10 ms feeds: 2,400 calls with no reply in between
            dec.feed(pcm[at:at + 320])
        result.append(dec.hypothesis())
        result.append(dec.finish())

    try:
        t = threading.Thread(target=feed_all, daemon=True)
        t.start()
        t.join(120)
        assert not t.is_alive(), "the decoder's pipe is stuck"
        assert words(result[1]) and wer(" ".join([SENTENCES[0]] * 8), result[1]) <= 0.2, result
    finally:
        engine.release(dec)


def test_a_backend_that_cannot_load_in_its_child_stops_the_worker_with_its_reason():
    with pytest.raises(FatalError, match="final_pass"):
        load_speech_engine(spec(), slots=1, final_pass="sometimes")


# -- the pool ---------------------------------------------------------------------------


def test_the_pool_lends_at_most_slots_decoders(engine):
    assert engine.slots == spec().slots == 2 and engine.sample_rate == 16000
    lent = [engine.acquire() for _ in range(engine.slots)]
    try:
        assert len({id(d) for d in lent}) == engine.slots and engine.in_use == engine.slots
        with pytest.raises(NoFreeDecoder) as exc:
            engine.acquire()
        assert exc.value.code == ErrorCode.overloaded and exc.value.status == 429
        lent[0].begin()
        engine.release(lent[0])  # an utterance in progress is aborted on release
        back = engine.acquire()
        assert back is lent[0] and not back.active
        back.begin()
        assert back.finish() == ""
    finally:
        for d in lent:
            engine.release(d)
    with pytest.raises(SpeechStateError, match="released twice"):
        engine.release(lent[0])
    assert engine.in_use == 0


def test_acquire_and_release_from_many_threads(engine):
    held, most, errors = [0], [0], []
    lock = threading.Lock()

    def borrow() -> None:
        for _ in range(200):
            try:
                d = engine.acquire()
            except NoFreeDecoder:
                continue
            with lock:
                held[0] += 1
                most[0] = max(most[0], held[0])
            with lock:
                held[0] -= 1
            try:
                engine.release(d)
            except Exception as exc:  # collected for the assertion
                errors.append(exc)

    threads = [threading.Thread(target=borrow) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and most[0] <= engine.slots and engine.in_use == 0


def test_a_closed_engine_lends_nothing(engine):
    eng = load_speech_engine(spec(), slots=1, final_pass=False)
    dec = eng.acquire()
    with pytest.raises(ValueError, match="did not lend"):
        engine.release(dec)  # another engine's decoder
    dec.begin()
    eng.close()
    assert not dec.active
    with pytest.raises(SpeechStateError):
        eng.acquire()
    with pytest.raises(SpeechStateError):
        dec.begin()
    eng.close()  # twice is fine


# -- the model repository ----------------------------------------------------------------


def write_model(root: Path, name: str, body: str) -> ModelSpec:
    (root / name).mkdir(parents=True)
    (root / name / "engine.toml").write_text(body)
    return ModelRepository(root).get(name)


def test_the_asr_model_folder():
    s = spec()
    assert (s.kind, s.backend, s.slots, s.sample_rate, s.language) == ("asr", "pocketsphinx", 2, 16000, "en-US")
    assert s.options == {"processes": True} and s.eos_token_ids == ()
    assert s.artifacts_present()
    ensure_artifacts(s)  # present: nothing generated, nothing raised
    assert ModelRepository().get("tiny-gpt").kind == "text"


def test_text_only_paths_refuse_a_speech_model():
    with pytest.raises(FatalError, match="'asr-en' is a speech model"):
        load_tokenizer(spec())


def test_a_text_model_is_not_a_speech_engine(tmp_path):
    text = write_model(tmp_path, "words", 'name = "words"\nmax_batch = 2\n')
    assert text.kind == "text" and text.max_batch == 2
    with pytest.raises(FatalError, match="'words' is not a speech model"):
        load_speech_engine(text)


def test_speech_fields_are_checked(tmp_path):
    other = write_model(tmp_path, "asr-fr", 'kind = "asr"\nbackend = "pocketsphinx"\nlanguage = "fr-FR"\n')
    assert other.slots == 1 and not other.artifacts_present()
    with pytest.raises(FatalError, match=r"'asr-fr' cannot be loaded.*en-US"):
        ensure_artifacts(other)
    with pytest.raises(FatalError, match="kind must be one of"):
        write_model(tmp_path, "odd", 'kind = "video"\n')
    with pytest.raises(FatalError, match="slots must be at least 1"):
        write_model(tmp_path, "none", 'kind = "asr"\nslots = 0\n')
    rate = write_model(tmp_path, "asr-8k", 'kind = "asr"\nsample_rate = 8000\nfinal_pass = false\n')
    assert rate.options == {"final_pass": False}
    with pytest.raises(FatalError, match="16000 Hz"):
        load_speech_engine(rate)
    with pytest.raises(FatalError, match="final_pass must be true or false"):
        load_speech_engine(spec(), final_pass="maybe")
    unknown = write_model(tmp_path, "ctc", 'kind = "asr"\nbackend = "whisperish"\n')
    assert not unknown.artifacts_present()
    with pytest.raises(FatalError, match="unknown speech backend"):
        load_speech_engine(unknown)
