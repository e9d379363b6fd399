"""A worker on a ``weights = "auto"`` GGUF model (a small random one) measures the modes on
first use, serves the one chosen for this CPU, and says which and why: in its heartbeat,
``/v1/models`` and ``streamfleet status`` (shared/execution.py, docs/models.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from streamfleet.shared import execution
from streamfleet.shared.modelrepo import ModelRepository
from tests.support.gguf_models import TinyLlama, write_tiny_gguf

MODEL = "tiny-auto"


@pytest.fixture(scope="module")
def auto_fleet(module_fleet, tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    src = write_tiny_gguf(root / "tiny.gguf", TinyLlama(seed=21, n_layer=2))
    execution.import_auto(src, root, MODEL, max_batch=8, max_kld=1.0)  # graphs only: nothing measured
    assert not (root / MODEL / "execution.json").exists()
    gw = module_fleet.gateway(engines_dir=str(root), models=MODEL, default_model=MODEL)
    module_fleet.worker(model=MODEL, engines_dir=str(root), wait=False)
    return module_fleet, gw, root


def test_the_worker_measures_chooses_and_says_why(auto_fleet):
    fleet, gw, root = auto_fleet
    fleet.wait_worker(fleet.procs[-1], MODEL, timeout=120)
    record = json.loads((root / MODEL / "execution.json").read_text())
    (entry,) = record["cpus"].values()
    models = httpx.get(gw.http + "/v1/models", timeout=10).json()["data"]
    (m,) = [x for x in models if x["id"] == MODEL]
    assert m["execution"] == [{"mode": entry["chosen"], "why": entry["why"], "workers": 1}]
    assert httpx.get(gw.http + f"/v1/models/{MODEL}", timeout=10).json()["execution"] == m["execution"]
    # what it serves answers: the chosen graph is the one loaded
    r = httpx.post(gw.http + "/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3,
                                                       "temperature": 0}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    st = subprocess.run([sys.executable, "-m", "streamfleet", "status", "--model", MODEL, "--redis-url",
                         fleet.redis_url], env=fleet.env(model=MODEL), capture_output=True, text=True, timeout=60)
    assert st.returncode == 0, st.stderr
    assert f"execution (every worker): {entry['chosen']}: {entry['why']}" in st.stdout
    spec = ModelRepository(root).get(MODEL)
    assert execution.served(spec).mode == entry["chosen"]

