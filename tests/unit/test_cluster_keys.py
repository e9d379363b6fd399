"""Redis Cluster naming (shared/keys.py, shared/redis.py; docs/cluster.md): what must
share a shard does, every Lua script touches one slot, and the URL forms parse."""

from __future__ import annotations

import re

import pytest
from redis.crc import key_slot

from streamfleet.gateway.admission.ratelimit import STREAM_SLOTS_LUA, TOKEN_BUCKET_LUA
from streamfleet.gateway.admission.voiceslots import VOICE_SLOTS_LUA
from streamfleet.shared.fairshare import ENQUEUE_LUA, FAIR_READ_LUA
from streamfleet.shared.keys import TAG_LEN, Keys, affinity_source, split_source
from streamfleet.shared.redis import RawBatch, RedisTarget, _route_key
from streamfleet.shared.settings import CommonSettings
from streamfleet.workers.affinity import READ_LUA, RETIRE_LUA, STEAL_LUA
from streamfleet.workers.drain import REQUEUE_LUA
from streamfleet.workers.prefixadvert import ADVERTISE_LUA


def slot(key: str) -> int:
    return key_slot(key.encode())


def test_a_connections_requests_share_its_reply_channels_shard() -> None:
    keys = Keys("sf", cluster=True)
    conn = "9f3a" + "0" * 28
    for _ in range(50):
        rid = Keys.new_request_id(conn)
        assert len(rid) == 32 and rid.startswith(conn[:TAG_LEN])
        # everything of the request is found from its id alone (resume on any gateway) ...
        assert {slot(keys.log(rid)), slot(keys.request(rid)), slot(keys.attach(rid))} == {slot(keys.reply(conn))}
    # ... and different connections spread over the slots
    assert len({slot(keys.reply(Keys.new_request_id(f"{i:04x}"))) for i in range(200)}) > 150


def test_a_models_channels_and_audio_live_on_its_lanes_slot() -> None:
    keys = Keys("sf", cluster=True)
    lane = slot(keys.lane("tiny-gpt", "high"))
    assert slot(keys.lane("tiny-gpt", "normal")) == slot(keys.dead("tiny-gpt")) == lane
    assert {slot(keys.wake("tiny-gpt")), slot(keys.cancel("tiny-gpt")), slot(keys.follow("tiny-gpt"))} == {lane}
    assert slot(keys.audio("a" * 32, "tiny-gpt")) == slot(keys.audio("b" * 32, "tiny-gpt")) == lane
    assert {slot(k) for k in keys.voice_slots("tiny-gpt")} == {lane}  # one script touches all three
    assert keys.publish == b"SPUBLISH"


def test_single_server_names_are_unchanged() -> None:
    keys = Keys("sf")
    assert (keys.reply("c1"), keys.log("r1"), keys.request("r1"), keys.attach("r1")) == (
        "sf:reply:c1", "sf:log:r1", "sf:req:r1", "sf:attach:r1")
    assert (keys.cancel("m"), keys.follow("m"), keys.wake("m"), keys.audio("r1", "m")) == (
        "sf:cancel", "sf:follow", "sf:wake:m", "sf:audio:r1")
    assert keys.publish == b"PUBLISH"


def _key_arg(args: list[str]) -> str:
    """The argument of a ``redis.call`` that names its key: after the subcommand of
    XGROUP and XINFO, after STREAMS for XREADGROUP, else the first."""
    if args[0] in ("'XGROUP'", "'XINFO'"):
        return args[2]
    if args[0] == "'XREADGROUP'":
        return args[args.index("'STREAMS'") + 1]
    return args[1]


@pytest.mark.parametrize("script", [ENQUEUE_LUA, TOKEN_BUCKET_LUA, STREAM_SLOTS_LUA, REQUEUE_LUA, VOICE_SLOTS_LUA,
                                    READ_LUA, STEAL_LUA, RETIRE_LUA, ADVERTISE_LUA, FAIR_READ_LUA])
