"""Every code block of README.md runs as pasted on a fresh install (issue 37, item 7).

A fresh install is the README's first command: `pip install -e .` in the checkout, then
`streamfleet serve` with its defaults (gateway on 127.0.0.1:8000, gRPC on :50051, the
default model, auth off) running in another shell.

Each fenced block in README.md has a marker on the line before it saying what happens to it:

    <!-- snippet: run -->
    <!-- snippet: run; given: speech.wav; expect: every live worker serves version 2 -->
    <!-- snippet: skip: WHY -->

`run`: a ``bash`` block runs with ``bash -e -o pipefail`` (any failing line fails it), a
``python`` block with this venv's python as a script; both in the README's order against
one `streamfleet serve` (so a later block sees what an earlier one did, as a user pasting
them in turn would), in a folder whose ``engines/`` is that fleet's model repository, with
no ``SF_*`` or ``REDIS_URL`` in the environment but ``SF_STATE_DIR`` (where this `serve`
records its Redis, so `status`, `keys` and `reload` find it by themselves, as the README
says) and ``SF_ENGINES_DIR`` (that ``engines/``). Each must exit 0, print something on
stdout, print no traceback, and print every ``expect`` text. ``given: FILE`` names a file
the block takes from the user (a recording of their own); the test makes it. A ``toml``
block is an ``engine.toml`` example: it must load as a model spec and agree with the
demo model's own file. A ``json`` block shows protocol frames: each must parse.

`skip`: not run, for the reason given (an install, a long-running server, a cluster, a
benchmark, files of the user's own). A block with no marker fails the test, so a new
block is either run or skipped on purpose.

The only rewriting of a block's text (``SUBSTITUTIONS``): this test cannot download the
default model, and other tests may hold ports 8000 and 50051, so the fleet serves the demo
model ``tiny-gpt`` on free ports, and
* ``smollm2-135m`` becomes ``tiny-gpt``;
* ``127.0.0.1:8000`` and ``127.0.0.1:50051`` become the fleet's ports;
* ``streamfleet client`` / ``streamfleet transcribe``, which reach 127.0.0.1:8000 (and
  :50051) by default, are given those addresses with ``--url`` (and ``--grpc-target``).
So the hot-reload round trip runs on tiny-gpt: its version 2 is generated from its
``[build]`` table on load (the example's ``weights`` edit, for smollm2-135m's import,
matches no line of tiny-gpt's engine.toml).

A bash block that calls a program this machine lacks (``TOOLS``: curl, grpcurl, …) is
skipped, naming it; so is the block given speech.wav where flite cannot speak one.

Python blocks may import only what `pip install -e .` installs, unless the README says
``pip install PACKAGE`` before them in the same section (checked without a fleet).
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from streamfleet.launcher import free_port
from streamfleet.shared.modelrepo import REPO_ROOT, ModelSpec

README = REPO_ROOT / "README.md"
MODEL = "tiny-gpt"
#: languages a `run` marker can apply to
RUNNABLE = {"bash", "python", "toml", "json"}
#: seconds one block may take
BLOCK_TIMEOUT_S = 180
#: programs a bash block may call that neither the OS image nor this venv may have: a block
#: that calls a missing one is skipped, saying which
TOOLS = ("curl", "wget", "websocat", "wscat", "grpcurl", "redis-cli", "jq", "sox", "docker", "kubectl")

FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(?P<body>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    line: int          # the opening fence's line, 1-based
    lang: str
    text: str          # the body, without the fence's indent
    marker: str | None  # the marker's body, or None
    section: str       # the `## ` heading above it
    before: str        # the README's text from that heading to the fence

    @property
    def id(self) -> str:
        first = next((ln for ln in self.text.splitlines() if ln.strip() and not ln.startswith("#")), "")
        slug = re.sub(r"[^A-Za-z0-9]+", "-", first)[:40].strip("-")
        return f"L{self.line}-{self.lang or 'text'}-{slug}"


@dataclass(frozen=True)
class Plan:
    run: bool
    reason: str = ""
    given: tuple[str, ...] = ()
    expect: tuple[str, ...] = ()


def readme_blocks(text: str) -> list[Block]:
    lines = text.splitlines()
    out, i, section, section_start = [], 0, "", 0
    while i < len(lines):
        if lines[i].startswith("## "):
            section, section_start = lines[i][3:].strip(), i
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, start = m["indent"], i
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        mk = MARKER.match(lines[j]) if j >= 0 else None
        out.append(Block(start + 1, m["lang"], "\n".join(body) + "\n", mk["body"] if mk else None, section,
                         "\n".join(lines[section_start:start])))
        i += 1
    return out


def plan(marker: str) -> Plan:
    """The marker's body as a plan; ValueError when it is not one."""
    if marker.startswith("skip:"):
        reason = marker[len("skip:"):].strip()
        if not reason:
            raise ValueError("a skip needs its reason: <!-- snippet: skip: WHY -->")
        return Plan(False, reason)
    head, *rest = [p.strip() for p in marker.split(";")]
    if head != "run":
        raise ValueError(f"a marker is `run[; given: FILE][; expect: TEXT]` or `skip: WHY`, not {marker!r}")
    given, expect = [], []
    for part in rest:
        key, _, value = part.partition(":")
        if key.strip() not in ("given", "expect") or not value.strip():
            raise ValueError(f"unknown marker part {part!r} (given: FILE, expect: TEXT)")
        (given if key.strip() == "given" else expect).append(value.strip())
    return Plan(True, given=tuple(given), expect=tuple(expect))


