"""What in the kept tokens makes the target miss: for chosen haystacks of the real eval, the gateway's own selection
(the dry run ``/v1/specprefill/compress`` of a live gateway with the default draft), then the target's greedy
answer, read in process at the kept tokens' original positions (``engine.runner``, as the reference engine reads
them), for variants of that selection:

- ``plan``: the selection as the gateway made it (the answer the real eval got);
- ``nearN``: the selection and every token within N of the planted answer;
- ``dropN``: the selection less its tokens farther than N from the planted answer (the chat's first 32 tokens and
  the last 80, the question, always kept);
- ``onlyN``: nothing but the tokens within N of the planted answer, the chat's head and the question;
- ``contig``: the selection at positions 0..K-1 instead of its own.

    .venv/bin/python lab/benchmarks/kept_context.py --length 16000 --task code --keep 0.3 --indices 29,32,36 \\
        --modes plan,near1024,drop1024,only256 --out kept-context.jsonl   # appends; a rerun skips rows done

A diagnostic, not a measure of quality: the real eval's answers are that.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx
import torch

from common.models import eos_token_ids, load_causal_lm, load_tokenizer
from engine.runner import decode_one, prefill
from specprefill.real_models.catalog import DEFAULT_PAIR, real_pair
from specprefill_lab.launch import launched_gateway
from specprefill_lab.real_eval import MAX_TOKENS, EvalPair, gateway_args, items, keep_request, variants

HEAD, QUESTION = 32, 80  # the chat's first tokens and the last ones (the question), kept by every variant


def selection(mode: str, kept: list[int], at: int, total: int) -> tuple[list[int], list[int]]:
    """The tokens a variant reads (indices into the prompt) and the positions it reads them at."""
    if mode == "plan":
        return kept, kept
    if mode == "contig":
        return kept, list(range(len(kept)))
    n = int(mode[4:])
    near = set(range(max(0, at - n), min(total, at + n)))
    ends = set(range(HEAD)) | set(range(total - QUESTION, total))
    if mode.startswith("near"):
        chosen = sorted(set(kept) | near)
    elif mode.startswith("drop"):
        chosen = [i for i in kept if i in near or i in ends]
    elif mode.startswith("only"):
        chosen = sorted(near | ends)
    else:
        raise SystemExit(f"unknown mode {mode!r}: plan, contig, nearN, dropN or onlyN")
    return chosen, chosen


def greedy(model, tokens: list[int], positions: list[int], eos: set[int], steps: int = MAX_TOKENS) -> list[int]:
    """The target's greedy answer to ``tokens`` at ``positions`` (its answer continues after the last)."""
    with torch.inference_mode():
        logits, cache = prefill(model, torch.tensor([tokens]), torch.tensor([positions]), capacity=len(tokens) + steps)
        out: list[int] = []
        position = positions[-1] + 1
        for _ in range(steps):
            token = int(logits.argmax())
            if token in eos:
                break
            out.append(token)
            logits = decode_one(model, torch.tensor(token), position, cache)
            position += 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default=DEFAULT_PAIR)
    parser.add_argument("--length", type=int, default=16000)
    parser.add_argument("--task", default="code")
    parser.add_argument("--keep", type=float, default=0.3)
    parser.add_argument("--indices", required=True, help="the haystacks, comma-separated")
    parser.add_argument("--draft", default="", help="the real eval's draft name (default: the pair's default)")
    parser.add_argument("--modes", default="plan,near1024,drop1024,only256")
    parser.add_argument("--out", type=Path, default=Path("kept-context.jsonl"))
    args = parser.parse_args()

    pair = EvalPair.made(real_pair(args.pair))
    draft = args.draft or pair.default_variant
    wanted = {int(i) for i in args.indices.split(",")}
    done = set()
    if args.out.exists():
        done = {(r["index"], r["keep"], r["draft"]) for r in map(json.loads, args.out.read_text().splitlines())}
    asked = [
        i
        for i in items(pair, [args.length], max(wanted) + 1)
        if i.sample.task == args.task and i.index in wanted and (i.index, args.keep, draft) not in done
    ]
    if not asked:
        return
    tokenizer = load_tokenizer(pair.target)
    plans = []
    with launched_gateway([*gateway_args(pair, "cpu"), *variants(pair)[draft]]) as url, httpx.Client(timeout=1800) as c:
        headers, extension = keep_request(args.keep)
        for item in asked:
            body = {"messages": item.sample.messages, "max_tokens": MAX_TOKENS, **(extension or {})}
            reply = c.post(f"{url}/v1/specprefill/compress", json=body, headers=headers)
            reply.raise_for_status()
            plans.append(reply.json())
    model = load_causal_lm(pair.target, device="cpu")
    eos = set(eos_token_ids(model))
    with args.out.open("a") as sink:
        for item, plan in zip(asked, plans):
            text = tokenizer.apply_chat_template(item.sample.messages, tokenize=False, add_generation_prompt=True)
            encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
            start = text.find(item.sample.answer)
            at = next(i for i, (_, end) in enumerate(offsets) if end > start)
            kept = sorted(plan["position_ids"]) if plan["status"] == "compressed" else list(range(len(ids)))
            row = {"index": item.index, "length": args.length, "task": args.task, "keep": args.keep, "draft": draft}
            row |= {"expected": item.sample.answer, "tokens": len(ids), "kept": len(kept), "answers": {}}
            for mode in args.modes.split(","):
                chosen, positions = selection(mode, kept, at, len(ids))
                began = time.perf_counter()
                answer = tokenizer.decode(greedy(model, [ids[i] for i in chosen], positions, eos)).strip()
                row["answers"][mode] = {
                    "answer": answer,
                    "read": len(chosen),
                    "s": round(time.perf_counter() - began, 1),
                }
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
