"""Fixtures shared by unit and integration tests."""

from __future__ import annotations

import os
import sys

import pytest

from streamfleet.shared.modelrepo import ModelRepository, ModelSpec, ensure_artifacts
from tests.support import schedule

# The machines CI runs on set PYTHONDONTWRITEBYTECODE=1. Without bytecode, pytest rewrites the
# asserts of every test module again in each -n process, and every gateway, worker and CLI
# process the tests start compiles the package from source again. The test run keeps its
# bytecode (in __pycache__ folders, which git ignores); this process and the ones it starts.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


@pytest.fixture(scope="session")
def tiny_spec() -> ModelSpec:
    """``engines/tiny-gpt``, its model.onnx and tokenizer.json generated on first use."""
    spec = ModelRepository().get("tiny-gpt")
    ensure_artifacts(spec)
    return spec


def pytest_addoption(parser: pytest.Parser) -> None:
    schedule.add_option(parser)


def pytest_configure(config: pytest.Config) -> None:
    schedule.configure(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # the longest modules first, so that with -n none runs alone at the end (tests/support/schedule.py)
    schedule.reorder(items)
