"""Generated from proto/streamfleet/v1/inference.proto by `python -m scripts.gen_proto`; do not edit."""
