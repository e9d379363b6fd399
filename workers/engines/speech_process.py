"""Speech decoders in child processes (docs/voice.md, "Decoders in child processes").

PocketSphinx holds the GIL while it decodes. In the worker process every decoding call
would stop the event loop for as long as it runs: a final pass over a 15 s utterance
takes about 3 s, the heartbeat stops, and after ``SF_WORKER_DEAD_AFTER_S`` (1.5 s) the
other workers take the utterance over and decode it again. ``ProcessSpeechEngine``
therefore runs each slot's decoder in a child process of its own: the worker's thread
only writes audio to a pipe and reads text back, which releases the GIL, so the event
loop keeps running, and the slots decode on as many cores as there are.

Each child loads the backend with one slot (its decoder and, for PocketSphinx, its own
final-pass decoder) once, when the worker starts, and serves one utterance at a time
over a ``multiprocessing`` pipe. Calls are pipelined: ``begin``, ``feed`` and ``abort``
are sent without waiting and get no reply (a failure of begin or feed comes back with
the utterance's next ``hypothesis`` or ``finish``, the only calls that answer). Every
call carries the utterance it belongs to, so the child drops what an aborted utterance
still had queued and an error of one utterance never lands on the next. A child that
dies fails its utterance (``engine_error``) and is started again before the slot's next
utterance.
"""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing.connection import Connection
from typing import Any

from streamfleet.shared.errors import FatalError
from streamfleet.shared.logging import get_logger
from streamfleet.shared.modelrepo import ModelSpec
from streamfleet.workers.engines.speech import SpeechDecoder, SpeechEngine, load_backend

__all__ = ["ProcessSpeechEngine", "DecoderProcessDied"]

log = get_logger("worker.speech")

#: how long a child may take to load its model before the worker gives up on it
START_TIMEOUT_S = 120.0


class DecoderProcessDied(RuntimeError):
    """The child process of a decoder slot exited (or its pipe broke) mid-utterance."""


def _child_main(conn: Connection, spec: ModelSpec, options: dict[str, Any]) -> None:
    """A slot's child: load the backend with one decoder, then serve calls until the
    pipe closes (the worker exited: the child goes with it)."""
    try:
        engine = load_backend(spec, **options, slots=1)
        decoder = engine.acquire()
    except BaseException as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    current = 0               # the utterance the parent is on
    failed: str | None = None  # the first failure of its begin/feed calls (they get no reply)
    while True:
        try:
            gen, op, arg = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            break
        if op == "close":
            break
        if op in ("begin", "abort"):
            current, failed = gen, None
            decoder.abort()
        if gen != current:
            continue  # a call of an utterance the parent has left (it skips the replies too)
        if op in ("begin", "feed"):
            if failed is None:
                try:
                    decoder.begin() if op == "begin" else decoder.feed(arg)
                except Exception as exc:
                    failed = f"{type(exc).__name__}: {exc}"
            continue
        if op == "abort":
            continue
        # hypothesis or finish: the only calls that answer, so the pipe back never fills
        try:
            if failed is not None:
                raise RuntimeError(failed)
            reply = (gen, True, decoder.hypothesis() if op == "hypothesis" else decoder.finish())
        except Exception as exc:
            reply = (gen, False, str(exc) if failed is not None else f"{type(exc).__name__}: {exc}")
            if op == "finish":
                decoder.abort()
        try:
            conn.send(reply)
        except (OSError, EOFError):
            break
    engine.close()


