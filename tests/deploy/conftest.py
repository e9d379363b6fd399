"""Fixtures of the deployment checks: the kustomize base rendered once per module by the
real ``kubectl kustomize`` (tests/support/deploy.py), with a folder for the overlays a
module renders on top of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.deploy import render


@pytest.fixture(scope="module")
def overlays_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("overlays")


@pytest.fixture(scope="module")
def base(overlays_root) -> list[dict]:
    return render(overlays_root)
