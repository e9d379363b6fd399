"""The HTTP answer to a refused request: the OpenAI error body (``StreamfleetError.to_openai``)
with the error's status and, for a refusal a retry may pass, ``Retry-After``. Every HTTP
door answers errors with it (docs/configuration.md, "Admission and limits")."""

from __future__ import annotations

import orjson
from starlette.responses import Response

from streamfleet.shared.errors import StreamfleetError

__all__ = ["openai_error_response"]


def openai_error_response(exc: StreamfleetError) -> Response:
    """``exc`` as an HTTP response: status, OpenAI error body, ``Retry-After`` (whole
    seconds, rounded up) when it carries a retry hint."""
    headers = {}
    if exc.retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, -(-exc.retry_after_ms // 1000)))
    return Response(orjson.dumps(exc.to_openai()), status_code=exc.status, media_type="application/json",
                    headers=headers)
