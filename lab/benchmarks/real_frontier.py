"""The frontier of accuracy against cold TTFT from committed files, asking nothing: the answers of
``specprefill eval --real`` runs and the ``specprefill bench`` runs of each draft, one point per draft, keep rate
and length that both measured (accuracy as a share of the whole prompt's, the mean over the passkey, fact and
code tasks; TTFT as a share of direct's):

    .venv/bin/python lab/benchmarks/real_frontier.py --answers A.jsonl [--answers B.jsonl] \\
        --speed DRAFT=BENCH.json [--speed DRAFT=OTHER.json] --out frontier.png [--title NAME]

A draft may be named with several bench runs (one per length); where two answer files answered one question, the
later file's answer counts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specprefill_lab.real_eval import answered, frontier, plot_frontier, summarize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--answers", type=Path, action="append", required=True, help="an answers.jsonl (repeatable)")
    parser.add_argument("--speed", action="append", required=True, help="DRAFT=a bench folder or its bench.json")
    parser.add_argument("--out", type=Path, required=True, help="the plot (PNG); its points beside it as JSON")
    parser.add_argument("--title", default="Qwen2.5-Coder-1.5B-Instruct")
    args = parser.parse_args()
    for spec in args.speed:
        if "=" not in spec:
            parser.error(f"--speed {spec!r}: write it as DRAFT=FILE")
    speeds = [(draft, where) for draft, _, where in (s.partition("=") for s in args.speed)]
    points = frontier(summarize(answered(args.answers)), speeds)
    if not points:
        parser.error("no draft, keep rate and length is in both the answers and the bench runs")
    plot_frontier(points, args.out, args.title)
    args.out.with_suffix(".json").write_text(json.dumps(points, indent=1) + "\n")
    for p in sorted(points, key=lambda p: (p["draft"], p["length"], p["keep"])):
        print(
            f"{p['draft']:>20s}  {p['length']:>6d} tokens  keep {p['keep']:<5g}  TTFT {p['ttft_of_direct']:.2f} of "
            f"direct  accuracy {p['accuracy_of_full']:.2f} of the whole prompt's ({', '.join(p['tasks'])})"
        )
    print(f"wrote {args.out}, {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
