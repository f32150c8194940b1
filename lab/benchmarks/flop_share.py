"""The least cold TTFT over direct that a draft and target pair can reach where time follows arithmetic:

    .venv/bin/python lab/benchmarks/flop_share.py [--lengths 2000,8000,16000] [--keep-rates 0.3,0.1]
    .venv/bin/python lab/benchmarks/flop_share.py --pair llama-3.1-8b:llama-3.1-70b   (a named pair of shapes)
    .venv/bin/python lab/benchmarks/flop_share.py --draft-layers 18   (the draft's first 18 layers)

SpecPrefill's TTFT is the draft's read of the whole prompt (a prefill, then ``--look-ahead`` decode steps whose
queries are scored) plus the target's prefill of the kept tokens, against the target's prefill of the whole
prompt. This counts the multiply-adds of each (``specprefill_lab.flops``: every linear layer's, and causal
attention's, half of the square), from the models' ``config.json`` or a named shape, and prints their ratio: what
the gateway would reach where both models ran every FLOP at one rate, with nothing else in the way. A measured
ratio above it is the draft running its FLOPs slower than the target runs its own (smaller matrices, narrower
heads); below it, the target running slower (its long prompt's attention on a kernel that falls behind). Where a
goal is below it, only a draft that does less arithmetic meets it on hardware of one rate per FLOP: fewer layers,
local attention, tokens dropped between layers. Nothing is loaded but the configs.
"""

from __future__ import annotations

import argparse
import dataclasses

from specprefill_lab.flops import REAL_PAIR, shape, shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default=":".join(REAL_PAIR), help="DRAFT:TARGET, each a name above or a folder")
    parser.add_argument("--lengths", default="2000,8000,16000,32000")
    parser.add_argument("--keep-rates", default="0.3,0.1,0.05")
    parser.add_argument("--look-ahead", type=int, default=8, help="the draft's scored steps (its default)")
    parser.add_argument("--window", type=int, default=16, help="the observation window's prompt tokens")
    parser.add_argument("--draft-layers", type=int, help="the draft's first K layers only (--draft-layers K)")
    args = parser.parse_args()
    draft_name, _, target_name = args.pair.partition(":")
    draft, target = shape(draft_name), shape(target_name)
    if args.draft_layers:
        draft = dataclasses.replace(draft, layers=args.draft_layers)
    print(f"draft {draft_name}: {draft}\ntarget {target_name}: {target}")
    print("tokens | keep | draft's read / direct | kept tokens' read / direct | the least TTFT over direct")
    for tokens in (int(n) for n in args.lengths.split(",")):
        for keep in (float(k) for k in args.keep_rates.split(",")):
            s = shares(draft, target, tokens, keep, args.look_ahead, args.window)
            print(f"{tokens:6d} | {keep:4.2f} | {s['draft']:.3f} | {s['kept']:.3f} | {s['total']:.3f}")


if __name__ == "__main__":
    main()
