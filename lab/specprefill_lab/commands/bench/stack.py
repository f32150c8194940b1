"""What every ``specprefill bench`` measurement shares: the servers it launches (or the URLs it is given), the
launched gateway's flags, and what a run writes down about them."""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import httpx
from pydantic import Field
from pydantic_settings import BaseSettings

from common.options import SETTINGS_CONFIG
from specprefill.real_models.catalog import DEFAULT_PAIR, PAIRS, real_pair
from specprefill_lab.launch import Stack, launched


class Launch(BaseSettings):
    """The servers a measurement launches: the models, and the engine kind."""

    model_config = SETTINGS_CONFIG
    out: str = Field("bench_results", description="folder for the results and the plots")
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
    local_attention: int | None = Field(
        None, ge=0, description="launched servers: the gateway's --local-attention (default: its own)"
    )
    draft_flags: str = Field(
        "",
        description="launched servers: more of the gateway's draft flags, as one string (e.g. "
        "'--propagate-layer 8 --propagate-rate 0.25')",
    )
    vllm_python: str | None = Field(
        None,
        description="launch vLLM (this python's, with the plugin for the "
        "gateway, stock for direct) instead of reference engines",
    )

    def models(self) -> tuple[Path | None, str | None]:
        """The launched target's folder and the gateway's draft, where the options name them (else the pair's)."""
        from specprefill.real_models.checkpoint import ensure_checkpoint

        target = None
        pair = real_pair(self.real_pair)
        if self.target_model == "real":
            target = ensure_checkpoint(pair.target)
        elif self.target_model:
            target = Path(self.target_model)
        draft = self.draft_model
        if draft == "real":
            draft = str(ensure_checkpoint(pair.draft))
        if draft == "target":
            draft = str(target) if target else str(Path(self.pair) / "target") if self.pair else None
            if draft is None:
                from specprefill_lab.demo_models import ensure_demo_models

                draft = str(ensure_demo_models() / "target")
        return target, draft

    def draft_args(self) -> list[str]:
        """The launched gateway's draft flags."""
        args = ["--draft-layers", str(self.draft_layers)] if self.draft_layers else []
        if self.observation_window:
            args += ["--observation-window", str(self.observation_window)]
        if self.local_attention is not None:
            args += ["--local-attention", str(self.local_attention)]
        return args + shlex.split(self.draft_flags)


