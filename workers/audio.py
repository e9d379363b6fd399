"""The speech worker's audio input: one blocking read over the audio streams of every
utterance it is transcribing (``sf:audio:{request_id}``), handed to the cores as it
arrives (docs/voice.md, "The worker").

Each utterance's stream is read from its first entry, so a worker that takes an
utterance over from a dead one decodes the whole retained audio again.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from redis.typing import KeyT, StreamIdT

from streamfleet.shared.logging import get_logger
from streamfleet.shared.redis import read_streams
from streamfleet.shared.schema import AudioChunk
from streamfleet.workers.context import Part, WorkerContext
from streamfleet.workers.coreset import CoreSet

__all__ = ["AudioFeed", "READ_BLOCK_MS"]

log = get_logger("worker.audio")

#: the longest a read waits for audio while no utterance has any to decode (a new task or
#: a cancel waits at most this long too)
READ_BLOCK_MS = 50
#: entries per stream per read
READ_COUNT = 200


@runtime_checkable
class Listener(Protocol):
    """What the audio reader needs of a core: a speech model's
    ``workers.speechcore.SpeechCore``."""

    def listening(self) -> list[str]: ...

    def ready(self) -> bool: ...

    def feed(self, request_id: str, pcm: list[bytes], ended: bool) -> None: ...


class AudioFeed(Part):
    """Reads the audio of the utterances the cores are listening to."""

    def __init__(self, ctx: WorkerContext, cores: CoreSet) -> None:
        super().__init__(ctx)
        self.cores = cores
        #: request id -> the id of the last entry read from its audio stream
        self.cursors: dict[str, bytes] = {}

    async def read(self) -> None:
        """Read what has arrived for every utterance still listening; wait up to
        ``READ_BLOCK_MS`` for it only when no core has anything else to do."""
        cores = self._listeners()
        listening: dict[str, Listener] = {}
        for core in cores:
            for rid in core.listening():
                listening[rid] = core
        for rid in [r for r in self.cursors if r not in listening]:
            del self.cursors[rid]
        if not listening:
            return
        ready = any(core.ready() for core in cores)
        rids = {self.keys.audio(rid, self.model).encode(): rid for rid in listening}
        streams: dict[KeyT, StreamIdT] = {key: self.cursors.get(rid, b"0-0") for key, rid in rids.items()}
        reply = await self.redis.xread(streams, count=READ_COUNT, block=None if ready else READ_BLOCK_MS)
        for key, entries in read_streams(reply):
            rid = rids[key]
            core = listening[rid]
            if not entries:
                continue
            pcm: list[bytes] = []
            ended = False
            for entry_id, fields in entries:
                self.cursors[rid] = entry_id
                try:
                    chunk = AudioChunk.decode(fields or {})
                except ValueError as exc:
                    log.warning("malformed audio entry skipped", request_id=rid, error=str(exc))
                    continue
                if chunk.end:
                    ended = True
                    break
                pcm.append(chunk.pcm)
            core.feed(rid, pcm, ended)

    def _listeners(self) -> list[Listener]:
        """The cores (a speech worker's: each a ``Listener``)."""
        out: list[Listener] = []
        for vc in self.cores.all():
            if not isinstance(vc.core, Listener):
                raise TypeError(f"the audio reader reads for speech cores, not {type(vc.core).__name__}")
            out.append(vc.core)
        return out
