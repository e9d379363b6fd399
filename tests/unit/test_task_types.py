"""A lane holds three kinds of task: text (``Task``), a speech model's utterance
(``SpeechTask``) and an embedding model's inputs (``EmbedTask``), each with its own
fields; ``decode_task`` tells them apart, and each core refuses the other kinds by name
(the embedding core's refusals: tests/unit/test_embedcore.py)."""

from __future__ import annotations

import orjson
import pytest

from streamfleet.shared.schema import AudioInput, EmbedTask, SamplingParams, SpeechTask, Task, decode_task
from tests.support.toy_core import make_core

TEXT = Task("r1", "tiny-gpt", "normal", "conn", "c1", [5, 6, 7], SamplingParams(max_tokens=3), 1000.0,
            deadline=1060.0, slot="k1", group="r1", group_size=2)
SPEECH = SpeechTask("r2", "asr-en", "high", "conn", "u0", AudioInput(sample_rate=8000, utterance=3, start_ms=1200),
                    1000.0, deadline=1030.0, trace_id="t", slot="k1")

EMBED = EmbedTask("r4", "tiny-embed", "normal", "conn", "e0", [[2, 7, 3], [2, 3]], 1000.0, deadline=1030.0,
                  trace_id="t", slot="k1")


def test_each_kind_round_trips_as_itself():
    assert decode_task(TEXT.encode()) == TEXT and Task.decode(TEXT.encode()) == TEXT
    assert decode_task(SPEECH.encode()) == SPEECH
    assert decode_task(EMBED.encode()) == EMBED


def test_an_embed_task_carries_its_inputs_and_no_prompt():
    wire = orjson.loads(EMBED.encode())
    assert wire["kind"] == "embed" and not {"prompt_ids", "params", "audio", "group"} & wire.keys()
    assert EMBED.prompt_tokens == 5
    with pytest.raises(ValueError, match="a embed task where a text task was expected"):
        Task.decode(EMBED.encode())


def test_a_text_task_on_the_wire_has_no_kind_and_no_audio_and_a_speech_task_no_prompt():
    text, speech = orjson.loads(TEXT.encode()), orjson.loads(SPEECH.encode())
    assert "kind" not in text and "audio" not in text  # what every gateway and worker has always read
    assert speech["kind"] == "speech" and not {"prompt_ids", "params", "group", "group_size"} & speech.keys()
    assert (TEXT.prompt_tokens, SPEECH.prompt_tokens) == (3, 0)


def test_a_speech_task_in_the_older_shape_is_read_as_speech():
    """Before the speech type, an utterance rode on the text task: empty prompt, default
    parameters, ``audio`` set. Such an entry, still in a lane during an upgrade, is speech."""
    old = {"request_id": "r3", "model": "asr-en", "lane": "normal", "reply_to": "conn", "client_id": "u1",
           "prompt_ids": [], "params": {"max_tokens": 64}, "created_at": 1000.0, "deadline": None,
           "trace_id": "", "slot": "", "audio": {"sample_rate": 16000}, "group": "", "group_size": 1}
    task = decode_task(orjson.dumps(old))
    assert isinstance(task, SpeechTask) and task.audio == AudioInput() and task.request_id == "r3"


@pytest.mark.parametrize("raw", [
    b"", b"[]", b"{}", b'{"kind": "image", "request_id": "r"}',
    orjson.dumps({**orjson.loads(TEXT.encode()), "audio": {"sample_rate": 16000}, "kind": "text"}),
    orjson.dumps({k: v for k, v in orjson.loads(SPEECH.encode()).items() if k != "audio"}),
    orjson.dumps({**orjson.loads(TEXT.encode()), "params": {"nope": 1}}),
    orjson.dumps({**orjson.loads(EMBED.encode()), "inputs": [1, 2]}),
    orjson.dumps({k: v for k, v in orjson.loads(EMBED.encode()).items() if k != "inputs"}),
])
def test_malformed_tasks_are_value_errors(raw):
    with pytest.raises(ValueError, match="malformed task"):
        decode_task(raw)


def test_task_decode_refuses_a_speech_task():
    with pytest.raises(ValueError, match="a speech task where a text task was expected"):
        Task.decode(SPEECH.encode())


def test_a_text_core_refuses_an_utterance_by_name():
    core, _engine = make_core()
    core.add(SpeechTask("r9", "toy", "normal", "conn", "u", AudioInput(), 1000.0))
    (reply_to, err), = core.step().events
    assert reply_to == "conn" and err.code == "invalid_request"
    assert err.message == "model 'toy' generates text; this is a speech task" and not core.has_work()


def test_the_speech_core_refuses_an_embed_task_by_name():
    from streamfleet.workers.speechcore import SpeechCore

    class Engine:  # SpeechCore refuses the task before it asks the engine for anything else
        slots, sample_rate = 1, 16000

    core = SpeechCore(Engine())
    core.add(EMBED)
    (_, err), = core.step().events
    assert err.code == "invalid_request" and err.message == "model 'tiny-embed' transcribes audio; this is a embed task"
