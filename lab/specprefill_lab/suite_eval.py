"""The suite (``suite``) through live gateways: where SpecPrefill holds and where it breaks.

Every variant is one ``specprefill serve`` process serving the suite pair's target (the in-process reference
engine), asked with the OpenAI SDK as a user would, ``x-keep-rate`` per request:

- ``specprefill``: the pair's draft with the paper's settings (look-ahead 8, pooling 13, chunks of 32);
- ``random``, ``head``, ``tail``: ``--draft-model baseline:…``, the same selection rule on baseline scores;
- ``upper``: the target as its own draft, an upper bound on what better scoring could buy;
- with ``ablations``, the paper's knobs one at a time: look-ahead 1 and 4, pooling off, chunks of 1, 8 and 64,
  protection off.

The full prompt (``x-specprefill: off``) is asked once per sample. Planner ``fresh``: this target costs about
what its draft does, so the cost planner would send every prompt whole and measure nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from tqdm import tqdm

from specprefill_lab.launch import launched_gateway
from specprefill_lab.suite import FAMILIES, TaskSample, evidence_kept, samples

KEEP_RATES = (0.05, 0.1, 0.3, 0.5, 1.0)
METHODS = ("specprefill", "random", "head", "tail", "upper")
ABLATIONS = {
    "look-ahead 1": ["--look-ahead", "1"],
    "look-ahead 4": ["--look-ahead", "4"],
    "pool 1": ["--pool-kernel", "1"],
    "chunk 1": ["--chunk-size", "1"],
    "chunk 8": ["--chunk-size", "8"],
    "chunk 64": ["--chunk-size", "64"],
    "no protection": ["--protect-first", "0", "--protect-last", "0"],
}
DEFAULTS = "defaults (8, 13, 32, protected)"


@dataclass
class VariantResult:
    variant: str
    accuracy: dict[str, dict[str, float]] = field(default_factory=dict)  # family -> keep rate -> fraction correct
    kept_fraction: dict[str, dict[str, float]] = field(default_factory=dict)
    evidence: dict[str, dict[str, float]] = field(default_factory=dict)  # ... -> the answer's source words all kept


@dataclass
class SuiteResult:
    samples: int
    words: int
    tokens_mean: dict[str, float]
    full: dict[str, float]  # family -> full-prompt accuracy
    methods: list[VariantResult]
    ablations: list[VariantResult] = field(default_factory=list)


def _gateway_args(pair: Path, draft: str, extra: list[str]) -> list[str]:
    """The score cache stays on: the dry run that follows each request reads that request's scores."""
    return [
        "--target-model",
        str(pair / "target"),
        "--draft-model",
        draft,
        "--served-model-name",
        "suite",
        "--planner",
        "fresh",
        "--min-prompt-tokens",
        "64",
        "--device",
        "cpu",
        *extra,
    ]


def _ask(client: openai.OpenAI, sample: TaskSample, headers: dict[str, str]) -> tuple[bool, float]:
    """Whether the answer is right, and the fraction of the prompt the target read."""
    expected = sample.answer.split()
    raw = client.completions.with_raw_response.create(
        model="suite", prompt=sample.prompt, max_tokens=len(expected) + 1, temperature=0, extra_headers=headers
    )
    words = raw.parse().choices[0].text.split()
    kept = int(raw.headers["x-specprefill-kept-tokens"]) / int(raw.headers["x-specprefill-original-tokens"])
    return words[: len(expected)] == expected, kept


def _evidence(client: openai.OpenAI, sample: TaskSample, keep: float) -> bool:
    """Whether the selection keeps what the answer is read from (``evidence_kept``), from the gateway's own
    dry run of the same request (``/v1/specprefill/compress``: the same plan)."""
    plan = client.post(
        "/specprefill/compress",
        cast_to=httpx.Response,
        body={"model": "suite", "prompt": sample.prompt, "specprefill": {"keep_rate": keep}},
    ).json()
    return evidence_kept(sample.family, sample.prompt, {p - 1 for p in plan["position_ids"]})  # BOS comes first


def _run_variant(url: str, name: str, data: dict[str, list[TaskSample]], keep_rates: list[float]) -> VariantResult:
    result = VariantResult(name)
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        for family, family_samples in data.items():
            result.accuracy[family], result.kept_fraction[family], result.evidence[family] = {}, {}, {}
            for keep in keep_rates:
                correct, kept, evidence = 0, 0.0, 0
                for sample in tqdm(family_samples, desc=f"{name}: {family} keep {keep:g}", unit="prompt", leave=False):
                    ok, fraction = _ask(client, sample, {"x-keep-rate": f"{keep:g}"})
                    correct, kept = correct + ok, kept + fraction
                    evidence += _evidence(client, sample, keep)
                result.accuracy[family][f"{keep:g}"] = correct / len(family_samples)
                result.kept_fraction[family][f"{keep:g}"] = kept / len(family_samples)
                result.evidence[family][f"{keep:g}"] = evidence / len(family_samples)
    return result