class ProcessDecoder(SpeechDecoder):
    """The parent's side of one slot: a child process and the pipe to it."""

    def __init__(self, spec: ModelSpec, options: dict[str, Any], index: int) -> None:
        super().__init__()
        self._spec = spec
        self._options = options
        self._index = index
        self._gen = 0          # the utterance number: the child drops calls of older ones
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._broken = False   # the pipe failed: the child is gone, whatever its process says
        self.restarts = 0

    # -- the child -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the child, without waiting for it to load (``wait_ready``)."""
        ctx = multiprocessing.get_context("spawn")  # never fork a process with threads
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, args=(child, self._spec, self._options), daemon=True,
                                 name=f"speech-decoder-{self._spec.name}-{self._index}")
        self._proc.start()
        child.close()
        self._conn = parent
        self._broken = False

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait for the child to load its model.

        Raises:
            FatalError: it failed to load, exited, or took longer than ``timeout``.
        """
        what = f"speech model {self._spec.name!r}, decoder {self._index}"
        conn = self._conn
        if conn is None:
            raise FatalError(f"{what}: the decoder process was not started")
        try:
            if not conn.poll(timeout):
                raise FatalError(f"{what}: the decoder process did not load in {timeout:g} s")
            status, detail = conn.recv()
        except (EOFError, OSError) as exc:
            raise FatalError(f"{what}: the decoder process exited while loading "
                             f"(exit code {self._proc.exitcode if self._proc else None})") from exc
        if status != "ready":
            raise FatalError(f"{what}: {detail}")

    def _restart(self) -> None:
        self._stop_child(wait_s=1.0)
        self.restarts += 1
        log.warning("speech decoder process restarting", model=self._spec.name, slot=self._index,
                    restarts=self.restarts)
        self.start()
        self.wait_ready()

    def _stop_child(self, wait_s: float) -> None:
        if self._conn is not None:
            try:
                self._conn.send((self._gen, "close", None))
            except (OSError, EOFError):
                pass
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            self._proc.join(wait_s)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5.0)
            self._proc = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # -- calls -----------------------------------------------------------------------------
    # begin, feed and abort get no reply (a failure of begin or feed comes back with the
    # utterance's next hypothesis or finish); only those two answer, and the parent reads
    # each answer before it sends the next, so neither side ever waits on a full pipe
    def _send(self, op: str, arg: bytes | None = None) -> None:
        conn = self._conn
        try:
            if conn is None:  # (stopped: as gone as a broken pipe)
                raise EOFError("no pipe to the decoder process")
            conn.send((self._gen, op, arg))
        except (OSError, EOFError, AttributeError) as exc:
            self._broken = True
            raise DecoderProcessDied(f"speech decoder process {self._index} is gone") from exc

    def _call(self, op: str) -> str | None:
        """Send ``op`` (hypothesis or finish) and return its answer.

        Raises:
            DecoderProcessDied: the child exited.
            RuntimeError: this utterance's begin, feed or this call failed in the child.
        """
        self._send(op)
        conn = self._conn
        try:
            if conn is None:  # (stopped: as gone as a broken pipe)
                raise EOFError("no pipe to the decoder process")
            while True:  # (every answer is read before the next call: only a stray one is skipped)
                gen, ok, value = conn.recv()
                if gen == self._gen:
                    break
        except (EOFError, OSError) as exc:
            self._broken = True
            raise DecoderProcessDied(f"speech decoder process {self._index} exited "
                                     f"(exit code {self._proc.exitcode if self._proc else None})") from exc
        if not ok:
            raise RuntimeError(value)
        return value

    def _begin(self) -> None:
        if self._broken or self._proc is None or not self._proc.is_alive():
            # a child that died in the last utterance: load a new one (in the worker's
            # engine thread, like every call that waits; the event loop goes on)
            self._restart()
        self._gen += 1
        self._send("begin")

    def _feed(self, pcm: bytes) -> None:
        self._send("feed", pcm)

    def _hypothesis(self) -> str:
        return self._call("hypothesis") or ""

    def _finish(self) -> str:
        return self._call("finish") or ""

    def _abort(self) -> None:
        self._gen += 1  # the child drops what the utterance still has queued
        try:
            self._send("abort")
        except DecoderProcessDied:
            pass  # restarted by the next begin

    def _close(self) -> None:
        super()._close()
        self._stop_child(wait_s=5.0)


class ProcessSpeechEngine(SpeechEngine):
    """``slots`` decoders of a backend, each in a child process (see the module docstring).

    Args:
        spec: the speech model; its ``backend`` is what the children load.
        slots: decoders (default: the spec's).
        options: the backend's keyword arguments.

    Raises:
        FatalError: a child could not load the backend.
    """

    concurrent = True

    def __init__(self, spec: ModelSpec, *, slots: int | None = None, **options: Any) -> None:
        n = int(slots if slots is not None else spec.slots)
        if n < 1:
            raise FatalError(f"speech model {spec.name!r}: slots must be at least 1, got {n}")
        decoders = [ProcessDecoder(spec, options, k) for k in range(n)]
        started = time.monotonic()
        try:
            for d in decoders:
                d.start()
            for d in decoders:  # they load in parallel
                d.wait_ready()
        except BaseException:
            for d in decoders:
                d._stop_child(wait_s=1.0)
            raise
        super().__init__(spec, decoders)
        self._children = decoders
        log.info("speech decoder processes ready", model=spec.name, slots=n,
                 pids=[d.pid for d in decoders], load_s=round(time.monotonic() - started, 2))

    @property
    def pids(self) -> list[int | None]:
        return [d.pid for d in self._children]
