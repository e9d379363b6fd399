"""The shapes of OpenAI's ``POST /v1/audio/transcriptions`` without I/O (docs/openai.md,
"Audio transcriptions"): the form fields checked into ``TranscriptionForm``, and a
transcript (its utterances, each a ``Segment`` with its times in the file) rendered as
``json``, ``text``, ``verbose_json``, ``srt`` or ``vtt``, or as the events of a streamed
transcription (``transcript.text.delta``, ``transcript.text.done``).

A segment is one utterance the voice activity segmenter found in the file
(``gateway/services/vad.py``): its times are the utterance's span, exact to the detector's frame
(32 ms for Silero). The engine gives no token ids, log probabilities or no-speech
probabilities: ``verbose_json`` segments leave those fields out rather than make them up,
and ``word`` timestamps are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson

from streamfleet.shared.errors import ErrorCode, ValidationError

__all__ = ["RESPONSE_FORMATS", "Segment", "TranscriptionForm", "check_form", "full_text", "render",
           "delta_event", "done_event", "srt", "vtt", "timestamp"]

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
#: OpenAI's fields that ask for what this engine does not do, refused when they ask for
#: anything (their empty or default value is accepted)
_ASKING_FIELDS = ("include", "known_speaker_names", "known_speaker_references", "keywords", "languages")
#: language names of ``verbose_json`` (OpenAI writes the language's English name)
_LANGUAGE_NAMES = {"en": "english", "de": "german", "fr": "french", "es": "spanish", "it": "italian",
                   "nl": "dutch", "pt": "portuguese", "ru": "russian", "zh": "chinese", "ja": "japanese"}


@dataclass(frozen=True, slots=True)
class Segment:
    """One utterance of the file and its transcript."""

    id: int
    start_ms: int
    end_ms: int
    text: str


@dataclass(frozen=True, slots=True)
class TranscriptionForm:
    """The form fields of one transcription, checked (the file apart)."""

    model: str | None
    language: str | None
    response_format: str
    stream: bool
    priority: str | None


def _one(fields: dict[str, list[str]], name: str) -> str | None:
    values = fields.get(name)
    if not values:
        return None
    if len(values) > 1:
        raise ValidationError(f"'{name}' was sent {len(values)} times; send it once", code=ErrorCode.invalid_request,
                              param=name)
    return values[0]


def _list(fields: dict[str, list[str]], name: str) -> list[str]:
    """A list field, as the SDK sends it (``name[]`` repeated) or plainly (``name``)."""
    return [v for key in (f"{name}[]", name) for v in fields.get(key, ()) if v != ""]


def check_form(fields: dict[str, list[str]]) -> TranscriptionForm:
    """Every rule on the non-file fields that costs nothing (the model and language are
    checked against the model repository by the door).

    Raises:
        ValidationError: a field this server cannot honour, named in ``param``.
    """
    model = _one(fields, "model")
    response_format = _one(fields, "response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        shown = response_format if len(response_format) <= 32 else response_format[:32] + "…"
        raise ValidationError(f"'response_format' must be one of {', '.join(RESPONSE_FORMATS)}, not {shown!r}",
                              code=ErrorCode.out_of_range, param="response_format")
    raw_stream = (_one(fields, "stream") or "false").strip().lower()
    if raw_stream not in ("true", "false", "1", "0"):
        raise ValidationError("'stream' must be true or false", code=ErrorCode.invalid_type, param="stream")
    stream = raw_stream in ("true", "1")
    if stream and response_format not in ("json", "text"):
        raise ValidationError(f"a streamed transcription is a stream of transcript.text events: 'response_format' "
                              f"{response_format!r} cannot be streamed (send json or text, or leave out 'stream')",
                              code=ErrorCode.invalid_request, param="response_format")
    temperature = _one(fields, "temperature")
    if temperature not in (None, ""):
        try:
            t = float(temperature)
        except ValueError:
            raise ValidationError("'temperature' must be a number", code=ErrorCode.invalid_type,
                                  param="temperature") from None
        if t != 0.0:
            raise ValidationError(f"'temperature' {temperature} is not supported: the speech engine decodes "
                                  f"deterministically (no sampling); send 0 or leave it out",
                                  code=ErrorCode.out_of_range, param="temperature")
    if _one(fields, "prompt"):
        raise ValidationError("'prompt' is not supported by this speech engine (it cannot be steered by text); "
                              "leave it out", code=ErrorCode.invalid_request, param="prompt")
    granularities = _list(fields, "timestamp_granularities")
    for g in granularities:
        if g == "word":
            raise ValidationError("'timestamp_granularities' 'word' is not supported: the speech engine gives "
                                  "segment times only; send 'segment' or leave it out", code=ErrorCode.invalid_request,
                                  param="timestamp_granularities")
        if g != "segment":
            raise ValidationError(f"'timestamp_granularities' must hold 'segment', not {g[:32]!r}",
                                  code=ErrorCode.out_of_range, param="timestamp_granularities")
    if granularities and response_format != "verbose_json":
        raise ValidationError("'timestamp_granularities' needs 'response_format' verbose_json",
                              code=ErrorCode.invalid_request, param="timestamp_granularities")
    chunking = _one(fields, "chunking_strategy")
    if chunking not in (None, "", "auto") or any(key.startswith("chunking_strategy[") for key in fields):
        raise ValidationError("'chunking_strategy' must be \"auto\" or left out: the file is cut into utterances "
                              "by the server's voice activity detector", code=ErrorCode.invalid_request,
                              param="chunking_strategy")
    for name in _ASKING_FIELDS:
        if _list(fields, name):
            raise ValidationError(f"'{name}' is not supported by streamfleet: leave it out",
                                  code=ErrorCode.invalid_request, param=name)
    language = _one(fields, "language") or None
    return TranscriptionForm(model=model or None, language=language, response_format=response_format, stream=stream,
                             priority=_one(fields, "priority") or None)


# -- rendering --------------------------------------------------------------------------------
def full_text(segments: list[Segment]) -> str:
    """The transcript: the segments' texts, one space apart (empty ones left out)."""
    return " ".join(s.text for s in segments if s.text)


