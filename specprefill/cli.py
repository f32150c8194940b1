"""The ``specprefill`` command: every option is a flag and an environment variable ``SPECPREFILL_<NAME>``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, CliApp, CliPositionalArg, CliSubCommand

from specprefill.cli_options import SETTINGS_CONFIG as _SETTINGS
from specprefill.cli_options import ScoringOptions
from gateway.settings import GatewaySettings

class Score(ScoringOptions):
    """Score one prompt with a draft model and show what the target would read."""

    file: CliPositionalArg[str] = Field(description="a text file, or - for standard input")
    model: str = Field(description="draft model: a local folder or a hub id")
    keep_rate: float = Field(0.3, description="fraction of chunks kept, in (0, 1]")
    token_ids: bool = Field(False, description="read a JSON list of token IDs instead of text")
    json_output: bool = Field(
        False, validation_alias=AliasChoices("json", "json_output"), description="print the numbers as JSON"
    )
    device: str | None = Field(None, description="torch device (default: cuda when available)")
    dtype: str = Field("auto", description="auto, float32, bfloat16 or float16")

    def cli_cmd(self) -> None:
        from specprefill.score_cmd import run_score

        raise SystemExit(run_score(self))


class Serve(GatewaySettings):
    """The gateway: OpenAI-compatible, compresses long prompts with SpecPrefill."""

    def cli_cmd(self) -> None:
        from gateway.app import DEMO_NAME, create_app
        from specprefill.server import run_server

        base = f"http://{self.host}:{self.port}/v1"
        model = self.served_model_name or self.target_model or DEMO_NAME
        body = dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16})
        print(f"SpecPrefill gateway: base URL {base}", flush=True)
        print(f"  try: curl -s {base}/chat/completions -H 'content-type: application/json' "
              f"-H 'x-keep-rate: 0.3' -d '{body}'", flush=True)
        run_server(create_app(self), host=self.host, port=self.port, log_level=self.log_level,
                   drain_timeout=self.drain_timeout, max_body_bytes=self.max_request_bytes)


class Engine(BaseSettings):
    """The reference backend engine: honours prompt token IDs at explicit positions (OpenAI completions)."""

    model_config = _SETTINGS
    model: str = Field(description="target model: a local folder or a hub id")
    host: str = "127.0.0.1"
    port: int = 8001
    device: str | None = Field(None, description="torch device (default: cuda when available)")
    dtype: str = Field("auto", description="auto, float32, bfloat16 or float16")
    served_model_name: str | None = Field(None, description="the model name clients send (default: --model)")
    max_running: int = Field(8, description="sequences decoded concurrently (interleaved)")
    max_waiting: int = Field(64, description="queued requests beyond which the engine answers 503")
    prefill_chunk: int = Field(2048, description="prompt tokens per prefill step (cancellation and fairness)")
    log_level: str = "info"
    drain_timeout: float = Field(30.0, description="on SIGTERM, seconds in-flight requests may take to finish")

    def cli_cmd(self) -> None:
        from specprefill.server import run_server

        from engine.server import create_app

        app = create_app(self.model, device=self.device, dtype=self.dtype, served_name=self.served_model_name,
                         max_running=self.max_running, max_waiting=self.max_waiting,
                         prefill_chunk=self.prefill_chunk)
        run_server(app, host=self.host, port=self.port, log_level=self.log_level, drain_timeout=self.drain_timeout)


class DraftWorkerCmd(ScoringOptions):
    """A standalone draft worker service, for gateways started with --draft-worker-url."""

    model: str = Field(description="draft model: a local folder or a hub id")
    host: str = "127.0.0.1"
    port: int = 8002
    device: str | None = Field(None, description="torch device (default: cuda when available)")
    dtype: str = Field("auto", description="auto, float32, bfloat16 or float16")
    max_batch_size: int = Field(8, description="prompts scored in one draft forward")
    max_batch_tokens: int = Field(65536, description="padded tokens (rows x longest prompt) in one forward")
    max_wait_ms: float = Field(5.0, description="how long a request waits for others to batch with")
    prefix_cache_mb: int = Field(1024, description="draft KV kept for prefix reuse (0: off)")
    log_level: str = "info"
    drain_timeout: float = Field(30.0, description="on SIGTERM, seconds in-flight requests may take to finish")

    def cli_cmd(self) -> None:
        from specprefill.server import run_server

        from draft_worker import DraftWorker
        from draft_worker.service import create_app

        def factory() -> DraftWorker:
            return DraftWorker.from_pretrained(self.model, self.scoring_config(), device=self.device,
                                               dtype=self.dtype, prefix_cache_bytes=self.prefix_cache_mb << 20)

        app = create_app(factory, max_batch_size=self.max_batch_size, max_batch_tokens=self.max_batch_tokens,
                         max_wait_ms=self.max_wait_ms)
        run_server(app, host=self.host, port=self.port, log_level=self.log_level, drain_timeout=self.drain_timeout)


class Bench(BaseSettings):
    """TTFT through the gateway vs directly at the same backend; launches the demo when no URL is given."""

    model_config = _SETTINGS
    base_url: str | None = Field(None, description="the gateway (default: launch the demo gateway and engine)")
    backend_url: str | None = Field(None, description="the same backend, measured directly")
    model: str | None = Field(None, description="model name at the gateway (default: its first)")
    backend_model: str | None = Field(None, description="model name at the backend (default: its first)")
    lengths: list[int] = Field([1024, 4096, 8192, 16384], description="prompt lengths in tokens")
    keep_rates: list[float] = Field([0.1, 0.3, 0.5, 1.0], description="keep rates through the gateway")
    repeats: int = Field(3, description="measured requests per point (after the warm-up)")
    warmup: int = Field(1, description="unmeasured requests per length first")
    max_tokens: int = Field(1, description="tokens generated per request")
    out: str = Field("bench_results", description="folder for bench.json and the plots")
    load: bool = Field(False, description="also run the Poisson load mode")
    load_only: bool = Field(False, description="only the load mode")
    rates: list[float] = Field([0.1, 0.2, 0.4, 0.8], description="load mode: offered requests per second")
    duration: float = Field(30.0, description="load mode: seconds per rate")
    ttft_slo: float = Field(2.0, description="load mode: the p99 TTFT objective in seconds")
    load_tokens: int = Field(4096, description="load mode: prompt length")
    load_keep_rate: float = Field(0.1, description="load mode: keep rate through the gateway")

    def cli_cmd(self) -> None:
        from specprefill.bench_cmd import run_bench

        raise SystemExit(run_bench(self))


class Eval(BaseSettings):
    """Answer quality vs keep rate: the built-in retrieval task, or --dataset FILE.jsonl against --base-url."""

    model_config = _SETTINGS
    keep_rates: list[float] = Field([0.1, 0.3, 0.5, 1.0], description="keep rates (comma-separated)")
    out: str = Field("eval_results", description="folder for eval.json (and eval.png)")
    samples: int = Field(100, description="retrieval: samples")
    words: int = Field(1500, description="retrieval: words of context per sample (about 1.1 tokens each)")
    pair: str | None = Field(None, description="retrieval: a pair's folder (DIR/draft, DIR/target); "
                                                "default: the one shipped in the package")
    train: bool = Field(False, description="retrieval: retrain the pair into the cache first (about 20 min)")
    dataset: str | None = Field(None, description="JSONL rows: messages or prompt, answers, metric")
    base_url: str | None = Field(None, description="dataset: the gateway's base URL (without /v1)")
    model: str | None = Field(None, description="dataset: the model name at the gateway (default: its first)")
    direct_url: str | None = Field(None, description="dataset: the backend direct (default: x-specprefill: off)")
    direct_model: str | None = Field(None, description="dataset: the model name at --direct-url")
    max_tokens: int = Field(64, description="dataset: tokens generated per answer")
    api_key: str | None = Field(None, description="dataset: Bearer token for the gateway")

    def cli_cmd(self) -> None:
        from specprefill.eval_cmd import run_eval

        raise SystemExit(run_eval(self))


class DemoModels(BaseSettings):
    """Write the demo draft/target pair into DIR (DIR/draft, DIR/target), made locally."""

    model_config = _SETTINGS
    dir: CliPositionalArg[Path]
    seed: int = 0

    def cli_cmd(self) -> None:
        from specprefill.demo_models import write_demo_models

        out = write_demo_models(self.dir, seed=self.seed)
        print(f"wrote {out / 'draft'} and {out / 'target'}")


class Main(BaseSettings, cli_prog_name="specprefill", cli_kebab_case=True, cli_implicit_flags=True):
    """SpecPrefill gateway: lower time-to-first-token for long prompts."""

    serve: CliSubCommand[Serve]
    engine: CliSubCommand[Engine]
    draft_worker: CliSubCommand[DraftWorkerCmd]
    score: CliSubCommand[Score]
    demo_models: CliSubCommand[DemoModels]
    bench: CliSubCommand[Bench]
    eval: CliSubCommand[Eval]

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def main(argv: list[str] | None = None) -> None:
    CliApp.run(Main, cli_args=sys.argv[1:] if argv is None else argv)


def dumps(payload: object) -> str:
    return json.dumps(payload, separators=(",", ":"))
