"""Scoring cost vs a plain prefill on the demo draft: time and peak memory, side by side in one run.

    .venv/bin/python benchmarks/bench_scorer.py [--lengths 1024 4096 16384] [--repeats 5] [--json out.json]

Time: median of ``--repeats`` runs after a warm-up, in this process. Memory: each measurement runs in a
fresh subprocess (no allocator cache from earlier runs); the resident-set high-water mark is reset with
/proc/self/clear_refs after loading and warming up, so the reported peak is what the one call added.
A "plain prefill" is what a serving engine runs: the same model, use_cache=True, logits for the last token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from draft_worker import DraftWorker, ScoringConfig
from specprefill.lab.demo_models import ensure_demo_models


def _prompt(length: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(length)
    return torch.randint(10, vocab, (length,), generator=g).tolist()


@torch.inference_mode()
def plain_prefill(model, ids: list[int]) -> None:
    model(torch.tensor([ids], device=model.device), use_cache=True, logits_to_keep=1)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure_peak(model_dir: str, mode: str, length: int) -> int:
    """Runs in a child process: peak resident bytes added by one call."""
    worker = DraftWorker.from_pretrained(model_dir, ScoringConfig(), device="cpu")
    ids = _prompt(length, worker.model.config.vocab_size)
    plain_prefill(worker.model, ids[:64])  # thread pools, lazy init
    worker.score(ids[:64])
    Path("/proc/self/clear_refs").write_text("5")
    base = _rss_kib("VmRSS")
    if mode == "plain":
        plain_prefill(worker.model, ids)
    else:
        worker.score(ids)
    return (_rss_kib("VmHWM") - base) * 1024


def peak_in_subprocess(model_dir: str, mode: str, length: int) -> int:
    code = (
        "import sys; sys.path.insert(0, %r); from bench_scorer import measure_peak; "
        "print(measure_peak(%r, %r, %d))" % (str(Path(__file__).parent), model_dir, mode, length)
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def time_call(fn, repeats: int) -> tuple[float, float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), (max(times) - min(times))


def run(lengths: list[int], repeats: int, model_dir: str | None = None) -> list[dict]:
    model_dir = model_dir or str(ensure_demo_models() / "draft")
    worker = DraftWorker.from_pretrained(model_dir, ScoringConfig(), device="cpu")
    rows = []
    for length in tqdm(lengths, desc="scorer bench", unit="length"):
        ids = _prompt(length, worker.model.config.vocab_size)
        plain_s, plain_spread = time_call(lambda: plain_prefill(worker.model, ids), repeats)
        score_s, score_spread = time_call(lambda: worker.score(ids), repeats)
        plain_mem = peak_in_subprocess(model_dir, "plain", length)
        score_mem = peak_in_subprocess(model_dir, "score", length)
        rows.append(
            {
                "tokens": length,
                "prefill_s": plain_s,
                "prefill_spread_s": plain_spread,
                "score_s": score_s,
                "score_spread_s": score_spread,
                "time_ratio": score_s / plain_s,
                "prefill_peak_mib": plain_mem / 2**20,
                "score_peak_mib": score_mem / 2**20,
                "memory_ratio": score_mem / plain_mem,
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'tokens':>7} {'prefill s':>10} {'score s':>9} {'time x':>7} {'prefill MiB':>12} {'score MiB':>10} {'mem x':>6}")
    for r in rows:
        print(
            f"{r['tokens']:>7} {r['prefill_s']:>10.3f} {r['score_s']:>9.3f} {r['time_ratio']:>7.3f} "
            f"{r['prefill_peak_mib']:>12.1f} {r['score_peak_mib']:>10.1f} {r['memory_ratio']:>6.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default=None, help="draft model folder (default: the demo draft)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    rows = run(args.lengths, args.repeats, args.model)
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