def test_every_lua_script_touches_only_declared_keys(script: str) -> None:
    """A script names no key of its own making: every command's key (or channel) is a
    KEYS[n], so the caller's hash tags decide the slot (checked below for the enqueue)."""
    for call in re.findall(r"redis\.call\(([^)]*)\)", script):
        args = [a.strip() for a in call.split(",")]
        if args[0] == "'TIME'":  # no key
            continue
        assert len(args) >= 2 and _key_arg(args).startswith("KEYS["), call


def test_the_enqueue_scripts_keys_share_a_slot() -> None:
    keys = Keys("sfx", cluster=True)
    for model in ("tiny-gpt", "asr-en", "m{odd}name"):
        for lane in ("high", "normal"):
            assert slot(keys.lane(model, lane)) == slot(keys.wake(model))
            # prefix-aware routing: a worker's affinity stream, the registry and the adverts
            # go with the lane (the enqueue and the workers' scripts touch them together)
            assert slot(keys.affinity(model, lane, "w1")) == slot(keys.affinity_streams(model)) == \
                slot(keys.prefix_advert(model, "w1")) == slot(keys.lane(model, lane))


def test_affinity_sources_name_their_streams() -> None:
    keys = Keys("sf")
    lanes = keys.lanes("m")
    assert dict(lanes) == {"high": "sf:{m}:tasks:high", "normal": "sf:{m}:tasks:normal"}  # only the lanes listed
    assert lanes[affinity_source("normal", "w-1@x")] == keys.affinity("m", "normal", "w-1@x") == \
        "sf:{m}:tasks:normal:@w-1@x"
    assert keys.affinity_source_of("m", keys.affinity("m", "high", "w2")) == "high@w2"
    assert keys.affinity_source_of("m", keys.lane("m", "high")) is None
    assert split_source("normal@w-1@x") == ("normal", "w-1@x") and split_source("high") == ("high", "")
    with pytest.raises(KeyError):
        lanes["bulk@w1"]


def test_a_batch_routes_each_command_by_its_key() -> None:
    b = RawBatch()
    b.add(b"XADD", "sf:log:{ab12}:ab12cd", b"*", b"e", b"x")
    b.add(b"EVALSHA", b"0" * 40, 2, "sf:{m}:tasks:normal", "sf:wake:{m}", b"1")
    b.add(b"EVALSHA", b"0" * 40, 0, b"1")
    b.add(b"XREADGROUP", b"GROUP", "workers", "w1", b"COUNT", 8, b"STREAMS", "sf:{m}:tasks:high", b">")
    assert [_route_key(a) for a in b._args] == ["sf:log:{ab12}:ab12cd", "sf:{m}:tasks:normal", None,
                                              "sf:{m}:tasks:high"]


@pytest.mark.parametrize("url, cluster, seeds", [
    ("redis://127.0.0.1:6379/0", False, [("127.0.0.1", 6379)]),
    ("redis://h1:7000", True, [("h1", 7000)]),
    ("redis://:pw@h1:7000,h2:7001,h3", True, [("h1", 7000), ("h2", 7001), ("h3", 6379)]),
    ("rediss://user:pw@h1:7000,h2:7000/0", True, [("h1", 7000), ("h2", 7000)]),
])
def test_cluster_urls(url: str, cluster: bool, seeds: list) -> None:
    flag = url == "redis://h1:7000"  # one seed needs the setting; several imply it
    t = RedisTarget.parse(url, flag)
    assert t.cluster is cluster and list(t.seeds) == seeds
    if cluster:
        assert t.node_url("10.0.0.9", 7005).split("@")[-1].split("://")[-1].startswith("10.0.0.9:7005")
        assert ("pw@" in t.node_url("x", 1)) == ("pw@" in url)


def test_a_cluster_url_is_refused_where_a_cluster_cannot_go(monkeypatch) -> None:
    with pytest.raises(ValueError, match="only database 0"):
        RedisTarget.parse("redis://h1:7000,h2:7000/3")
    monkeypatch.setenv("SF_REDIS_URL", "redis://h1:7000,h2:7000")
    assert CommonSettings().redis_cluster is True  # a seed list turns it on
    monkeypatch.setenv("SF_REDIS_URL", "redis://h1:7000/2")
    monkeypatch.setenv("SF_REDIS_CLUSTER", "true")
    with pytest.raises(ValueError, match="SF_REDIS_URL"):
        CommonSettings()
