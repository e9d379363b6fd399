"""Admission's decisions that need no Redis (gateway/admission/gate.py): who owns a request,
the tier's lane and ceilings, the all-or-nothing checks of a request of several choices,
the local "known dry" refusal, resumes with auth off, and revocation watches. Whatever
would touch Redis (the bucket, the stream and connection slots) is left unset here, so
a decision that reached it would fail the test; those paths run against a real Redis in
tests/integration/test_keys_ratelimit.py and test_auth_limits.py."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from streamfleet.gateway.admission.auth import Identity
from streamfleet.gateway.admission.gate import Admission, Ticket, owner_of, token_owner
from streamfleet.gateway.admission.kinds import TextRequest
from streamfleet.shared.errors import AuthError, ErrorCode, RefusedError, ValidationError
from streamfleet.shared.schema import SamplingParams
from streamfleet.shared.settings import GatewaySettings
from streamfleet.shared.tiers import Tier

FREE = Tier("free", requests_per_minute=60, burst=4, max_streams=2, max_lane="normal", max_tokens=100,
            max_timeout_s=30.0)
WHO = Identity(key_id="k1", name="alice", tier=FREE)


def draft(*, lane: str = "normal", max_tokens: int = 64, timeout_s: float = 10.0,
          explicit: frozenset[str] = frozenset()) -> TextRequest:
    return TextRequest(client_id="c", model="m", lane=lane, params=SamplingParams(max_tokens=max_tokens),
                       timeout_s=timeout_s, prompt_text="hi", explicit=explicit)


def admission(auth: bool) -> Admission:
    return Admission(GatewaySettings(auth_enabled=auth), broker=None)  # never started: no Redis


def test_owners_never_hold_the_secret():
    assert owner_of(None) is None and owner_of(WHO) == "key:k1"
    owner = token_owner("s3cret-token")
    assert owner.startswith("tok:") and "s3cret" not in owner and owner == token_owner("s3cret-token")
    assert owner != token_owner("other-token")


def test_a_ticket_carries_its_slot_only_when_it_holds_one():
    assert Ticket("r", "key:k1", "k1", holds_slot=True).slot == "k1"
    assert Ticket("r", "key:k1", "k1", holds_slot=False).slot == ""
    assert Ticket("r", "tok:x").slot == ""


async def test_auth_off_admits_with_a_resume_token_and_no_redis():
    adm = admission(auth=False)
    assert await adm.authenticate("Bearer anything") is None
    t, admitted = await adm.admit(None, draft(), "0123abcd" * 4)
    assert admitted == draft()  # auth off: no ceilings
    assert t.request_id == "0123abcd" * 4 and t.resume_token and t.owner == token_owner(t.resume_token)
    assert not t.holds_slot and t.key_id is None
    other, _ = await adm.admit(None, draft(), "f" * 32)
    assert other.resume_token != t.resume_token  # each request its own secret
    assert await adm.admit_resume(None, t.resume_token) == t.owner
    with pytest.raises(ValidationError) as err:
        await adm.admit_resume(None, None)
    assert err.value.code == ErrorCode.missing_field and err.value.param == "resume_token"
    await adm.charge(None, 16)  # nothing is charged without a key
    assert adm.watch(None, lambda: None) is None


async def test_the_lane_is_refused_before_any_budget_is_touched():
    adm = admission(auth=True)
    with pytest.raises(AuthError) as err:
        await adm.admit(WHO, draft(lane="high"), "r" * 32)
    assert err.value.code == ErrorCode.forbidden and err.value.param == "priority" and "free" in str(err.value)


def test_ceilings_refuse_what_the_client_set_and_lower_the_defaults():
    within = Admission._within_ceilings
    d = draft(max_tokens=64, timeout_s=10.0)
    assert within(FREE, d) is d  # under both ceilings: the same draft
    with pytest.raises(ValidationError) as err:
        within(FREE, draft(max_tokens=500, explicit=frozenset({"max_tokens"})))
    assert err.value.code == ErrorCode.out_of_range and err.value.param == "max_tokens"
    assert "500" in str(err.value) and "free" in str(err.value) and "100" in str(err.value)
    with pytest.raises(ValidationError) as err:
        within(FREE, draft(timeout_s=60.0, explicit=frozenset({"timeout"})))
    assert err.value.param == "timeout"
    lowered = within(FREE, draft(max_tokens=500, timeout_s=60.0))  # the gateway's defaults, not the client's
    assert lowered.params.max_tokens == 100 and lowered.timeout_s == 30.0
    unlimited = Tier("pro", requests_per_minute=None, burst=1, max_streams=None)
    assert within(unlimited, draft(max_tokens=4096, explicit=frozenset({"max_tokens"}))).params.max_tokens == 4096


@pytest.mark.parametrize("choices,why", [(5, "burst"), (3, "streams")])
async def test_a_request_of_more_choices_than_the_tier_could_ever_run_is_refused_whole(choices, why):
    adm = admission(auth=True)
    with pytest.raises(ValidationError) as err:
        await adm.charge(WHO, choices, "best_of")
    assert err.value.code == ErrorCode.out_of_range and err.value.param == "best_of"
    assert f"{choices} choices" in str(err.value) and why in str(err.value)


async def test_a_key_known_dry_is_refused_locally_until_its_next_token():
    adm = admission(auth=True)
    adm.spent(WHO)  # nothing known: no refusal
    now = asyncio.get_running_loop().time()
    adm._spent["k1"] = (now + 2.0, False)
    with pytest.raises(RefusedError) as err:
        adm.spent(WHO)
    assert err.value.code == ErrorCode.rate_limited and 1000 <= err.value.retry_after_ms <= 2000
    adm.spent(Identity(key_id="k2", name="bob", tier=FREE))  # another key is not affected
    adm._spent["k1"] = (now - 0.1, False)
    adm.spent(WHO)  # lapsed: forgotten
    assert "k1" not in adm._spent
    adm._spent["k1"] = (now + 2.0, True)  # dry of tokens (tokens_per_minute): refused naming them
    with pytest.raises(RefusedError) as err:
        adm.spent(Identity(key_id="k1", name="alice", tier=replace(FREE, tokens_per_minute=600)))
    assert err.value.code == ErrorCode.rate_limited and "600 tokens/min for tier free is spent" in err.value.message


async def test_revocation_watches_are_per_key_and_undone():
    adm = admission(auth=True)
    calls = []
    h1 = adm.watch(WHO, lambda: calls.append(1))
    h2 = adm.watch(WHO, lambda: calls.append(2))
    assert h1 != h2 and set(adm._watched["k1"]) == {h1, h2}
    adm.unwatch(WHO, h1)
    assert set(adm._watched["k1"]) == {h2}
    adm.unwatch(WHO, h2)
    assert "k1" not in adm._watched or not adm._watched["k1"]
    adm.unwatch(WHO, None)  # a watch never set: nothing to undo
