"""Which drafts keep the answer: for each of the real eval's haystacks, whether every token of the planted answer
(one of its occurrences) is among the tokens the target would read, per draft and keep rate.

    .venv/bin/python lab/benchmarks/draft_recall.py --lengths 2000 --samples 30 --drafts 0.5b-18,0.5b,target \\
        [--variant 'NAME=--draft-model DIR --look-ahead 16'] [--out recall.jsonl]

Each draft is a live gateway (the real eval's flags), asked the dry run ``/v1/specprefill/compress`` with
``x-keep-rate`` per request: the selection is the gateway's own, system prompt and protected ends included, and
only the draft runs, so a draft's choice is measured in a small fraction of the target's time. It is a proxy:
an answer kept is not an answer given (the target must still read it), and a model may answer from a kept
neighbour; the real eval's answers are the measure. Rows are appended to ``--out`` as they come and a rerun
skips those done.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

import httpx
from tqdm import tqdm

from common.models import load_tokenizer
from specprefill.real_models.catalog import DEFAULT_PAIR, real_pair
from specprefill_lab.launch import launched_gateway
from specprefill_lab.real_eval import (
    MAX_TOKENS,
    EvalPair,
    Keep,
    gateway_args,
    items,
    keep_label,
    keep_order,
    keep_request,
    named_variants,
    variants,
    wilson,
)


def answer_spans(text: str, answer: str, question_start: int) -> list[tuple[int, int]]:
    """Where the planted answer stands in the rendered chat (characters), before the question."""
    found = re.finditer(re.escape(answer), text, re.IGNORECASE)
    return [(m.start(), m.end()) for m in found if m.end() <= question_start]


def kept_answer(offsets: list[tuple[int, int]], kept: set[int], spans: list[tuple[int, int]]) -> bool:
    """Whether every token overlapping one of ``spans`` is kept."""
    for start, end in spans:
        tokens = [i for i, (a, b) in enumerate(offsets) if a < end and b > start]
        if tokens and all(i in kept for i in tokens):
            return True
    return False


def plan_row(client: httpx.Client, url: str, tokenizer, name: str, item, keep: Keep) -> dict:
    """One haystack's dry run at ``keep``: whether the planted answer is among the tokens kept."""
    messages = item.sample.messages
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    question = text.rfind(messages[-1]["content"].rsplit("\n\n", 1)[-1])
    spans = answer_spans(text, item.sample.answer, question)
    headers, extension = keep_request(keep)
    reply = client.post(
        f"{url}/v1/specprefill/compress",
        json={"messages": messages, "max_tokens": MAX_TOKENS, **(extension or {})},
        headers=headers,
    )
    reply.raise_for_status()
    plan = reply.json()
    assert plan["original_tokens"] == len(encoded["input_ids"]), "the gateway renders as the tokenizer"
    whole = range(len(encoded["input_ids"]))
    kept = set(plan["position_ids"] if plan["status"] == "compressed" else whole)
    return {
        "variant": name,
        "length": item.length,
        "index": item.index,
        "task": item.sample.task,
        "keep": keep,
        "applied": plan["keep_rate"],  # the rate applied (auto: the one the scores chose)
        "status": plan["status"],
        "kept": len(kept),
        "tokens": plan["original_tokens"],
        "found": bool(spans),
        "recalled": kept_answer(encoded["offset_mapping"], kept, spans),
    }


def print_table(path: Path) -> None:
    cells: dict[tuple, list[bool]] = defaultdict(list)
    rates: dict[tuple, list[float]] = defaultdict(list)
    for line in path.read_text().splitlines():
        r = json.loads(line)
        cell = (r["variant"], r["length"], r["task"], r["keep"])
        cells[cell].append(r["recalled"])
        rates[cell].append(r.get("applied", r["kept"] / r["tokens"]))
    print(f"{'draft':<24} {'length':>6} {'task':<8} {'keep':>8}  recalled            applied rate")
    for cell, got in sorted(cells.items(), key=lambda c: (c[0][1], c[0][2], keep_order(c[0][3]), c[0][0])):
        variant, length, task, keep = cell
        low, high = wilson(sum(got), len(got))
        applied = f"{statistics.fmean(rates[cell]):.3f} ± {statistics.pstdev(rates[cell]):.3f}"
        print(
            f"{variant:<24} {length:>6} {task:<8} {keep_label(keep):>8}  {sum(got):>3}/{len(got):<3} "
            f"[{low:.2f}, {high:.2f}]  {applied}"
        )


def _keep(raw: str) -> Keep:
    """``0.1`` a fixed rate, ``auto@0.5`` the auto rule with that mass target."""
    return raw if raw.startswith("auto@") else float(raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default=DEFAULT_PAIR)
    parser.add_argument("--lengths", default="2000")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--tasks", default="passkey,fact,code")
    parser.add_argument("--keep-rates", default="0.3,0.1,0.05", help="fixed rates, or auto@T: auto at target T")
    parser.add_argument("--drafts", default="", help="the real eval's draft names (comma-separated)")
    parser.add_argument("--draft-layers", default="", help="the smaller model's first-layer drafts to know")
    parser.add_argument("--variant", action="append", default=[], help="NAME=GATEWAY FLAGS (repeatable)")
    parser.add_argument("--out", type=Path, default=Path("recall.jsonl"))
    args = parser.parse_args()

    pair = EvalPair.made(real_pair(args.pair))
    known = variants(pair, draft_layers=[int(k) for k in args.draft_layers.split(",") if k])
    drafts = {name: known[name] for name in args.drafts.split(",") if name}
    drafts |= named_variants(args.variant)
    tasks, keeps = set(args.tasks.split(",")), [_keep(k) for k in args.keep_rates.split(",")]
    asked = [i for i in items(pair, [int(n) for n in args.lengths.split(",")], args.samples) if i.sample.task in tasks]
    tokenizer = load_tokenizer(pair.target)
    done = set()
    if args.out.exists():
        for line in args.out.read_text().splitlines():
            r = json.loads(line)
            done.add((r["variant"], r["length"], r["index"], r["task"], r["keep"]))
    with args.out.open("a") as sink:
        for name, flags in drafts.items():
            todo = [(i, k) for i in asked for k in keeps if (name, i.length, i.index, i.sample.task, k) not in done]
            if not todo:
                continue
            with launched_gateway([*gateway_args(pair, "cpu"), *flags]) as url, httpx.Client(timeout=1800) as client:
                for item, keep in tqdm(todo, desc=f"recall: {name}", unit="plan"):
                    sink.write(json.dumps(plan_row(client, url, tokenizer, name, item, keep)) + "\n")
                    sink.flush()
    print_table(args.out)


if __name__ == "__main__":
    main()
