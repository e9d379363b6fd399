"""The adapters, one per protocol (docs/architecture.md, "Module map"): each translates its
wire to the services and back. No door imports another door
(tests/unit/test_import_graph.py)."""
