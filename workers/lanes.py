"""How a worker shares its free slots between priority lanes.

docs/scheduling.md, "Lanes": when both ``high`` and ``normal`` have backlog, ``normal`` still gets at
least its weight share (20% by default) of the slots a worker admits, so VIP traffic
cannot starve it; when only one lane has work it gets everything.

``LanePolicy`` is smooth weighted round-robin (nginx's upstream algorithm) over
admissions: each lane carries a credit; every admission adds each lane's weight to
its credit and takes the total weight from the lane that was served. The credits
always sum to zero and stay bounded, so over any run in which every lane has backlog
each lane's count is within a slot or two of its exact share — also when only one
slot frees up per round. A lane that comes up short (it returned fewer tasks than
asked) has no backlog: its credit is capped at the lowest credit of the lanes that
still have backlog, so an idle lane cannot hoard credit and later starve the others,
and the refills the busy lanes got meanwhile leave them no debt.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["LanePolicy"]


class LanePolicy:
    """Splits free slots between lanes by weight.

    Use per round: ``split(free)`` says how many tasks to ask of each lane; the caller
    reads them, refills any slots left over from the lanes that had more (in priority
    order), then reports with ``record(admitted, asked)``.

    Args:
        weights: lane name → weight, in priority order (ties go to the earlier lane).
            Weights are relative (normalised here); at least one must be positive.

    Raises:
        ValueError: no lanes, a negative weight, or all weights zero.
    """

    __slots__ = ("_lanes", "_weights", "_credit")

    def __init__(self, weights: Mapping[str, float]) -> None:
        if not weights:
            raise ValueError("LanePolicy needs at least one lane")
        if any(float(w) < 0 for w in weights.values()):
            raise ValueError(f"lane weights must be >= 0, got {dict(weights)}")
        total = float(sum(weights.values()))
        if total <= 0:
            raise ValueError("at least one lane weight must be positive")
        self._lanes: tuple[str, ...] = tuple(weights)
        self._weights: dict[str, float] = {k: float(w) / total for k, w in weights.items()}
        self._credit: dict[str, float] = dict.fromkeys(self._lanes, 0.0)

    @property
    def lanes(self) -> tuple[str, ...]:
        """Lane names in priority order."""
        return self._lanes

    @property
    def weights(self) -> dict[str, float]:
        """Normalised weights (they sum to 1)."""
        return dict(self._weights)

    @property
    def credit(self) -> dict[str, float]:
        """Current credits (for metrics and tests): positive means owed slots."""
        return dict(self._credit)

    def split(self, free: int) -> dict[str, int]:
        """How many tasks to ask of each lane this round; the counts sum to ``free``.

        Does not change state: only ``record`` does.

        Raises:
            ValueError: ``free`` is negative.
        """
        if free < 0:
            raise ValueError(f"free must be >= 0, got {free}")
        credit = dict(self._credit)
        counts = dict.fromkeys(self._lanes, 0)
        for _ in range(free):
            best: str | None = None
            for lane in self._lanes:
                credit[lane] += self._weights[lane]
                if best is None or credit[lane] > credit[best]:
                    best = lane
            assert best is not None  # there is a lane
            credit[best] -= 1.0
            counts[best] += 1
        return counts

    def record(self, admitted: Mapping[str, int], asked: Mapping[str, int]) -> None:
        """Account for one round.

        Args:
            admitted: tasks actually taken from each lane (missing lanes: 0).
            asked: tasks asked of each lane, refills included (missing lanes: 0).
                A lane with ``admitted < asked`` is taken to have no backlog.

        Raises:
            KeyError: a lane this policy does not know.
        """
        for lane in (*admitted, *asked):
            if lane not in self._credit:
                raise KeyError(f"unknown lane {lane!r}")
        n = sum(int(v) for v in admitted.values())
        # Order-independent: n smooth-round-robin steps serving lane l n_l times move
        # each credit by n * w_l - n_l (total weight is 1).
        for lane in self._lanes:
            self._credit[lane] += n * self._weights[lane] - int(admitted.get(lane, 0))
        short = [lane for lane in self._lanes if int(admitted.get(lane, 0)) < int(asked.get(lane, 0))]
        if not short:
            return
        # A short lane got all it had: nothing is owed to it, so it may not stay ahead
        # of any lane that still has backlog. Those lanes' refills were not taken from
        # anyone, so they leave them no debt either.
        busy = [lane for lane in self._lanes if lane not in short]
        if busy:
            floor = min(self._credit[lane] for lane in busy)
            for lane in short:
                self._credit[lane] = min(self._credit[lane], floor)
        else:
            self._credit = dict.fromkeys(self._lanes, 0.0)
        # restore sum == 0; shifting every credit alike changes no decision
        mean = sum(self._credit.values()) / len(self._lanes)
        for lane in self._lanes:
            self._credit[lane] -= mean

    def reset(self) -> None:
        """Forget all history (e.g. after the worker was paused)."""
        self._credit = dict.fromkeys(self._lanes, 0.0)
