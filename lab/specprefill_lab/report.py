"""The bench's outputs: ``bench.json`` and the plots."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from specprefill_lab.bench import Row, Sample


def write_outputs(out_dir: Path, rows: list[Row], samples: list[Sample], load: dict | None, meta: dict) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "rows": [asdict(r) for r in rows], "samples": [asdict(s) for s in samples]}
    if load:
        payload["load"] = load
    written = [out_dir / "bench.json"]
    written[0].write_text(json.dumps(payload, indent=2))
    written += plot(out_dir, rows, load)
    return written


def merge_outputs(out_dir: Path, sources: list[Path]) -> list[Path]:
    """Several sweeps' ``bench.json`` (one per length, say) as one: their rows, samples and each one's meta."""
    payloads = [json.loads(Path(source).read_text()) for source in sources]
    rows = sorted((Row(**r) for p in payloads for r in p["rows"]), key=lambda r: (r.tokens, r.keep_rate))
    samples = [Sample(**s) for p in payloads for s in p["samples"]]
    meta = {"merged": [{"source": str(source), **p["meta"]} for source, p in zip(sources, payloads, strict=True)]}
    return write_outputs(out_dir, rows, samples, None, meta)


def plot(out_dir: Path, rows: list[Row], load: dict | None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if rows:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        lengths = sorted({r.tokens for r in rows})
        direct = [next(r.direct_s for r in rows if r.tokens == n) for n in lengths]
        ax1.plot(lengths, direct, "k-o", label="direct (full prompt)")
        for keep in sorted({r.keep_rate for r in rows}):
            sel = [r for r in rows if r.keep_rate == keep]
            ax1.plot([r.tokens for r in sel], [r.gateway_s for r in sel], "-o", label=f"gateway, keep {keep:g}")
            if keep < 1.0:
                ax2.plot([r.tokens for r in sel], [r.speedup for r in sel], "-o", label=f"measured, keep {keep:g}")
                ax2.plot(
                    [r.tokens for r in sel],
                    [r.ideal for r in sel],
                    "--",
                    color=ax2.lines[-1].get_color(),
                    label=f"ideal, keep {keep:g}",
                )
        ax1.set(xlabel="prompt tokens", ylabel="TTFT (s)", title="Time to first token", xscale="log", yscale="log")
        ax2.set(
            xlabel="prompt tokens", ylabel="speedup over direct", title="TTFT speedup: measured vs ideal", xscale="log"
        )
        ax1.legend(fontsize=8)
        ax2.legend(fontsize=7)
        fig.tight_layout()
        written.append(out_dir / "ttft.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    if load:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, results in load["results"].items():
            ax.plot([r["rate"] for r in results], [r["p50_s"] for r in results], "-o", label=f"{name} p50")
            ax.plot([r["rate"] for r in results], [r["p99_s"] for r in results], "--o", label=f"{name} p99")
        ax.axhline(load["slo_s"], color="grey", lw=0.8, label=f"objective {load['slo_s']:g} s")
        ax.set(xlabel="offered load (requests/s)", ylabel="TTFT (s)", title="TTFT under Poisson load")
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(out_dir / "load.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def write_workloads(
    out_dir: Path, modes: dict[str, list[dict]], samples: list, sessions: dict | None, meta: dict
) -> list[Path]:
    """``workloads.json`` and the plots: per arrival mode and workload, both paths' TTFT request by request
    (``workloads.png``); with Poisson sessions, TTFT p50 and p90 against the rate (``sessions.png``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "workloads.json"
    payload = {"meta": meta, "modes": modes, "samples": [asdict(s) for s in samples]}
    if sessions is not None:
        payload["sessions"] = sessions
    path.write_text(json.dumps(payload, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = [path]
    if modes:
        columns = max(len(rows) for rows in modes.values())
        fig, axes = plt.subplots(len(modes), columns, figsize=(3.2 * columns, 3.0 * len(modes)), squeeze=False)
        for line, (mode, rows) in zip(axes, modes.items()):
            for ax, row in zip(line, rows):
                index = [r["index"] + 1 for r in row["requests"]]
                ax.plot(index, [r["direct_s"] for r in row["requests"]], "k-o", label="direct")
                ax.plot(index, [r["gateway_s"] for r in row["requests"]], "-o", color="tab:blue", label="gateway")
                ax.set(title=f"{row['workload']} ({mode})", xlabel="request", yscale="log", xticks=index)
            line[0].set(ylabel="TTFT (s)")
        axes[0][0].legend(fontsize=8)
        fig.suptitle(
            f"Time to first token, request by request ({meta.get('engine', '')}, "
            f"{meta.get('workload_tokens', '')} tokens, keep {meta.get('keep_rate', '')})",
            fontsize=10,
        )
        fig.tight_layout()
        written.append(out_dir / "workloads.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    if sessions is not None:
        summary = sessions["summary"]
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, color in (("gateway", "tab:blue"), ("direct", "black")):
            entries = [e for e in summary["rates"] if name in e["paths"]]
            rates = [e["rate"] for e in entries]
            ax.plot(rates, [e["paths"][name]["p50_s"] for e in entries], "-o", color=color, label=f"{name} p50")
            ax.plot(rates, [e["paths"][name]["p90_s"] for e in entries], "--o", color=color, label=f"{name} p90")
        if "objective_s" in summary:
            ax.axhline(summary["objective_s"], color="grey", lw=0.8, label="objective (2x direct p90, lowest rate)")
        ax.set(
            xlabel="sessions started per second",
            ylabel="TTFT (s)",
            yscale="log",
            title=f"Mixed sessions, Poisson arrivals ({meta.get('engine', '')})",
        )
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(out_dir / "sessions.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written
