"""A prompt's log probabilities (the OpenAI door's ``echo`` with ``logprobs``), piece by
piece: the engine's logits of every position of a chunk (``OnnxRuntimeEngine.extend_all``)
against its own last-position logits of each prefix, exactly, on tiny-gpt and on small
random GGUF models; the worker core's ``PromptEvent``s against the log-softmax of those
logits; the gateway's ordering of them before the tokens (``RequestStream``); the
validator's rules and the text an echo shows; the response shapes. No process or Redis."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import pytest

from streamfleet.gateway.admission.validation import Validator, echo_of
from streamfleet.gateway.protocols.openai_mapping import (
    ChoiceStream,
    Echo,
    Gathered,
    ResponseShape,
    completion_echo,
    request_payload,
)
from streamfleet.gateway.requests.request_stream import RequestStream
from streamfleet.shared.errors import ErrorCode, StreamfleetError, ValidationError
from streamfleet.shared.ggufimport import import_gguf
from streamfleet.shared.modelrepo import ModelRepository, load_tokenizer
from streamfleet.shared.schema import (
    DoneEvent,
    ErrorEvent,
    PromptEvent,
    SamplingParams,
    Task,
    TokenEvent,
    decode_events,
    encode_events,
)
from streamfleet.shared.settings import GatewaySettings
from streamfleet.workers.core import WorkerCore
from streamfleet.workers.engines.echo import EchoEngine
from streamfleet.workers.engines.onnxruntime import OnnxRuntimeEngine
from streamfleet.workers.logits import Logprobs
from tests.support.gguf_models import TinyLlama, numpy_logits, write_tiny_gguf
from tests.support.toy_core import Log, make_core, run, task

RNG = np.random.default_rng(11)

# -- the engine: every position's logits ---------------------------------------------------


@pytest.fixture(scope="module")
def gguf_engines(tmp_path_factory):
    """A small random Llama imported from GGUF in each weights mode, and its weights."""
    tmp = tmp_path_factory.mktemp("gguf")
    model = TinyLlama(seed=5)
    src = write_tiny_gguf(tmp / "tiny.gguf", model)
    engines = {}
    for weights in ("fp32", "int8", "q4-int8act", "q4"):
        import_gguf(src, tmp / "engines", f"tiny-{weights}", weights=weights, max_batch=8)
        engines[weights] = OnnxRuntimeEngine(ModelRepository(tmp / "engines").get(f"tiny-{weights}"), threads=1)
    yield model, engines
    for e in engines.values():
        e.close()


@pytest.fixture(scope="module")
def tiny_engine(tiny_spec):
    eng = OnnxRuntimeEngine(tiny_spec, threads=1)
    yield eng
    eng.close()


def engine_of(name: str, tiny_engine, gguf_engines) -> OnnxRuntimeEngine:
    return tiny_engine if name == "tiny-gpt" else gguf_engines[1][name.removeprefix("gguf-")]


def scored(engine: OnnxRuntimeEngine, sid: str, prompt: list[int], cuts: list[int]) -> np.ndarray:
    """``extend_all`` over ``prompt`` in chunks of ``cuts``, from an empty cache: every
    position's logits."""
    assert engine.start([(sid, prompt)], from_cache=False) == [0]
    rows, at = [], 0
    for n in cuts:
        rows.append(engine.extend_all(sid, prompt[at:at + n]))
        at += n
    assert at == len(prompt)
    return np.concatenate(rows)


CUTS = {"whole": [41], "chunks": [16, 9, 16], "pairs": [2] * 20 + [1]}


@pytest.mark.parametrize("cut", sorted(CUTS))
@pytest.mark.parametrize("name", ["tiny-gpt", "gguf-fp32", "gguf-int8", "gguf-q4-int8act"])
def test_every_positions_logits_are_the_engines_own_last_position_logits_of_each_prefix(
        name, cut, tiny_engine, gguf_engines):
    """Row i of ``extend_all`` is, bit for bit, what a prefill of the prompt's first i + 1
    tokens returns, however the prompt is cut into chunks (of two tokens or more, as the
    worker core cuts them; a last chunk of one starts the pairs' last position); the last
    row of each chunk is what ``extend`` returns for it, and the cache after it decodes on
    as it would have."""
    engine = engine_of(name, tiny_engine, gguf_engines)
    prompt = RNG.integers(3, engine.vocab_size, 41).tolist()
    cuts = CUTS[cut] if cut != "pairs" else [2] * 19 + [3]
    every = scored(engine, "all", prompt, cuts)
    assert every.shape == (41, engine.vocab_size) and every.dtype == np.float32
    for i in range(len(prompt)):
        alone = engine.prefill([("p", prompt[:i + 1])])[0]
        engine.release("p")
        assert np.array_equal(every[i], alone), (name, cut, i, float(np.abs(every[i] - alone).max()))
    # the extend path: each chunk's last position, and the decode steps after it
    engine.start([("ext", prompt)], from_cache=False)
    at = 0
    for n in cuts:
        last = engine.extend([("ext", prompt[at:at + n])])[0]
        at += n
        assert np.array_equal(last, every[at - 1])
    for step in range(4):
        token = int(np.argmax(last))
        a, b = engine.decode([("all", token)])[0], engine.decode([("ext", token)])[0]
        assert np.array_equal(a, b), step
        last = a
    engine.release("all")
    engine.release("ext")


