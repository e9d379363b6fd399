"""``python -m streamfleet.shared.measuring ENGINE_TOML STAMP``: a ``weights = "auto"``
folder's execution modes measured (``shared/execution.measure``) in a process of its own.

Measuring opens every candidate's graph at once (the fp32 reference among them), and a
process keeps much of what it once held: run inside a worker or ``streamfleet serve`` it
would leave them that much larger for their whole life (docs/models.md, "Execution modes
chosen by measurement"). ``shared/modelrepo._ensure_measured`` runs this instead and logs the lines it prints
(one a step); a failure prints ``error: REASON`` last and exits 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

from streamfleet.shared.errors import FatalError
from streamfleet.shared.execution import measure
from streamfleet.shared.modelrepo import ModelSpec


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m streamfleet.shared.measuring ENGINE_TOML STAMP", file=sys.stderr)
        return 2
    try:
        spec = ModelSpec.from_toml(Path(args[0]))
        measure(spec, args[1], say=lambda line: print(line, flush=True))
    except FatalError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
