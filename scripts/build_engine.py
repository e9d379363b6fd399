#!/usr/bin/env python3
"""Build a model's TensorRT plan on this host (TensorRT and a GPU needed), or show what
would be built (``--dry-run``: profiles, key and path; no TensorRT needed).

    python -m scripts.build_engine tiny-gpt
    python -m scripts.build_engine tiny-gpt --force --option builder_optimization_level=5
    python -m scripts.build_engine bench-gpt --dry-run --trt-version 10.8.0.43 --cc 90

The same as ``streamfleet engines build MODEL`` without ``--queue`` (which also records
the plan in Redis); see docs/tensorrt.md.
"""

from __future__ import annotations

import argparse
import json
import sys

from streamfleet.shared.errors import FatalError, NotFoundError
from streamfleet.shared.modelrepo import ModelRepository, ensure_artifacts
from streamfleet.workers.engines import trt_build, trt_plan


def _options(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--option {pair!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="model folder under the engines directory")
    ap.add_argument("--engines-dir", default=None, help="model repository (default: <repo>/engines)")
    ap.add_argument("--force", action="store_true", help="rebuild even when the plan exists")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="override engine.toml's [tensorrt] table (repeatable)")
    ap.add_argument("--dry-run", action="store_true", help="print the profiles, key and path; build nothing")
    ap.add_argument("--trt-version", default=None, help="with --dry-run: TensorRT version (default: installed)")
    ap.add_argument("--cc", default=None, help="compute capability as digits, e.g. 90 (default: this GPU's)")
    args = ap.parse_args(argv)
    try:
        spec = ModelRepository(args.engines_dir).get(args.model)
        ensure_artifacts(spec)
        options = trt_plan.tensorrt_options(spec, _options(args.option))
        if args.dry_run:
            version = args.trt_version or trt_build.import_tensorrt().__version__
            if args.cc is None:
                from streamfleet.workers.engines.cuda_mem import detect_compute_capability

                args.cc = detect_compute_capability()
            req = trt_plan.plan_request(spec, version, args.cc, options)
            print(json.dumps({"path": str(req.path), "key": req.key, "exists": req.path.exists(),
                              "timing_cache": str(req.timing_cache_path), **req.key_material()}, indent=2))
            return 0
        result = trt_build.build_plan(spec, force=args.force, options=options, compute_capability=args.cc,
                                      log=lambda s: print(s, file=sys.stderr))
    except (FatalError, NotFoundError) as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    print(json.dumps(result.record(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