BLOCKS = readme_blocks(README.read_text())


def _run_blocks() -> list[Block]:
    out = []
    for b in BLOCKS:
        try:
            if b.marker is not None and plan(b.marker).run:
                out.append(b)
        except ValueError:
            pass  # test_every_block_is_marked says why
    return out


def test_every_block_is_marked():
    """Each block says whether it runs (or why not), and runs only in a language this test runs."""
    problems = []
    for b in BLOCKS:
        if b.marker is None:
            problems.append(f"README.md:{b.line} ({b.lang or 'no language'}): no `<!-- snippet: run -->` or "
                            f"`<!-- snippet: skip: WHY -->` on the line before it")
            continue
        try:
            p = plan(b.marker)
        except ValueError as exc:
            problems.append(f"README.md:{b.line}: {exc}")
            continue
        if p.run and b.lang not in RUNNABLE:
            problems.append(f"README.md:{b.line}: marked run, but its language {b.lang or 'none'!r} is not one "
                            f"this test runs ({', '.join(sorted(RUNNABLE))})")
    assert not problems, "\n".join(problems)


# -- what a plain install has ------------------------------------------------------------


def _installed_by_plain_install() -> set[str]:
    """The distributions `pip install -e .` brings: streamfleet's requirements without
    extras, and theirs, as installed here."""
    env = default_environment()
    seen: set[str] = set()
    todo = ["streamfleet"]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for raw in reqs:
            req = Requirement(raw)
            if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
                todo.append(req.name)
    return seen


def _imported_modules(code: str) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods.add(node.module.split(".")[0])
    return mods


def test_python_blocks_say_what_to_install():
    """A python block that imports a package `pip install -e .` does not bring (the
    `openai` SDK) is preceded, in its section, by `pip install` of it."""
    plain = _installed_by_plain_install()
    owners = md.packages_distributions()
    problems = []
    for b in _run_blocks():
        if b.lang != "python":
            continue
        for mod in sorted(_imported_modules(b.text) - set(sys.stdlib_module_names)):
            dists = {canonicalize_name(d) for d in owners.get(mod, [])}
            if mod == "streamfleet":
                continue
            if not dists:
                problems.append(f"README.md:{b.line}: imports {mod}, which no installed distribution provides")
                continue
            if dists & plain:
                continue
            said = re.findall(r"pip install ([^\n`]*)", b.before)
            named = {canonicalize_name(w) for line in said for w in line.split() if not w.startswith("-")}
            if not dists & named:
                problems.append(f"README.md:{b.line}: imports {mod} ({', '.join(sorted(dists))}), which "
                                f"`pip install -e .` does not install, and the section ({b.section!r}) says no "
                                f"`pip install {sorted(dists)[0]}` before it")
    assert not problems, "\n".join(problems)


# -- blocks that are data ---------------------------------------------------------------


@pytest.mark.parametrize("block", [b for b in _run_blocks() if b.lang in ("toml", "json")], ids=lambda b: b.id)
def test_data_block(block, tiny_spec, tmp_path):
    if block.lang == "toml":
        data = tomllib.loads(block.text)
        own = tomllib.loads((tiny_spec.path / "engine.toml").read_text())
        name = data.get("name")
        assert name == MODEL, f"README.md:{block.line}: the engine.toml example is the demo model's, not {name!r}"
        differ = {k: (v, own.get(k)) for k, v in data.items() if own.get(k) != v}
        assert not differ, f"README.md:{block.line}: the example disagrees with engines/{MODEL}/engine.toml: {differ}"
        folder = tmp_path / MODEL  # and it loads as a model spec
        shutil.copytree(tiny_spec.path, folder, ignore=shutil.ignore_patterns("plans", "versions"))
        (folder / "engine.toml").write_text(block.text)
        assert ModelSpec.from_toml(folder / "engine.toml").name == MODEL
    else:
        text, dec, pos, n = block.text, json.JSONDecoder(), 0, 0
        while True:
            while pos < len(text) and text[pos].isspace():
                pos += 1
            if pos >= len(text):
                break
            try:
                _, pos = dec.raw_decode(text, pos)
            except json.JSONDecodeError as exc:
                pytest.fail(f"README.md:{block.line}: frame {n + 1} is not JSON: {exc}")
            n += 1
        assert n, f"README.md:{block.line}: no frame"


# -- blocks that run against a live `streamfleet serve` ------------------------------------


