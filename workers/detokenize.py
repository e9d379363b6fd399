"""Streaming text out of streaming tokens.

``IncrementalDetokenizer`` turns token ids into text one token at a time without ever
emitting broken UTF-8: byte-level BPE (and byte-fallback) tokenizers split one
character over several tokens, and the client must only see whole characters
(docs/websocket.md, "Server → client"). ``StopMatcher`` finds stop strings that span tokens and holds back the text
that might turn out to be the start of one, so a stop string never reaches the client.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamfleet.shared.modelrepo import Tokenizer

__all__ = ["IncrementalDetokenizer", "StopMatcher", "REPLACEMENT_CHAR"]

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Decodes one request's generated tokens incrementally.

    The technique is vLLM's ``prefix_offset``/``read_offset``: decode a short window of
    ids (a few already-emitted tokens as context, then the new ones) and emit what the
    new ids add to the context's text. The context matters for decoders that drop a
    leading space at the start of a string (Metaspace/SentencePiece); it is seeded with
    the prompt's last tokens. Text that ends in U+FFFD is an incomplete character: it
    is held back until a later token completes it. Everything before that trailing run
    of U+FFFD is final and is emitted at once.

    Works with any ``PreTrainedTokenizerFast`` (it only calls ``decode``).

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)``.
        prompt_ids: the request's prompt; its tail is decoding context only.
        skip_special_tokens: drop special tokens from the text (as the final
            ``tokenizer.decode(ids, skip_special_tokens=True)`` would).
    """

    #: prompt tokens kept as decoding context
    CONTEXT_TOKENS = 5
    #: pending tokens after which a tail that still ends in U+FFFD is given up on and
    #: emitted as is (no character takes more than 4 bytes; only byte garbage gets here)
    MAX_PENDING = 32

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # the Rust tokenizer's own decode when the wrapper would add nothing to it (no
        # clean-up of spaces): the wrapper's argument handling runs twice per token
        backend = getattr(tokenizer, "backend_tokenizer", None)
        raw = getattr(backend, "decode", None)
        plain = getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
        self._raw_decode = raw if raw is not None and plain else None
        ctx = [int(i) for i in prompt_ids[-self.CONTEXT_TOKENS :]] if self.CONTEXT_TOKENS else []
        ctx_text = self._decode(ctx)
        if ctx_text.endswith(REPLACEMENT_CHAR):
            # the prompt ends inside a character: its text cannot serve as a stable prefix
            ctx, ctx_text = [], ""
        self._ids: list[int] = ctx  # the window: context ids, then pending ids
        self._read = len(ctx)  # ids[:read] are context, ids[read:] are pending
        self._ctx_len = len(ctx_text)  # chars of decode(ids[:read])
        self._sent = 0  # chars of the pending text already emitted
        self._holding = False  # the last push held back an incomplete character

    @property
    def holding(self) -> bool:
        """Whether text is held back (an incomplete character) that ``flush`` would release."""
        return self._holding

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._raw_decode is not None:
            return self._raw_decode(ids, skip_special_tokens=self._skip)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the text it completes (possibly "")."""
        self._ids.append(int(token_id))
        pending = self._decode(self._ids)[self._ctx_len :]
        overdue = len(self._ids) - self._read > self.MAX_PENDING
        complete = overdue or not pending.endswith(REPLACEMENT_CHAR)
        stable = pending if complete else pending.rstrip(REPLACEMENT_CHAR)
        out = stable[self._sent :]
        self._sent = max(self._sent, len(stable))
        self._holding = not complete
        if complete and (pending or overdue):
            # the pending ids end on a character boundary: they become the next context
            # (ids that decode to nothing, e.g. skipped special tokens, keep the old one)
            del self._ids[: self._read]
            self._read = len(self._ids)
            self._ctx_len = len(self._decode(self._ids))
            self._sent = 0
        return out

    def flush(self) -> str:
        """The text still held back, at the end of generation.

        An incomplete character at the very end comes out as U+FFFD, exactly as
        ``tokenizer.decode`` renders it, so pushes + flush always equal the full decode.
        """
        pending = self._decode(self._ids)[self._ctx_len :]
        out = pending[self._sent :]
        self._holding = False
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._ctx_len = len(self._decode(self._ids))
        self._sent = 0
        return out


class StopMatcher:
    """Cuts a text stream at the first stop string (OpenAI semantics: excluded).

    "First" is the stop string that is complete earliest in the text (of two that end
    at the same place, the longer), so the cut never depends on how the text was
    split into tokens.

    Text that could be the start of a stop string is held back until it is clear
    whether the stop string follows.

    Args:
        stop: the stop strings; empty strings are ignored.
        include: the stop string found stays at the end of the text (vLLM's
            ``include_stop_str_in_output``); otherwise the text ends just before it.
    """

    __slots__ = ("_stops", "_max_hold", "_held", "_hit", "_include")

    def __init__(self, stop: Sequence[str] = (), include: bool = False) -> None:
        self._include = include
        self._stops = tuple(dict.fromkeys(s for s in stop if s))
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self._hit = False

    @property
    def hit(self) -> bool:
        """Whether a stop string has been found (later pushes then return "")."""
        return self._hit

    @property
    def held(self) -> str:
        """The text held back right now."""
        return self._held

    def push(self, text: str) -> tuple[str, bool]:
        """Feed newly generated text.

        Returns:
            ``(safe, hit)``: the text that can go to the client now, and whether a stop
            string was found (``safe`` then ends just before it, or with it: ``include``).
        """
        if self._hit:
            return "", True
        if not self._stops:
            return text, False
        buf = self._held + text
        # The stop string that completes first wins (then the longer one): the same
        # cut whatever the chunking, as if the text arrived one character at a time.
        best: tuple[int, int] | None = None  # (end, start)
        for s in self._stops:
            i = buf.find(s)
            if i != -1 and (best is None or (i + len(s), i) < best):
                best = (i + len(s), i)
        if best is not None:
            self._hit = True
            self._held = ""
            return buf[: best[0] if self._include else best[1]], True
        hold = 0
        for k in range(min(len(buf), self._max_hold), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                hold = k
                break
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """Release the held-back text at the end of generation."""
        out, self._held = self._held, ""
        return "" if self._hit else out