def test_the_gguf_graphs_every_position_matches_an_independent_forward_pass(gguf_engines):
    """Every row of the fp32 import against a numpy forward pass of the GGUF weights; the
    4-bit import's rows are its one-row runs' but for the last bits (its head takes other
    kernels for one row and for several: docs/sampling.md)."""
    model, engines = gguf_engines
    prompt = RNG.integers(3, model.vocab, 30).tolist()
    every = scored(engines["fp32"], "x", prompt, [12, 18])
    engines["fp32"].release("x")
    np.testing.assert_allclose(every, numpy_logits(model, prompt), atol=2e-4, rtol=0)
    q4 = scored(engines["q4"], "q", prompt, [12, 18])
    engines["q4"].release("q")
    for i in (0, 11, 29):
        alone = engines["q4"].prefill([("p", prompt[:i + 1])])[0]
        engines["q4"].release("p")
        np.testing.assert_allclose(q4[i], alone, atol=1e-4, rtol=0)


def test_start_can_leave_the_prefix_cache_alone(tiny_spec):
    """A sequence started ``from_cache=False`` starts empty, whatever the cache holds (a
    cached position has no logits), and still gives the cache its blocks."""
    eng = OnnxRuntimeEngine(tiny_spec, threads=1, prefix_cache_mb=16, prefix_block=16)
    prompt = RNG.integers(3, eng.vocab_size, 50).tolist()
    assert eng.start([("a", prompt)], from_cache=False) == [0]
    eng.extend_all("a", prompt)
    eng.release("a")
    assert len(eng.prefix_cache) == 3  # its 3 whole blocks
    assert eng.start([("b", prompt)]) == [48]
    assert eng.start([("c", prompt)], from_cache=False) == [0]
    eng.close()


def _last_position_graph(tiny_spec, tmp_path) -> Path:
    """tiny-gpt whose graph slices the last position's logits itself, as GGUF imports did
    before ``logits_to_keep``."""
    import onnx
    from onnx import helper

    model = onnx.load(str(tiny_spec.onnx_path))
    g = model.graph
    for node in g.node:
        node.output[:] = ["logits_all" if o == "logits" else o for o in node.output]
    for name, value in (("last_s", -1), ("last_e", 2**62), ("last_a", 1)):
        g.initializer.append(helper.make_tensor(name, onnx.TensorProto.INT64, [1], [value]))
    g.node.append(helper.make_node("Slice", ["logits_all", "last_s", "last_e", "last_a"], ["logits"]))
    out = tmp_path / "last.onnx"
    onnx.save(model, str(out))
    return out


def test_a_graph_that_gives_the_last_position_only_says_so(tiny_spec, tmp_path):
    spec = dataclasses.replace(tiny_spec, onnx=str(_last_position_graph(tiny_spec, tmp_path)))
    eng = OnnxRuntimeEngine(spec, threads=1)
    assert not eng.every_position
    eng.start([("a", [5, 6, 7])], from_cache=False)
    with pytest.raises(RuntimeError, match="last position only"):
        eng.extend_all("a", [5, 6, 7])
    core = WorkerCore(eng, load_tokenizer(tiny_spec))
    log = Log()
    core.add(Task("r", "tiny-gpt", "normal", "c", "r", [5, 6, 7], SamplingParams(prompt_logprobs=1), 1.0))
    log.feed(core.step())
    end = log.end("r")
    assert isinstance(end, ErrorEvent) and end.code == "invalid_request"
    assert "last position only" in end.message and "tiny-gpt" in end.message
    eng.close()


# -- the worker core ------------------------------------------------------------------------


