"""The token rate limit (a tier's ``tokens_per_minute``, docs/admission.md, "Rate limits")
with a real gateway and worker: a request's prompt tokens are taken before it is queued,
its generated tokens when it ends (into debt), and a key in debt is refused with 429 on
every door until the refill pays it back; a prompt larger than the bucket is a 400."""

from __future__ import annotations

import httpx
import pytest

from tests.support.keys import add_key
from tests.support.wait import until
from tests.support.wsclient import Client

#: 60 tokens a minute (one a second), 40 at once; no request limit
TIERS = '{"tok": {"requests_per_minute": null, "tokens_per_minute": 60, "token_burst": 40, "max_lane": "high"}}'


@pytest.fixture(scope="module")
def limited(module_fleet):
    gw = module_fleet.gateway(auth_enabled="true", tiers=TIERS)
    module_fleet.worker(backend="echo", echo_delay_ms=1)
    return module_fleet, gw


def _tokens(rds, fleet, key: str) -> float | None:
    key_id = key.split("-", 2)[1]  # sf-<key id>-<secret>
    raw = rds.hget(f"{fleet.prefix}:rlt:{key_id}", "tokens")
    return None if raw is None else float(raw)


async def test_generated_tokens_put_the_key_in_debt_and_it_is_refused_until_paid_back(limited, rds):
    fleet, gw = limited
    key = add_key(fleet, "spender", "tok", tiers=TIERS)
    other = add_key(fleet, "bystander", "tok", tiers=TIERS)
    c = await Client.connect(gw.ws + "?api_key=" + key)
    first = await c.generate("a", "hi", max_tokens=60, ignore_eos=True)
    assert first.end["type"] == "done" and first.end["usage"]["completion_tokens"] == 60, first.end
    prompt = first.end["usage"]["prompt_tokens"]
    # the worker charges the 60 generated tokens when the request ends: 40 - prompt - 60 < 0
    until(lambda: (_tokens(rds, fleet, key) or 0) < 0, timeout=10, what="the generated tokens charged")
    assert _tokens(rds, fleet, key) == pytest.approx(40 - prompt - 60, abs=3)  # (a second or two of refill)
    refused = await c.generate("b", "hi", max_tokens=1)
    assert refused.end["type"] == "error" and refused.end["code"] == "rate_limited", refused.end
    assert "token rate limit of 60 tokens/min for tier tok is spent" in refused.end["message"]
    assert refused.end["retry_after_ms"] > 0
    # the OpenAI door says the same: 429 with Retry-After, before anything is queued
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.post(gw.http + "/v1/completions", headers={"authorization": f"Bearer {key}"},
                            json={"model": "tiny-gpt", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
    assert r.json()["error"]["code"] == "rate_limited" and "tokens/min" in r.json()["error"]["message"]
    # another key of the same tier has its own bucket
    d = await Client.connect(gw.ws + "?api_key=" + other)
    ok = await d.generate("c", "hi", max_tokens=2, ignore_eos=True)
    assert ok.end["type"] == "done", ok.end
    await c.close()
    await d.close()


async def test_a_prompt_larger_than_the_bucket_is_refused_by_name_and_one_that_does_not_fit_now_waits(limited, rds):
    fleet, gw = limited
    key = add_key(fleet, "wordy", "tok", tiers=TIERS)
    c = await Client.connect(gw.ws + "?api_key=" + key)
    big = await c.generate("a", "one two three four five six seven eight nine ten " * 6, max_tokens=1)
    assert big.end["type"] == "error" and big.end["code"] == "out_of_range", big.end
    assert "more than the tok tier's token rate limit ever allows at once (40 tokens)" in big.end["message"]
    assert _tokens(rds, fleet, key) is None or _tokens(rds, fleet, key) >= 39  # nothing taken for it
    fits = await c.generate("b", "one two three four five six seven eight nine ten " * 2, max_tokens=1)
    assert fits.end["type"] == "done", fits.end
    after = fits.end["usage"]["prompt_tokens"]
    assert after > 20
    later = await c.generate("c", "one two three four five six seven eight nine ten " * 2, max_tokens=1)
    assert later.end["type"] == "error" and later.end["code"] == "rate_limited", later.end
    assert f"has not the {after} tokens this request needs left" in later.end["message"]
    await c.close()
