"""WorkerCore over a small deterministic in-memory engine, for unit tests
(tests/unit/test_core.py, tests/unit/test_logits.py).

The toy model continues every sequence by copying its prompt cyclically (greedy
output of prompt "abc" is "abcabc..."), with seeded noise in the logits so sampled
output varies; a prompt containing EOS therefore ends at that point. Token ids are
bytes (0..255) plus EOS (256) and PAD (257), decoded like a byte-level BPE.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from streamfleet.shared.modelrepo import ModelSpec
from streamfleet.shared.schema import DoneEvent, ErrorEvent, PromptEvent, SamplingParams, StartedEvent, Task, TokenEvent
from streamfleet.workers.core import StepOutput, WorkerCore
from streamfleet.workers.engines.base import Engine, SequenceError

EOS, PAD = 256, 257
VOCAB = 258


class ByteTokenizer:
    """decode() of a byte-level tokenizer: invalid UTF-8 becomes U+FFFD."""

    def decode(self, ids, skip_special_tokens=False):
        data = bytearray()
        for i in ids:
            if i < 256:
                data.append(i)
            elif not skip_special_tokens:
                data += b"<eos>" if i == EOS else b"<pad>"
        return data.decode("utf-8", errors="replace")

    @staticmethod
    def encode(text: str) -> list[int]:
        return list(text.encode("utf-8"))


class ContractViolation(BaseException):
    """Raised by the toy engine when the core misuses it (not caught by the core)."""


class ToyEngine:
    def __init__(self, *, max_batch: int = 8, max_context: int = 64, noise: float = 1.0) -> None:
        self.spec = ModelSpec(
            name="toy", path=Path("/nonexistent"), backend="toy",
            max_batch=max_batch, max_context=max_context, eos_token_ids=(EOS,),
        )
        self.max_batch = max_batch
        self.max_context = max_context
        self.vocab_size = VOCAB
        self.noise = noise
        self.seqs: dict[str, tuple[int, list[int]]] = {}  # id -> (prompt_len, tokens)
        self.calls: list[tuple[str, list[str]]] = []
        self.fail_ids: set[str] = set()  # SequenceError for these
        self.crash: Exception | None = None  # raised once by the next call
        self.bad_shape = False

    def _row(self, plen: int, tokens: list[int]) -> np.ndarray:
        pos = len(tokens)
        target = tokens[(pos - plen) % plen]
        rng = np.random.default_rng([tokens[-1], pos])
        row = (rng.standard_normal(VOCAB) * self.noise).astype(np.float32)
        row[target] += 8.0
        return row

    def _check_fail(self, ids: list[str]) -> None:
        if self.crash is not None:
            exc, self.crash = self.crash, None
            raise exc
        failed = [i for i in ids if i in self.fail_ids]
        if failed:
            for i in failed:
                self.seqs.pop(i, None)
            raise SequenceError("toy failure", failed)

    def _out(self, rows: list[np.ndarray]) -> np.ndarray:
        out = np.stack(rows) if rows else np.zeros((0, VOCAB), np.float32)
        return out[:-1] if self.bad_shape else out

    def prefill(self, seqs):
        ids = [s for s, _ in seqs]
        self.calls.append(("prefill", ids))
        if len(seqs) + len(self.seqs) > self.max_batch:
            raise ContractViolation("more sequences than max_batch")
        for sid, prompt in seqs:
            if sid in self.seqs or not prompt or len(prompt) > self.max_context:
                raise ContractViolation(f"bad prefill of {sid}")
        self._check_fail(ids)
        rows = []
        for sid, prompt in seqs:
            self.seqs[sid] = (len(prompt), list(prompt))
            rows.append(self._row(len(prompt), self.seqs[sid][1]))
        return self._out(rows)

    def decode(self, seqs):
        ids = [s for s, _ in seqs]
        self.calls.append(("decode", ids))
        for sid, tok in seqs:
            if sid not in self.seqs:
                raise ContractViolation(f"decode of unknown {sid}")
            if len(self.seqs[sid][1]) + 1 > self.max_context:
                raise ContractViolation(f"{sid} past max_context")
            if not 0 <= tok < VOCAB or tok == EOS:
                raise ContractViolation(f"{sid} fed token {tok}")
        self._check_fail(ids)
        rows = []
        for sid, tok in seqs:
            plen, tokens = self.seqs[sid]
            tokens.append(tok)
            rows.append(self._row(plen, tokens))
        return self._out(rows)

    def release(self, seq_id):
        self.seqs.pop(seq_id, None)

    def close(self):
        self.seqs.clear()


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class TimedToyEngine(ToyEngine):
    """The toy model taking prompts in chunks (``start``/``extend``), each call moving a
    fake ``Clock`` on by what it would cost on a CPU like the one docs/scheduling.md
    measures (SmolLM2-135M on two cores), times ``slow``, each call within ``jitter`` of
    that (seeded): a call's overhead (``call_ms``; a machine whose cores other processes
    take makes each call's threads wait for each other), then per prompt fed a cost per
    token that grows with the positions before it, and per sequence a cost for the cache
    it reads."""

    def __init__(self, clock: Clock, *, slow: float = 1.0, jitter: float = 0.1, seed: int = 0,
                 call_ms: float = 5.0, **kw) -> None:
        super().__init__(**kw)
        self.clock = clock
        self.call_ms = call_ms
        self.slow = slow
        self.jitter = jitter
        self.rng = np.random.default_rng(seed)
        self.extended: list[list[tuple[int, int]]] = []  # each extend call's (position, tokens)

    def _spend(self, ms: float) -> None:
        self.clock.t += ms * self.slow * (1.0 + self.jitter * self.rng.uniform(-1.0, 1.0)) / 1000.0

    def start(self, seqs, *, from_cache: bool = True):
        for sid, prompt in seqs:
            if sid in self.seqs or not prompt or len(prompt) > self.max_context:
                raise ContractViolation(f"bad start of {sid}")
            self.seqs[sid] = (len(prompt), [])
        return [0] * len(seqs)

    def extend(self, seqs):
        ids = [s for s, _ in seqs]
        self.calls.append(("extend", ids))
        self._check_fail(ids)
        ms, rows, call = self.call_ms, [], []
        for sid, chunk in seqs:
            plen, tokens = self.seqs[sid]
            if not chunk or len(tokens) + len(chunk) > plen:
                raise ContractViolation(f"bad extend of {sid}")
            p, n = len(tokens), len(chunk)
            call.append((p, n))
            ms += 0.72 * n + 0.21e-3 * (n * p + n * (n + 1) / 2) + 4.6e-3 * p
            tokens.extend(chunk)
            rows.append(self._row(plen, tokens) if len(tokens) == plen else np.zeros(VOCAB, np.float32))
        self.extended.append(call)
        self._spend(ms)
        return self._out(rows)

    def decode(self, seqs):
        out = super().decode(seqs)
        self._spend(self.call_ms - 1.0 + sum(3.0 + 2.4e-3 * len(self.seqs[sid][1]) for sid, _ in seqs))
        return out


def task(rid: str, prompt, *, max_tokens=16, stop=(), temperature=0.0, seed=0, created_at=1000.0,
         deadline=None, reply_to="c1", logprobs=None, prompt_logprobs=None):
    ids = ByteTokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=list(stop), seed=seed,
                            logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    return Task(rid, "toy", "normal", reply_to, rid, ids, params, created_at, deadline)


def make_core(max_batch=None, clock=None, **engine_kw):
    engine = ToyEngine(**engine_kw)
    core = WorkerCore(engine, ByteTokenizer(), max_batch=max_batch, clock=clock or Clock())
    assert isinstance(engine, Engine)
    return core, engine


class Log:
    """Collects step outputs and checks the stream invariants per request."""

    def __init__(self) -> None:
        self.events: dict[str, list] = defaultdict(list)
        self.finished: list[str] = []

    def feed(self, out: StepOutput) -> StepOutput:
        ended = []
        for reply_to, ev in out.events:
            assert isinstance(reply_to, str)
            self.events[ev.request_id].append(ev)
            if isinstance(ev, (DoneEvent, ErrorEvent)):
                ended.append(ev.request_id)
        assert sorted(ended) == sorted(out.finished)
        self.finished += out.finished
        return out

    def tokens(self, rid):
        return [e for e in self.events[rid] if isinstance(e, TokenEvent)]

    def prompt(self, rid) -> list[dict]:
        """The prompt's log probability entries (``PromptEvent``s), in position order."""
        return [entry for e in self.events[rid] if isinstance(e, PromptEvent) for entry in e.logprobs]

    def text(self, rid):
        return "".join(e.text for e in self.tokens(rid))

    def end(self, rid):
        return self.events[rid][-1]

    def check(self, rid):
        evs = self.events[rid]
        assert evs, rid
        # a prompt's log probabilities first, covering positions 0, 1, ... in order
        prompt = [e for e in evs if isinstance(e, PromptEvent)]
        assert evs[:len(prompt)] == prompt, evs
        at = 0
        for e in prompt:
            assert e.start == at and e.logprobs, evs
            at += len(e.logprobs)
        evs = evs[len(prompt):]
        # the worker's word that it took the request, before any token (none once it spoke)
        started = [e for e in evs if isinstance(e, StartedEvent)]
        assert evs[:len(started)] == started, evs
        evs = evs[len(started):]
        *toks, last = evs
        assert all(isinstance(e, TokenEvent) for e in toks), evs
        assert [e.index for e in toks] == list(range(len(toks))), evs
        assert isinstance(last, (DoneEvent, ErrorEvent))
        if isinstance(last, DoneEvent):
            assert last.completion_tokens == len(toks)
        assert self.finished.count(rid) == 1


def run(core, log, max_steps=500):
    for _ in range(max_steps):
        if not core.has_work():
            return
        log.feed(core.step())
    raise AssertionError("core did not finish")
