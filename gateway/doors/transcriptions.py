"""OpenAI's audio transcription door, ``POST /v1/audio/transcriptions`` (docs/openai.md,
"Audio transcriptions"): an audio file in a multipart form, its transcript out as
``json``, ``text``, ``verbose_json``, ``srt`` or ``vtt``, or streamed as
``transcript.text.delta`` events and a ``transcript.text.done``.

The transcription itself (the file decoded, cut into utterances, each one ``SpeechTask``
through the lanes, the transcript in the file's order) is the service this door and
gRPC's ``Transcribe`` share (``gateway/services/transcription.py``, ``open_transcription``).

What a request costs before it is admitted is bounded, cheapest check first: the key
(before a byte of the body is read), a key known to be out of its rate limit, the
Content-Type, the Content-Length against ``SF_TRANSCRIPTION_MAX_BYTES``; then the body,
read within that limit (``gateway/edge/multipart_form.py``: parts, headers, fields, the
file), the fields, the model, its live workers, one request of the key's rate limit;
only then is the file decoded (its duration first, from its header,
``SF_TRANSCRIPTION_MAX_DURATION_S``) and segmented, in a thread, at most
``DECODES_AT_ONCE`` files per process. Each utterance after the first is admitted, and
charged to the key's rate limit and stream cap, as a voice utterance is.

A client that leaves cancels every utterance still running; an utterance that fails
fails the transcription with its error (the same error, code and status, as the voice
door and the text doors give).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio
import structlog
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from streamfleet.gateway.admission.validation import check_lane
from streamfleet.gateway.edge import guard
from streamfleet.gateway.edge.httpbody import DISCONNECTED, until_disconnect
from streamfleet.gateway.edge.httperror import openai_error_response
from streamfleet.gateway.edge.multipart_form import FormLimits, FormReader, UploadedForm
from streamfleet.gateway.protocols.sse import KEEPALIVE, SSE_HEADERS, sse_frame
from streamfleet.gateway.protocols.transcription_mapping import Segment, check_form, delta_event, done_event, render
from streamfleet.gateway.requests.observe import trace_id_from
from streamfleet.gateway.services.transcription import Transcription, open_transcription
from streamfleet.shared.errors import ErrorCode, StreamfleetError, UnavailableError, ValidationError
from streamfleet.shared.logging import get_logger
from streamfleet.shared.metrics import gateway as metrics

if TYPE_CHECKING:
    from streamfleet.gateway.hub import Hub

__all__ = ["router", "transcriptions"]

log = get_logger("gateway.transcriptions")
router = APIRouter()

#: the form's bytes beyond the file: its other fields, part headers, boundaries
FORM_OVERHEAD_BYTES = 65_536

async def _read_form(request: Request, limits: FormLimits) -> UploadedForm | None:
    """The form of ``request``, read within ``limits`` (the body past the file's limit and
    the form's overhead is refused before it is kept). None when the client left mid-body.

    Raises:
        ValidationError: ``frame_too_large``, or the body is not a valid form.
    """
    reader = FormReader(request.headers.get("content-type"), limits)
    cap = limits.max_file_bytes + FORM_OVERHEAD_BYTES
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise ValidationError(f"the body of {int(declared)} bytes exceeds the limit of {cap} (an audio file of "
                              f"at most {limits.max_file_bytes} bytes, SF_TRANSCRIPTION_MAX_BYTES, and its form)",
                              code=ErrorCode.frame_too_large, param="file")
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise ValidationError(f"the body exceeds the limit of {cap} bytes (an audio file of at most "
                                      f"{limits.max_file_bytes} bytes, SF_TRANSCRIPTION_MAX_BYTES, and its form)",
                                      code=ErrorCode.frame_too_large, param="file")
            if chunk:
                reader.feed(chunk)
    except ClientDisconnect:
        return None
    return reader.finish()


async def transcriptions(request: Request) -> Response:
    hub: Hub = request.app.state.hub
    s = hub.settings
    try:
        if hub.draining:
            raise UnavailableError("this gateway is shutting down; retry", retry_after_ms=0,
                                   code=ErrorCode.shutting_down)
        # who is asking, before a byte of the body is read
        identity = await hub.admission.authenticate(request.headers.get("authorization"))
        if identity is not None:
            structlog.contextvars.bind_contextvars(key_id=identity.key_id)
            guard.authenticated(request.scope)
        hub.admission.spent(identity)  # a key known out of its rate limit: 429 before reading the body
        form_data = await _read_form(request, FormLimits(max_file_bytes=s.transcription_max_bytes))
        if form_data is None:
            log.debug("client left mid-body", path=request.url.path)
            return Response(status_code=499)
        form = check_form(form_data.fields)
        lane = check_lane(form.priority or request.headers.get("x-priority"))
        data, form_data.file = form_data.file, None  # (the upload's bytes go with the decode)
        assert data is not None  # (``FormReader.finish`` refuses a form without a file)
        job, audio, spec = await open_transcription(
            hub, identity, data, model=form.model, language=form.language, lane=lane,
            trace_id=trace_id_from(request.headers.get("traceparent")),
            log_fields={"response_format": form.response_format, "stream": form.stream})
        del data
    except StreamfleetError as exc:
        metrics.refusals.labels("transcription", str(exc.code)).inc()
        return openai_error_response(exc)

    # the first utterance's admission decides the status: a refusal (rate limit, lane
    # full, stream cap) is an HTTP error, not a stream that starts and fails
    try:
        first = await until_disconnect(request, asyncio.shield(job.first_submitted))
    except StreamfleetError as exc:
        await job.close()
        return openai_error_response(exc)
    if first is DISCONNECTED:
        await job.close()
        return Response(status_code=499)
    if form.stream:
        # (``background``: the job is closed even when the client left before the body started)
        return StreamingResponse(_sse(hub, job), media_type="text/event-stream", headers=SSE_HEADERS,
                                 background=BackgroundTask(job.close))
    try:
        result = await until_disconnect(request, _gather(job))
    except StreamfleetError as exc:
        return openai_error_response(exc)
    finally:
        await job.close()
    if result is DISCONNECTED:
        return Response(status_code=499)
    body, media_type = render(form.response_format, result, duration_s=audio.duration_s, language=spec.language)
    return Response(body, media_type=media_type)


async def _gather(job: Transcription) -> list[Segment]:
    return [seg async for seg in job.segments()]


async def _sse(hub: Hub, job: Transcription) -> AsyncIterator[bytes]:
    """A streamed transcription: a ``transcript.text.delta`` per utterance with text, as
    soon as it and every utterance before it are transcribed, then ``transcript.text.done``
    (or the error, in OpenAI's shape); a keepalive comment after ``SF_SSE_KEEPALIVE_S``
    without an event."""
    segments = job.segments()
    got: list[Segment] = []
    pending: asyncio.Future[Segment] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(segments))
            done, _ = await asyncio.wait({pending}, timeout=hub.settings.sse_keepalive_s)
            if not done:
                yield KEEPALIVE
                continue
            fut, pending = pending, None
            try:
                seg = fut.result()
            except StopAsyncIteration:
                break
            except StreamfleetError as exc:
                yield sse_frame(exc.to_openai())
                return
            if seg.text:
                yield sse_frame(delta_event(seg, first=not any(g.text for g in got)))
            got.append(seg)
        yield sse_frame(done_event(got))
    finally:
        with anyio.CancelScope(shield=True):
            if pending is not None and not pending.done():
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
            await segments.aclose()
            await job.close()


@router.post("/v1/audio/transcriptions")
async def transcriptions_route(request: Request) -> Response:
    return await transcriptions(request)
