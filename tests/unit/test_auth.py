"""API key format and extraction (no Redis)."""

from __future__ import annotations

import pytest

from streamfleet.gateway.admission.auth import extract_key, hash_key, parse_key
from streamfleet.shared.schema import KeyRecord


@pytest.mark.parametrize("header, query, expected", [
    ("Bearer sf-abc", None, "sf-abc"),
    ("bearer sf-abc", None, "sf-abc"),
    ("BEARER   sf-abc  ", None, "sf-abc"),
    ("Bearer sf-abc", "sf-query", "sf-abc"),
    (None, "sf-query", "sf-query"),
    ("", " sf-query ", "sf-query"),
    ("Basic dXNlcjpwYXNz", None, None),
    ("Basic dXNlcjpwYXNz", "sf-query", "sf-query"),
    ("Bearer", None, None),
    ("Bearer   ", None, None),
    (None, "", None),
    (None, None, None),
])
def test_extract_key(header, query, expected):
    assert extract_key(header, query) == expected


def test_parse_key():
    secret = "A" * 30 + "-_"
    assert parse_key(f"sf-0123456789ab-{secret}") == ("0123456789ab", secret)
    for bad in ["", "sf-0123456789ab", f"sf-0123456789AB-{secret}", f"sf-0123456789a-{secret}",
                f"xx-0123456789ab-{secret}", f"sf-0123456789ab-{secret}x", f"sf-0123456789ab-{secret[:-1]}",
                f" sf-0123456789ab-{secret}", f"sf-0123456789ab-{secret[:-1]}="]:
        assert parse_key(bad) is None, bad


def test_record_round_trip_hides_the_hash():
    r = KeyRecord("0123456789ab", "alice", "paid", hash_key("k"), "2024-01-01T00:00:00Z")
    assert KeyRecord.decode(r.encode()) == r
    assert "hash" not in r.public() and hash_key("k") not in repr(r)
    assert len(r.hash) == 64