@dataclass
class Served:
    http_port: int
    grpc_port: int
    home: Path         # the blocks' working folder; its engines/ is the fleet's model repository
    state: Path        # SF_STATE_DIR: where `serve` records its Redis
    log: Path

    def substitute(self, text: str) -> str:
        for old, new in SUBSTITUTIONS:
            text = re.sub(old, new.format(http=self.http_port, grpc=self.grpc_port), text)
        return text

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SF_") and k != "REDIS_URL"}
        env.update(SF_STATE_DIR=str(self.state), SF_ENGINES_DIR=str(self.home / "engines"),
                   PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
                   PYTHONUNBUFFERED="1")
        return env


#: (regex, replacement) applied to a block's text, in order; see the module's docstring
SUBSTITUTIONS = [
    (r"smollm2-135m", MODEL),
    (r"127\.0\.0\.1:8000\b", "127.0.0.1:{http}"),
    (r"127\.0\.0\.1:50051\b", "127.0.0.1:{grpc}"),
    (r"\bstreamfleet client\b", "streamfleet client --url http://127.0.0.1:{http} --grpc-target 127.0.0.1:{grpc}"),
    (r"\bstreamfleet transcribe\b", "streamfleet transcribe --url http://127.0.0.1:{http}"),
]


@pytest.fixture(scope="module")
def served(tiny_spec, tmp_path_factory):
    """`streamfleet serve` as the README's first command leaves it, on the demo model and
    free ports, with the speech worker."""
    tmp = tmp_path_factory.mktemp("readme")
    home = tmp / "home"
    engines = home / "engines"
    shutil.copytree(tiny_spec.path, engines / MODEL, ignore=shutil.ignore_patterns("plans", "versions"))
    shutil.copytree(REPO_ROOT / "engines" / "asr-en", engines / "asr-en")
    s = Served(free_port(), free_port(), home, tmp / "state", tmp / "serve.log")
    env = s.env()
    env.update(REDIS_URL="redis://127.0.0.1:1/0",  # unanswered: serve starts its own Redis
               SF_THREADS="1", SF_CACHE_DIR=str(tmp / "cache"),
               SF_PACKAGE_INDEX=f"http://127.0.0.1:{free_port()}/simple")  # nothing is downloaded
    log = open(s.log, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "streamfleet", "serve", "--model", MODEL,
                             "--port", str(s.http_port), "--grpc-port", str(s.grpc_port), "--metrics-port", "0"],
                            env=env, cwd=home, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "Ctrl-C stops everything." not in s.log.read_text(errors="replace"):
            assert proc.poll() is None, f"serve exited:\n{s.log.read_text(errors='replace')[-4000:]}"
            assert time.monotonic() < deadline, f"serve did not come up:\n{s.log.read_text(errors='replace')[-4000:]}"
            time.sleep(0.2)
        assert httpx.get(f"http://127.0.0.1:{s.http_port}/readyz", timeout=5).status_code == 200
        yield s
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _given(name: str, home: Path) -> None:
    """A file a block takes from the user."""
    if name == "speech.wav":
        from scripts.flite import SENTENCES, flite_missing, silence, speech, write_wav

        if flite_missing():
            pytest.skip(f"README's speech.wav is a recording of the user's own; to make one here: {flite_missing()}")
        write_wav(home / name, silence(300) + speech(SENTENCES[0]) + silence(900))
    else:
        raise AssertionError(f"the test does not know how to make {name!r}: teach _given")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", [b for b in _run_blocks() if b.lang in ("bash", "python")], ids=lambda b: b.id)
def test_block_runs(block, served):
    p = plan(block.marker)
    if block.lang == "bash":
        for tool in TOOLS:
            if re.search(rf"(^|[|;&(`]|\$\()\s*{tool}\b", block.text, re.M) and shutil.which(tool) is None:
                pytest.skip(f"README.md:{block.line} calls {tool}, which is not installed here")
    for name in p.given:
        _given(name, served.home)
    code = served.substitute(block.text)
    if block.lang == "bash":
        cmd = ["bash", "-e", "-o", "pipefail", "-c", code]
    else:
        cmd = [sys.executable, "-c", code]
    try:
        out = subprocess.run(cmd, cwd=served.home, env=served.env(), capture_output=True, text=True,
                             timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"README.md:{block.line} did not finish in {BLOCK_TIMEOUT_S} s:\n{code}\n"
                    f"stdout: {exc.stdout}\nstderr: {exc.stderr}")
    said = f"README.md:{block.line}, run as:\n{code}\nexit {out.returncode}\nstdout:\n{out.stdout[-3000:]}\n" \
           f"stderr:\n{out.stderr[-3000:]}"
    print(said)  # shown with -s, or when the block fails
    assert out.returncode == 0, said
    assert out.stdout.strip(), f"no output on stdout; {said}"
    assert "Traceback (most recent call last)" not in out.stdout + out.stderr, said
    for text in p.expect:
        assert served.substitute(text) in out.stdout, f"expected {text!r} on stdout; {said}"