def collect(core: WorkerCore, tasks: list[Task]) -> Log:
    log = Log()
    for t in tasks:
        core.add(t)
    run(core, log)
    for t in tasks:
        log.check(t.request_id)
    return log


def text_task(rid: str, prompt: list[int], **params) -> Task:
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", 6)
    return Task(rid, "tiny-gpt", "normal", "c", rid, list(prompt), SamplingParams(**params), 1000.0)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


@pytest.mark.parametrize("name", ["tiny-gpt", "gguf-fp32"])
def test_the_cores_prompt_logprobs_are_the_log_softmax_of_the_engines_logits(name, tiny_engine, gguf_engines,
                                                                            tiny_spec):
    """In chunks of at most ``max_step_tokens``, the core sends position 0 (no log
    probability) and, for each later position, the log-softmax of the engine's logits at
    the position before, evaluated at the prompt's token, with the top alternatives, all
    before the first token; and the completion is the one the same request gets without
    them, token for token and log probability for log probability."""
    engine = engine_of(name, tiny_engine, gguf_engines)
    tokenizer = load_tokenizer(tiny_spec) if name == "tiny-gpt" else \
        load_tokenizer(ModelRepository(gguf_engines[1]["fp32"].spec.path.parent).get("tiny-fp32"))
    prompt = RNG.integers(3, engine.vocab_size, 70).tolist()
    every = scored(engine, "ref", prompt, [70])
    engine.release("ref")
    core = WorkerCore(engine, tokenizer, max_step_tokens=32)
    log = collect(core, [text_task("echo", prompt, logprobs=3, prompt_logprobs=3)])
    plain = collect(core, [text_task("plain", prompt, logprobs=3)])  # alone: it cannot fork the other's cache
    events = log.events["echo"]
    prompt_events = [e for e in events if isinstance(e, PromptEvent)]
    assert len(prompt_events) >= 3  # chunk by chunk, each before any token
    entries = log.prompt("echo")
    assert len(entries) == len(prompt) and [e["id"] for e in entries] == prompt
    assert entries[0] == {"id": prompt[0], "token": entries[0]["token"]}  # nothing predicts the first
    lps = Logprobs(every, list(range(len(prompt) - 1)), [3] * (len(prompt) - 1))
    for i in range(1, len(prompt)):
        want = log_softmax(every[i - 1])
        e = entries[i]
        assert e["logprob"] == pytest.approx(want[prompt[i]], abs=1e-5)
        lp, top = lps.of(i - 1, prompt[i])  # the very code a generated token's go through, on the same bits
        assert e["logprob"] == lp and [(t["id"], t["logprob"]) for t in e["top"]] == top
        assert [t["id"] for t in e["top"]] == list(np.argsort(-every[i - 1], kind="stable")[:3])
    assert [(t.text, t.logprobs) for t in log.tokens("echo")] == [(t.text, t.logprobs) for t in plain.tokens("plain")]
    assert log.end("echo").completion_tokens == plain.end("plain").completion_tokens > 0


def test_the_prompt_of_a_request_that_asks_is_computed_whole_and_in_bounded_chunks(tiny_spec):
    """Never from the prefix cache (a cached position has no logits), and in chunks of at
    most the core's bound, even with no ``max_step_tokens``: its logits never hold more
    than one chunk."""
    eng = OnnxRuntimeEngine(tiny_spec, threads=1, prefix_cache_mb=16, prefix_block=16)
    chunks = []
    real = eng.extend_all

    def extend_all(seq_id, chunk):
        chunks.append(len(chunk))
        return real(seq_id, chunk)

    eng.extend_all = extend_all
    core = WorkerCore(eng, load_tokenizer(tiny_spec), max_step_tokens=0)
    core._score_chunk = 40
    prompt = RNG.integers(3, eng.vocab_size, 150).tolist()
    log = collect(core, [text_task("warm", prompt)])
    assert log.end("warm").cached_tokens == 0 and len(eng.prefix_cache) == 9
    log = collect(core, [text_task("echo", prompt, prompt_logprobs=0)])
    assert log.end("echo").cached_tokens == 0 and len(log.prompt("echo")) == 150
    assert chunks == [40, 40, 40, 30]
    assert all(e["top"] == [] for e in log.prompt("echo")[1:])  # k = 0: the token's own only
    log = collect(core, [text_task("again", prompt)])
    assert log.end("again").cached_tokens == 144  # the cache serves the others as before
    eng.close()


