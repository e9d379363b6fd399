"""What a step costs this worker, learned from the steps it runs, and how much of a prompt
fits in a step's time target (docs/scheduling.md, "A step budget in time").

Pure arithmetic: no I/O and no clock. The core describes each step it ran
(``StepShape``) and how long it took; ``StepCosts`` keeps a fit of

    seconds ≈ call·calls + token·tokens + pair·pairs + seq·decodes + kpos·context

where ``calls`` are the engine calls the step made (its decodes are one, its prompts'
chunks another), ``tokens`` the prompt tokens it fed, ``pairs`` the attention pairs
those tokens form (a chunk of n tokens from position p attends to n·p + n(n+1)/2
earlier positions; in thousands), ``decodes`` the sequences decoded, and ``context``
the positions of cache the step's sequences read (each decode's length, each chunk's
start; in thousands). On a CPU a later chunk costs more per token (``pair``), and any
chunk more the more cache it reads (``kpos``; the figures are in docs/scheduling.md). What a
call and the cache cost is also what a decode step costs, so the frequent decode-only
steps pin down a chunk's overhead, and the chunks what their tokens cost. Each core (one
model version on one engine, in one execution mode) keeps its own.

The fit is least squares over the steps, each weighted ``FORGET`` times less than the
next (about the last ``1 / (1 - FORGET)`` steps count), so it follows the machine as
its load changes. A cost the recent steps say nothing about (no prompt fed for a while)
keeps its last value rather than decaying to nothing: each solve is pulled, lightly,
toward the previous one. No cost is negative.

A step takes at most twice the prompt tokens of the last step that fed any (``PROBE``
before the first), so a guess is never far from what was measured: a fresh worker, and
each new prompt after a long one's last small chunks, work their way up while the fit
learns the costs where they now are. And a step plans for a little less than its
target: by how far off the recent predictions were (``margin``), so that noise and a fit
that lags a prompt's growing cost still leave it within the target.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["StepShape", "StepCosts", "FORGET", "PROBE"]

#: the weight of a step relative to the next one's (about the last 30 steps count)
FORGET = 0.97
#: the most tokens of a step's prompts before any step with a prompt was timed
PROBE = 32
#: how strongly a solve is held to the previous one, in steps of typical size: only
#: what the recent steps leave open keeps its old value
_HOLD = 0.1
#: typical size of each term (``StepShape.vector``), for ``_HOLD``
_SCALE = np.array([1.5, 64.0, 128.0, 4.0, 4.0])
#: the weight of the latest step in ``StepCosts.margin``, and the most it may be
_ERROR_WEIGHT = 0.1
_MAX_MARGIN = 0.25
#: a step that needs the costs solves them (``theta``); others solve every this many steps
_SOLVE_EVERY = 16
_N = 5
_NAMES = ("call_ms", "token_ms", "token_kpos_ms", "seq_ms", "kpos_ms")


def pairs(position: int, n: int) -> float:
    """Attention pairs, in thousands, of ``n`` prompt tokens fed from ``position``."""
    return (n * position + n * (n + 1) / 2) / 1000.0


@dataclass(slots=True)
class StepShape:
    """What a step put through the engine.

    Attributes:
        chunks: prompts fed (a whole prompt, on an engine that takes no chunks), in one
            engine call.
        tokens: their tokens.
        pairs: attention pairs those tokens formed, in thousands (``pairs``).
        decodes: sequences decoded, in another call.
        context: positions of cache the step's sequences read, in thousands.
    """

    chunks: int = 0
    tokens: int = 0
    pairs: float = 0.0
    decodes: int = 0
    context: float = 0.0

    def chunk(self, position: int, n: int) -> None:
        """``n`` prompt tokens fed from ``position``."""
        self.chunks += 1
        self.tokens += n
        self.pairs += pairs(position, n)
        self.context += position / 1000.0

    def decode(self, length: int) -> None:
        """A sequence of ``length`` positions decoded one token."""
        self.decodes += 1
        self.context += length / 1000.0

    def vector(self) -> np.ndarray:
        calls = (self.chunks > 0) + (self.decodes > 0)
        return np.array([calls, self.tokens, self.pairs, self.decodes, self.context], dtype=float)


@dataclass
class StepCosts:
    """The learned fit, and the chunk that fits a time.

    Args:
        forget: the weight of a step relative to the next one's.
    """

    forget: float = FORGET
    #: steps timed
    steps: int = 0
    #: the prompt tokens of the last step timed that fed any
    recent: int = 0
    #: how far off the predicted time of the recent steps that fed prompts was, as a share
    #: of their time (root mean square, weighted ``1 - _ERROR_WEIGHT`` less a step back;
    #: at most ``_MAX_MARGIN``): a step plans to that much less than its target, so its
    #: noise and the fit's lag leave it within the target
    margin: float = 0.0
    _err2: float = 0.0
    _s: np.ndarray = field(default_factory=lambda: np.zeros((_N, _N)))
    _r: np.ndarray = field(default_factory=lambda: np.zeros(_N))
    _theta: np.ndarray = field(default_factory=lambda: np.zeros(_N))
    _stale: bool = False

    def observe(self, shape: StepShape, seconds: float) -> None:
        """One step of ``shape`` took ``seconds``."""
        if not seconds >= 0.0 or not seconds < 3600.0:  # (a clock that jumped, or NaN)
            return
        x = shape.vector()
        if shape.tokens and seconds > 0:
            miss = (seconds - float(self.theta @ x)) / seconds
            self._err2 += _ERROR_WEIGHT * (miss * miss - self._err2)
            self.margin = min(_MAX_MARGIN, self._err2 ** 0.5)
        self._s *= self.forget
        self._s += np.outer(x, x)
        self._r *= self.forget
        self._r += x * seconds
        self.steps += 1
        if shape.tokens:
            self.recent = shape.tokens
        self._stale = True
        if self.steps % _SOLVE_EVERY == 0:  # (``describe`` reads the last solve, from another thread)
            _ = self.theta

    @property
    def theta(self) -> np.ndarray:
        """The costs, in seconds per unit of each ``StepShape.vector`` term."""
        if self._stale:
            self._stale = False
            self._theta = self._solve()
        return self._theta

    def _solve(self) -> np.ndarray:
        hold = _HOLD * _SCALE ** 2
        a = self._s + np.diag(hold)
        b = self._r + hold * self._theta
        free = np.ones(_N, dtype=bool)
        theta = np.zeros(_N)
        for _ in range(_N):  # least squares with no negative cost: drop a term that goes below 0, solve again
            idx = np.flatnonzero(free)
            try:
                sol = np.linalg.solve(a[np.ix_(idx, idx)], b[idx])
            except np.linalg.LinAlgError:
                return self._theta
            theta = np.zeros(_N)
            theta[idx] = sol
            if (sol >= 0).all():
                break
            free[idx[sol < 0]] = False
        return np.maximum(theta, 0.0)

    def predict(self, shape: StepShape) -> float:
        """Seconds a step of ``shape`` is expected to take."""
        return float(self.theta @ shape.vector())

    def most_tokens(self) -> int:
        """The most prompt tokens a step may take: twice those of the last step timed
        that fed any (``PROBE`` before any)."""
        return max(PROBE, 2 * self.recent)

    def overhead(self, position: int, call: bool = True) -> float:
        """Seconds feeding a chunk from ``position`` adds to a step whatever its size: the
        cache it reads, and the engine call when it is the step's first chunk."""
        t = self.theta
        return float(t[0] * call + t[4] * position / 1000.0)

    def chunk_cost(self, position: int, n: int, call: bool = True) -> float:
        """Seconds ``n`` prompt tokens fed from ``position`` add to a step (``call``: the
        step's first chunk, whose engine call it pays)."""
        if n <= 0:
            return 0.0
        t = self.theta
        return self.overhead(position, call) + float(t[1] * n + t[2] * pairs(position, n))

    def fit(self, position: int, most: int, seconds: float, call: bool = True) -> int:
        """The most tokens, up to ``most``, that fed from ``position`` add no more than
        ``seconds`` to a step (0: not even one)."""
        if most <= 0 or self.chunk_cost(position, 1, call) > seconds:
            return 0
        if self.chunk_cost(position, most, call) <= seconds:
            return most
        _, tok, pair, _, _ = self.theta
        # overhead + tok·n + pair·(n·p + n(n+1)/2)/1000 <= seconds, for n
        qa = pair / 2000.0
        qb = tok + pair * (position + 0.5) / 1000.0
        qc = self.overhead(position, call) - seconds
        if qa > 0:
            n = (-qb + (qb * qb - 4 * qa * qc) ** 0.5) / (2 * qa)
        else:
            n = -qc / qb if qb > 0 else most
        n = max(0, min(most, int(n)))
        while n > 0 and self.chunk_cost(position, n, call) > seconds:  # (rounding)
            n -= 1
        return n

    def describe(self) -> dict[str, float]:
        """The costs in milliseconds, for the heartbeat (``shared.schema.Heartbeat.step_costs``):
        ``call_ms`` an engine call (a step's decodes are one, its prompts' chunks another),
        ``token_ms`` a prompt token, ``token_kpos_ms`` a prompt token per 1,000 positions
        before it, ``seq_ms`` a sequence decoded, ``kpos_ms`` per 1,000 positions of cache
        a sequence reads; and ``steps`` timed. They are the last solve's (one every
        ``_SOLVE_EVERY`` steps at least), so another thread than the one that steps may
        read them."""
        out = {name: round(float(v) * 1000.0, 4) for name, v in zip(_NAMES, self._theta)}
        out["steps"] = float(self.steps)
        return out
