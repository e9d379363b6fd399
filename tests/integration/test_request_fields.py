"""The worked example of adding a field to a request (docs/architecture.md, "Adding a field
to a request"), through real doors and a real worker: ``include_stop_str_in_output``
keeps the stop string that ends a completion at its end."""

from __future__ import annotations

import httpx

from tests.support.wsclient import Client

PROMPT = "Once upon a time"


def _stop_in(text: str) -> tuple[str, int]:
    """A stop string from the middle of ``text`` (two characters, not whitespace) and where
    it first starts."""
    for i in range(len(text) // 3, len(text) - 2):
        s = text[i:i + 2]
        if s.strip() == s:
            return s, text.index(s)
    raise AssertionError(f"no stop string in {text!r}")


async def test_a_stop_string_stays_in_the_output_when_asked(fleet):
    gw = fleet.gateway()
    fleet.worker()
    body = {"model": "tiny-gpt", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "seed": 1,
            "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as http:
        ref = (await http.post(gw.http + "/v1/completions", json=body)).json()["choices"][0]["text"]
        stop, at = _stop_in(ref)
        cut = (await http.post(gw.http + "/v1/completions", json={**body, "stop": [stop]})).json()["choices"][0]
        kept = (await http.post(gw.http + "/v1/completions",
                                json={**body, "stop": [stop], "include_stop_str_in_output": True})).json()
        bad = await http.post(gw.http + "/v1/completions", json={**body, "include_stop_str_in_output": "yes"})
    assert cut["text"] == ref[:at] and cut["finish_reason"] == "stop"
    assert kept["choices"][0]["text"] == ref[:at + len(stop)] and kept["choices"][0]["finish_reason"] == "stop"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "include_stop_str_in_output"

    c = await Client.connect(gw.ws)
    try:
        res = await c.generate("k", PROMPT, max_tokens=24, temperature=0, seed=1, ignore_eos=True, stop=[stop],
                               include_stop_str_in_output=True)
    finally:
        await c.close()
    assert res.text == ref[:at + len(stop)] and res.end["finish_reason"] == "stop"
