"""The gateway process (docs/architecture.md, "Module map"): ``doors/`` (one adapter per
protocol) over ``services/`` (what several doors use), ``protocols/`` (each wire's shapes
without I/O), ``admission/`` (keys, limits, the one validation path and the typed
requests), ``requests/`` (a request's life after admission: Redis, reply channels, the
exactly-once stream) and ``edge/`` (what a client meets before it is admitted); the
process itself is ``server.py``, ``app.py``, ``hub.py`` and ``scrape.py``."""