def test_max_tokens_zero_is_the_prompt_alone(tiny_engine, tiny_spec):
    core = WorkerCore(tiny_engine, load_tokenizer(tiny_spec), max_step_tokens=64)
    prompt = RNG.integers(3, tiny_engine.vocab_size, 20).tolist()
    log = collect(core, [text_task("scored", prompt, max_tokens=0, prompt_logprobs=2),
                         text_task("bare", prompt, max_tokens=0)])
    for rid in ("scored", "bare"):
        end = log.end(rid)
        assert isinstance(end, DoneEvent) and (end.finish_reason, end.completion_tokens) == ("length", 0)
        assert end.prompt_tokens == 20 and not log.tokens(rid)
    assert len(log.prompt("scored")) == 20 and log.prompt("bare") == []
    # with a toy engine: no engine call at all for the bare one
    core, engine = make_core()
    log = Log()
    core.add(task("bare", "abc", max_tokens=0))
    run(core, log)
    log.check("bare")
    assert log.end("bare").finish_reason == "length" and engine.calls == []


def test_engines_that_cannot_refuse_the_request_by_name(tiny_spec):
    core, _ = make_core()
    log = Log()
    core.add(task("r", "abc", prompt_logprobs=1))
    run(core, log)
    end = log.end("r")
    assert isinstance(end, ErrorEvent) and end.code == "invalid_request" and "ToyEngine" in end.message
    echo = EchoEngine(dataclasses.replace(tiny_spec, backend="echo"))
    core = WorkerCore(echo, load_tokenizer(tiny_spec))
    log = Log()
    core.add(text_task("r", [5, 6], prompt_logprobs=0))
    run(core, log)
    assert log.end("r").code == "invalid_request" and "EchoEngine" in log.end("r").message


def test_choices_share_the_prefill_of_the_one_that_computes_the_prompt(tiny_engine, tiny_spec):
    """The OpenAI door asks a prompt's log probabilities of its first choice only: the
    others wait for its prefill and fork it, and continue as they would have."""
    core = WorkerCore(tiny_engine, load_tokenizer(tiny_spec), max_step_tokens=16)
    prompt = RNG.integers(3, tiny_engine.vocab_size, 40).tolist()
    group = dict(group="g", group_size=2)
    first = dataclasses.replace(text_task("c0", prompt, prompt_logprobs=1, temperature=0.8, seed=3), **group)
    second = dataclasses.replace(text_task("c1", prompt, temperature=0.8, seed=4), **group)
    log = Log()
    core.add(first)
    core.add(second)
    shared = 0
    while core.has_work():
        shared += log.feed(core.step()).shared_prefills
    log.check("c0")
    log.check("c1")
    assert shared == 1 and len(log.prompt("c0")) == 40 and log.prompt("c1") == []
    alone = collect(WorkerCore(tiny_engine, load_tokenizer(tiny_spec)),
                    [dataclasses.replace(text_task("solo", prompt, temperature=0.8, seed=4))])
    assert [t.text for t in log.tokens("c1")] == [t.text for t in alone.tokens("solo")]


def test_a_takeover_that_replays_tokens_sends_no_prompt_again(tiny_engine, tiny_spec):
    """A worker that takes a request over and continues from the tokens in its log: the
    prompt's log probabilities were sent before those tokens, so none are sent again."""
    prompt = RNG.integers(3, tiny_engine.vocab_size, 12).tolist()
    first = int(np.argmax(scored(tiny_engine, "s", prompt, [12])[-1]))  # what it generated (greedy)
    tiny_engine.release("s")
    core = WorkerCore(tiny_engine, load_tokenizer(tiny_spec))
    log = Log()
    core.add(text_task("b", prompt, prompt_logprobs=1), replay=[first])
    run(core, log)
    assert log.prompt("b") == [] and log.tokens("b")[0].index == 1 and isinstance(log.end("b"), DoneEvent)


# -- the wire and the gateway's stream ---------------------------------------------------------


def pev(start: int, n: int) -> PromptEvent:
    return PromptEvent("r", start, [{"id": start + j, "token": f"p{start + j}", "logprob": -1.0, "top": []}
                                    for j in range(n)])


def test_a_prompt_event_crosses_the_wire_as_it_is():
    ev = PromptEvent("r", 0, [{"id": 5, "token": "a"}, {"id": 6, "token": "b", "logprob": -0.5,
                                                       "top": [{"id": 6, "token": "b", "logprob": -0.5}]}])
    assert decode_events(encode_events([ev, TokenEvent("r", 0, "x")])) == [ev, TokenEvent("r", 0, "x")]
    plain = Task("r", "m", "normal", "c", "x", [1], SamplingParams(), 1.0)
    assert b"prompt_logprobs" not in plain.encode()  # left off the wire when not asked
    asked = dataclasses.replace(plain, params=SamplingParams(prompt_logprobs=2))
    assert Task.decode(asked.encode()) == asked and Task.decode(plain.encode()) == plain