class Gateway(Launch):
    """A launched gateway's planning, as it is configured or as it was before cache-aware planning."""

    kv_events: bool = Field(
        True,
        description="launched servers: the gateway's engine publishes its KV cache "
        "events and the gateway follows them (off: it guesses)",
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

    def min_prompt_tokens(self) -> int:
        """The launched gateway's --min-prompt-tokens: prompts shorter than this go whole."""
        return 1024

    def gateway_args(self) -> list[str]:
        """The launched gateway's `specprefill serve` flags for these options."""
        args = ["--min-prompt-tokens", str(self.min_prompt_tokens()), *self.draft_args()]
        if self.baseline:  # the gateway as it was before cache-aware planning
            return args + ["--planner", "fresh", "--no-warming", "--no-keep-system-whole"]
        if not self.gateway_warming:
            args.append("--no-warming")
        if not self.gateway_keep_system_whole:
            args.append("--no-keep-system-whole")
        return args


class Against(Gateway):
    """A gateway and the engine it fronts, each measured: given as URLs, or launched (each path on its own
    engine, or replicas of it)."""

    base_url: str | None = Field(None, description="the gateway (default: launch the demo gateway and engine)")
    backend_url: str | None = Field(None, description="the same backend, measured directly")
    model: str | None = Field(None, description="model name at the gateway (default: its first)")
    backend_model: str | None = Field(None, description="model name at the backend (default: its first)")
    max_tokens: int = Field(1, description="tokens generated per request")
    nonce: str | None = Field(
        None,
        description="what every document begins with (default: new each run, so that no run sends an engine an "
        "earlier run's documents; the same in two runs on fresh engines: the same prompts, before and after)",
    )
    vllm_scheduling: str = Field(
        "fcfs",
        description="launched vLLM: fcfs (its default) or priority (--scheduling-policy priority), for both instances",
    )
    engine_cache_tokens: int | None = Field(
        None, description="launched reference engines: their prefix caches' size in tokens (default: the engine's)"
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

    def engines(self) -> int:
        """Launched engines: one per path."""
        return 2

    def stack(self) -> contextlib.AbstractContextManager[Stack] | None:
        """The stack to measure, as a context: the given servers, or launched ones (None: options that do not
        fit, said on stderr)."""
        if (self.base_url is None) != (self.backend_url is None):
            print(
                "specprefill bench: give --base-url with --backend-url (or neither, to launch the demo)",
                file=sys.stderr,
            )
            return None
        if self.base_url is not None and self.backend_url is not None:
            urls = (self.base_url.rstrip("/"), self.backend_url.rstrip("/"))
            return contextlib.nullcontext(Stack(*urls, list(urls)))
        if self.vllm_scheduling not in ("fcfs", "priority"):
            print("specprefill bench: --vllm-scheduling is fcfs or priority", file=sys.stderr)
            return None
        if self.router not in ("round-robin", "prefix"):
            print("specprefill bench: --router is round-robin or prefix", file=sys.stderr)
            return None
        vllm_args = ("--scheduling-policy", "priority") if self.vllm_scheduling == "priority" else ()
        target, draft = self.models()
        out = Path(self.out)
        out.mkdir(parents=True, exist_ok=True)
        return launched(
            self.engines(),
            self.gateway_args(),
            self.vllm_python,
            out,
            Path(self.pair) if self.pair else None,
            vllm_args=vllm_args,
            kv_events=self.kv_events,
            cache_tokens=self.engine_cache_tokens,
            replicas=self.replicas,
            router=self.router,
            target=target,
            draft=draft,
        )

    def meta(self, stack: Stack, model: str) -> dict[str, Any]:
        """What the run measured, written beside its results."""
        return {
            "gateway_url": stack.gateway_url,
            "backend_url": stack.direct_url,
            "model": model,
            "launched": self.base_url is None,
            "engine": "vllm" if self.vllm_python else "reference",
            "baseline": self.baseline,
            "gateway_warming": self.gateway_warming,
            "gateway_keep_system_whole": self.gateway_keep_system_whole,
            "replicas": self.replicas,
            "router": self.router if self.replicas > 1 else None,
            "pair": pair_description(self.pair) if self.base_url is None else None,
            "target_model": self.target_model,
            "draft_model": self.draft_model,
            "real_pair": self.real_pair if "real" in (self.target_model, self.draft_model) else None,
            "draft_layers": self.draft_layers,
            "observation_window": self.observation_window,
            "local_attention": self.local_attention,
            "draft_flags": self.draft_flags or None,
        }


def served_models(client: httpx.Client, stack: Stack, options: Against) -> tuple[str, str]:
    """The model names at the gateway and at the backend: the options', else each server's first."""
    model = options.model or client.get(f"{stack.gateway_url}/v1/models").json()["data"][0]["id"]
    direct = options.backend_model or client.get(f"{stack.direct_url}/v1/models").json()["data"][0]["id"]
    return model, direct


def cost_coefficients(gateway_url: str) -> dict[str, dict[str, float]]:
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


def gateway_counters(gateway_url: str) -> dict[str, float]:
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


def pair_description(pair: str | None) -> dict[str, Any]:
    """What the launched servers ran: the pair's shapes (from its demo.json) and the device."""
    import torch

    from specprefill_lab.demo_models import ensure_demo_models

    folder = Path(pair) if pair else ensure_demo_models()
    info = json.loads((folder / "demo.json").read_text()) if (folder / "demo.json").exists() else {}
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    return {"folder": str(folder), **info, "device": device}
