"""First contact with the command line: every `--help` reads as prose (no type
placeholders, no sentence broken where the source wrapped it, each group's summary names
its commands), errors name a model's kind in English, and a request that names no
temperature gets the same default on every door, which the client tools say they
replace with their own."""

from __future__ import annotations

import inspect
import re
import shutil

import pytest
import typer
from typer.testing import CliRunner

from streamfleet.cli import app
from streamfleet.shared.errors import ValidationError
from streamfleet.shared.modelrepo import REPO_ROOT, ModelRepository
from streamfleet.shared.settings import GatewaySettings

#: a value's type as Typer prints it by default: <str>, <int>, <bool>, <list[str]>, <int range>…
TYPE_PLACEHOLDER = re.compile(r"<(?:str|int|float|bool|path|list\[[^\]]*\]|int range|float range)>")


def _commands(cmd, path=()):
    """``(path, command)`` for the root and every group and command under it."""
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from _commands(sub, (*path, name))


ROOT = typer.main.get_command(app)
COMMANDS = list(_commands(ROOT))


def test_every_command_is_covered():
    names = {" ".join(p) for p, _ in COMMANDS}
    assert {"serve", "client", "status", "reload", "keys add", "engines import", "engines list"} <= names


@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=lambda p: " ".join(p) or "streamfleet")
def test_help_names_values_not_python_types(path):
    out = CliRunner().invoke(app, [*path, "--help"], terminal_width=120, env={"COLUMNS": "120"})
    assert out.exit_code == 0, out.output
    assert not TYPE_PLACEHOLDER.search(out.output), out.output
    usage = next(line for line in out.output.splitlines() if "Usage:" in line)
    assert "{" not in usage, usage  # a required argument is PROMPT, not {prompt}
    for param in dict(COMMANDS)[path].params:
        if param.param_type_name == "argument":
            assert param.name.upper() in usage, usage


@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=lambda p: " ".join(p) or "streamfleet")
def test_help_texts_are_not_hard_wrapped(path):
    """Click wraps help to the terminal; a line break in the source would show as a
    sentence broken in the middle (Typer keeps them in a command list and in every
    paragraph after the first)."""
    cmd = dict(COMMANDS)[path]
    for paragraph in inspect.cleandoc(cmd.help or "").split("\n\n"):
        assert "\n" not in paragraph, f"{' '.join(path)}: {paragraph!r}"
    for param in cmd.params:
        assert "\n" not in (param.help or ""), f"{' '.join(path)} {param.name}: {param.help!r}"


def test_group_summaries_name_their_commands():
    out = CliRunner().invoke(app, ["--help"], terminal_width=200, env={"COLUMNS": "200"})
    for group in ("engines", "keys"):
        summary = next(line for line in out.output.splitlines() if f" {group} " in line)
        for sub in ROOT.commands[group].commands:
            assert sub in summary, (group, sub, summary)


def test_a_model_kind_reads_as_english():
    from streamfleet.gateway.admission.validation import Validator

    validator = Validator(GatewaySettings(), ModelRepository(REPO_ROOT / "engines"))
    with pytest.raises(ValidationError) as refused:
        validator.generate({"id": "a", "prompt": "hello", "model": "asr-en"})
    assert "a asr" not in refused.value.message
    assert "is an ASR (speech recognition) model, not a text model" in refused.value.message


@pytest.fixture(scope="module")
def validator(tiny_spec, tmp_path_factory):
    from streamfleet.gateway.admission.validation import Validator

    root = tmp_path_factory.mktemp("engines")
    shutil.copytree(tiny_spec.path, root / "tiny-gpt")
    return Validator(GatewaySettings(default_model="tiny-gpt"), ModelRepository(root))


def test_every_door_applies_one_default_temperature(validator):
    """A request naming no temperature: the WebSocket frame, the OpenAI bodies (completions
    and chat, mapped as gateway/protocols/openai_mapping.py maps them) and a gRPC GenerateRequest with the
    field unset all come out at ``DEFAULT_TEMPERATURE``; each still honours one it names."""
    from streamfleet.gateway.doors.grpc_server import generate_payload
    from streamfleet.gateway.protocols.openai_mapping import request_payload
    from streamfleet.shared.schema import DEFAULT_TEMPERATURE
    from streamfleet.v1 import inference_pb2 as pb

    doors = {
        "websocket": lambda extra: {"type": "generate", "id": "a", "prompt": "Once upon a time", **extra},
        "openai completions": lambda extra: request_payload({"prompt": "Once upon a time", **extra}, chat=False),
        "openai chat": lambda extra: request_payload({"messages": [{"role": "user", "content": "hi"}], **extra},
                                                     chat=True),
        "grpc": lambda extra: generate_payload(pb.GenerateRequest(prompt="Once upon a time", **extra), "grpc"),
    }
    defaults = {door: validator.generate(make({})).params.temperature for door, make in doors.items()}
    assert defaults == dict.fromkeys(doors, DEFAULT_TEMPERATURE)
    assert DEFAULT_TEMPERATURE == 1.0  # OpenAI's; docs/sampling.md says so
    for door, make in doors.items():
        assert validator.generate(make({"temperature": 0.25})).params.temperature == 0.25, door
    # a set 0 is greedy, not "unset" (proto3 field presence)
    assert validator.generate(doors["grpc"]({"temperature": 0.0})).params.temperature == 0.0


def test_client_tools_say_their_own_default_temperature():
    from streamfleet import client

    # the CLI and the functions behind it send one value: greedy
    cli_default = next(p for p in ROOT.commands["client"].params if p.name == "temperature").default
    assert cli_default == 0.0
    for fn in (client.stream_ws, client.stream_sse, client.stream_grpc):
        assert inspect.signature(fn).parameters["temperature"].default == cli_default, fn.__name__
    assert cli_default == client.CLIENT_TEMPERATURE
    DEFAULT_TEMPERATURE = 1.0  # the gateway's (the test above)
    for command in ("client", "bench"):
        temp = next(p for p in ROOT.commands[command].params if p.name == "temperature")
        assert "greedy" in temp.help and f"the gateway's {DEFAULT_TEMPERATURE}" in temp.help, (command, temp.help)


def test_docs_state_the_default_temperature_once_and_each_door_points_there():
    from streamfleet.shared.schema import DEFAULT_TEMPERATURE

    sampling = (REPO_ROOT / "docs" / "sampling.md").read_text()
    assert "### The default temperature" in sampling
    assert f"sampled at {DEFAULT_TEMPERATURE} (OpenAI's default) whichever door" in sampling
    anchor = "sampling.md#the-default-temperature"
    assert anchor in (REPO_ROOT / "docs" / "grpc.md").read_text()
    assert anchor in (REPO_ROOT / "README.md").read_text()
    assert "unset: 1.0" in (REPO_ROOT / "proto" / "streamfleet" / "v1" / "inference.proto").read_text()
