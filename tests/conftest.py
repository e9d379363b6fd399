"""Fixtures shared by unit and integration tests."""

from __future__ import annotations

import pytest

from streamfleet.shared.modelrepo import ModelRepository, ModelSpec, ensure_artifacts


@pytest.fixture(scope="session")
def tiny_spec() -> ModelSpec:
    """``engines/tiny-gpt``, its model.onnx and tokenizer.json generated on first use."""
    spec = ModelRepository().get("tiny-gpt")
    ensure_artifacts(spec)
    return spec
