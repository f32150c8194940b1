"""Reference-engine prefill: K kept tokens at their original positions vs all S tokens, on the demo target.

    .venv/bin/python benchmarks/bench_engine.py [--lengths 4096 8192] [--keep 0.1 0.3 0.5 1.0] [--repeats 3]

Prints the time ratio next to K/S: attention is quadratic and the rest linear, so the ratio should sit
at or below K/S once attention dominates, and a little above it for short prompts (fixed costs).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from common.models import load_causal_lm
from engine.runner import prefill
from specprefill.lab.demo_models import ensure_demo_models


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--keep", type=float, nargs="+", default=[0.1, 0.3, 0.5, 1.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="target model folder (default: the demo target)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    model = load_causal_lm(args.model or ensure_demo_models() / "target", device="cpu")
    rows = []
    for length in args.lengths:
        ids = torch.randint(10, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
        full = median_time(lambda: prefill(model, ids, torch.arange(length)[None]), args.repeats)
        for rate in tqdm(args.keep, desc=f"{length} tokens", unit="rate"):
            kept = math.ceil(length * rate)
            # evenly spread kept positions ending at the last token, as the gateway sends them
            positions = torch.linspace(0, length - 1, kept).round().long().unique()[None]
            t = median_time(lambda: prefill(model, ids[:, positions[0]], positions), args.repeats)
            rows.append({"tokens": length, "keep_rate": rate, "kept": positions.shape[1], "full_s": full,
                         "kept_s": t, "time_ratio": t / full, "token_ratio": positions.shape[1] / length})
    print(f"\n{'S':>6} {'keep':>5} {'K':>6} {'all S s':>8} {'K s':>7} {'time K/S':>9} {'tokens K/S':>11}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['keep_rate']:>5} {r['kept']:>6} {r['full_s']:>8.3f} {r['kept_s']:>7.3f} "
              f"{r['time_ratio']:>9.3f} {r['token_ratio']:>11.3f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
