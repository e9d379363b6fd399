"""What a client meets before it is admitted (docs/architecture.md, "Module map"): the
bounded edge before auth, allowed origins, bounded HTTP bodies and forms, the HTTP error
answer."""
