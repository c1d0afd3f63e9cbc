"""Reward hacks against KCoral's numbers, and what the service makes of each (GPU host).

The attacks are candidate modules under ``tests/gpu/attacks/`` (one file each; their catalogue,
classes and the verdicts are described there, ``tests/gpu/attacks/__init__.py`` and
``outcomes.py``); the GPU test ``tests/gpu/test_integrity_gpu.py`` runs the same ones. This runner
prints their table against a running broker.

Usage (on the GPU host, a broker running)::

    python3 benchmarks/integrity_attacks.py --url tcp://127.0.0.1:5555 [--only a,b] [--json out.json]

Prints ``attack | class | path | honest ms | reported ms | ratio | verdict | how | notes``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tests.gpu.attacks.outcomes import HEADER, Outcome, run_attack, select  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("KCORAL_URL"), help="tcp://HOST:PORT of a KCoral broker")
    parser.add_argument("--only", default="", help="comma-separated attack names (default: all)")
    parser.add_argument("--json", type=Path, help="write the outcomes here")
    parser.add_argument("--list", action="store_true", help="list the attacks and exit")
    args = parser.parse_args(argv)
    attacks = select(args.only)
    if args.list:
        for attack in attacks:
            print(f"{attack.name:<24} {attack.path:<9} {attack.origin:<6} {attack.klass}")
        return 0
    if not args.url:
        parser.error("give --url (or set KCORAL_URL)")
    from kcoral import Client

    outcomes: list[Outcome] = []
    print(HEADER, flush=True)
    with Client(args.url, connect_timeout_seconds=30.0) as client:
        for attack in attacks:
            outcome = run_attack(client, args.url, attack)
            outcomes.append(outcome)
            print(outcome.line(), flush=True)
            if args.json:
                args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=1))
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome.verdict] = counts.get(outcome.verdict, 0) + 1
    print("verdicts: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
