"""The installed distribution is one namespace: `streamfleet` and its subpackages, and no
top-level `gateway`, `workers` or `shared` that would collide with other projects."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_only_streamfleet_is_importable_outside_the_repository(tmp_path):
    probe = (
        "import importlib.util as u, streamfleet.gateway.app, streamfleet.workers.process, "
        "streamfleet.shared.schema, streamfleet.cli\n"
        "print([n for n in ('gateway', 'workers', 'shared', 'scripts', 'tests') if u.find_spec(n)])"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"top-level packages installed beside streamfleet: {out.stdout}"


def test_no_module_imports_the_folders_as_top_level_packages():
    bad = re.compile(r"(^\s*|\"|\bimport )(from|import) (gateway|workers|shared)\b|\bimport (gateway|workers|shared)\.",
                     re.MULTILINE)
    offenders = []
    for folder in ("gateway", "workers", "shared", "streamfleet", "scripts", "tests"):
        for path in (REPO / folder).rglob("*.py"):
            if "fixtures" in path.parts:
                continue
            if bad.search(path.read_text()):
                offenders.append(str(path.relative_to(REPO)))
    assert not offenders, f"import streamfleet.<package>, not the bare folder: {offenders}"


def test_nothing_outside_tests_imports_tests():
    bad = re.compile(r"^\s*(from|import) tests\b", re.MULTILINE)
    offenders = [str(p.relative_to(REPO)) for folder in ("gateway", "workers", "shared", "streamfleet", "scripts")
                 for p in (REPO / folder).rglob("*.py") if bad.search(p.read_text())]
    assert not offenders, offenders


def test_scripts_need_no_sys_path_edits():
    offenders = [p.name for p in (REPO / "scripts").glob("*.py") if "sys.path" in p.read_text()]
    assert not offenders, f"scripts run as modules (python -m scripts.NAME): {offenders}"


def test_scripts_start_other_scripts_as_modules():
    """A script run by its file path (``python scripts/x.py``) cannot import ``scripts.*``,
    so one script starts another as ``python -m scripts.NAME`` (bench_fleet's arq worker
    failed to start when it did not)."""
    by_path = re.compile(r"""["']scripts/\w+\.py["']|(SCRIPTS|parent)\s*/\s*["']\w+\.py["']""")
    offenders = [p.name for p in (REPO / "scripts").glob("*.py") if by_path.search(p.read_text())]
    assert not offenders, f"start scripts with [sys.executable, '-m', 'scripts.NAME']: {offenders}"


def test_gpu_extra_pins_one_cuda_line():
    """Unpinned, `tensorrt` and `cuda-python` resolve to the CUDA 13 line, which needs a
    CUDA 13 driver: the extra stays on TensorRT 10 for CUDA 12 with the CUDA 12 bindings."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    extra = {r.name: r for r in map(Requirement,
                                    tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
                                    ["optional-dependencies"]["gpu"])}
    assert set(extra) == {"tensorrt-cu12", "cuda-python", "pycuda"}
    trt, cuda = extra["tensorrt-cu12"].specifier, extra["cuda-python"].specifier
    assert Version("10.8.0.43") in trt and Version("11.0.0") not in trt
    assert Version("12.9.0") in cuda and Version("13.0.0") not in cuda
