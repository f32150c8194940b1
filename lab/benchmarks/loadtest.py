"""Load test: N concurrent streaming clients on loopback for a fixed time, gateway vs the same backend direct.

    .venv/bin/python lab/benchmarks/loadtest.py [--concurrency 200] [--duration 20]     (or: make loadtest)
    .venv/bin/python lab/benchmarks/loadtest.py --concurrency 100 --rounds 5 --pause 60   (rounds that must agree)
    .venv/bin/python lab/benchmarks/loadtest.py --concurrency 100 --workers 1,2 --rounds 3 --slice 5   (workers)
    .venv/bin/python lab/benchmarks/loadtest.py --concurrency 50 --rounds 4 --slice 2 --against /tmp/old
        (before and after: another checkout's gateway beside this one's, after git worktree add /tmp/old REV)
    .venv/bin/python lab/benchmarks/loadtest.py --concurrency 50 --rounds 4 --slice 2 --floor
        (the floor: a bare proxy of the same parts, uvicorn and aiohttp, beside the gateway in the same rounds)

The backend answers at once (``specprefill_lab.fast_backend``), so the numbers are the gateway's own cost.
Prompts are short (they bypass compression: the gateway tokenizes, renders the chat template and proxies).
Reports requests/s, TTFT p50/p99 (and the gateway's addition), errors, the CPU each process spent per request,
the share of the machine's time the hypervisor took (steal), and the gateway's resident memory before, during
and after the load. Everything runs on this machine: the client, the gateway and the backend share its cores
(``--pin`` gives the gateway one of its own), which counts against every number here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from specprefill_lab.rounds import Round, closed_loop, instant_stack, rounds, spread, tree_rss_mib


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="loaded rounds per path against the same servers, "
        "alternating direct and gateway; the spread of their requests/s is printed",
    )
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between rounds")
    parser.add_argument(
        "--slice",
        type=float,
        help="the two paths take turns every SLICE seconds within each "
        "round, so both see the machine at the same speed (otherwise one round after the other)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the gateway on one core, the client and the backend on "
        "another (the system under test then shares no core with the load)",
    )
    parser.add_argument(
        "--workers",
        default="1",
        help="gateway worker processes (specprefill serve --workers; more than 1 needs Redis); a list "
        "(1,2) measures each in turn, a fresh stack each, and prints requests/s against the worker count",
    )
    parser.add_argument(
        "--redis",
        action="store_true",
        help="one worker shares its state through Redis too, as more than one must (a like-for-like yardstick)",
    )
    parser.add_argument(
        "--against",
        type=Path,
        help="another checkout (git worktree add /tmp/old REV) whose gateway stands beside this one's, with the "
        "same arguments in front of the same backend; the three paths take turns (with --slice, slice by slice), "
        "and its CPU per request, requests/s and TTFT are printed against this checkout's, round by round",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="a bare streaming proxy (specprefill_lab.bare_proxy: uvicorn in, aiohttp out, nothing between) in "
        "front of the same backend takes turns with the gateway: the least a proxy of the gateway's parts costs, "
        "its CPU a request printed beside the gateway's, round by round",
    )
    parser.add_argument("--out", type=Path, help="write every round's numbers to this JSON file")
    return parser.parse_args()


def main() -> None:
    args = _arguments()
    counts = [int(n) for n in str(args.workers).split(",")]
    measured = {count: _measure(args, count) for count in counts}
    if len(counts) > 1:
        print("\nworkers   gateway req/s   direct req/s   gateway/direct   gateway CPU ms/request   errors")
        for count, found in measured.items():
            by_path = {path: [r for r in found["loaded"] if r.path == path] for path in ("direct", "gateway")}
            gateway, direct = (sum(r.rps for r in by_path[p]) / len(by_path[p]) for p in ("gateway", "direct"))
            cpu = sum(r.cpu_ms["gateway"] for r in by_path["gateway"]) / len(by_path["gateway"])
            errors = sum(r.errors for r in found["loaded"])
            print(f"{count:>7} {gateway:>15.0f} {direct:>14.0f} {gateway / direct:>16.3f} {cpu:>24.2f} {errors:>8}")
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"out": str(args.out)},
                    "by_workers": {
                        str(count): {
                            "sequential": [r.summary() for r in found["sequential"].values()],
                            "rounds": [r.summary() for r in found["loaded"]],
                            "rss_mib": found["rss_mib"],
                        }
                        for count, found in measured.items()
                    },
                },
                indent=1,
            )
        )


def _measure(args: argparse.Namespace, workers: int) -> dict:
    """One stack with ``workers`` gateway processes: the sequential rounds, the loaded ones, the memory."""
    print(f"\n== {workers} gateway worker{'s' if workers > 1 else ''}{' (Redis)' if workers > 1 or args.redis else ''}")
    paths = ("direct", "gateway", *(["against"] if args.against else []), *(["floor"] if args.floor else []))
    with instant_stack(args.pin, workers, args.redis, args.against, args.floor) as stack:
        for path in paths[1:]:
            asyncio.run(closed_loop(*stack.url(path), 4, 2.0))  # warm-up
        gateway_pid = stack.pids["gateway"]
        rss_before = tree_rss_mib(gateway_pid)
        sequential = {
            path: asyncio.run(closed_loop(*stack.url(path), 1, min(args.duration, 10.0), path)) for path in paths
        }
        loaded = rounds(stack, args.rounds, args.concurrency, args.duration, args.pause, paths, slice_s=args.slice)
        rss_peak = max([rss_before, *(r.gateway_rss_mib for r in loaded)])
        time.sleep(3)
        rss_after = tree_rss_mib(gateway_pid)
    _report(args, sequential, loaded)
    print(
        f"gateway resident memory: {rss_before:.0f} MiB before, {rss_peak:.0f} MiB at peak, "
        f"{rss_after:.0f} MiB 3 s after the load"
    )
    rss = {"before": rss_before, "peak": rss_peak, "after": rss_after}
    return {"sequential": sequential, "loaded": loaded, "rss_mib": rss}


def _report(args: argparse.Namespace, sequential: dict[str, Round], loaded: list[Round]) -> None:
    """Every round's numbers as a table, and the gateway's cost over the direct path."""

    def row(name: str, clients: int, r: Round) -> None:
        parts = ("gateway", "backend", "client")
        cpu = " / ".join(f"{r.cpu_ms[part]:.2f}" if part in r.cpu_ms else "–" for part in parts)
        print(
            f"{name:>19} {clients:>7} {r.requests:>8} {r.errors:>6} {r.rps:>7.1f} "
            f"{r.ms(0.5):>7.2f}ms {r.ms(0.99):>6.1f}ms {r.steal * 100:>5.1f}%  {cpu if r.cpu_ms else ''}"
        )

    print(
        f"\n{'':>19} {'clients':>7} {'requests':>8} {'errors':>6} {'req/s':>7} {'TTFT p50':>9} {'p99':>8} "
        f"{'steal':>6}  CPU ms per request: gateway / backend / client"
    )
    for path, r in sequential.items():
        row(f"sequential {path}", 1, r)
    per_round = len(sequential)
    for index, r in enumerate(loaded):
        row(r.path if args.rounds == 1 else f"{r.path} {index // per_round + 1}", args.concurrency, r)
    for r in [*sequential.values(), *loaded]:
        if r.error_reasons:
            print(f"{r.path} errors: {r.error_reasons}")
    by_path = {path: [r for r in loaded if r.path == path] for path in sequential}
    one = sequential["gateway"].ms(0.5) - sequential["direct"].ms(0.5)
    many = by_path["gateway"][-1].ms(0.5) - by_path["direct"][-1].ms(0.5)
    print(f"\ngateway p50 TTFT overhead: {one:.2f} ms with one client, {many:.1f} ms with {args.concurrency}")
    if args.rounds > 1:
        for path, done in by_path.items():
            rps = [r.rps for r in done]
            print(f"{path} rounds: {', '.join(f'{v:.0f}' for v in rps)} req/s; max/min {spread(rps):.2f}")
        relative = [g.rps / d.rps for g, d in zip(by_path["gateway"], by_path["direct"])]
        print(
            f"gateway over direct, each round: {', '.join(f'{v:.3f}' for v in relative)}; "
            f"max/min {spread(relative):.2f}"
        )
    if "against" in by_path:
        _compared(args, sequential, by_path)
    if "floor" in by_path:
        _floor(by_path)


def _floor(by_path: dict[str, list[Round]]) -> None:
    """The gateway's CPU a request against the bare proxy's, round by round (they took turns)."""
    pairs = list(zip(by_path["gateway"], by_path["floor"]))
    each = ", ".join(f"{g.cpu_ms['gateway']:.3f} / {f.cpu_ms['gateway']:.3f}" for g, f in pairs)
    ratios = [g.cpu_ms["gateway"] / f.cpu_ms["gateway"] for g, f in pairs]
    above = [g.cpu_ms["gateway"] - f.cpu_ms["gateway"] for g, f in pairs]
    print(f"\nthe gateway against the bare proxy (specprefill_lab.bare_proxy), CPU ms a request, each round: {each}")
    print(
        f"  gateway over floor, median {statistics.median(ratios):.2f}; the gateway's own part (above the floor) "
        f"{statistics.median(above):.3f} ms; requests/s "
        f"{statistics.median(g.rps for g, _ in pairs):.0f} against {statistics.median(f.rps for _, f in pairs):.0f}"
    )


def _compared(args: argparse.Namespace, sequential: dict[str, Round], by_path: dict[str, list[Round]]) -> None:
    """This checkout's gateway against the other's, round by round (each pair took turns on the same machine)."""
    pairs = list(zip(by_path["gateway"], by_path["against"]))

    def line(name: str, values: list[tuple[float, float]], digits: int) -> None:
        ratios = [now / before for now, before in values]
        each = ", ".join(f"{before:.{digits}f} -> {now:.{digits}f}" for now, before in values)
        print(f"  {name}: {each}; this over that, median {statistics.median(ratios):.3f}")

    print(f"\nthis checkout's gateway against {args.against}'s (theirs -> ours, each round):")
    line("gateway CPU ms a request", [(g.cpu_ms["gateway"], a.cpu_ms["gateway"]) for g, a in pairs], 3)
    line(
        "the gateway's CPU over the backend's",
        [(g.cpu_ms["gateway"] / g.cpu_ms["backend"], a.cpu_ms["gateway"] / a.cpu_ms["backend"]) for g, a in pairs],
        3,
    )
    line("requests/s", [(g.rps, a.rps) for g, a in pairs], 0)
    line("TTFT p50 ms", [(g.ms(0.5), a.ms(0.5)) for g, a in pairs], 2)
    one = (sequential["gateway"].ms(0.5), sequential["against"].ms(0.5), sequential["direct"].ms(0.5))
    print(f"  one client, TTFT p50: {one[1]:.2f} -> {one[0]:.2f} ms (direct {one[2]:.2f} ms)")


if __name__ == "__main__":
    main()
