"""Reference-engine prefill: K kept tokens at their original positions vs all S tokens, on the demo target.

    .venv/bin/python lab/benchmarks/bench_engine.py [--lengths 4096 8192] [--keep 0.1 0.3 0.5 1.0] [--repeats 3]
    python lab/benchmarks/bench_engine.py --model PAIR/target --device cuda --lengths 16384 32768   # on a GPU

Prints the time ratio next to K/S: attention is quadratic and the rest linear, so the ratio should sit
at or below K/S once attention dominates, and a little above it for short prompts (fixed costs). It also
times the same K tokens at positions 0..K-1, which should take as long: positions only turn RoPE. The
prefill runs in the engine's chunks (``--chunk``).
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
from specprefill_lab.demo_models import ensure_demo_models


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def chunked_prefill(model, ids: torch.Tensor, positions: torch.Tensor, chunk: int) -> None:
    """As the engine reads a prompt: ``chunk`` tokens per forward into one cache."""
    cache = None
    for start in range(0, ids.shape[1], chunk):
        _, cache = prefill(
            model, ids[:, start : start + chunk], positions[:, start : start + chunk], cache, capacity=ids.shape[1]
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--keep", type=float, nargs="+", default=[0.1, 0.3, 0.5, 1.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="target model folder (default: the demo target)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--chunk", type=int, default=2048, help="prompt tokens per forward (the engine's prefill_chunk)"
    )
    args = parser.parse_args()
    model = load_causal_lm(args.model or ensure_demo_models() / "target", device=args.device)
    device = model.device
    rows = []
    for length in args.lengths:
        ids = torch.randint(10, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
        ids = ids.to(device)
        full = median_time(
            lambda: chunked_prefill(model, ids, torch.arange(length, device=device)[None], args.chunk), args.repeats
        )
        for rate in tqdm(args.keep, desc=f"{length} tokens", unit="rate"):
            kept = math.ceil(length * rate)
            # evenly spread kept positions ending at the last token, as the gateway sends them
            positions = torch.linspace(0, length - 1, kept).round().long().unique()[None].to(device)
            kept_ids = ids[:, positions[0]]
            t = median_time(lambda: chunked_prefill(model, kept_ids, positions, args.chunk), args.repeats)
            contiguous = torch.arange(positions.shape[1], device=device)[None]
            t0 = median_time(lambda: chunked_prefill(model, kept_ids, contiguous, args.chunk), args.repeats)
            rows.append(
                {
                    "tokens": length,
                    "keep_rate": rate,
                    "kept": positions.shape[1],
                    "full_s": full,
                    "kept_s": t,
                    "kept_contiguous_s": t0,
                    "time_ratio": t / full,
                    "token_ratio": positions.shape[1] / length,
                }
            )
    print(
        f"\n{'S':>6} {'keep':>5} {'K':>6} {'all S s':>8} {'K s':>7} {'K at 0..K-1 s':>14} {'time K/S':>9} "
        f"{'tokens K/S':>11}"
    )
    for r in rows:
        print(
            f"{r['tokens']:>6} {r['keep_rate']:>5} {r['kept']:>6} {r['full_s']:>8.3f} {r['kept_s']:>7.3f} "
            f"{r['kept_contiguous_s']:>14.3f} {r['time_ratio']:>9.3f} {r['token_ratio']:>11.3f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
