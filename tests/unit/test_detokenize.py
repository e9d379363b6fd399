"""IncrementalDetokenizer and StopMatcher, on a real byte-level BPE tokenizer."""

from __future__ import annotations

import functools
import itertools

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from streamfleet.workers.detokenize import REPLACEMENT_CHAR, IncrementalDetokenizer, StopMatcher

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello streamfleet. tokens stream one by one!",
    "你好，世界。今天天气很好，我们去公园散步吧。",
    "机器学习和自然语言处理",
    "emoji time 😀 🎉 👍🏽 👨‍👩‍👧 ❤️ done",
    "Observation: stop here\n\nnext paragraph",
    "naïve café — déjà vu",
]


def _build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=["<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


@pytest.fixture(scope="module")
def tokenizer():
    return _build_tokenizer()


@functools.cache
def _tok():
    # hypothesis tests cannot take function-scoped fixtures; share one instance
    return _build_tokenizer()


def stream(tokenizer, ids, prompt_ids=()):
    d = IncrementalDetokenizer(tokenizer, list(prompt_ids))
    parts = [d.push(i) for i in ids]
    return parts, d.flush()


def decode(tokenizer, ids):
    return tokenizer.decode(list(ids), skip_special_tokens=True)


# -- IncrementalDetokenizer ----------------------------------------------------


@pytest.mark.parametrize(
    "text",
    ["你好，世界。", "机器学习 and 自然语言", "rare: 🦀🐍 and 🎉👍🏽", "👨‍👩‍👧 family", "naïve café", "plain ascii"],
)
def test_round_trip_never_breaks_characters(tokenizer, text):
    ids = tokenizer.encode(text)
    parts, tail = stream(tokenizer, ids)
    assert "".join(parts) == text
    assert tail == ""
    assert not any(REPLACEMENT_CHAR in p for p in parts)


def test_token_ending_inside_character_is_held_back(tokenizer):
    text = "🦀x"  # unseen in training: the crab's 4 bytes are split over tokens
    ids = tokenizer.encode(text)
    assert len(ids) >= 3
    parts, tail = stream(tokenizer, ids)
    assert parts[0] == ""  # first byte(s) of the crab: held
    assert "🦀" in parts and parts[-1] == "x"
    assert tail == ""


def test_flush_renders_incomplete_tail_as_replacement_char(tokenizer):
    ids = tokenizer.encode("ok🦀")
    partial = ids[:-1]  # stop before the crab's last byte
    parts, tail = stream(tokenizer, partial)
    assert "".join(parts) == "ok"
    assert tail == REPLACEMENT_CHAR
    assert "".join(parts) + tail == decode(tokenizer, partial)


def test_special_tokens_are_skipped(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    ids = tokenizer.encode("hi ") + [eos] + tokenizer.encode("你好")
    parts, tail = stream(tokenizer, ids)
    assert "".join(parts) + tail == "hi 你好"


def test_prompt_is_context_only(tokenizer):
    prompt = tokenizer.encode("hello 你")
    gen = tokenizer.encode("好 world")
    parts, tail = stream(tokenizer, gen, prompt)
    assert "".join(parts) + tail == "好 world"


def test_metaspace_tokenizer_keeps_word_spaces_with_context():
    """Decoders that drop a leading space (SentencePiece style) need the previous
    tokens as context; the stream must still read "a b c"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS * 5, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    t = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    prompt = t.encode("the quick")
    gen = t.encode(" brown fox jumps")
    parts, tail = stream(t, gen, prompt)
    full = t.decode(prompt + gen)
    assert "".join(parts) + tail == full[len(t.decode(prompt)) :] == " brown fox jumps"


TEXT = st.lists(
    st.one_of(
        st.sampled_from(list("abc xyz,.!\n")),
        st.sampled_from(list("你好世界机器学习天气")),
        st.sampled_from(["😀", "🎉", "👍🏽", "🦀", "é", "—", "\u200d", "❤️"]),
        st.characters(codec="utf-8", exclude_categories=("Cs",)),
    ),
    max_size=30,
).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(TEXT, TEXT)
def test_property_stream_of_encoded_text_equals_text(prompt, text):
    tok = _tok()
    ids = tok.encode(text)
    parts, tail = stream(tok, ids, tok.encode(prompt))
    assert "".join(parts) + tail == decode(tok, ids) == text
    assert tail == "" or text.endswith(REPLACEMENT_CHAR)  # a real U+FFFD is held like a broken one
    assert not any(REPLACEMENT_CHAR in p for p in parts if REPLACEMENT_CHAR not in text)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 419), max_size=60), st.lists(st.integers(0, 419), max_size=8))
def test_property_any_ids_pushes_plus_flush_equal_decode(ids, prompt):
    """Whatever the ids (byte garbage, specials), the stream adds up to the full decode."""
    tok = _tok()
    vocab = len(tok)
    ids = [i % vocab for i in ids]
    prompt = [i % vocab for i in prompt]
    parts, tail = stream(tok, ids, prompt)
    assert "".join(parts) + tail == decode(tok, ids)


# -- StopMatcher ---------------------------------------------------------------


def run_stop(stops, chunks):
    m = StopMatcher(stops)
    out, hit = [], False
    for c in chunks:
        safe, hit = m.push(c)
        out.append(safe)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    return out, hit


def test_stop_string_spanning_chunks_is_cut_and_excluded():
    out, hit = run_stop(["\n\n"], ["Hel", "lo\n", "\nWorld"])
    assert hit and out == ["Hel", "lo", ""]
    assert "".join(out) == "Hello"


def test_partial_match_that_fails_is_released():
    out, hit = run_stop(["abc"], ["xa", "bd", "e"])
    assert not hit and out == ["x", "abd", "e", ""]


def test_held_text_is_flushed_at_end():
    m = StopMatcher(["Observation:"])
    assert m.push("I think. Obs") == ("I think. ", False)
    assert m.held == "Obs"
    assert m.flush() == "Obs"


def test_first_completed_stop_wins_and_text_after_is_dropped():
    out, hit = run_stop(["world", "lo w"], ["hello world and more"])
    assert hit and out == ["hel"]
    # "b" completes before "abc" does, whatever the chunking
    assert run_stop(["abc", "b"], ["xabc"]) == (["xa"], True)
    assert run_stop(["abc", "b"], ["xa", "bc"]) == (["x", "a"], True)
    # same end: the longer one
    assert run_stop(["bc", "abc"], ["xabc"]) == (["x"], True)
    m = StopMatcher(["x"])
    assert m.push("axb") == ("a", True)
    assert m.push("more") == ("", True)
    assert m.flush() == ""


def test_no_stops_passes_through():
    m = StopMatcher([])
    assert m.push("anything\n\n") == ("anything\n\n", False)
    m = StopMatcher([""])
    assert m.push("a") == ("a", False)


def test_stop_across_tokens_with_real_tokenizer(tokenizer):
    """Chinese stop string spread over several tokens, detokenizer feeding the matcher."""
    ids = tokenizer.encode("今天天气很好，我们去公园")
    d, m = IncrementalDetokenizer(tokenizer, []), StopMatcher(["很好，"])
    out = []
    for i in ids:
        safe, hit = m.push(d.push(i))
        out.append(safe)
        if hit:
            break
    assert hit and "".join(out) == "今天天气"


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet="ab\n你😀", max_size=30),
    st.lists(st.text(alphabet="ab\n你😀", min_size=1, max_size=4), max_size=3),
    st.lists(st.integers(0, 30), max_size=8),
)
def test_property_stop_matcher_equals_cut_at_first_stop(text, stops, cuts):
    pos = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    chunks = [text[a:b] for a, b in itertools.pairwise(pos)]
    out, hit = run_stop(stops, chunks)
    # reference: grow the text one character at a time; cut when a stop first appears
    for end in range(len(text) + 1):
        starts = [end - len(s) for s in stops if text[:end].endswith(s)]
        if starts:
            assert hit and "".join(out) == text[: min(starts)]
            break
    else:
        assert not hit and "".join(out) == text
