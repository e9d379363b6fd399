"""Replies in the prefix cache, in real worker processes (tiny-gpt, blocks of 16 tokens):
a chat's next turn starts from the blocks of the last prompt and the model's reply (the
worker computes those by a prefill while idle: workers/replykeep.py), and the text is the
same as from a worker without the cache: over several turns, after another worker took a
turn over from a dead one, and after a hot reload to a new model version, whose cache
starts empty (docs/scheduling.md, "Prefix cache")."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import orjson
import pytest

from tests.support.ports import free_port
from tests.support.versions import two_versions as two_versions_repo
from tests.support.wait import until_async
from tests.support.wsclient import Client, Result

pytestmark = pytest.mark.slow  # workers started, killed and reloaded for each test

BLOCK = 16
SYSTEM = "Be brief."  # (tiny-gpt's context is 256 tokens)
QUESTIONS = ["Tell me about the cat.", "And then what happened?", "Why did the dog run away?",
             "How does the story end?"]


def reply_tokens(port: int) -> float:
    """The worker's count of reply tokens computed into its prefix cache while idle."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    m = re.search(r'^streamfleet_worker_prefix_cache_reply_tokens_total\{model="tiny-gpt"\} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


async def until(check, what: str, timeout: float = 30.0) -> None:
    await until_async(check, what, timeout=timeout)


def start_chat(c: Client, rid: str, messages: list[dict], **fields) -> asyncio.Future:
    """A greedy ``generate`` frame with ``messages`` (replies of 20 tokens at least: they
    span a block); its future is the ``Result``."""
    c.results[rid] = Result(rid)
    fut = asyncio.get_running_loop().create_future()
    c.waiters[rid] = fut
    frame = {"type": "generate", "id": rid, "messages": messages, "temperature": 0, "min_tokens": 20, **fields}
    c.send_soon(frame)
    return fut


class Chat:
    """One conversation over a WebSocket: each turn sends the earlier turns, the model's
    replies and a new question, greedy."""

    def __init__(self, c: Client, name: str) -> None:
        self.c, self.name = c, name
        self.messages = [{"role": "system", "content": SYSTEM}]
        self.texts: list[str] = []
        #: per turn: (prompt tokens, completion tokens, cached tokens)
        self.usage: list[tuple[int, int, int]] = []

    def start(self, turn: int, **fields) -> asyncio.Future:
        self.messages.append({"role": "user", "content": QUESTIONS[turn]})
        return start_chat(self.c, f"{self.name}-{turn}", list(self.messages), **fields)

    def ended(self, res: Result) -> str:
        assert res.end["type"] == "done", res.end
        u = res.end["usage"]
        self.usage.append((u["prompt_tokens"], u["completion_tokens"], u.get("cached_tokens", 0)))
        self.texts.append(res.text)
        self.messages.append({"role": "assistant", "content": res.text})
        return res.text

    async def turn(self, turn: int, **fields) -> str:
        return self.ended(await asyncio.wait_for(self.start(turn, **fields), 60))

    def kept_after(self, turn: int) -> int:
        """The tokens of the next prompt that the blocks of this turn's prompt and reply
        cover (the reply's text is tokenized again in the next prompt)."""
        prompt, completion, _ = self.usage[turn]
        return (prompt + completion) // BLOCK * BLOCK