def timestamp(ms: int, separator: str = ",") -> str:
    """``HH:MM:SS,mmm`` (SRT; ``separator`` "." for WebVTT)."""
    h, rest = divmod(max(0, ms), 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, milli = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{separator}{milli:03d}"


def _spoken(segments: list[Segment]) -> list[Segment]:
    return [s for s in segments if s.text]


def srt(segments: list[Segment]) -> str:
    """SubRip: one numbered cue per segment with text, from 1."""
    return "".join(f"{n}\n{timestamp(s.start_ms)} --> {timestamp(s.end_ms)}\n{s.text}\n\n"
                   for n, s in enumerate(_spoken(segments), 1))


def vtt(segments: list[Segment]) -> str:
    """WebVTT: the header, then one cue per segment with text."""
    return "WEBVTT\n\n" + "".join(f"{timestamp(s.start_ms, '.')} --> {timestamp(s.end_ms, '.')}\n{s.text}\n\n"
                                  for s in _spoken(segments))


def _language_name(tag: str) -> str:
    base = tag.lower().replace("_", "-").split("-")[0]
    return _LANGUAGE_NAMES.get(base, tag)


def _usage(duration_s: float) -> dict[str, Any]:
    """OpenAI's usage of a model billed by audio duration: whole seconds, rounded up."""
    return {"type": "duration", "seconds": math.ceil(duration_s)}


def render(response_format: str, segments: list[Segment], *, duration_s: float, language: str) -> tuple[bytes, str]:
    """The body and media type of a finished transcription in ``response_format``."""
    text = full_text(segments)
    if response_format == "json":
        return orjson.dumps({"text": text, "usage": _usage(duration_s)}), "application/json"
    if response_format == "text":
        return (text + "\n").encode(), "text/plain; charset=utf-8"
    if response_format == "srt":
        return srt(segments).encode(), "text/plain; charset=utf-8"
    if response_format == "vtt":
        return vtt(segments).encode(), "text/vtt; charset=utf-8"
    spoken = _spoken(segments)
    return orjson.dumps({
        "task": "transcribe", "language": _language_name(language), "duration": round(duration_s, 3), "text": text,
        # id, seek (the start in centiseconds, as Whisper counts), times in seconds, the
        # text; the engine's decode is deterministic (temperature 0) and gives no token
        # ids or probabilities: those fields are left out, not made up
        "segments": [{"id": n, "seek": s.start_ms // 10, "start": s.start_ms / 1000, "end": s.end_ms / 1000,
                      "text": s.text, "tokens": [], "temperature": 0.0} for n, s in enumerate(spoken)],
        "usage": _usage(duration_s),
    }), "application/json"


def delta_event(segment: Segment, first: bool) -> dict[str, Any]:
    """A streamed transcription's ``transcript.text.delta``: one utterance's final text
    (after a space, but for the first), so that the deltas add up to the done event's text."""
    return {"type": "transcript.text.delta", "delta": segment.text if first else " " + segment.text}


def done_event(segments: list[Segment]) -> dict[str, Any]:
    """A streamed transcription's last event, ``transcript.text.done``, with the whole text."""
    return {"type": "transcript.text.done", "text": full_text(segments)}
