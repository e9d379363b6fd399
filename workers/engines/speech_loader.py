"""Loading a speech worker's engine (docs/voice.md, "Speech engines"): in this process, or
with each decoder in a child process of its own (``workers/engines/speech_process.py``),
as ``processes`` says. Apart from ``speech.py`` (the interface) and ``speech_process.py``
(the child processes), which both import no loader."""

from __future__ import annotations

from typing import Any

from streamfleet.shared.errors import FatalError
from streamfleet.shared.modelrepo import ModelSpec
from streamfleet.workers.engines.speech import SpeechEngine, load_backend
from streamfleet.workers.engines.speech_process import ProcessSpeechEngine

__all__ = ["load_speech_engine"]


def load_speech_engine(spec: ModelSpec, **options: Any) -> SpeechEngine:
    """Load the speech engine ``spec.backend`` names, with ``options`` (keyword
    arguments of that backend; they override engine.toml's).

    ``processes`` (an option, else engine.toml's, default false) puts each decoder in a
    child process of its own: for backends that hold the GIL while they decode, like
    PocketSphinx.

    Raises:
        FatalError: not a speech model, unknown backend, or the backend cannot start.
    """
    processes = options.pop("processes", spec.options.get("processes", False))
    if not isinstance(processes, bool):
        raise FatalError(f"speech model {spec.name!r}: processes must be true or false, got {processes!r}")
    if processes and spec.kind == "asr":
        return ProcessSpeechEngine(spec, **options)
    return load_backend(spec, **options)