def stream(log=None, positions: int = 10, **kw) -> RequestStream:
    async def reader(after: bytes, block_ms):
        return list(log or [])

    return RequestStream("r", "c", prompt_tokens=positions, deadline=time.time() + 60, log_reader=reader,
                         prompt_positions=positions, **kw)


async def drain(s: RequestStream) -> list:
    return [ev async for ev in s]


async def test_the_prompts_events_come_first_once_each_in_order():
    s = stream()
    s.feed(pev(0, 4))
    s.feed(TokenEvent("r", 0, "t0"))  # early (the worker sent it after the prompt; pub/sub lost some)
    s.feed(pev(7, 3))
    s.feed(pev(0, 4))  # a redelivered task computes the prompt again
    s.feed(pev(2, 5))  # another worker's chunks: only positions 4-6 are new
    s.feed(TokenEvent("r", 1, "t1"))
    s.feed(DoneEvent("r", "length", 10, 2))
    evs = await drain(s)
    assert [(e.start, len(e.logprobs)) for e in evs if isinstance(e, PromptEvent)] == [(0, 4), (4, 3), (7, 3)]
    assert [e["id"] for e in evs if isinstance(e, PromptEvent) for e in e.logprobs] == list(range(10))
    assert [type(e).__name__ for e in evs][-3:] == ["TokenEvent", "TokenEvent", "DoneEvent"]


async def test_a_lost_prompt_event_is_read_from_the_log_and_an_end_waits_for_it():
    s = stream([(b"1-0", pev(0, 6)), (b"2-0", pev(6, 4)), (b"3-0", DoneEvent("r", "length", 10, 0))])
    s.feed(pev(6, 4))  # the first was lost
    s.feed(DoneEvent("r", "length", 10, 0))  # max_tokens 0: the end after the prompt's
    evs = await drain(s)
    assert [(e.start, len(e.logprobs)) for e in evs[:-1]] == [(0, 6), (6, 4)] and s.gaps_repaired == 1
    assert isinstance(evs[-1], DoneEvent)


async def test_a_cancel_mid_prompt_ends_the_stream_and_a_resume_drops_prompt_events():
    s = stream()
    s.feed(pev(0, 3))
    s.feed(DoneEvent("r", "cancelled", 10, 0))
    evs = await drain(s)
    assert isinstance(evs[0], PromptEvent) and evs[-1].finish_reason == "cancelled"
    resumed = stream(positions=0, resumed=False)
    resumed.feed(pev(0, 3))
    resumed.feed(TokenEvent("r", 0, "t"))
    resumed.feed(DoneEvent("r", "length", 10, 1))
    assert [type(e).__name__ for e in await drain(resumed)] == ["TokenEvent", "DoneEvent"]


# -- the OpenAI door: what an echo shows ----------------------------------------------------


@pytest.fixture(scope="module")
def validator(tiny_spec):
    return Validator(GatewaySettings(), ModelRepository(tiny_spec.path.parent))


def test_echo_of_a_text_prompt_is_the_text_and_its_tokens_offsets(tiny_spec):
    tok = load_tokenizer(tiny_spec)
    text = "Once upon a  time, 你好 world"
    shown, ids, offsets = echo_of(tok, text, None)
    assert shown == text and ids == tok.backend_tokenizer.encode(text).ids
    assert len(offsets) == len(ids) and offsets == sorted(offsets) and offsets[0] == 0
    assert [text[o] for o in offsets[:3]] == ["O", " ", " "]
    shown2, ids2, offsets2 = echo_of(tok, "", tuple(ids))  # token ids: decoded
    assert (shown2, ids2, offsets2) == (text, ids, offsets)