def evaluate_suite(
    pair: Path,
    *,
    families: list[str] = list(FAMILIES),
    samples_per_family: int = 50,
    words: int = 1024,
    keep_rates: list[float] = list(KEEP_RATES),
    seed: int = 1234,
    methods: list[str] = list(METHODS),
    ablations: bool = False,
) -> SuiteResult:
    data = {family: samples(family, samples_per_family, words, seed) for family in families}
    compressed = [k for k in keep_rates if k < 1]
    drafts = {
        "specprefill": str(pair / "draft"),
        "upper": str(pair / "target"),
        "random": "baseline:random",
        "head": "baseline:head",
        "tail": "baseline:tail",
    }
    full: dict[str, float] = {}
    tokens: dict[str, float] = {}
    results = []
    for method in tqdm(methods, desc="suite", unit="variant"):
        with launched_gateway(_gateway_args(pair, drafts[method], [])) as url:
            if not full:
                with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
                    for family, family_samples in data.items():
                        asked = [
                            _ask(client, s, {"x-specprefill": "off"})[0]
                            for s in tqdm(family_samples, desc=f"full prompt: {family}", leave=False)
                        ]
                        full[family] = sum(asked) / len(asked)
                        tokens[family] = sum(len(s.prompt.split()) + 1 for s in family_samples) / len(family_samples)
            results.append(_run_variant(url, method, data, compressed))
    ablation_results = []
    if ablations:
        for name, args in tqdm(ABLATIONS.items(), desc="ablations", unit="setting"):
            with launched_gateway(_gateway_args(pair, str(pair / "draft"), args)) as url:
                ablation_results.append(_run_variant(url, name, data, compressed))
    if 1.0 in keep_rates:  # keep 1 sends the whole prompt (``select_tokens``): the full prompt's answers
        for r in results + ablation_results:
            for family in data:
                r.accuracy[family]["1"], r.kept_fraction[family]["1"] = full[family], 1.0
                r.evidence[family]["1"] = 1.0
    return SuiteResult(samples_per_family, words, tokens, full, results, ablation_results)


def format_suite(result: SuiteResult) -> str:
    keeps = sorted({k for r in result.methods + result.ablations for f in r.accuracy.values() for k in f}, key=float)
    lines = [f"suite: {result.samples} samples per family, ~{result.words} words of context"]
    for family in result.full:
        lines.append(f"\n{family} (~{result.tokens_mean[family]:.0f} tokens): full prompt {result.full[family]:.0%}")
        lines.append(f"{'':>32} " + " ".join(f"{'keep ' + k:>9}" for k in keeps))
        for title, rows in (("", result.methods), ("ablation: ", result.ablations)):
            for r in rows:
                cells = " ".join(f"{r.accuracy[family][k]:>9.0%}" for k in keeps)
                kept = " ".join(f"{r.evidence[family][k]:>9.0%}" for k in keeps)
                lines.append(f"{title + r.variant:>32} {cells}")
                lines.append(f"{'(evidence kept)':>32} {kept}")
    return "\n".join(lines)


def plot_suite(result: SuiteResult, path: Path) -> Path:
    """One column per family: accuracy (top, the full prompt dashed) and how often the selection kept every word
    the answer is read from (bottom), against keep rate, for every method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = list(result.full)
    fig, axes = plt.subplots(
        2, len(families), figsize=(3.2 * len(families), 6.2), sharey=True, sharex=True, squeeze=False
    )
    for column, family in enumerate(families):
        for row, metric in enumerate(("accuracy", "evidence")):
            ax = axes[row][column]
            for r in result.methods:
                values = getattr(r, metric)[family]
                keeps = sorted(values, key=float)
                ax.plot(
                    [float(k) for k in keeps],
                    [values[k] for k in keeps],
                    marker="o",
                    ms=3,
                    label=r.variant,
                    lw=2.5 if r.variant == "specprefill" else 1.2,
                    ls=":" if r.variant == "upper" else "-",
                )
            if metric == "accuracy":
                ax.axhline(result.full[family], color="k", ls="--", lw=1, label="full prompt")
                ax.set_title(family)
            else:
                ax.set_xlabel("keep rate")
            ax.set(xscale="log", ylim=(-0.02, 1.05))
    axes[0][0].set_ylabel("answers right")
    axes[1][0].set_ylabel("answer's source words kept")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
