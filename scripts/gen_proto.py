"""Regenerate the gRPC code in streamfleet/v1/ from proto/streamfleet/v1/inference.proto.

    python -m scripts.gen_proto           # rewrite the generated modules
    python -m scripts.gen_proto --check   # exit 1 if they do not match the .proto

The generated modules are committed (installing streamfleet needs no protoc);
tests/unit/test_grpc_contract.py checks that they describe exactly the .proto.
Needs grpcio-tools (in the dev extra).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"
PROTO = "streamfleet/v1/inference.proto"
#: what protoc writes for PROTO, relative to the output root
OUTPUTS = ("streamfleet/v1/inference_pb2.py", "streamfleet/v1/inference_pb2.pyi",
           "streamfleet/v1/inference_pb2_grpc.py")


def generate(out: Path) -> None:
    """Run protoc (grpc_tools) on PROTO, writing the modules under ``out``."""
    import importlib.resources

    from grpc_tools import protoc

    include = str(importlib.resources.files("grpc_tools") / "_proto")
    rc = protoc.main(["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
                      f"--grpc_python_out={out}", str(PROTO_ROOT / PROTO)])
    if rc != 0:
        raise SystemExit(f"protoc failed on {PROTO} (exit {rc})")


def descriptor_set() -> bytes:
    """The .proto's FileDescriptorProto as protoc parses it (serialized)."""
    import importlib.resources

    from grpc_tools import protoc

    include = str(importlib.resources.files("grpc_tools") / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "set.pb"
        rc = protoc.main(["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--descriptor_set_out={path}",
                          str(PROTO_ROOT / PROTO)])
        if rc != 0:
            raise SystemExit(f"protoc failed on {PROTO} (exit {rc})")
        return path.read_bytes()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = []
        for rel in OUTPUTS:
            new = (Path(tmp) / rel).read_bytes()
            dest = REPO / rel
            if dest.exists() and dest.read_bytes() == new:
                continue
            stale.append(rel)
            if not args.check:
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(new)
    if args.check:
        for rel in stale:
            print(f"{rel} does not match {PROTO}; run python -m scripts.gen_proto", file=sys.stderr)
        return 1 if stale else 0
    print("\n".join(f"wrote {rel}" for rel in stale) or "up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
