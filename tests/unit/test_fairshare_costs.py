"""Fair share's pure parts (shared/fairshare.py; its scripts run on a real Redis in
tests/integration/test_fairshare.py): what a request costs its tenant, a tier's share, the
task's fields on the wire, and who the tenant of a request is."""

from __future__ import annotations

import orjson
import pytest

from streamfleet.gateway.admission.auth import Identity
from streamfleet.gateway.admission.gate import Ticket
from streamfleet.gateway.requests.lifecycle import ClientRequest
from streamfleet.shared.errors import FatalError
from streamfleet.shared.fairshare import GENERATED_WEIGHT, MIN_COST, PROMPT_WEIGHT, audio_cost, prompt_cost, token_cost
from streamfleet.shared.keys import Keys
from streamfleet.shared.schema import (
    AudioInput,
    DoneEvent,
    EmbedTask,
    SamplingParams,
    SpeechTask,
    Task,
    decode_events,
    decode_task,
    encode_events,
)
from streamfleet.shared.tiers import AUDIO_TOKENS_PER_S, DEFAULT_TIERS, parse_tiers
from streamfleet.workers.publisher import served


def test_a_request_costs_its_prompt_tokens_and_at_least_one_divided_by_its_share():
    assert prompt_cost(100, 1.0) == 100.0
    assert prompt_cost(100, 2.0) == 50.0
    assert prompt_cost(0, 1.0) == MIN_COST  # an utterance, whose audio is still coming, takes turns too
    assert token_cost(1.0) == GENERATED_WEIGHT == 2.0
    assert token_cost(4.0) == 0.5


def test_a_tier_has_a_share_of_one_unless_set_and_a_bad_share_stops_the_gateway():
    assert all(t.share == 1.0 for t in DEFAULT_TIERS.values())
    assert parse_tiers('{"gold": {"requests_per_minute": null, "share": 3}}')["gold"].share == 3
    for bad in ("0", "-1", "true", '"2"', "1e999"):
        with pytest.raises(FatalError, match="share must be a number > 0"):
            parse_tiers(f'{{"free": {{"share": {bad}}}}}')


def test_a_tier_may_cap_the_tokens_its_keys_have_waiting():
    assert all(t.max_queued_tokens is None for t in DEFAULT_TIERS.values())
    assert parse_tiers('{"free": {"max_queued_tokens": 4096}}')["free"].max_queued_tokens == 4096
    with pytest.raises(FatalError, match="max_queued_tokens must be an integer >= 1 or null"):
        parse_tiers('{"free": {"max_queued_tokens": 0}}')


def _task(**fields: object) -> Task:
    return Task(request_id="r1", model="m", lane="normal", reply_to="c1", client_id="x", prompt_ids=[1, 2],
                params=SamplingParams(), created_at=1.0, **fields)  # type: ignore[arg-type]


def test_a_task_carries_its_tenant_only_when_it_has_one():
    plain = orjson.loads(_task().encode())
    assert "tenant" not in plain and "token_cost" not in plain  # read alike by a worker that predates it
    fair = _task(tenant="key:abc", token_cost=0.5)
    assert decode_task(fair.encode()) == fair


def test_the_fair_keys_of_a_lane_share_its_hash_tag():
    keys = Keys("sf", cluster=True)
    fair = keys.fair("tiny-gpt", "normal")
    lane = keys.lane("tiny-gpt", "normal")
    names = list(fair.script_keys)
    assert all("{tiny-gpt}" in n for n in names) and "{tiny-gpt}" in lane
    assert len(set(names)) == len(names) and not any(n.startswith(lane + ":") for n in names)  # no affinity name


def _request(**kw: object) -> ClientRequest:
    async def nothing(*_a: object) -> None:
        return None

    return ClientRequest("c", admission=None, validator=None, broker=None, check_workers=nothing,  # type: ignore[arg-type]
                         shared_channel=nothing, **kw)  # type: ignore[arg-type]


def test_the_tenant_is_the_key_then_the_connection_then_the_peer():
    ticket = Ticket("rid", "key:k1", "k1")
    keyed = _request(identity=Identity(key_id="k1", name="a", tier=DEFAULT_TIERS["paid"]), peer="10.0.0.1")
    assert keyed.tenant(ticket) == "key:k1"
    assert _request(peer="10.0.0.1").tenant(Ticket("rid", "tok:x")) == "peer:10.0.0.1"
    anonymous = _request()
    assert anonymous.tenant(Ticket("rid", "tok:x")).startswith("conn:")


def test_what_a_request_is_served_at_its_end_generated_tokens_or_seconds_of_audio():
    """``workers.publisher.served``: charged to the tenant's counter (times the task's
    ``token_cost``) and to its key's token rate limit when the request ends."""
    text = Task("r", "m", "normal", "c", "x", [1, 2], SamplingParams(), 1.0)
    speech = SpeechTask("s", "m", "normal", "c", "x", AudioInput(), 1.0)
    embed = EmbedTask("e", "m", "normal", "c", "x", [[1, 2]], 1.0)
    done = DoneEvent("r", "stop", prompt_tokens=2, completion_tokens=7, audio_s=2.5)
    assert served(text, done) == 7.0
    assert served(speech, done) == 2.5 * AUDIO_TOKENS_PER_S == 25.0  # a second of speech is 10 tokens
    assert served(embed, done) == 0.0  # its input tokens were charged when it was taken
    assert served(text, None) == 0.0  # failed: nothing
    assert audio_cost(2.0) == PROMPT_WEIGHT / 2.0  # audio is input, weighted as a prompt


def test_the_charges_travel_on_the_wire_only_when_set():
    text = Task("r", "m", "normal", "c", "x", [1], SamplingParams(), 1.0)
    assert b"token_limit" not in text.encode()
    text.token_limit, text.token_rate, text.token_burst = "k1", 10.0, 600
    assert decode_task(text.encode()) == text
    speech = SpeechTask("s", "m", "normal", "c", "x", AudioInput(), 1.0, tenant="key:k1", token_cost=0.5,
                        token_limit="k1", token_rate=10.0, token_burst=600)
    assert decode_task(speech.encode()) == speech
    plain = DoneEvent("r", "stop", 1, 2)
    assert b"audio_s" not in encode_events([plain])
    timed = DoneEvent("r", "stop", 0, 3, audio_s=1.25)
    assert decode_events(encode_events([plain, timed])) == [plain, timed]
