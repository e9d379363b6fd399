"""The speech worker's audio input: one blocking read over the audio streams of every
utterance it is transcribing (``sf:audio:{request_id}``), handed to the cores as it
arrives (docs/voice.md, "The worker").

Each utterance's stream is read from its first entry, so a worker that takes an
utterance over from a dead one decodes the whole retained audio again.
"""

from __future__ import annotations

from streamfleet.shared.logging import get_logger
from streamfleet.shared.schema import AudioChunk
from streamfleet.workers.context import Part

__all__ = ["AudioFeed", "READ_BLOCK_MS"]

log = get_logger("worker.audio")

#: the longest a read waits for audio while no utterance has any to decode (a new task or
#: a cancel waits at most this long too)
READ_BLOCK_MS = 50
#: entries per stream per read
READ_COUNT = 200


class AudioFeed(Part):
    """Reads the audio of the utterances the cores are listening to."""

    def __init__(self, ctx, cores) -> None:
        super().__init__(ctx)
        self.cores = cores
        #: request id -> the id of the last entry read from its audio stream
        self.cursors: dict[str, bytes] = {}

    async def read(self) -> None:
        """Read what has arrived for every utterance still listening; wait up to
        ``READ_BLOCK_MS`` for it only when no core has anything else to do."""
        listening: dict[str, object] = {}
        for vc in self.cores.all():
            for rid in vc.core.listening():
                listening[rid] = vc.core
        for rid in [r for r in self.cursors if r not in listening]:
            del self.cursors[rid]
        if not listening:
            return
        ready = any(vc.core.ready() for vc in self.cores.all())
        rids = {self.keys.audio(rid, self.model).encode(): rid for rid in listening}
        streams = {key: self.cursors.get(rid, b"0-0") for key, rid in rids.items()}
        reply = await self.redis.xread(streams, count=READ_COUNT, block=None if ready else READ_BLOCK_MS)
        for key, entries in reply or ():
            rid = rids[key if isinstance(key, bytes) else key.encode()]
            core = listening[rid]
            if not entries:
                continue
            pcm: list[bytes] = []
            ended = False
            for entry_id, fields in entries:
                self.cursors[rid] = entry_id
                try:
                    chunk = AudioChunk.decode(fields)
                except ValueError as exc:
                    log.warning("malformed audio entry skipped", request_id=rid, error=str(exc))
                    continue
                if chunk.end:
                    ended = True
                    break
                pcm.append(chunk.pcm)
            core.feed(rid, pcm, ended)
