"""How steady this machine's speed is: a fixed Python loop timed back to back, with the hypervisor's steal.

    .venv/bin/python lab/benchmarks/machine_speed.py [--seconds 150] [--out speed.json]

Prints how far apart the loop's mean times are over windows of 5–60 s. Run it idle before trusting a bar that
compares rounds of a benchmark: rounds cannot agree more closely than the machine's speed over their length.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specprefill_lab.rounds import machine_times


def loop_seconds() -> float:
    started, total = time.perf_counter(), 0
    for i in range(300_000):
        total += i * i % 7
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    samples = []  # (seconds since the start, the loop's time, steal's share meanwhile)
    start = time.monotonic()
    while (now := time.monotonic()) - start < args.seconds:
        total_before, steal_before = machine_times()
        took = loop_seconds()
        total_after, steal_after = machine_times()
        samples.append((now - start, took, (steal_after - steal_before) / max(1, total_after - total_before)))
        time.sleep(0.2)
    times = [took for _, took, _ in samples]
    print(f"{len(samples)} loops: {min(times) * 1e3:.1f}–{max(times) * 1e3:.1f} ms")
    for window in (5, 10, 20, 40, 60):
        groups: dict[int, list[float]] = {}
        for at, took, _ in samples:
            groups.setdefault(int(at // window), []).append(took)
        means = [sum(g) / len(g) for g in groups.values() if len(g) > 3]
        if len(means) > 1:
            print(f"means over {window:>2} s windows: max/min {max(means) / min(means):.2f} ({len(means)} windows)")
    print(f"steal: {max(s for *_, s in samples) * 100:.1f}% at most over one loop")
    if args.out:
        args.out.write_text(json.dumps(samples))


if __name__ == "__main__":
    main()
