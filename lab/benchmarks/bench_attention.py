"""One prefill chunk's attention over a cache, the two ways the engine can run it (a GPU benchmark):

    python lab/benchmarks/bench_attention.py [--chunk 2048] [--cache 8192 32768 131072] [--json FILE]

``mask``: transformers' SDPA path as the engine took it before, a [Q, K] boolean mask aligned at the end of the
keys (the keys and values repeated per query group, the memory-efficient kernel). ``lower-right``:
``common.attention.lower_right_causal_attention``, the flash kernel with its causal mask aligned at the end.
Shapes default to Qwen2.5-32B's attention (40 query heads, 8 KV heads, 128 dimensions, bf16); per chunk and, for
the whole prompt, the sum over its chunks (the attention share of a cold prefill at that length).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from common.attention import lower_right_causal_attention


def timed(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument(
        "--cache", type=int, nargs="+", default=[8192, 32768, 131072], help="keys, the chunk's own included"
    )
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "a GPU benchmark"
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = args.heads // args.kv_heads, True
    rows = []
    for keys in args.cache:
        q = torch.randn(1, args.heads, args.chunk, args.head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = (
            torch.randn(1, args.kv_heads, keys, args.head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2)
        )
        mask = torch.ones(args.chunk, keys, dtype=torch.bool, device="cuda").tril(keys - args.chunk)[None, None]
        old = timed(lambda q=q, k=k, v=v, mask=mask: sdpa_attention_forward(module, q, k, v, mask, is_causal=False))
        new = timed(lambda q=q, k=k, v=v: lower_right_causal_attention(module, q, k, v))
        reference = sdpa_attention_forward(module, q, k, v, mask, is_causal=False)[0].float()
        error = (lower_right_causal_attention(module, q, k, v).float() - reference).abs().max().item()
        # a cold prompt of `keys` tokens: its chunks see chunk, 2 chunk, ... keys keys; time scales with keys seen
        chunks = keys // args.chunk
        whole = sum(range(1, chunks + 1)) / chunks
        rows.append(
            {
                "keys": keys,
                "chunk": args.chunk,
                "mask_ms": old * 1e3,
                "lower_right_ms": new * 1e3,
                "ratio": old / new,
                "max_abs_diff": error,
                "prompt_attention_s": {"mask": old * whole, "lower_right": new * whole},
            }
        )
        print(
            f"{keys:>7} keys: mask {old * 1e3:8.2f} ms, lower-right {new * 1e3:8.2f} ms ({old / new:.2f}x); "
            f"a cold {keys}-token prompt's attention per layer ≈ {old * whole:.3f} s vs {new * whole:.3f} s; "
            f"max |diff| {error:.1e}",
            flush=True,
        )
        del q, k, v, mask
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(0),
                    "torch": torch.__version__,
                    "heads": args.heads,
                    "kv_heads": args.kv_heads,
                    "head_dim": args.head_dim,
                    "rows": rows,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
