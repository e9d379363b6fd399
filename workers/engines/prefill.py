"""How a backend batches the prompts of one prefill call (shared by the ONNX Runtime and
TensorRT backends): sequences of similar length run together, left-padded, so padding
stays a small share of the work."""

from __future__ import annotations

__all__ = ["prefill_groups", "PREFILL_PAD_SHARE", "PREFILL_PAD_ROWS"]

#: a group may waste at most this share of its tokens on padding ...
PREFILL_PAD_SHARE = 0.25
#: ... or this many padding tokens per row, whichever is larger
PREFILL_PAD_ROWS = 16


def prefill_groups(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Indices grouped by similar length, longest first in each group; a group's
    rows x longest length stays within ``token_budget`` (one prompt always fits)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    group: list[int] = []
    real = 0
    for i in order:
        if group:
            rows, width = len(group) + 1, lengths[group[0]]
            pad = rows * width - (real + lengths[i])
            if rows * width <= token_budget and pad <= max(PREFILL_PAD_SHARE * (real + lengths[i]),
                                                         PREFILL_PAD_ROWS * rows):
                group.append(i)
                real += lengths[i]
                continue
            groups.append(group)
        group, real = [i], lengths[i]
    if group:
        groups.append(group)
    return groups
