"""One decoder layer's causal attention over a whole prompt, for two head shapes, on the CPU (or a GPU):

    .venv/bin/python lab/benchmarks/attention_per_layer.py [--tokens 16384] [--shape 14x64 --shape 12x128]

The default shapes are the real pair's: Qwen2.5-Coder-0.5B (14 query heads of 64 dimensions) and 1.5B (12 of
128). Both have 336 query heads over all their layers (24 x 14 and 28 x 12), so where attention costs by its
scores (the softmax over each query's keys) rather than by its dimensions, the draft's attention costs as
much as the target's: one ``scaled_dot_product_attention(is_causal=True)`` call per shape, bfloat16, the best of
``--repeats``, with its rate in FLOP/s and in scores/s.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def seconds(heads: int, dim: int, tokens: int, repeats: int, device: str) -> float:
    q, k, v = (torch.randn(1, heads, tokens, dim, dtype=torch.bfloat16, device=device) for _ in range(3))
    F.scaled_dot_product_attention(q[:, :, :2048], k[:, :, :2048], v[:, :, :2048], is_causal=True)  # warm
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--shape", action="append", help="HEADSxDIM (repeatable; default: 14x64 and 12x128)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    for shape in args.shape or ["14x64", "12x128"]:
        heads, dim = map(int, shape.split("x"))
        took = seconds(heads, dim, args.tokens, args.repeats, args.device)
        scores = heads * args.tokens * args.tokens / 2
        print(
            f"{heads} heads x {dim}: {took:.2f} s a layer at {args.tokens} tokens, "
            f"{4 * scores * dim / took / 1e9:.0f} GFLOP/s, {scores / took / 1e9:.2f} G scores/s"
        )


if __name__ == "__main__":
    main()
