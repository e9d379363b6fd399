"""Random WebSocket client frames (hypothesis strategies): JSON shaped like the protocol's
frames with random values, any JSON, any text, any bytes, and deep nesting. Fed to the
connection's protocol in memory (tests/unit/test_protocol.py) and to a live gateway
(tests/integration/test_fuzz.py)."""

from __future__ import annotations

import json

from hypothesis import strategies as st

FIELDS = ["type", "id", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed",
          "priority", "model", "request_id", "from_index", "ignore_eos", "timeout"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20,
)
shaped = st.fixed_dictionaries(
    {"type": st.sampled_from(["generate", "cancel", "ping", "resume", "bogus", "", 5, None])},
    optional={f: json_values | st.sampled_from(["hi", "tiny-gpt", "high", "normal", "x", 1, 0.5, -1])
              for f in FIELDS if f != "type"},
)


def _encode(v) -> str:
    return json.dumps(v, allow_nan=False)


#: one client frame: ``str`` for a text frame, ``bytes`` for a binary one
frames = st.one_of(
    shaped.map(_encode),
    json_values.map(_encode),
    st.text(max_size=200),
    st.binary(max_size=200),
    st.integers(min_value=1, max_value=3000).map(lambda n: "[" * n + "]" * n),
    st.integers(min_value=1, max_value=3000).map(lambda n: '{"a":' * n + "1" + "}" * n),
)

#: frames near the valid ones (known types, a few ids, each field most often within its
#: range, sometimes just past it), so that submits, resumes and cancels are accepted often
#: enough to be checked
_ids = st.sampled_from(["a", "b", "c"])
plausible = st.fixed_dictionaries(
    {"type": st.sampled_from(["generate"] * 4 + ["cancel", "resume"]), "id": _ids,
     "prompt": st.text(min_size=1, max_size=300)},
    optional={
        "max_tokens": st.sampled_from([1, 2, 16, 64, 4096, 0, 1.0, 4097]),
        "temperature": st.sampled_from([0, 0.7, 1.0, 2.0, 2.5, -0.1, "1"]),
        "top_p": st.sampled_from([1.0, 0.9, 0.01, 0, 1.1]),
        "top_k": st.sampled_from([0, 1, 40, -1]),
        "stop": st.sampled_from([None, "\n", ["a", "bc"], [""], ["a"] * 5]),
        "seed": st.integers(min_value=0, max_value=2**63 - 1) | st.sampled_from([-1, 2**64, True]),
        "priority": st.sampled_from(["high", "normal", None, "low"]),
        "model": st.sampled_from(["tiny-gpt", "tiny-gpt", "nope"]),
        "ignore_eos": st.sampled_from([True, False, "yes"]),
        "timeout": st.sampled_from([0.5, 30, 3600, 0, 4000]),
        "request_id": st.text("abcdef0123456789", min_size=1, max_size=70),
        "from_index": st.integers(min_value=-1, max_value=1_000_001),
    },
).map(_encode)
