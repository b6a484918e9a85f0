"""``python -m localkube --port PORT --kubeconfig PATH [--state FILE]``: run localkube in the foreground until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import tempfile
from pathlib import Path

from localkube.cluster import ClusterError, check_loopback
from localkube.options import Options
from localkube.server import LocalKube


def _pairs(values: list[str], flag: str) -> dict[str, str]:
    out = {}
    for value in values:
        key, sep, val = value.partition("=")
        if not sep or not key:
            raise SystemExit(f"{flag} expects KEY=VALUE, got {value!r}")
        out[key] = val
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m localkube", description=__doc__)
    parser.add_argument(
        "--port", type=int, default=8001, help="API server port on the loopback address (0: any free port)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="loopback address to listen on (127.0.0.0/8 only)")
    parser.add_argument("--kubeconfig", type=Path, required=True, help="where to write the kubeconfig for clients")
    parser.add_argument("--state", type=Path, help="JSON file to persist objects in (loaded at start if it exists)")
    parser.add_argument("--workdir", type=Path, help="folder for pod logs (default: a temporary folder)")
    parser.add_argument("--no-kubelet", action="store_true", help="serve the API only; pods stay Pending")
    parser.add_argument("--node-label", action="append", default=[], metavar="KEY=VALUE", help="extra node label")
    parser.add_argument(
        "--node-capacity",
        action="append",
        default=[],
        metavar="RESOURCE=QUANTITY",
        help="extra node capacity, e.g. nvidia.com/gpu=1",
    )
    parser.add_argument(
        "--restart-backoff",
        default="1,60",
        metavar="BASE,MAX",
        help="crash-loop back-off in seconds: first delay and cap (default 1,60)",
    )
    parser.add_argument(
        "--pod-subnet",
        metavar="CIDR",
        help="loopback subnet for pod IPs, e.g. 127.0.0.0/24 (default: a random /24 in 127.0.0.0/8, "
        "so that two localkubes on one machine never hand out the same address)",
    )
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


async def _run(options: Options) -> None:
    kube = LocalKube(options)
    await kube.start()
    print(
        f"localkube: API server at {kube.url}; kubeconfig written to {options.kubeconfig}; "
        f"pod logs under {options.workdir}",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("localkube: stopping (terminating pod processes)", flush=True)
    await kube.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        base, cap = (float(x) for x in args.restart_backoff.split(","))
        host = check_loopback(args.host)
    except ValueError:
        print(f"--restart-backoff expects BASE,MAX seconds, got {args.restart_backoff!r}", file=sys.stderr)
        return 2
    except ClusterError as exc:
        print(exc, file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="localkube-"))
    options = Options(
        host=host,
        port=args.port,
        state_file=args.state,
        workdir=workdir,
        kubelet=not args.no_kubelet,
        node_labels=_pairs(args.node_label, "--node-label"),
        node_capacity=_pairs(args.node_capacity, "--node-capacity"),
        restart_backoff=(base, cap),
        pod_subnet=args.pod_subnet,
        kubeconfig=args.kubeconfig,
    )
    asyncio.run(_run(options))
    return 0


if __name__ == "__main__":
    sys.exit(main())
