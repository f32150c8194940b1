"""``specprefill bench``: runs the sweep (and the load mode) against URLs, or against servers it launches."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path

import httpx
from pydantic import Field
from pydantic_settings import BaseSettings

from common.options import SETTINGS_CONFIG
from specprefill.real_models.catalog import DEFAULT_PAIR, PAIRS, real_pair
from specprefill_lab.launch import Stack, launched
from specprefill_lab.workloads import EXTRA_WORKLOADS, MODES, WORKLOADS


class Bench(BaseSettings):
    """TTFT through the gateway vs directly at the same backend; launches the demo when no URL is given."""

    model_config = SETTINGS_CONFIG
    base_url: str | None = Field(None, description="the gateway (default: launch the demo gateway and engine)")
    backend_url: str | None = Field(None, description="the same backend, measured directly")
    model: str | None = Field(None, description="model name at the gateway (default: its first)")
    backend_model: str | None = Field(None, description="model name at the backend (default: its first)")
    lengths: list[int] = Field([1024, 4096, 8192, 16384], description="prompt lengths in tokens")
    keep_rates: list[float] = Field([0.1, 0.3, 0.5, 1.0], description="keep rates through the gateway")
    repeats: int = Field(3, description="measured requests per point (after the warm-up)")
    warmup: int = Field(1, description="unmeasured requests per length first")
    warmup_direct: bool = Field(
        True,
        description="the warm-up requests also go directly (off: through the gateway "
        "only, where the draft has first-time costs at a new length and "
        "the engine has none: a 32B target's direct 128k-token prompt "
        "takes most of a minute on a GPU)",
    )
    max_tokens: int = Field(1, description="tokens generated per request")
    out: str = Field("bench_results", description="folder for bench.json and the plots")
    load: bool = Field(False, description="also run the Poisson load mode")
    load_only: bool = Field(False, description="only the load mode")
    rates: list[float] = Field([0.1, 0.2, 0.4, 0.8], description="load mode: offered requests per second")
    duration: float = Field(30.0, description="load mode: seconds per rate")
    ttft_slo: float = Field(2.0, description="load mode: the p99 TTFT objective in seconds")
    load_tokens: int = Field(4096, description="load mode: prompt length")
    load_keep_rate: float = Field(0.1, description="load mode: keep rate through the gateway")
    load_direct: bool = Field(
        True,
        description="load mode: also load the engine directly (off: the gateway only, "
        "as when comparing gateway settings)",
    )
    workloads: bool = Field(False, description="run the workload mode (repeated contexts) instead of the sweep")
    arrivals: list[str] = Field(
        ["back-to-back", "think", "poisson"],
        description="workloads: how requests "
        "arrive, one run each: back-to-back (the next request when the previous answer "
        "ends), think (after --think-time), poisson (mixed sessions at --session-rates), "
        "idle (after the engines and the gateway are idle, warming included: flatters "
        "warming, for comparison only)",
    )
    think_time: float = Field(1.0, description="workloads: seconds between an answer and the next request (think)")
    workload_names: list[str] = Field(
        list(WORKLOADS),
        description="workloads: which ones (also: "
        + ", ".join(EXTRA_WORKLOADS)
        + ", which disturb the engine on purpose)",
    )
    workload_requests: int = Field(7, description="workloads: requests per workload")
    workload_tokens: int = Field(8000, description="workloads: prompt tokens of each workload's context")
    step_tokens: int = Field(1000, description="workloads: tokens an agent step adds")
    workload_keep_rate: float = Field(0.3, description="workloads: keep rate through the gateway")
    session_rates: list[float] = Field(
        [0.04, 0.08, 0.12, 0.2, 0.3], description="poisson: sessions started per second, one run each"
    )
    sessions_per_rate: int = Field(18, description="poisson: sessions per rate (kinds in equal shares)")
    vllm_scheduling: str = Field(
        "fcfs",
        description="launched vLLM: fcfs (its default) or priority (--scheduling-policy priority), for both instances",
    )
    shared_engine: bool = Field(
        False,
        description="workloads: one engine for both paths, the direct path's "
        "requests over other documents of the same length (neither "
        "warms the other's cache, and no two instances differ)",
    )
    vllm_python: str | None = Field(
        None,
        description="launch vLLM (this python's, with the plugin for the "
        "gateway, stock for direct) instead of reference engines",
    )
    baseline: bool = Field(
        False,
        description="launch the gateway as it was before cache-aware planning: a fresh "
        "selection for every prompt, no warming, system prompts compressed",
    )
    gateway_warming: bool = Field(True, description="launched gateway: warming on (its default) or off")
    gateway_keep_system_whole: bool = Field(
        True,
        description="launched gateway: system prompts kept whole where "
        "affordable (its default) or compressed with the rest",
    )
    kv_events: bool = Field(
        True,
        description="launched servers: the gateway's engine publishes its KV cache "
        "events and the gateway follows them (off: it guesses)",
    )
    engine_cache_tokens: int | None = Field(
        None, description="launched reference engines: their prefix caches' size in tokens (default: the engine's)"
    )
    foreign_tokens: int = Field(
        16000,
        description="workload foreign: tokens another client sends straight to the "
        "engine before each later turn, in prompts of --workload-tokens",
    )
    replicas: int = Field(
        1,
        ge=1,
        description="launched servers: each path's engine as this many replicas (the "
        "gateway routes over its own; the direct path's behind --router)",
    )
    router: str = Field(
        "round-robin",
        description="with --replicas: the direct path's router: round-robin, or "
        "prefix (prefix affinity, as SGLang's cache-aware router)",
    )
    pair: str | None = Field(
        None,
        description="launched servers: a folder with draft/ and target/ (as "
        "`specprefill demo-models` writes; default: the demo pair)",
    )
    target_model: str | None = Field(
        None,
        description="launched servers: the target's folder instead of the pair's "
        "(`real`: the target of --real-pair, made on first use)",
    )
    draft_model: str | None = Field(
        None,
        description="launched servers: the gateway's draft instead of the pair's "
        "(a folder, `target` for the target itself, `real` for --real-pair's draft, or baseline:KIND)",
    )
    real_pair: str = Field(DEFAULT_PAIR, description=f"`real` models: the real pair ({', '.join(PAIRS)})")
    draft_layers: int | None = Field(
        None,
        ge=1,
        description="launched servers: the draft's first N layers only (with --draft-model target: a self-draft)",
    )
    observation_window: int | None = Field(
        None, ge=1, description="launched servers: the gateway's --observation-window (default: its own)"
    )
    agents: bool = Field(
        False,
        description="coding agents' sessions instead: Claude Code (and Codex CLI) headless, "
        "turn after turn, through the gateway and directly, each path on its own engine "
        "(agents.json); the demo pair (131,072 positions), or --pair",
    )
    agent_names: list[str] = Field(["claude", "codex"], description="agents: which (claude, codex)")
    agent_sessions: int = Field(1, ge=1, description="agents: sessions per agent and path")
    agent_turns: int = Field(5, ge=1, description="agents: turns per session")
    agent_think: float = Field(5.0, ge=0, description="agents: seconds between an answer and the next turn")
    agent_direct: str = Field(
        "session",
        description="agents: the direct path's requests: session (the agent's own session against the engine) or "
        "replay (the requests the agent sent through the gateway, as it sent them: the same prompts on both paths)",
    )
    agent_max_new_tokens: int = Field(
        512,
        gt=0,
        description="agents: the engines' cap on each answer (a safety net: "
        "the target's end-of-turn row is doubled so its random answers end by "
        "themselves; an agent takes an answer cut at the cap for an error)",
    )
    trace: str | None = Field(
        None,
        description="replay a production trace instead (Mooncake's JSONL: timestamp ms, input_length, "
        "output_length, hash_ids): each hash ID one block of text wherever it appears, through the gateway and "
        "directly, each path on its own engine (trace.json)",
    )
    trace_requests: int = Field(100, ge=1, description="trace: its first N requests (after the two below)")
    trace_seconds: float | None = Field(None, gt=0, description="trace: only its first S seconds (its own clock)")
    trace_conversations_every: int = Field(
        1,
        ge=1,
        description="trace: one conversation in N, each whole (all its turns: what recurs still recurs, at a "
        "load this machine can serve)",
    )
    trace_block_tokens: int = Field(64, ge=1, description="trace: tokens per hash ID (the trace's are 512)")
    trace_clock: float = Field(1.0, gt=0, description="trace: how many times faster than the trace's time")
    trace_clocks: list[float] = Field(
        [],
        description="trace: one replay (both paths, fresh engines) at each of these clocks instead, and the "
        "max-QPS ratio: the fastest clock at which each path's p90 TTFT stays under --trace-slo (max-qps.json)",
    )
    trace_slo: float = Field(10.0, gt=0, description="trace: the p90 TTFT objective in seconds for the max-QPS ratio")
    trace_max_output: int = Field(32, ge=1, description="trace: each answer's tokens at most")
    trace_foreign_tokens: int = Field(
        0,
        ge=0,
        description="trace: a second client sends prompts of this many random token IDs straight to each path's "
        "engine during its replay (0: none)",
    )
    trace_foreign_every: float = Field(10.0, gt=0, description="trace: seconds between the second client's prompts")
    vllm_flags: str = Field(
        "readme",
        description="launched vLLM: readme (the README's flags: prompt-token details; the gateway's with KV "
        "events) or stock (prefix caching only, as an existing deployment runs it; the gateway's keeps the plugin)",
    )
    merge: list[str] = Field(
        [],
        description="merge these sweeps' bench.json files (one per length, say) into one "
        "table and plot in --out, and run nothing",
    )
    chaos: bool = Field(
        False,
        description="faults under load instead: Redis, the engine, a draft worker, a stalled "
        "engine, refused swaps, several at once, then a SIGTERM, all on loopback (chaos.json)",
    )
    chaos_fault_s: float = Field(8.0, description="chaos: seconds each part stays broken")
    chaos_calm_s: float = Field(10.0, description="chaos: seconds of steady load first and after each recovery")
    chaos_rate: float = Field(2.0, description="chaos: requests per second")
    chaos_soak_s: float = Field(
        0.0,
        description="chaos: a soak of this many seconds instead (no faults; the "
        "gateway's resident memory and open file descriptors sampled every 10 s)",
    )

    def cli_cmd(self) -> None:
        raise SystemExit(run_bench(self))


def run_bench(options: Bench) -> int:
    if options.merge:
        return _merge(options)
    if (options.base_url is None) != (options.backend_url is None):
        print("specprefill bench: give --base-url with --backend-url (or neither, to launch the demo)", file=sys.stderr)
        return 2
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    if options.chaos:
        return _run_chaos(options, out)
    if options.agents:
        return _run_agents(options, out)
    if options.trace:
        return _run_trace(options, out)
    context = _stack(options, out)
    if context is None:
        return 2
    with context as stack, httpx.Client(timeout=60) as client:
        model = options.model or client.get(f"{stack.gateway_url}/v1/models").json()["data"][0]["id"]
        direct_model = options.backend_model or client.get(f"{stack.direct_url}/v1/models").json()["data"][0]["id"]
        from specprefill_lab.bench import PromptMaker

        prompts = PromptMaker(client, stack.gateway_url, model)
        meta = _meta(options, stack, model)
        if options.workloads:
            written = _workloads(options, stack, prompts, (model, direct_model), meta)
        else:
            written = _sweep_and_load(options, stack, prompts, (model, direct_model), meta)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _merge(options: Bench) -> int:
    from specprefill_lab.bench import Row, format_table
    from specprefill_lab.report import merge_outputs

    written = merge_outputs(Path(options.out), [Path(source) for source in options.merge])
    rows = [Row(**r) for r in json.loads(written[0].read_text())["rows"]]
    print(format_table(rows) + "\nwrote " + ", ".join(str(p) for p in written))
    return 0


def _stack(options: Bench, out: Path):
    """The stack to measure, as a context: the given servers, or launched ones (None: options that do not fit)."""
    if options.base_url is not None:
        urls = (options.base_url.rstrip("/"), options.backend_url.rstrip("/"))
        return contextlib.nullcontext(Stack(*urls, list(urls)))
    engines = 1 if options.workloads and options.shared_engine else 2
    if options.vllm_scheduling not in ("fcfs", "priority"):
        print("specprefill bench: --vllm-scheduling is fcfs or priority", file=sys.stderr)
        return None
    if options.router not in ("round-robin", "prefix"):
        print("specprefill bench: --router is round-robin or prefix", file=sys.stderr)
        return None
    vllm_args = ("--scheduling-policy", "priority") if options.vllm_scheduling == "priority" else ()
    target, draft = _models(options)
    return launched(
        engines,
        gateway_args(options),
        options.vllm_python,
        out,
        Path(options.pair) if options.pair else None,
        vllm_args=vllm_args,
        kv_events=options.kv_events,
        cache_tokens=options.engine_cache_tokens,
        replicas=options.replicas,
        router=options.router,
        target=target,
        draft=draft,
    )


def _meta(options: Bench, stack: Stack, model: str) -> dict:
    """What the run measured, written beside its results."""
    return {
        "gateway_url": stack.gateway_url,
        "backend_url": stack.direct_url,
        "model": model,
        "launched": options.base_url is None,
        "engine": "vllm" if options.vllm_python else "reference",
        "baseline": options.baseline,
        "gateway_warming": options.gateway_warming,
        "gateway_keep_system_whole": options.gateway_keep_system_whole,
        "replicas": options.replicas,
        "router": options.router if options.replicas > 1 else None,
        "pair": _pair_description(options.pair) if options.base_url is None else None,
        "target_model": options.target_model,
        "draft_model": options.draft_model,
        "real_pair": options.real_pair if "real" in (options.target_model, options.draft_model) else None,
        "draft_layers": options.draft_layers,
        "observation_window": options.observation_window,
    }


def _models(options: Bench) -> tuple[Path | None, str | None]:
    """The launched target's folder and the gateway's draft, where the options name them (else the pair's)."""
    from specprefill.real_models.checkpoint import ensure_checkpoint

    target = None
    pair = real_pair(options.real_pair)
    if options.target_model == "real":
        target = ensure_checkpoint(pair.target)
    elif options.target_model:
        target = Path(options.target_model)
    draft = options.draft_model
    if draft == "real":
        draft = str(ensure_checkpoint(pair.draft))
    if draft == "target":
        draft = str(target) if target else str(Path(options.pair) / "target") if options.pair else None
        if draft is None:
            from specprefill_lab.demo_models import ensure_demo_models

            draft = str(ensure_demo_models() / "target")
    return target, draft


def gateway_args(options: Bench) -> list[str]:
    """The launched gateway's `specprefill serve` flags for these bench options."""
    args = ["--min-prompt-tokens", "1024" if options.workloads else str(min(options.lengths) // 2)]
    if options.draft_layers:
        args += ["--draft-layers", str(options.draft_layers)]
    if options.observation_window:
        args += ["--observation-window", str(options.observation_window)]
    if options.baseline:  # the gateway as it was before cache-aware planning
        return args + ["--planner", "fresh", "--no-warming", "--no-keep-system-whole"]
    if not options.gateway_warming:
        args.append("--no-warming")
    if not options.gateway_keep_system_whole:
        args.append("--no-keep-system-whole")
    return args


def _sweep_and_load(options: Bench, stack: Stack, prompts, models: tuple[str, str], meta: dict) -> list[Path]:
    from specprefill_lab.bench import BenchConfig, format_table, run_sweep
    from specprefill_lab.report import write_outputs

    model, direct_model = models
    samples, rows, load = [], [], None
    if not options.load_only:
        config = BenchConfig(
            stack.gateway_url,
            stack.direct_url,
            model,
            direct_model,
            options.lengths,
            options.keep_rates,
            options.repeats,
            options.warmup,
            options.max_tokens,
            options.warmup_direct,
        )
        samples, rows = asyncio.run(run_sweep(config, prompts, stack.idle_urls))
        print(format_table(rows))
    if options.load or options.load_only:
        load = _load(options, stack, prompts, models)
    meta |= {
        "lengths": options.lengths,
        "keep_rates": options.keep_rates,
        "repeats": options.repeats,
        "warmup": options.warmup,
        "warmup_direct": options.warmup_direct,
        "cost_coefficients": _cost_coefficients(stack.gateway_url),
    }
    return write_outputs(Path(options.out), rows, samples, load, meta)


def _load(options: Bench, stack: Stack, prompts, models: tuple[str, str]) -> dict:
    """The Poisson load mode: each path at each offered rate, and the highest rate meeting the objective."""
    from specprefill_lab.load import max_rate_meeting, run_load

    model, direct_model = models
    # a different document per request, as real traffic: no cache hit flatters the gateway
    n_bodies = max(8, int(max(options.rates) * options.duration * 1.5))
    bodies = [
        {"messages": prompts.make(options.load_tokens), "max_tokens": options.max_tokens, "temperature": 0}
        for _ in range(n_bodies)
    ]
    results = {
        "gateway": asyncio.run(
            run_load(
                f"{stack.gateway_url}/v1/chat/completions",
                [{**b, "model": model} for b in bodies],
                {"x-keep-rate": f"{options.load_keep_rate:g}"},
                options.rates,
                options.duration,
                idle_urls=stack.idle_urls,
            )
        )
    }
    if options.load_direct:
        results["direct"] = asyncio.run(
            run_load(
                f"{stack.direct_url}/v1/chat/completions",
                [{**b, "model": direct_model} for b in bodies],
                {},
                options.rates,
                options.duration,
                idle_urls=stack.idle_urls,
            )
        )
    load = {
        "slo_s": options.ttft_slo,
        "tokens": options.load_tokens,
        "keep_rate": options.load_keep_rate,
        "results": results,
        "max_rate": {name: max_rate_meeting(r, options.ttft_slo) for name, r in results.items()},
    }
    for name, result in results.items():
        for r in result:
            print(
                f"load {name:>7} {r['rate']:>6g} req/s: p50 {r['p50_s']:.3f} s, p99 {r['p99_s']:.3f} s, "
                f"{r['errors']} errors"
            )
    print(f"highest rate with p99 TTFT <= {options.ttft_slo:g} s: {load['max_rate']}")
    return load


def _workloads(options: Bench, stack: Stack, prompts, models: tuple[str, str], meta: dict) -> list[Path]:
    from specprefill_lab.report import write_workloads
    from specprefill_lab.sessions import format_sessions
    from specprefill_lab.workloads import (
        build_workloads,
        format_workloads,
        last_whole_request,
        run_workloads,
        summarize_workloads,
    )

    unknown = sorted(set(options.arrivals) - {*MODES, "poisson"})
    if unknown:
        raise SystemExit(f"specprefill bench: unknown arrival mode {unknown[0]!r}: use {', '.join(MODES)} or poisson")
    paths = _paths(options, stack, models)
    modes: dict[str, list[dict]] = {}
    samples, last = [], None
    sizes = (options.workload_names, options.workload_requests, options.workload_tokens, options.step_tokens)
    for number, mode in enumerate(m for m in options.arrivals if m != "poisson"):
        # new documents for every mode (the engines have seen none of them); the direct path's over other
        # documents when both paths share one engine
        workloads = build_workloads(prompts, *sizes)
        direct = build_workloads(prompts, *sizes) if options.shared_engine else workloads
        mode_samples = asyncio.run(
            run_workloads(
                mode,
                {"gateway": workloads, "direct": direct},
                paths,
                stack.idle_urls,
                think_s=options.think_time,
                max_tokens=options.max_tokens,
                first="gateway" if number % 2 == 0 else "direct",
                act=_engine_actions(options, stack, models[1]),
            )
        )
        modes[mode] = summarize_workloads(mode_samples)
        print(f"arrivals: {mode}\n" + format_workloads(modes[mode]))
        samples += mode_samples
        # the engine check's request: one both engines hold whole, else the last one sent
        last = (
            last_whole_request(workloads, mode_samples)
            or last
            or next((w.requests[-1] for w in reversed(workloads) if w.api == "chat"), None)
        )
    sessions = None
    if "poisson" in options.arrivals:
        sessions = _poisson(options, stack, prompts, paths)
        print("arrivals: poisson, mixed sessions\n" + format_sessions(sessions["summary"]))
    if stack.gateway_engine_url is not None and last is not None and "kill" not in options.workload_names:
        meta["engines"] = _engines_compared(options, stack, models[1], last)
    meta |= _workload_meta(options, stack)
    return write_workloads(Path(options.out), modes, samples, sessions, meta)


def _paths(options: Bench, stack: Stack, models: tuple[str, str]) -> list:
    """The two paths the workloads go through: the gateway (at the workloads' keep rate) and the engine."""
    from specprefill_lab.workloads import PathTarget

    return [
        PathTarget(
            "gateway",
            stack.gateway_url,
            models[0],
            {"x-keep-rate": f"{options.workload_keep_rate:g}"},
            stack.gateway_engine_url,
        ),
        PathTarget("direct", stack.direct_url, models[1], {}, stack.direct_url),
    ]


def _workload_meta(options: Bench, stack: Stack) -> dict:
    return {
        "workload_tokens": options.workload_tokens,
        "step_tokens": options.step_tokens,
        "keep_rate": options.workload_keep_rate,
        "baseline": options.baseline,
        "shared_engine": options.shared_engine,
        "arrivals": options.arrivals,
        "think_time": options.think_time,
        "vllm_scheduling": options.vllm_scheduling if options.vllm_python else None,
        "cost_coefficients": _cost_coefficients(stack.gateway_url),
        "gateway_counters": _gateway_counters(stack.gateway_url),
    }


def _engines_compared(options: Bench, stack: Stack, model: str, last) -> dict:
    """The last request sent whole straight to each path's engine, alternating: the engines' own difference."""
    from specprefill_lab.workloads import compare_engines

    engines = asyncio.run(
        compare_engines(
            {"gateway's engine": stack.gateway_engine_url, "direct's engine": stack.direct_url},
            model,
            last,
            stack.idle_urls,
            max_tokens=options.max_tokens,
        )
    )
    print(
        "the last request sent whole, with a new last line each time, directly to each engine (alternating, "
        "8 each): median "
        + ", ".join(f"{name} {s * 1e3:.0f} ms" for name, s in engines["medians_s"].items())
        + f"; ratio {engines['ratio']:.2f} (the engines' difference, no gateway in it)"
    )
    return engines


def _engine_actions(options: Bench, stack: Stack, model: str):
    """The workloads' actions at a path's engine: another client's long prompts straight to it (random token
    IDs, a new prompt each time), a restart, or killing the replica that served the path's last request
    (launched engines only)."""
    import random

    rng = random.Random(0)

    async def act(action: str, path, last) -> None:
        if action == "kill":
            urls = (stack.replicas or {}).get(path.name)
            if stack.kill is None or not urls or last is None or last.replica is None:
                raise SystemExit("specprefill bench: workload kill needs replicas the bench launched (--replicas)")
            await asyncio.to_thread(stack.kill, urls[last.replica])
            return
        if action == "restart":
            if stack.restart is None or path.engine_url is None:
                raise SystemExit("specprefill bench: workload restart needs engines the bench launched")
            await asyncio.to_thread(stack.restart, path.engine_url)
            return
        async with httpx.AsyncClient(timeout=3600) as client:
            for _ in range(max(1, options.foreign_tokens // options.workload_tokens)):
                prompt = [rng.randrange(100, 4000) for _ in range(options.workload_tokens)]
                r = await client.post(
                    f"{path.engine_url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1}
                )
                r.raise_for_status()

    return act


def _poisson(options: Bench, stack: Stack, prompts, paths) -> dict:
    """Each rate's schedule through both paths, one after the other (which first alternating), each once
    everything is idle: the boundary between two systems under test. The rates done so far are summarised in
    ``sessions-partial.json`` after each one (a run stopped early keeps them)."""
    from specprefill_lab.bench import wait_idle
    from specprefill_lab.sessions import as_dicts, run_sessions, session_schedule, summarize_sessions

    async def run() -> list:
        samples = []
        async with httpx.AsyncClient(timeout=60) as client:
            for number, rate in enumerate(options.session_rates):
                schedule = session_schedule(
                    prompts, rate, options.sessions_per_rate, options.workload_tokens, options.step_tokens, seed=number
                )
                for path in paths if number % 2 == 0 else paths[::-1]:
                    await wait_idle(client, stack.idle_urls)
                    print(
                        f"poisson: {rate:g} sessions/s through {path.name} ({schedule[-1].start_s:.0f} s of arrivals)",
                        flush=True,
                    )
                    samples += await run_sessions(path, schedule, rate, options.max_tokens)
                (Path(options.out) / "sessions-partial.json").write_text(
                    json.dumps({"summary": summarize_sessions(samples), "samples": as_dicts(samples)})
                )
        return samples

    samples = asyncio.run(run())
    return {"summary": summarize_sessions(samples), "samples": as_dicts(samples)}


def _cost_coefficients(gateway_url: str) -> dict[str, dict[str, float]]:
    """The gateway's calibrated cost models as its /metrics shows them at the end of the run (empty if it
    shows none): what the planner priced the last requests with."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{gateway_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "specprefill_cost_coefficient":
            for sample in family.samples:
                out.setdefault(sample.labels.get("model", "?"), {})[sample.labels.get("term", "?")] = sample.value
    return out


def _gateway_counters(gateway_url: str) -> dict[str, float]:
    """What the gateway's background work did over the run, from its /metrics: warming by outcome, and the
    requests that found a warming piece at the engine (how many, and their time beside it)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{gateway_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "specprefill_warming_total":
                out[f"warming_{sample.labels['outcome']}"] = sample.value
            elif sample.name in (
                "specprefill_foreground_behind_background_seconds_count",
                "specprefill_foreground_behind_background_seconds_sum",
            ):
                out[sample.name.removeprefix("specprefill_")] = sample.value
    return out


def _pair_description(pair: str | None) -> dict:
    """What the launched servers ran: the pair's shapes (from its demo.json) and the device."""
    import torch

    from specprefill_lab.demo_models import ensure_demo_models

    folder = Path(pair) if pair else ensure_demo_models()
    info = json.loads((folder / "demo.json").read_text()) if (folder / "demo.json").exists() else {}
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    return {"folder": str(folder), **info, "device": device}


def _run_chaos(options: Bench, out: Path) -> int:
    import asyncio

    from specprefill_lab.chaos import FAULTS, format_chaos, run_chaos
    from specprefill_lab.demo_models import ensure_demo_models

    root = Path(options.pair) if options.pair else ensure_demo_models()
    soak = options.chaos_soak_s > 0
    report = asyncio.run(
        run_chaos(
            root,
            out,
            fault_s=options.chaos_fault_s,
            rate=options.chaos_rate,
            calm_s=options.chaos_soak_s if soak else options.chaos_calm_s,
            faults=() if soak else FAULTS,
        )
    )
    summary = report.summary()
    print(format_chaos(summary))
    if soak:  # flat after the first 5 minutes (a twelfth of a shorter soak)
        print(f"soak: {report.growth(min(300.0, options.chaos_soak_s / 12))}")
    print(f"wrote {out / 'chaos.json'}")
    return 0 if summary["lost"] == 0 and not summary["wrong_answers"] and not summary["unshaped_errors"] else 1


def _run_agents(options: Bench, out: Path) -> int:
    """Each agent's sessions through each path's timing proxy: the direct path's engine stock, the gateway's with
    the plugin (vLLM), the same turns in the same order, one path after the other (which first alternating)."""
    from specprefill_lab.agents import AGENT_MODELS, as_dicts, ending_target, format_turns, summarize_turns
    from specprefill_lab.demo_models import ensure_demo_models

    unknown = sorted(set(options.agent_names) - {"claude", "codex"})
    if unknown:
        print(f"specprefill bench: unknown agent {unknown[0]!r}: use claude or codex", file=sys.stderr)
        return 2
    if options.agent_direct not in ("session", "replay"):
        print("specprefill bench: --agent-direct is session or replay", file=sys.stderr)
        return 2
    bin_dir = _agent_clis()
    if bin_dir is None:
        return 1
    target, draft = _models(options)
    pair = Path(options.pair) if options.pair else ensure_demo_models()
    target = ending_target(target or pair / "target", out)
    cap = options.agent_max_new_tokens
    args = gateway_args(options) + ["--min-prompt-tokens", "1024", "--model-alias", ",".join(AGENT_MODELS)]
    turns, failures = [], []
    meta = {
        "engine": "vllm" if options.vllm_python else "reference",
        "think_s": options.agent_think,
        "direct": options.agent_direct,
        "turns": options.agent_turns,
        "sessions": options.agent_sessions,
        "max_new_tokens": cap,
        "pair": _pair_description(options.pair),
    }

    def write() -> list[dict]:  # after every session: a run cut short keeps what it measured
        rows = summarize_turns(turns)
        (out / "agents.json").write_text(
            json.dumps({"meta": meta, "summary": rows, "failures": failures, "turns": as_dicts(turns)}, indent=1)
        )
        return rows

    served = ("--served-model-name", "specprefill-demo")
    with launched(
        2,
        args,
        options.vllm_python,
        out,
        pair,
        vllm_args=("--override-generation-config", json.dumps({"max_new_tokens": cap}), *served, *AGENT_MODELS),
        kv_events=options.kv_events,
        target=target,
        draft=draft,
        max_model_len=131_072,
        engine_args=("--max-new-tokens", str(cap), *served, *(a for n in AGENT_MODELS for a in ("--model-alias", n))),
    ) as stack:
        _agent_sessions(options, stack, bin_dir, out, turns, failures, write)
        meta["gateway_counters"] = _gateway_counters(stack.gateway_url)
    print(format_turns(write()))
    print(f"wrote {out / 'agents.json'}")
    return 0 if not failures else 1


def _agent_clis() -> Path | None:
    """The agent CLIs' bin folder, installed once (``scripts/agent-clis.sh``); None where they cannot be."""
    import subprocess

    script = Path(__file__).resolve().parents[3] / "scripts" / "agent-clis.sh"
    installed = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=1800)
    if installed.returncode != 0:
        print(f"specprefill bench: the agents could not be installed:\n{installed.stderr[-2000:]}", file=sys.stderr)
        return None
    return Path(installed.stdout.strip().splitlines()[-1])


def _agent_sessions(options: Bench, stack: Stack, bin_dir: Path, out: Path, turns: list, failures: list, write) -> None:
    """Every agent's sessions, each through both paths' timing proxies (which first alternating; with
    ``--agent-direct replay``, the gateway's session, then its requests again directly); ``write`` after each."""
    from specprefill_lab.agents import TimingProxy, replay_session, run_session

    proxies = {"gateway": TimingProxy(stack.gateway_url), "direct": TimingProxy(stack.direct_url)}
    replay = options.agent_direct == "replay"
    with contextlib.ExitStack() as running:
        urls = {name: running.enter_context(proxy.serving()) for name, proxy in proxies.items()}
        for agent in options.agent_names:
            for session in range(options.agent_sessions):
                order = ("direct", "gateway") if session % 2 == 0 else ("gateway", "direct")
                for path in ("gateway",) if replay else order:
                    print(f"agents: {agent} session {session + 1} through {path}", flush=True)
                    first = len(proxies[path].sent)
                    done, error = run_session(
                        agent, bin_dir, path, urls[path], proxies[path], out / "sessions", session,
                        options.agent_turns, options.agent_think,
                    )  # fmt: skip
                    turns += done
                    if error is not None:
                        print(f"agents: {agent} session {session + 1} through {path} failed at {error[:600]}")
                        failures.append({"agent": agent, "path": path, "session": session, "error": error})
                    if replay:
                        print(f"agents: {agent} session {session + 1}: its requests again, directly", flush=True)
                        sent = proxies[path].sent[first:]
                        turns += replay_session(done, sent, "direct", urls["direct"], proxies["direct"])
                    write()


def _trace_meta(options: Bench, requests: int, clock: float) -> dict:
    """What a trace replay measured, written beside its results."""
    return {
        "trace": str(options.trace),
        "requests": requests,
        "seconds": options.trace_seconds,
        "conversations_every": options.trace_conversations_every,
        "block_tokens": options.trace_block_tokens,
        "clock": clock,
        "max_output": options.trace_max_output,
        "foreign": {"tokens": options.trace_foreign_tokens, "every_s": options.trace_foreign_every}
        if options.trace_foreign_tokens
        else None,
        "engine": "vllm" if options.vllm_python else "reference",
        "vllm_flags": options.vllm_flags if options.vllm_python else None,
        "pair": _pair_description(options.pair),
    }


def _trace_schedule(options: Bench, stack: Stack, requests: list, clock: float) -> tuple[list, list]:
    """The trace's requests as the stack's chats (texts made through its gateway), and the two paths."""
    from specprefill_lab.bench import PromptMaker
    from specprefill_lab.trace import replay_schedule
    from specprefill_lab.workloads import PathTarget

    with httpx.Client(timeout=120) as client:
        urls = (stack.gateway_url, stack.direct_url)
        models = [client.get(f"{url}/v1/models").json()["data"][0]["id"] for url in urls]
        prompts = PromptMaker(client, stack.gateway_url, models[0])
        scaling = {"clock": clock, "max_output": options.trace_max_output}
        schedule = replay_schedule(requests, prompts, block_tokens=options.trace_block_tokens, **scaling)
    paths = [
        PathTarget("gateway", stack.gateway_url, models[0], {}, stack.gateway_engine_url),
        PathTarget("direct", stack.direct_url, models[1], {}, stack.direct_url),
    ]
    return schedule, paths


def _run_trace(options: Bench, out: Path) -> int:
    """The trace's requests at their times (scaled), through the gateway, then directly, each path on its own
    engine, the same texts for both; with ``--trace-clocks``, one such replay at each clock and the max-QPS
    ratio."""
    from specprefill_lab.trace import format_trace, load_trace, max_qps, plot_trace, select

    try:
        requests = load_trace(Path(options.trace))
    except (OSError, ValueError) as exc:
        print(f"specprefill bench: {exc}", file=sys.stderr)
        return 2
    if options.vllm_flags not in ("readme", "stock"):
        print("specprefill bench: --vllm-flags is readme or stock", file=sys.stderr)
        return 2
    cut = {"seconds": options.trace_seconds, "every": options.trace_conversations_every}
    requests = select(requests, **cut, limit=options.trace_requests)
    if not options.trace_clocks:
        summary, written = _replay_trace(options, requests, options.trace_clock, out)
        print(format_trace(summary))
        print(f"wrote {written}, {plot_trace(json.loads(written.read_text()), out / 'trace.png')}")
        return 0
    runs = {}
    for clock in options.trace_clocks:
        runs[clock], written = _replay_trace(options, requests, clock, out / f"clock-{clock:g}")
        print(f"clock x{clock:g}:\n{format_trace(runs[clock])}")
        plot_trace(json.loads(written.read_text()), written.parent / "trace.png")
        result = max_qps(runs, options.trace_slo)
        (out / "max-qps.json").write_text(json.dumps(result, indent=1))  # after each clock: a stop keeps what ran
    print(f"max-QPS: {json.dumps(result)}\nwrote {out / 'max-qps.json'}")
    return 0


def _replay_trace(options: Bench, requests: list, clock: float, out: Path) -> tuple[dict, Path]:
    """One replay at ``clock``: both paths, each on its own freshly launched engine."""
    from specprefill_lab.trace import Foreign, TraceReport, replay

    out.mkdir(parents=True, exist_ok=True)  # the engines' logs go there before any result does
    target, draft = _models(options)
    meta = _trace_meta(options, len(requests), clock)
    report = TraceReport(meta)
    args = ["--draft-layers", str(options.draft_layers)] if options.draft_layers else []  # else its defaults
    pair = Path(options.pair) if options.pair else None
    readme = options.vllm_flags == "readme"
    foreign = (
        Foreign(options.trace_foreign_tokens, options.trace_foreign_every) if options.trace_foreign_tokens else None
    )
    launch = {"target": target, "draft": draft, "kv_events": readme, "readme_flags": readme}
    with launched(2, args, options.vllm_python, out, pair, **launch) as stack:
        schedule, paths = _trace_schedule(options, stack, requests, clock)
        for path in paths:
            print(f"trace: {len(schedule)} requests through {path.name} (clock x{clock:g})", flush=True)
            samples, sent = asyncio.run(replay(path, schedule, foreign, paths[1].model))
            report.samples += samples
            if foreign is not None:
                meta.setdefault("foreign_sent", {})[path.name] = sent
            report.write(out)
        meta["gateway_counters"] = _gateway_counters(stack.gateway_url)
    return report.summary(), report.write(out)
