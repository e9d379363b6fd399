"""A real architecture served by the fleet, end to end: imported with `streamfleet
engines import` from an Optimum export (tests/fixtures/archs/), then driven through the
gateway; the text equals transformers' greedy tokens, the tokenizer's BOS is added, and
generation stops on every EOS id the model's generation_config declares."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from streamfleet.shared.modelrepo import ModelRepository, load_tokenizer
from tests.support.wsclient import Client

pytestmark = pytest.mark.slow  # real architectures imported and served

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "archs"


@pytest.mark.parametrize("arch", ["llama", "gemma", "gemma3", "gpt2-merged"])
async def test_an_imported_model_serves_transformers_tokens(fleet, tmp_path, arch):
    if not (FIXTURES / arch).is_dir():
        pytest.skip(f"no {arch} fixture")
    engines = tmp_path / "engines"
    out = subprocess.run([sys.executable, "-m", "streamfleet", "engines", "import", str(FIXTURES / arch),
                          "--name", arch, "--engines-dir", str(engines), "--max-batch", "8"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "EOS ids" in out.stdout and f"imported as '{arch}'" in out.stdout
    ref = json.loads((FIXTURES / arch / "reference.json").read_text())
    gw = fleet.gateway(engines_dir=engines, models=arch, default_model=arch)
    fleet.worker(model=arch, engines_dir=engines)
    tok = load_tokenizer(ModelRepository(engines).get(arch))
    eos = set(ref["eos_token_ids"])
    c = await Client.connect(gw.ws)
    # all prompts at once: they batch on the worker
    results = await asyncio.gather(*(c.generate(f"r{i}", case["prompt_text"], temperature=0, max_tokens=24)
                                     for i, case in enumerate(ref["cases"])))
    stopped_early = 0
    for case, res in zip(ref["cases"], results):
        assert res.end["type"] == "done", res.end
        want = case["stop_at_eos_ids"]
        ended_on_eos = bool(want) and want[-1] in eos
        shown = want[:-1] if ended_on_eos else want
        assert res.end["usage"]["prompt_tokens"] == len(case["prompt_ids"])  # BOS included where added
        assert res.end["finish_reason"] == ("stop" if ended_on_eos else "length"), case["prompt_text"]
        assert res.end["usage"]["completion_tokens"] == len(shown)
        assert res.text == tok.decode(shown, skip_special_tokens=True), case["prompt_text"]
        stopped_early += ended_on_eos
    if arch == "llama":
        assert stopped_early  # at least one case ends on an EOS id from generation_config.json
    await c.close()
