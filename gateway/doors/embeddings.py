"""``POST /v1/embeddings``: OpenAI's embeddings API over the lanes (docs/openai.md,
"Embeddings").

The body is read within the door's limit (``SF_MAX_FRAME_BYTES``), then takes the
embeddings request's path every door shares (``gateway/services/embeddings.py``:
``check_body``, ``submit``, ``EmbedCall``).

The response is OpenAI's: ``{"object": "list", "data": [{"object": "embedding", "index",
"embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}``, each embedding a
list of floats, or with ``encoding_format: "base64"`` the float32 values' little-endian
bytes in base64 (what the worker sent, passed on as it is). Errors are OpenAI's body, as
on the other endpoints (``gateway/edge/httperror.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from streamfleet.gateway.edge.httpbody import DISCONNECTED, open_json, until_disconnect
from streamfleet.gateway.edge.httperror import openai_error_response
from streamfleet.gateway.requests.observe import trace_id_from
from streamfleet.gateway.services.embeddings import check_body, submit
from streamfleet.shared.errors import StreamfleetError
from streamfleet.shared.logging import get_logger
from streamfleet.shared.metrics import gateway as metrics
from streamfleet.shared.schema import DoneEvent, EmbeddingEvent

if TYPE_CHECKING:
    from streamfleet.gateway.hub import Hub

__all__ = ["router", "render"]

log = get_logger("gateway.embeddings")
router = APIRouter()


def _float_list(vector: str) -> bytes:
    """A base64 float32 vector as a JSON array of its values (each float32 printed as the
    shortest decimal that reads back as the same float32's double)."""
    values = EmbeddingEvent(request_id="", index=0, vector=vector).values()
    return orjson.dumps(values.astype("float64").tolist())


def render(model: str, vectors: list[str], done: DoneEvent, encoding: str) -> bytes:
    """OpenAI's response body (built by hand: the vectors are written once, as they are)."""
    parts = []
    for i, vector in enumerate(vectors):
        emb = orjson.dumps(vector) if encoding == "base64" else _float_list(vector)
        parts.append(b'{"object":"embedding","index":%d,"embedding":%s}' % (i, emb))
    usage = orjson.dumps({"prompt_tokens": done.prompt_tokens, "total_tokens": done.prompt_tokens})
    return b'{"object":"list","data":[%s],"model":%s,"usage":%s}' % (b",".join(parts), orjson.dumps(model), usage)


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    hub: Hub = request.app.state.hub
    try:
        identity, body = await open_json(request, hub)
        if body is None:
            log.debug("client left mid-body", path=request.url.path)
            return Response(status_code=499)
        checked = check_body(hub, body, request.headers.get("x-priority"))
        call = await submit(hub, "http", identity, checked, trace_id_from(request.headers.get("traceparent")))
    except StreamfleetError as exc:
        metrics.refusals.labels("http", str(exc.code)).inc()
        return openai_error_response(exc)
    try:
        vectors, end = await call.result(lambda consume: until_disconnect(request, consume))
    except StreamfleetError as exc:
        return openai_error_response(exc)
    if end is DISCONNECTED:
        return Response(status_code=499)
    return Response(render(checked.spec.name, vectors, end, checked.encoding), media_type="application/json")
