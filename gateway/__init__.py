"""The edge: ASGI app, WebSocket protocol adapter, validation, and the pub/sub fan-in
that routes worker events to client connections."""
