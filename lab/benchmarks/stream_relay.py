"""What one gateway process spends to relay a streamed answer: its CPU per request and per streamed event.

A token stream goes through the gateway event by event (read from the backend, decoded, checked, encoded again,
written to the client), so a busy engine's aggregate token rate is what the gateway must keep up with: 256
streams at 50 tokens a second are 12,800 events a second. Here a backend that answers at once
(``specprefill_lab.fast_backend``) streams answers of ``--short`` and of ``--long`` events to ``--concurrency``
closed-loop clients through the gateway; the gateway's CPU time per request at the two lengths gives its cost
per event (the slope) and per request (the rest), and so the events a second one core of it relays. The
backend's own CPU per request is printed beside it (a minimal Starlette server writing the same events).

    .venv/bin/python lab/benchmarks/stream_relay.py [--concurrency 50] [--duration 8] [--repeats 4] [--out F]
    .venv/bin/python lab/benchmarks/stream_relay.py --against /tmp/old   # after: git worktree add /tmp/old REV

``--against`` puts another checkout's gateway beside this one's, in front of the same backend, the two taking
turns round by round, so that two versions are compared at the machine's same speed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
from pathlib import Path

from specprefill_lab.demo_models import ensure_demo_models
from specprefill_lab.launch import launched_gateway_process, launched_instant_backend
from specprefill_lab.rounds import closed_loop, cpu_seconds


def measure(events: int, checkouts: dict[str, Path | None], concurrency: int, duration: float, repeats: int) -> dict:
    """Each checkout's gateway in front of one backend whose answers carry ``events`` events, ``repeats`` rounds
    each, taking turns: CPU ms per request of the gateway and of the backend, each round and the median."""
    root = ensure_demo_models()
    rounds: dict[str, list[dict]] = {name: [] for name in checkouts}
    with launched_instant_backend(events) as (backend_url, backend), contextlib.ExitStack() as stack:
        args = ["--backend-url", backend_url, "--backend-model", "fast", "--served-model-name", "demo"]
        args += ["--target-model", str(root / "target"), "--draft-model", str(root / "draft")]
        gateways = {name: stack.enter_context(launched_gateway_process(args, cwd)) for name, cwd in checkouts.items()}
        for url, _ in gateways.values():
            asyncio.run(closed_loop(url, "demo", concurrency, 3.0))  # warm-up
        for index in range(repeats):
            order = list(gateways.items())
            for name, (url, gateway) in order if index % 2 == 0 else order[::-1]:
                before = cpu_seconds(gateway.pid), cpu_seconds(backend.pid)
                done = asyncio.run(closed_loop(url, "demo", concurrency, duration))
                after = cpu_seconds(gateway.pid), cpu_seconds(backend.pid)
                n = max(1, done.requests)
                rounds[name].append(
                    {
                        "requests_per_s": round(done.rps, 1),
                        "errors": done.errors,
                        "gateway_ms": round((after[0] - before[0]) * 1e3 / n, 3),
                        "backend_ms": round((after[1] - before[1]) * 1e3 / n, 3),
                    }
                )
                print(f"  {name}, {events:>3} events: {rounds[name][-1]}", flush=True)
    return {
        name: {
            "rounds": done,
            "gateway_ms": statistics.median(r["gateway_ms"] for r in done),
            "backend_ms": statistics.median(r["backend_ms"] for r in done),
            # the backend is the same code for every checkout: a yardstick read in the same round
            "over_backend": round(statistics.median(r["gateway_ms"] / r["backend_ms"] for r in done), 2),
        }
        for name, done in rounds.items()
    }


def fitted(short: dict, long: dict, events: tuple[int, int]) -> dict:
    """Per event (the slope between the two lengths) and per request (the rest), gateway and backend."""
    out = {}
    for part in ("gateway", "backend"):
        per_event = (long[f"{part}_ms"] - short[f"{part}_ms"]) / (events[1] - events[0])
        out[f"{part}_us_per_event"] = round(per_event * 1e3, 1)
        out[f"{part}_ms_per_request"] = round(short[f"{part}_ms"] - events[0] * per_event, 3)
    out["gateway_events_per_core_s"] = (
        round(1e6 / out["gateway_us_per_event"]) if out["gateway_us_per_event"] > 0 else None
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds a round")
    parser.add_argument("--repeats", type=int, default=4, help="rounds at each length (their median is used)")
    parser.add_argument("--short", type=int, default=8, help="events in a short answer")
    parser.add_argument("--long", type=int, default=64, help="events in a long answer")
    parser.add_argument("--against", type=Path, help="another checkout whose gateway takes turns with this one's")
    parser.add_argument("--out", type=Path, help="write the numbers to this JSON file")
    args = parser.parse_args()
    checkouts: dict[str, Path | None] = {"this": None} | ({"other": args.against} if args.against else {})
    short, long = (
        measure(n, checkouts, args.concurrency, args.duration, args.repeats) for n in (args.short, args.long)
    )
    summary = {
        name: fitted(short[name], long[name], (args.short, args.long))
        | {"long_over_backend": long[name]["over_backend"]}
        for name in checkouts
    }
    for name, s in summary.items():
        print(
            f"{name}: gateway {s['gateway_us_per_event']} us a streamed event, {s['gateway_ms_per_request']} ms a "
            f"request (one core relays ~{s['gateway_events_per_core_s']} events/s); backend "
            f"{s['backend_us_per_event']} us an event, {s['backend_ms_per_request']} ms a request; a {args.long}-event "
            f"request's gateway CPU over the backend's: {s['long_over_backend']}x"
        )
    if args.out:
        result = {"args": vars(args) | {"out": str(args.out), "against": str(args.against)}, "short": short}
        args.out.write_text(json.dumps(result | {"long": long, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