def test_the_validator_reads_echo(validator):
    p = request_payload({"prompt": "Once upon", "logprobs": 2, "max_tokens": 0, "echo": True}, chat=False)
    assert "echo" not in p  # the door's own
    draft = validator.check(p, echo=True)
    assert draft.echo and draft.params.max_tokens == 0
    assert (draft.params.logprobs, draft.params.prompt_logprobs) == (2, 2)
    req = validator.finish(draft)
    assert req.echo_text == "Once upon" and len(req.echo_offsets) == len(req.prompt_ids)
    bare = validator.finish(validator.check({"id": "x", "prompt": "Once upon"}, echo=True))
    assert bare.params.prompt_logprobs is None and bare.echo_text == "Once upon"
    assert validator.finish(validator.check({"id": "x", "prompt": "Once"})).echo_text is None
    with pytest.raises(ValidationError) as e:  # max_tokens 0 without echo: as before
        validator.check({"id": "x", "prompt": "Once", "max_tokens": 0})
    assert (e.value.code, e.value.param) == (ErrorCode.out_of_range, "max_tokens")
    with pytest.raises(ValidationError) as e:
        validator.check({"id": "x", "messages": [{"role": "user", "content": "hi"}]}, echo=True)
    assert e.value.param == "echo"
    for bad in ("yes", 1, [True]):
        with pytest.raises(ValidationError) as e:
            completion_echo({"echo": bad})
        assert (e.value.code, e.value.param) == (ErrorCode.invalid_type, "echo")
    assert completion_echo({"echo": None}) is False and completion_echo({}) is False


@pytest.mark.parametrize("backend", ["tensorrt", "echo"])
def test_a_model_whose_engine_cannot_is_refused_by_name(tiny_spec, tmp_path, backend):
    folder = tmp_path / "other"
    folder.mkdir()
    for f in tiny_spec.path.iterdir():
        if f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    toml = (folder / "engine.toml").read_text().replace('name = "tiny-gpt"', 'name = "other"')
    (folder / "engine.toml").write_text(toml.replace('backend = "onnxruntime"', f'backend = "{backend}"')
                                        if 'backend =' in toml else f'backend = "{backend}"\n' + toml)
    v = Validator(GatewaySettings(), ModelRepository(tmp_path))
    with pytest.raises(ValidationError) as e:
        v.check({"id": "x", "model": "other", "prompt": "hi", "logprobs": True}, echo=True)
    assert (e.value.code, e.value.param) == (ErrorCode.invalid_request, "echo")
    assert f"the {backend} engine" in e.value.message and "'other'" in e.value.message
    assert v.check({"id": "x", "model": "other", "prompt": "hi"}, echo=True).echo  # without logprobs: served


def test_a_completion_shows_its_prompt_first():
    shape = ResponseShape(False, "abc", "tiny-gpt", created=1)
    echo = Echo("Hi there", [0, 2, 3], True)
    got = Gathered()
    got.add(PromptEvent("r", 0, [{"id": 1, "token": "p0"}]))  # the first: nothing predicts it
    got.add(PromptEvent("r", 1, [{"id": 2, "token": " ", "logprob": -2.0, "top": []},
                                 {"id": 3, "token": "there", "logprob": -1.0,
                                  "top": [{"id": 4, "token": "you", "logprob": -0.5}]}]))
    got.add(TokenEvent("r", 0, "!", {"id": 9, "token": "!", "bytes": [33], "logprob": -0.1, "top": []}))
    text, tokens = got.echoed(echo)
    choice = shape.choice_full(0, text, DoneEvent("r", "length", 3, 1), tokens)
    assert choice["text"] == "Hi there!"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["p0", " ", "there", "!"] and lp["text_offset"] == [0, 2, 3, 8]
    assert lp["token_logprobs"] == [None, -2.0, -1.0, -0.1]
    assert lp["top_logprobs"] == [None, {" ": -2.0}, {"you": -0.5, "there": -1.0}, {"!": -0.1}]
    with pytest.raises(StreamfleetError) as e:  # never misaligned
        Gathered().echoed(echo)
    assert e.value.code == ErrorCode.internal
    # streamed: the prompt's text in pieces as its events come, then the completion's
    stream_ = ChoiceStream(shape, 0, False, echo)
    chunks = [*stream_.opening(), *stream_.prompt(PromptEvent("r", 0, got.prompt[:1])),
              *stream_.prompt(PromptEvent("r", 1, got.prompt[1:])), *stream_.token(got_token()),
              *stream_.end(DoneEvent("r", "length", 3, 1))]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hi there!"
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks[:3]] == [[0], [2, 3], [8]]
    plain = ChoiceStream(shape, 0, False, Echo("Hi there", [0, 2, 3], False))
    assert [c["choices"][0]["text"] for c in plain.opening()] == ["Hi there"] and plain.prompt_done


def got_token() -> TokenEvent:
    return TokenEvent("r", 0, "!", {"id": 9, "token": "!", "bytes": [33], "logprob": -0.1, "top": []})
