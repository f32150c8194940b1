"""Draft prefix reuse and request batching, each measured side by side in one run, on the demo draft.

    .venv/bin/python lab/benchmarks/bench_draft_scaling.py [--doc-tokens 16384] [--question-tokens 100]
                                                      [--concurrent 8] [--prompt-tokens 1024]

1. Prefix reuse: a shared document, then the same document with a new question; scoring time with the
   draft's KV of the document reused vs scored from scratch (medians of --repeats, new questions each time).
2. Batching: --concurrent requests of --prompt-tokens each arriving together; throughput (prompts/s) when
   the draft-worker batches them into one forward vs runs them one at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from draft_worker import DraftWorker, ScoringConfig
from draft_worker.batching import ScoreBatcher
from specprefill_lab.demo_models import ensure_demo_models


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def bench_prefix_reuse(model_dir: str, doc_tokens: int, question_tokens: int, repeats: int) -> dict:
    reuse = DraftWorker.from_pretrained(model_dir, ScoringConfig(), device="cpu", prefix_cache_bytes=4 << 30)
    scratch = DraftWorker(reuse.model, reuse.tokenizer, ScoringConfig(), prefix_cache_bytes=0)
    vocab = reuse.model.config.vocab_size
    document = _ids(doc_tokens, 0, vocab)
    reuse.score(document + _ids(question_tokens, 1, vocab))  # the document's first question fills the cache
    scratch.score(document[:1024])  # warm-up
    timings = {"reuse": [], "scratch": []}
    for i in range(repeats):
        prompt = document + _ids(question_tokens, 100 + i, vocab)
        for name, worker in (("reuse", reuse), ("scratch", scratch)):
            start = time.perf_counter()
            worker.score(prompt)
            timings[name].append(time.perf_counter() - start)
    reuse_s, scratch_s = statistics.median(timings["reuse"]), statistics.median(timings["scratch"])
    return {
        "doc_tokens": doc_tokens,
        "question_tokens": question_tokens,
        "scratch_s": scratch_s,
        "reuse_s": reuse_s,
        "speedup": scratch_s / reuse_s,
    }


async def _throughput(worker: DraftWorker, prompts: list[list[int]], max_batch_size: int) -> tuple[float, int]:
    batcher = ScoreBatcher(worker, max_batch_size=max_batch_size, max_wait_s=0.005)
    await asyncio.gather(*(batcher.score(p) for p in prompts[:2]))  # warm-up
    batcher.batches = 0
    start = time.perf_counter()
    await asyncio.gather(*(batcher.score(p) for p in prompts))
    elapsed = time.perf_counter() - start
    await batcher.close()
    return len(prompts) / elapsed, batcher.batches


def bench_batching(model_dir: str, concurrent: int, prompt_tokens: int, repeats: int) -> dict:
    worker = DraftWorker.from_pretrained(model_dir, ScoringConfig(), device="cpu", prefix_cache_bytes=0)
    vocab = worker.model.config.vocab_size
    results = {"batched": [], "one_at_a_time": []}
    for r in range(repeats):
        prompts = [_ids(prompt_tokens, 1000 * r + i, vocab) for i in range(concurrent)]
        results["batched"].append(asyncio.run(_throughput(worker, prompts, concurrent)))
        results["one_at_a_time"].append(asyncio.run(_throughput(worker, prompts, 1)))
    batched = statistics.median(t for t, _ in results["batched"])
    single = statistics.median(t for t, _ in results["one_at_a_time"])
    return {
        "concurrent": concurrent,
        "prompt_tokens": prompt_tokens,
        "batched_prompts_per_s": batched,
        "one_at_a_time_prompts_per_s": single,
        "speedup": batched / single,
        "batches": results["batched"][0][1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doc-tokens", type=int, default=16384)
    parser.add_argument("--question-tokens", type=int, default=100)
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="draft model folder (default: the demo draft)")
    args = parser.parse_args()
    model_dir = args.model or str(ensure_demo_models() / "draft")
    reuse = bench_prefix_reuse(model_dir, args.doc_tokens, args.question_tokens, args.repeats)
    print(f"\nprefix reuse: {reuse['doc_tokens']}-token document + a new {reuse['question_tokens']}-token question")
    print(
        f"  from scratch {reuse['scratch_s']:.3f} s, with reuse {reuse['reuse_s']:.3f} s: "
        f"{reuse['speedup']:.1f}x faster"
    )
    batching = bench_batching(model_dir, args.concurrent, args.prompt_tokens, args.repeats)
    print(f"\nbatching: {batching['concurrent']} concurrent {batching['prompt_tokens']}-token prompts")
    print(
        f"  one at a time {batching['one_at_a_time_prompts_per_s']:.1f} prompts/s, batched "
        f"{batching['batched_prompts_per_s']:.1f} prompts/s ({batching['batches']} forwards): "
        f"{batching['speedup']:.2f}x"
    )


if __name__ == "__main__":
    main()
