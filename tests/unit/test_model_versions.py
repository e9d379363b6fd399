"""A model's versions (shared/modelrepo.py): the folder ``versions/N`` is version N."""

from __future__ import annotations

import shutil

import pytest

from streamfleet.shared.errors import NotFoundError
from streamfleet.shared.modelrepo import ModelRepository


@pytest.fixture
def repo(tmp_path, tiny_spec):
    base = tmp_path / "tiny-gpt"
    base.mkdir()
    shutil.copy(tiny_spec.path / "engine.toml", base / "engine.toml")
    return tmp_path


def _version(repo, n: str, line: str | None) -> None:
    folder = repo / "tiny-gpt" / "versions" / n
    folder.mkdir(parents=True)
    text = "\n".join(line for line in (repo / "tiny-gpt" / "engine.toml").read_text().splitlines()
                     if not line.startswith("version"))
    (folder / "engine.toml").write_text((f"{line}\n" if line else "") + text + "\n")


def test_a_version_folder_without_a_version_line_is_its_folders_version(repo):
    _version(repo, "2", None)
    assert ModelRepository(repo).get("tiny-gpt", "2").version == "2"
    assert ModelRepository(repo).versions("tiny-gpt") == ["1", "2"]


def test_a_version_folder_that_says_another_version_is_refused_by_name(repo):
    """(It used to load, report version 1, and have `streamfleet reload --to 2` wait for a
    version no worker would ever report.)"""
    _version(repo, "2", 'version = "1"')
    with pytest.raises(NotFoundError, match=r"versions/2/engine.toml says version = '1' but its folder is version '2'"):
        ModelRepository(repo).get("tiny-gpt", "2")
    _version(repo, "3", 'version = "3"')
    assert ModelRepository(repo).get("tiny-gpt", "3").version == "3"