async def kept(port: int, before: float, chat: Chat, turn: int, replayed: int = 0) -> float:
    """Wait until the worker computed the blocks of ``chat``'s turn's reply while idle
    (after the prompt's, and those of the ``replayed`` tokens of a takeover, which its
    prefill computed); returns its new count."""
    prompt, completion, _ = chat.usage[turn]
    end = (prompt + completion) // BLOCK * BLOCK
    want = before + max(0, end - (prompt + replayed) // BLOCK * BLOCK)
    # (a reply that ended with EOS holds one token more: its block may be one more)
    await until(lambda: reply_tokens(port) >= want, f"the reply of turn {turn} in the prefix cache")
    return reply_tokens(port)


async def reference(fleet, gw, turns: int, fields: dict[int, dict] | None = None, **settings) -> list[str]:
    """The same conversation on a worker without the cache (``fields``: each turn's
    request fields, default 24 tokens; ``settings``: the worker's)."""
    plain = fleet.worker(prefix_cache_mb=0, max_step_tokens=0, **settings)
    try:
        c = await Client.connect(gw.ws)
        chat = Chat(c, "ref")
        for t in range(turns):
            await chat.turn(t, **(fields or {}).get(t, {"max_tokens": 24}))
        await c.close()
        return chat.texts
    finally:
        plain.terminate()


async def test_a_conversations_replies_are_cached_and_change_nothing(fleet):
    gw = fleet.gateway()
    port = free_port()
    worker = fleet.worker(metrics_port=port, prefix_block_tokens=BLOCK, max_step_tokens=32)
    c = await Client.connect(gw.ws)
    chat = Chat(c, "on")
    count = 0.0
    for t in range(4):
        await chat.turn(t, max_tokens=24)
        count = await kept(port, count, chat, t)
    await c.close()
    for t in range(1, 4):  # each turn starts from the blocks of the last prompt and its reply
        assert chat.usage[t][2] >= chat.kept_after(t - 1) > chat.usage[t - 1][0] // BLOCK * BLOCK, chat.usage
    worker.terminate()
    assert await reference(fleet, gw, 4) == chat.texts


async def test_after_a_takeover_the_text_is_the_same_and_the_reply_is_cached(fleet):
    """Turns 1-2 on worker A; A dies in turn 3's reply; B, started then, takes it over
    (replaying what A generated: its prefill) and serves turn 4 from the blocks of turn 3."""
    gw = fleet.gateway()
    pb = free_port()
    a = fleet.worker(prefix_block_tokens=BLOCK, max_step_tokens=32)
    c = await Client.connect(gw.ws)
    chat = Chat(c, "t")
    for t in range(2):
        await chat.turn(t, max_tokens=20)
    long_turn = {"max_tokens": 70, "min_tokens": 70}  # (no EOS inside: its text would not come back)
    fut = chat.start(2, **long_turn)
    res = c.results["t-2"]
    await until(lambda: len(res.tokens) >= 5 or res.end is not None, "A's first tokens of turn 3")
    a.popen.send_signal(signal.SIGKILL)
    assert len(res.tokens) < 70 and res.end is None, f"A ended turn 3 before it was killed: {res.end}"
    b = fleet.worker(metrics_port=pb, prefix_block_tokens=BLOCK, max_step_tokens=32)
    chat.ended(await asyncio.wait_for(fut, 60))
    assert res.indices == list(range(70))
    log = b.log(tail=None)
    assert "took over the tasks of a dead worker" in log
    replayed = next(e["replay_tokens"] for e in map(orjson.loads, re.findall(r"^\{.*\}$", log, re.MULTILINE))
                    if e.get("event") == "reclaimed a task")
    assert 0 < replayed < 70
    await kept(pb, 0.0, chat, 2, replayed)
    await chat.turn(3, max_tokens=4, min_tokens=0)
    await c.close()
    assert chat.usage[3][2] >= chat.kept_after(2), chat.usage
    b.terminate()
    fields = {0: {"max_tokens": 20}, 1: {"max_tokens": 20}, 2: long_turn, 3: {"max_tokens": 4, "min_tokens": 0}}
    assert await reference(fleet, gw, 4, fields) == chat.texts


@pytest.fixture
def two_versions(tiny_spec, tmp_path):
    """tiny-gpt v1 and a v2 beside it: the same weights, another version (so another
    prefix cache namespace)."""
    return two_versions_repo(Path(tiny_spec.path), tmp_path)


async def test_after_a_hot_reload_the_cache_starts_empty_and_the_text_is_the_same(fleet, two_versions):
    engines = str(two_versions)
    gw = fleet.gateway(engines_dir=engines)
    port = free_port()
    worker = fleet.worker(engines_dir=engines, metrics_port=port, prefix_block_tokens=BLOCK, max_step_tokens=32)
    c = await Client.connect(gw.ws)
    chat = Chat(c, "r")
    count = 0.0
    for t in range(2):
        await chat.turn(t, max_tokens=24)
        count = await kept(port, count, chat, t)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "streamfleet", "reload", "tiny-gpt", "--to", "2", "--timeout", "90",
        env=fleet.env(engines_dir=engines), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    await chat.turn(2, max_tokens=24)
    assert c.results["r-2"].end.get("model_version") == "2"
    assert chat.usage[2][2] == 0  # version 2's cache holds nothing of version 1's
    await kept(port, count, chat, 2)
    await chat.turn(3, max_tokens=24)
    await c.close()
    assert chat.usage[3][2] >= chat.kept_after(2), chat.usage
    worker.terminate()
    # (a worker started now serves version 2: the same weights)
    assert await reference(fleet, gw, 4, engines_dir=engines) == chat.texts
