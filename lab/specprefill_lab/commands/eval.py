"""``specprefill eval``: the built-in retrieval evaluation, the task suite, or a JSONL dataset against an OpenAI
endpoint."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings

from common.options import SETTINGS_CONFIG
from common.selection import validate_keep_rate
from specprefill.real_models.catalog import DEFAULT_PAIR, PAIRS, real_pair

if TYPE_CHECKING:
    from specprefill_lab.real_eval import EvalPair


class Eval(BaseSettings):
    """Answer quality vs keep rate: the built-in retrieval task, the --suite of five task families, or
    --dataset FILE.jsonl against --base-url."""

    model_config = SETTINGS_CONFIG
    keep_rates: list[float] = Field([0.1, 0.3, 0.5, 1.0], description="keep rates (comma-separated)")
    out: str = Field("eval_results", description="folder for eval.json (and eval.png)")
    samples: int = Field(100, description="retrieval: samples")
    words: int = Field(1500, description="retrieval: words of context per sample (about 1.1 tokens each)")
    pair: str | None = Field(
        None, description="retrieval: a pair's folder (DIR/draft, DIR/target); default: the one shipped in the package"
    )
    train: bool = Field(False, description="retrieval: retrain the pair into the cache first (about 20 min)")
    dataset: str | None = Field(None, description="JSONL rows: messages or prompt, answers, metric")
    base_url: str | None = Field(None, description="dataset: the gateway's base URL (without /v1)")
    model: str | None = Field(None, description="dataset: the model name at the gateway (default: its first)")
    direct_url: str | None = Field(None, description="dataset: the backend direct (default: x-specprefill: off)")
    direct_model: str | None = Field(None, description="dataset: the model name at --direct-url")
    max_tokens: int = Field(64, description="dataset: tokens generated per answer")
    api_key: str | None = Field(None, description="dataset: Bearer token for the gateway")
    sessions: bool = Field(
        False,
        description="retrieval across requests: one document, several questions, as "
        "chat turns and as separate requests, through a live gateway",
    )
    questions: int = Field(4, description="sessions: questions per document")
    session_samples: int = Field(40, description="sessions: documents")
    session_keep_rate: float = Field(0.1, description="sessions: keep rate through the gateway")
    cross_tokenizer: bool = Field(
        False,
        description="retrieval through live gateways with the pair's own draft and "
        "with --cross-draft (another tokenizer, mapped), and the mapping's cost",
    )
    cross_draft: str | None = Field(
        None,
        description="cross-tokenizer: the other draft (default: the shipped "
        "retrieval draft with a SentencePiece-style BPE, retrieval-pair/draft-bpe)",
    )
    suite: bool = Field(
        False,
        description="the RULER-style suite (single, multivalue, multiquery, variables, "
        "aggregation) through live gateways: SpecPrefill, random/head/tail chunks, and the target as "
        "its own draft (upper bound), at every --suite-keep-rates; --pair defaults to the suite pair",
    )
    families: list[str] = Field(
        ["single", "multivalue", "multiquery", "variables", "aggregation"],
        description="suite: task families (comma-separated)",
    )
    suite_samples: int = Field(50, description="suite: samples per family")
    suite_words: int = Field(
        1024, description="suite: words of context per sample (one token each; the suite pair was trained up to 2,048)"
    )
    suite_keep_rates: list[float] = Field([0.05, 0.1, 0.3, 0.5, 1.0], description="suite: keep rates")
    methods: list[str] = Field(
        ["specprefill", "random", "head", "tail", "upper"], description="suite: selection methods (comma-separated)"
    )
    ablations: bool = Field(
        False,
        description="suite: also the paper's ablations (look-ahead 1/4, pooling off, "
        "chunks of 1/8/64, protection off), each on the pair's draft",
    )
    real: bool = Field(
        False,
        description="a real pair on real text: facts planted in the standard library's prose, and its code, "
        "through live gateways with each draft (resumes from OUT/answers.jsonl); hours on 2 cores",
    )
    real_pair: str = Field(DEFAULT_PAIR, description=f"real: the pair ({', '.join(PAIRS)})")
    real_lengths: list[int] = Field([2000, 8000, 16000], description="real: chat lengths in tokens")
    real_samples: int = Field(30, description="real: haystacks per length (each asked every task)")
    real_default_samples: int = Field(
        50, description="real: haystacks for the full prompt and for the pair's default draft at keep 0.3 and 0.1"
    )
    real_keep_rates: list[float] = Field([0.3, 0.1, 0.05], description="real: keep rates (the full prompt too)")
    real_auto_targets: list[float] = Field(
        [], description="real: also x-keep-rate auto at each of these mass targets (cells named auto@T)"
    )
    real_drafts: list[str] | None = Field(
        None,
        description="real: which drafts, in this order (target, self-K for each --real-self-layers K, the "
        "smaller model (0.5b) and its first K layers for each --real-draft-layers K (0.5b-K), cross (SmolLM2), "
        "random, head, tail, each model draft with /wN for each --real-windows N; default: all)",
    )
    real_variant: list[str] = Field(
        [],
        description="real: NAME=GATEWAY FLAGS, a draft of its own (repeatable; asked after --real-drafts): e.g. "
        "'0.5b/w16/p8=--draft-model DIR --observation-window 16 --propagate-layer 8'",
    )
    real_self_layers: list[int] = Field([4, 8, 12], description="real: the self-drafts' layer counts")
    real_draft_layers: list[int] = Field([], description="real: the smaller model's first-layer drafts")
    real_windows: list[int] = Field(
        [], description="real: each model draft also with these observation windows (drafts named DRAFT/wN)"
    )
    real_tasks: list[str] = Field(
        [], description="real: only these tasks (passkey, fact, two-fact, code, rule; default: all)"
    )
    real_rule_length: int | None = Field(
        None, description="real: the instruction-following haystacks' length (0: none; default: every length)"
    )
    real_haystacks: Path | None = Field(
        None,
        description="real: ask the haystacks another run wrote (its OUT/haystacks.jsonl), not new ones (on "
        "another Python, whose standard library is other prose)",
    )
    real_haystacks_only: bool = Field(
        False, description="real: write OUT/haystacks.jsonl (for --real-haystacks elsewhere) and ask nothing"
    )
    real_device: str = Field("cpu", description="real: where each gateway runs both models (cpu, cuda)")
    real_parallel: int = Field(1, ge=1, description="real: gateways (drafts) asked at a time")
    real_speed: list[str] = Field(
        [],
        description="real: DRAFT=FOLDER, a `specprefill bench` run of that draft (its folder or bench.json) "
        "(repeatable): accuracy against cold TTFT, plotted (real-frontier.png)",
    )

    @field_validator("real_tasks")
    @classmethod
    def _real_tasks(cls, value: list[str]) -> list[str]:
        from specprefill_lab.haystack import CODE_TASK, RULE_TASK, TASKS

        unknown = set(value) - {*TASKS, CODE_TASK, RULE_TASK}
        if unknown:
            raise ValueError(f"unknown task {sorted(unknown)[0]!r}: use {', '.join([*TASKS, CODE_TASK, RULE_TASK])}")
        return value

    @field_validator("keep_rates", "suite_keep_rates", "real_keep_rates")
    @classmethod
    def _keep_rates(cls, value: list[float]) -> list[float]:
        return [validate_keep_rate(rate) for rate in value]

    def cli_cmd(self) -> None:
        from common.process import sigterm_unwinds

        with sigterm_unwinds():  # the servers it launched stopped on a SIGTERM too
            code = run_eval(self)
        raise SystemExit(code)


def run_eval(options: Eval) -> int:
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    if options.dataset:
        return _dataset(options, out)
    if options.suite:
        return _suite(options, out)
    if options.real:
        return _real(options, out)
    from specprefill_lab.eval import evaluate_retrieval, format_retrieval, plot_retrieval
    from specprefill_lab.retrieval import SHIPPED_PAIR
    from specprefill_lab.training import ensure_retrieval_pair

    if options.pair and options.train:
        print("specprefill eval: give --pair DIR or --train, not both", file=sys.stderr)
        return 2
    pair = Path(options.pair) if options.pair else ensure_retrieval_pair() if options.train else SHIPPED_PAIR
    if not (pair / "draft").is_dir() or not (pair / "target").is_dir():
        print(f"specprefill eval: {pair} needs draft/ and target/ model folders", file=sys.stderr)
        return 2
    if options.sessions:
        return _sessions(options, pair, out)
    if options.cross_tokenizer:
        return _cross_tokenizer(options, pair, out)
    result = evaluate_retrieval(pair, samples=options.samples, words=options.words, keep_rates=options.keep_rates)
    print(format_retrieval(result))
    payload = asdict(result) | {"pair": str(pair), "words": options.words}
    (out / "eval.json").write_text(json.dumps(payload, indent=2))
    written = plot_retrieval(result, out / "eval.png")
    print(f"wrote {out / 'eval.json'}, {written}")
    return 0


def _dataset(options: Eval, out: Path) -> int:
    """A JSONL dataset through the gateway at each keep rate (and directly)."""
    from specprefill_lab.dataset_eval import evaluate_dataset, load_dataset

    if not options.base_url:
        print("specprefill eval: --dataset needs --base-url (the gateway)", file=sys.stderr)
        return 2
    rows = load_dataset(Path(options.dataset))
    model = options.model
    if model is None:
        import httpx

        model = httpx.get(f"{options.base_url.rstrip('/')}/v1/models", timeout=30).json()["data"][0]["id"]
    results = evaluate_dataset(
        rows,
        options.base_url.rstrip("/"),
        model,
        options.keep_rates,
        direct_url=options.direct_url,
        direct_model=options.direct_model,
        max_tokens=options.max_tokens,
        api_key=options.api_key,
    )
    print(f"{'variant':>10} {'score':>7} {'kept':>6}")
    for name, r in results.items():
        kept = f"{r['kept_fraction']:.1%}" if r["kept_fraction"] is not None else "-"
        print(f"{name:>10} {r['score']:>7.3f} {kept:>6}")
    (out / "eval.json").write_text(
        json.dumps({"dataset": options.dataset, "rows": len(rows), "results": results}, indent=2)
    )
    print(f"wrote {out / 'eval.json'}")
    return 0


def _real(options: Eval, out: Path) -> int:
    from specprefill.real_models.gguf_files import RealModelError
    from specprefill_lab.real_eval import Counts, EvalPair, format_summary, run_real_eval, summarize

    try:
        pair = EvalPair.made(real_pair(options.real_pair))
    except (RealModelError, ValueError) as exc:
        print(f"specprefill eval: {exc}", file=sys.stderr)
        return 1
    try:
        drafts = _real_drafts(options, pair)
    except ValueError as exc:
        print(f"specprefill eval: {exc}", file=sys.stderr)
        return 2
    rule = options.real_rule_length
    rule_lengths = options.real_lengths if rule is None else [rule] if rule else []
    counts = Counts(options.real_samples, options.real_default_samples, pair.default_variant)
    if options.real_haystacks_only:
        from specprefill_lab.real_eval import items, save_items

        save_items(items(pair, options.real_lengths, counts.most, rule_lengths), out / "haystacks.jsonl")
        print(f"wrote {out / 'haystacks.jsonl'}")
        return 0
    rows = run_real_eval(
        pair,
        out,
        lengths=options.real_lengths,
        counts=counts,
        keep_rates=[*options.real_keep_rates, *(f"auto@{t:g}" for t in options.real_auto_targets)],
        drafts=drafts,
        rule_lengths=rule_lengths,
        haystacks=options.real_haystacks,
        device=options.real_device,
        parallel=options.real_parallel,
        tasks=options.real_tasks,
    )
    cells = summarize(rows)
    print("\n".join(format_summary(cells)))
    result = {"samples": options.real_samples, "cells": cells}
    if options.real_speed:
        from specprefill_lab.real_eval import frontier, plot_frontier

        speeds = [(draft, where) for draft, _, where in (s.partition("=") for s in options.real_speed)]
        result["frontier"] = frontier(cells, speeds)
        plot_frontier(result["frontier"], out / "real-frontier.png", pair.pair.target.name)
        print(f"wrote {out / 'real-frontier.png'}")
    from specprefill_lab.real_eval import markdown_summary

    (out / "real.md").write_text("\n".join(markdown_summary(cells)))
    (out / "real.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'real.json'}, {out / 'real.md'} (answers in {out / 'answers.jsonl'})")
    return 0


def _real_drafts(options: Eval, pair: EvalPair) -> dict[str, list[str]]:
    """The drafts asked, each as its gateway flags: the named ones (``--real-drafts``, default all) in order, then
    each ``--real-variant``. Raises ``ValueError`` for an unknown name or a malformed variant."""
    from specprefill_lab.real_eval import named_variants, variants

    known = variants(pair, options.real_self_layers, options.real_draft_layers, options.real_windows)
    unknown = [d for d in options.real_drafts or () if d not in known]
    if unknown:
        raise ValueError(f"unknown draft {unknown[0]!r}; drafts: {', '.join(known)}")
    drafts = {name: known[name] for name in options.real_drafts} if options.real_drafts is not None else known
    try:
        return drafts | named_variants(options.real_variant)
    except ValueError as exc:
        raise ValueError(f"--real-variant {exc}") from exc


def _sessions(options: Eval, pair: Path, out: Path) -> int:
    from specprefill_lab.session_eval import evaluate_sessions, format_sessions

    results = evaluate_sessions(
        pair,
        samples=options.session_samples,
        words=options.words,
        questions=options.questions,
        keep_rate=options.session_keep_rate,
    )
    print(format_sessions(results))
    (out / "sessions.json").write_text(
        json.dumps(
            {
                "pair": str(pair),
                "keep_rate": options.session_keep_rate,
                "words": options.words,
                "results": [asdict(r) for r in results],
            },
            indent=2,
        )
    )
    print(f"wrote {out / 'sessions.json'}")
    return 0


def _cross_tokenizer(options: Eval, pair: Path, out: Path) -> int:
    from specprefill_lab.draft_eval import evaluate_drafts, format_drafts, mapping_cost
    from specprefill_lab.retrieval import SHIPPED_PAIR

    other = Path(options.cross_draft) if options.cross_draft else SHIPPED_PAIR / "draft-bpe"
    results = evaluate_drafts(
        pair / "target",
        [pair / "draft", other],
        samples=options.samples,
        words=options.words,
        keep_rates=[k for k in options.keep_rates if k < 1],
    )
    print(format_drafts(results))
    cost = mapping_cost(pair / "target", other)
    print(
        f"mapping a {cost['target_tokens']}-token prompt onto the draft's {cost['draft_tokens']} tokens and back: "
        f"{cost['mapping_ms']:.1f} ms, {cost['ratio']:.1%} of the draft's scoring ({cost['draft_ms']:.1f} ms)"
    )
    (out / "cross-tokenizer.json").write_text(
        json.dumps(
            {
                "pair": str(pair),
                "samples": options.samples,
                "words": options.words,
                "results": [asdict(r) for r in results],
                "mapping_cost": cost,
            },
            indent=2,
        )
    )
    print(f"wrote {out / 'cross-tokenizer.json'}")
    return 0


def _suite(options: Eval, out: Path) -> int:
    from specprefill_lab.suite import FAMILIES, SHIPPED_SUITE_PAIR
    from specprefill_lab.suite_eval import METHODS, evaluate_suite, format_suite, plot_suite

    pair = Path(options.pair) if options.pair else SHIPPED_SUITE_PAIR
    unknown = sorted(set(options.families) - set(FAMILIES)) + sorted(set(options.methods) - set(METHODS))
    if unknown:
        print(
            f"specprefill eval: unknown {', '.join(unknown)}; families: {', '.join(FAMILIES)}; "
            f"methods: {', '.join(METHODS)}",
            file=sys.stderr,
        )
        return 2
    if not (pair / "draft").is_dir() or not (pair / "target").is_dir():
        print(f"specprefill eval: {pair} needs draft/ and target/ model folders", file=sys.stderr)
        return 2
    result = evaluate_suite(
        pair,
        families=options.families,
        samples_per_family=options.suite_samples,
        words=options.suite_words,
        keep_rates=options.suite_keep_rates,
        methods=options.methods,
        ablations=options.ablations,
    )
    print(format_suite(result))
    (out / "suite.json").write_text(json.dumps(asdict(result) | {"pair": str(pair)}, indent=2))
    written = plot_suite(result, out / "suite.png")
    print(f"wrote {out / 'suite.json'}, {written}")
    return 0
