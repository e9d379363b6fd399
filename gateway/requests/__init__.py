"""A request's life after admission, whatever its door (docs/architecture.md, "A
request's path"): ``ClientRequest``, the gateway's side of Redis, the reply channels and
the exactly-once stream of events."""
