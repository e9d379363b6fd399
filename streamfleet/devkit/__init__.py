"""Tools for benchmarks, checks and tests: test speech and word error rate (``speech``),
greedy decoding drivers (``greedy``), the TensorRT data path emulated on the CPU
(``trt_emulation``) and the structured-outputs benchmark's schema (``structured``).
Installed with the package so that ``scripts/`` and ``tests/`` share one copy; never
imported by the gateway, workers or shared code (``tests/unit/test_import_graph.py``)."""
