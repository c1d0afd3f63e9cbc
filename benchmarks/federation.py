"""The load generator against a router on simulated hosts, with 1, 2 and 3 broker hosts in one run.

    sudo python3 benchmarks/federation.py --duration 60 --json benchmarks/federation.json

The router and each broker run in a network namespace of their own (benchmarks/simulated_hosts.py),
started from the systemd units' command lines with CURVE keys; the load generator
(benchmarks/loadgen.py, as ``--url`` with keys) runs on the host that built them. Hosts join one at
a time: the first run has one broker host, the next two, the last three, each run ``--duration``
seconds of the same mix and clients. The router's metrics are scraped before and after each run
and compared with the load generator's counts. Root only (namespaces); everything it made is
removed at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import loadgen
from benchmarks.common import let_go_of
from benchmarks.simulated_hosts import ROUTER_METRICS_PORT, Federation, Keys, Network, unavailable_reason

NODES = ("b1", "b2", "b3")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 benchmarks/federation.py", description=__doc__)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of submissions per run (default 60)")
    parser.add_argument("--clients", type=int, default=16, help="clients, one connection each (default 16)")
    parser.add_argument("--mix", default=loadgen.DEFAULT_MIX, help="the load generator's mix (default: its own)")
    parser.add_argument("--broker", default="--fake-gpus 2", help="flags of each broker host (default: --fake-gpus 2)")
    parser.add_argument("--hosts", type=int, default=len(NODES), choices=range(1, len(NODES) + 1))
    parser.add_argument("--json", help="write the runs' summaries here")
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        parser.error(f"simulated hosts need network namespaces: {reason}")
    work = Path(tempfile.mkdtemp(prefix="kcoral-federation-"))
    keys = Keys(work / "etc-kcoral", nodes=NODES, clients=("loadgen",))
    server_key, client_key = keys.client_files("loadgen")
    runs: list[dict[str, Any]] = []
    with Network.create() as network:
        federation = Federation(network, keys, work, broker_args=args.broker, log_level="warning")
        try:
            router = federation.start_router(network.add_host("router"))
            metrics = f"http://{router.url[len('tcp://') :].rsplit(':', 1)[0]}:{ROUTER_METRICS_PORT}/metrics"
            for count, node in enumerate(NODES[: args.hosts], start=1):
                started = time.monotonic()
                federation.start_broker(network.add_host(node))
                federation.wait_live(*NODES[:count], timeout_seconds=300)
                print(f"federation: {count} host(s) live after {time.monotonic() - started:.1f} s", file=sys.stderr)
                summary_path = work / f"hosts-{count}.json"
                argv = ["--url", router.url, "--server-key", str(server_key), "--client-key", str(client_key)]
                argv += ["--duration", str(args.duration), "--clients", str(args.clients), "--mix", args.mix]
                argv += ["--metrics", metrics, "--quiet", "--json", str(summary_path)]
                status = loadgen.main(argv)
                summary = json.loads(summary_path.read_text())
                summary.pop("samples", None)
                summary["hosts"] = count
                summary["service"] = f"router with {count} broker host(s) ({args.broker}), simulated hosts"
                summary["loadgen_exit"] = status
                runs.append(summary)
        finally:
            statuses = federation.stop()
    print("\n| hosts | programs | per s | p50 ms | p90 ms | by node | accounted, metrics agree |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for run in runs:
        overall = run["kinds"]["all"]
        nodes = " / ".join(f"{n} {c}" for n, c in sorted(run["nodes"].items()))
        agree = run.get("metrics", {}).get("agree")
        print(
            f"| {run['hosts']} | {run['submitted']} | {overall['throughput_per_s']:.2f} | {overall['p50_ms']:.1f} "
            f"| {overall['p90_ms']:.1f} | {nodes} | {run['accounted']}, {agree} |"
        )
    print(f"services stopped with {statuses}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "stopped": statuses}, indent=1) + "\n")
    failed = any(r["loadgen_exit"] for r in runs) or any(statuses.values())
    let_go_of(work, failed=failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
