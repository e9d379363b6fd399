"""The wire shapes of each door without I/O (docs/architecture.md, "Module map"): frames
in, payloads and rendered events out."""
