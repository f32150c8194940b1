"""Scoring cost vs a plain prefill on a draft model: time and peak memory, side by side in one run.

    .venv/bin/python lab/benchmarks/bench_scorer.py [--lengths 1024 4096 16384] [--repeats 5] [--json out.json]
    python lab/benchmarks/bench_scorer.py --model PAIR/draft --device cuda --lengths 8192 16384 32768  # on a GPU

Every scoring call reads the prompt afresh (the draft's prefix cache is off: a cached prompt would measure
the cache). Time: median of ``--repeats`` runs after a warm-up, in this process (on CUDA, synchronised).
Memory on the CPU: each measurement runs in a fresh subprocess (no allocator cache from earlier runs); the
resident-set high-water mark is reset with /proc/self/clear_refs after loading and warming up, so the
reported peak is what the one call added. On CUDA: the allocator's peak over what was allocated before the
call (``torch.cuda.max_memory_allocated``), in this process. A "plain prefill" is what a serving engine runs:
the same model, use_cache=True, logits for the last token.
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
from specprefill_lab.demo_models import ensure_demo_models


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


def load_worker(model_dir: str, device: str = "cpu", dtype: str = "auto") -> DraftWorker:
    return DraftWorker.from_pretrained(model_dir, ScoringConfig(), device=device, dtype=dtype, prefix_cache_bytes=0)


def measure_peak(model_dir: str, mode: str, length: int) -> int:
    """Runs in a child process: peak resident bytes added by one call."""
    worker = load_worker(model_dir)
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


def cuda_peak(fn, kept: int = 0) -> int:
    """Bytes the CUDA allocator held at its peak during ``fn`` beyond what it held before, counting ``kept``
    bytes held before as the call's own (buffers a warm-up made that every call uses)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() - kept
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def time_call(fn, repeats: int) -> tuple[float, float]:
    cuda = torch.cuda.is_initialized()
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), (max(times) - min(times))


def run(
    lengths: list[int], repeats: int, model_dir: str | None = None, device: str = "cpu", dtype: str = "auto"
) -> list[dict]:
    model_dir = model_dir or str(ensure_demo_models() / "draft")
    worker = load_worker(model_dir, device, dtype)
    cuda = worker.model.device.type == "cuda"
    rows = []
    for length in tqdm(lengths, desc="scorer bench", unit="length"):
        ids = _prompt(length, worker.model.config.vocab_size)
        plain_s, plain_spread = time_call(lambda: plain_prefill(worker.model, ids), repeats)
        score_s, score_spread = time_call(lambda: worker.score(ids), repeats)
        extra = {}
        if cuda:
            plain_mem = cuda_peak(lambda: plain_prefill(worker.model, ids))
            graphs = worker.graphs
            buffers = sum(k.nbytes + v.nbytes for k, v in graphs.storage) if graphs and graphs.enabled else 0
            score_mem = cuda_peak(lambda: worker.score(ids), kept=buffers)
            worker.graphs = None  # the same scoring with the look-ahead's steps launched one by one
            extra["score_plain_steps_s"] = time_call(lambda: worker.score(ids), repeats)[0]
            extra["cuda_graphs"] = bool(graphs and graphs.enabled)
            worker.graphs = graphs
        else:
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
                **extra,
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'tokens':>7} {'prefill s':>10} {'score s':>9} {'time x':>7} "
        f"{'prefill MiB':>12} {'score MiB':>10} {'mem x':>6}"
    )
    for r in rows:
        print(
            f"{r['tokens']:>7} {r['prefill_s']:>10.3f} {r['score_s']:>9.3f} {r['time_ratio']:>7.3f} "
            f"{r['prefill_peak_mib']:>12.1f} {r['score_peak_mib']:>10.1f} {r['memory_ratio']:>6.3f}"
            + (f"   without CUDA graphs: {r['score_plain_steps_s']:.3f} s" if "score_plain_steps_s" in r else "")
        )


def profile(model_dir: str, device: str, dtype: str, length: int, trace: Path | None) -> None:
    """One scoring call and one plain prefill under torch.profiler: where the time goes, by phase
    (``specprefill.*`` ranges) and by kernel; ``trace``: a Chrome trace of the scoring call."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    worker = load_worker(model_dir, device, dtype)
    ids = _prompt(length, worker.model.config.vocab_size)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if worker.model.device.type == "cuda" else [])
    calls = (("plain prefill", lambda: plain_prefill(worker.model, ids)), ("scoring", lambda: worker.score(ids)))
    for name, fn in calls:
        for _ in range(2):
            fn()
        with torch_profile(activities=activities) as prof:
            fn()
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
        sort = "device_time_total" if ProfilerActivity.CUDA in activities else "cpu_time_total"
        print(f"\n== {name}, {length} tokens")
        print(prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=60))
        if trace is not None and name == "scoring":
            prof.export_chrome_trace(str(trace))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default=None, help="draft model folder (default: the demo draft)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16 or float16")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="instead: profile one scoring call and one plain prefill at the first length",
    )
    parser.add_argument("--trace", type=Path, default=None, help="with --profile: a Chrome trace of the scoring call")
    args = parser.parse_args()
    if args.profile:
        model_dir = args.model or str(ensure_demo_models() / "draft")
        profile(model_dir, args.device, args.dtype, args.lengths[0], args.trace)
        return
    torch.set_num_threads(torch.get_num_threads())
    rows = run(args.lengths, args.repeats, args.model, args.device, args.dtype)
    print_table(rows)
    if args.json:
        device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
        meta = {"device": device, "dtype": args.dtype, "model": args.model or "demo draft"}
        args.json.write_text(json.dumps({**meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
