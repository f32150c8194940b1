"""Faults under load: ``specprefill bench chaos``.

A gateway (cost planner, warming, the engine-cache model in Redis, two remote draft workers) in front of a
reference engine, every part its own process on loopback, serves a steady mixed load (long prompts over a few
shared documents and new ones, short chats; chat streamed and not, completions, Responses) while a schedule
breaks one part at a time and then several together:

  redis     Redis killed, then started again (empty)
  engine    the engine killed, then started again on its port (its prefix cache empty)
  draft     one of the two draft workers killed, then started again
  stall     the engine stopped (SIGSTOP) and continued: slow but alive
  swap      the engine refuses every swap, as one whose chat template changed would (a fault proxy answers the
            mismatch 400 in its place)
  together  Redis and a draft worker killed and the engine stopped, all at once
  bodies    a client sends 5 and 15 MB bodies that cannot fit (chat, completions, Messages) beside the load: each
            must be refused at once, ``/health`` must keep answering, and the memory they used must be given back
  burst     the load's rate five times over: past ``--max-queue-wait``, requests are shed with a 503 and
            ``Retry-After``; the ones admitted must still meet the time the gateway predicted for them
and at the end a SIGTERM to the gateway while it serves (and warms): the short requests in flight finish (where the
machine answers within the drain's limit), long ones still generating when the limit runs out are ended in their
API's shape (a 503 with ``Retry-After``, or an error event and ``[DONE]`` on a stream), none before it, and a
request sent after the signal gets a 503.

``/health`` is asked every 100 ms throughout, and its slowest answer kept per phase. Between the gateway and the
engine sits a recording proxy (``FaultProxy``), which also keeps each failure of its own connection to the engine
(what a 502 or a broken stream in a phase with the engine up comes from). Per request: the status, whether an
error had OpenAI's shape, the plan, the latency. Lost: a request that got neither an answer nor an error. After
the run, the greedy answers the engine gave through the proxy (400 at most, evenly spaced) are asked again of a
fresh, undisturbed engine with the same body (the same kept tokens at the same positions): a different answer
counts as wrong; so does a client's answer that differs from what the engine gave. Per fault: the 5xx by cause,
and the seconds from the part's return to the first request compressed again. The cost models' coefficients
at the end of every phase, and what the target's model prices the load's shapes at, against the calm phase
before the first fault: a fault must leave them unpoisoned.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from common.process import free_port, quiet_openmp, rss_mib, wait_healthy
from common.request_body import request_body
from common.swap import KEPT_KEY, MISMATCH_CODE, SWAP_PARAM
from gateway.planning.costs import target_features
from specprefill_lab.bench import parse_server_timing, predicted_cached
from specprefill_lab.demo_models import synthetic_corpus
from specprefill_lab.launch import CLI

# each fault: the parts it breaks and how (killed, then started again; stopped, then continued; swaps refused)
BREAKS = {
    "redis": [("redis", "kill")],
    "engine": [("engine", "kill")],
    "draft": [("draft0", "kill")],
    "stall": [("engine", "stop")],
    "swap": [("proxy", "refuse")],
    "together": [("redis", "kill"), ("draft0", "kill"), ("engine", "stop")],
    "bodies": [("client", "bodies")],
    "burst": [("client", "burst")],
}
FAULTS = tuple(BREAKS)
COEFFICIENT = re.compile(r'^specprefill_cost_coefficient\{model="(\w+)",term="(\w+)"\} (\S+)$', re.MULTILINE)
MAX_CHECKED = 400  # greedy engine answers asked again of an undisturbed engine, at most (evenly spaced)
# (new, cached) prompt tokens: a long prompt of the load whole, compressed, and a few tokens after a cached one
PRICED = ((1500, 0), (450, 0), (64, 1000))
BURST = 5  # the burst's rate over the load's
BIG_BODIES = ((5_000_000, "/v1/chat/completions"), (15_000_000, "/v1/completions"), (5_000_000, "/v1/messages"))
DRAIN_S = 5.0  # the gateway's --drain-timeout: the SIGTERM's long requests are cut off at it
CUT_OFF_FIELDS = ("number", "api", "stream", "status", "cause", "shaped", "retry_after", "done", "seconds")
WARMING = re.compile(r'^specprefill_warming_total\{outcome="(\w+)"\} (\S+)$', re.MULTILINE)


class Part:
    """One process of the stack on a fixed port: killed, started again there, stopped and continued."""

    def __init__(self, name: str, args: list[str], health: str | None) -> None:
        self.name, self.args, self.health = name, args, health
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            self.args, env=quiet_openmp(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        if self.health:
            wait_healthy(self.health, self.process, timeout=300)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)


class FaultProxy:
    """Forwards everything to the engine; answers swaps with the engine's mismatch 400 while ``refuse_swaps``;
    records each greedy non-streamed answer with the body that asked for it."""

    def __init__(self, engine_url: str) -> None:
        self.engine_url = engine_url
        self.refuse_swaps = False
        self.answers: list[tuple[str, dict, str]] = []  # (path, body, answer text)
        self.failures: list[tuple[float, str]] = []  # (when, what failed): its own connection to the engine
        self.closing = False
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=httpx.Limits(max_connections=256))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = await request_body(receive)
        if body is None:  # the client left
            return
        path = scope["path"] + (f"?{scope['query_string'].decode()}" if scope["query_string"] else "")
        parsed = _json(body) if scope["method"] == "POST" else None
        if self.refuse_swaps and parsed and (parsed.get("vllm_xargs") or {}).get(KEPT_KEY) is not None:
            error = {
                "error": {
                    "message": "kept token 1 at position 0 differs from the rendered prompt's token 2",
                    "type": "invalid_request_error",
                    "param": SWAP_PARAM,
                    "code": MISMATCH_CODE,
                }
            }
            await _send(send, 400, [(b"content-type", b"application/json")], json.dumps(error).encode())
            return
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"host", b"content-length")]
        try:
            request = self.client.build_request(
                scope["method"],
                self.engine_url + path,
                content=body,
                headers=[(k.decode(), v.decode()) for k, v in headers],
            )
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            self._failed(f"connect {type(exc).__name__}")
            await _send(
                send,
                502,
                [(b"content-type", b"application/json")],
                b'{"error": {"message": "engine unreachable", "type": "api_error"}}',
            )
            return
        out = [
            (k.encode(), v.encode())
            for k, v in response.headers.items()
            if k.lower() not in ("content-length", "transfer-encoding", "connection")
        ]
        await send({"type": "http.response.start", "status": response.status_code, "headers": out})
        chunks = []
        try:
            async for chunk in response.aiter_raw():
                chunks.append(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as exc:  # the engine went away mid-answer: the gateway sees the stream end early
            self._failed(f"mid-answer {type(exc).__name__}")
        finally:
            await response.aclose()
        await send({"type": "http.response.body", "body": b""})
        if parsed and response.status_code == 200 and not parsed.get("stream") and parsed.get("temperature") == 0:
            if (text := _answer_text(_json(b"".join(chunks)))) is not None:
                self.answers.append((scope["path"], parsed, text))

    def _failed(self, what: str) -> None:
        if not self.closing:
            self.failures.append((time.perf_counter(), what))


@dataclass
class ChaosSample:
    number: int
    phase: str
    api: str
    stream: bool
    long: bool
    sent_s: float
    status: int | None = None  # None: lost (neither an answer nor an error)
    seconds: float = 0.0
    shaped: bool = True  # an error in OpenAI's shape with a message
    cause: str = ""
    specprefill: str = ""  # compressed or bypassed
    reason: str = ""
    answer: str | None = None
    user: str = ""
    context: str = ""  # the shared document it asks about, if any
    predicted_cached: int | None = None  # prompt tokens the plan expected the engine to hold (Server-Timing)
    reported_cached: int | None = None  # prompt tokens the engine said it served from its cache (usage)
    predicted_ms: float | None = None  # the plan's backend time, predicted and measured (Server-Timing)
    backend_ms: float | None = None
    retry_after: str | None = None  # on a 503
    done: bool = False  # a stream's [DONE] arrived


@dataclass
class ChaosReport:
    samples: list[ChaosSample]
    faults: list[dict]
    coefficients: dict[str, dict[str, float]]  # at the start (after the gateway's probe), then each phase's end
    answers_checked: int = 0
    wrong_answers: list[dict] = field(default_factory=list)
    sigterm: dict = field(default_factory=dict)
    resources: list[tuple[float, float, int]] = field(default_factory=list)  # (seconds, gateway RSS MiB, fds)
    warming: dict[str, int] = field(default_factory=dict)  # the gateway's warming by outcome, over the run
    health: dict[str, float] = field(default_factory=dict)  # the slowest /health answer (s) by phase
    bodies: dict = field(default_factory=dict)  # the big bodies: refusals, their times, memory around them
    proxy_failures: dict[str, int] = field(default_factory=dict)  # "phase: what failed" -> how often

    def growth(self, warm_up_s: float) -> dict[str, float] | None:
        """Resident memory and open file descriptors late in the run over their values once ``warm_up_s`` passed.

        Each is the floor (the least sample) of its half of the samples: a socket in flight when one sample is
        taken is traffic, not a leak, and a leak raises the floor."""
        after = [r for r in self.resources if r[0] >= warm_up_s]
        if len(after) < 4:
            return None
        early, late = after[: len(after) // 2], after[len(after) // 2 :]
        rss = [min(r[1] for r in early), min(r[1] for r in late)]
        fds = [min(r[2] for r in early), min(r[2] for r in late)]
        return {
            "rss_mib": rss,
            "fds": fds,
            "rss_growth": round(rss[1] / rss[0], 3),
            "fd_growth": round(fds[1] / fds[0], 3),
        }

    def restart_mispredicted(self) -> int:
        """After the engine came back empty: requests whose plan mispredicted the engine's cache although an
        earlier request on the same context (API and shared document) had been answered since the restart, and
        had told the gateway what the engine holds."""
        after = sorted(
            (
                s
                for s in self.samples
                if s.phase == "after engine"
                and s.context
                and s.predicted_cached is not None
                and s.reported_cached is not None
            ),
            key=lambda s: s.sent_s,
        )
        answered: dict[str, float] = {}  # context -> when its first request since the restart was answered
        wrong = 0
        for sample in after:
            context = f"{sample.api} {sample.context}"
            if (
                context in answered
                and answered[context] <= sample.sent_s
                and sample.predicted_cached != sample.reported_cached
            ):
                wrong += 1
            answered.setdefault(context, sample.sent_s + sample.seconds)
        return wrong

    def predicted_within_2x(self) -> dict[str, float]:
        """The share of compressed answers whose predicted backend time was within 2x of the measured one, before
        the first fault and in the calm after each: the cost models must come out of a fault unpoisoned. In the
        burst, of every answer admitted (its prediction holds the queue ahead of it)."""
        return {
            phase: round(sum(1 for s in timed if 0.5 <= s.predicted_ms / s.backend_ms <= 2) / len(timed), 2)
            for phase, timed in self._timed().items()
        }

    def predicted_counts(self) -> dict[str, int]:
        """How many answers each phase's share in ``predicted_within_2x`` is of."""
        return {phase: len(timed) for phase, timed in self._timed().items()}

    def _timed(self) -> dict[str, list[ChaosSample]]:
        out = {}
        for phase in ("calm", "burst", *(f"after {fault}" for fault in FAULTS)):
            timed = [
                s
                for s in self.samples
                if s.phase == phase
                and s.status == 200
                and (phase == "burst" or s.specprefill == "compressed")
                and s.predicted_ms
                and s.backend_ms
            ]
            if timed:
                out[phase] = timed
        return out

    def target_prices(self) -> dict[str, list[float]]:
        """The target model's price of each ``PRICED`` shape at the end of each phase, over its price at the end
        of the calm phase before the first fault (1.0: the fault taught the model nothing)."""

        def prices(coefficients: dict[str, float]) -> list[float]:
            terms = [v for k, v in coefficients.items() if k.startswith("target.")]
            return [sum(c * f for c, f in zip(terms, target_features(new, cached))) for new, cached in PRICED]

        calm = prices(self.coefficients["calm"])
        return {
            phase: [round(p / c, 2) for p, c in zip(prices(coefficients), calm)]
            for phase, coefficients in self.coefficients.items()
        }

    def window(self, sample: ChaosSample) -> str:
        """The last fault whose window the request's life overlapped, else the phase it was sent in: a request
        sent just before the engine is killed and cut off by it is the engine's doing, not its phase's."""
        end = sample.sent_s + sample.seconds
        hit = [f["fault"] for f in self.faults if sample.sent_s <= f["returned_s"] and end >= f["broken_s"]]
        return hit[-1] if hit else sample.phase

    def summary(self) -> dict:
        lost = [s for s in self.samples if s.status is None]
        errors = Counter(
            f"{self.window(s)}: {s.status} {s.cause}"
            for s in self.samples
            if s.status and s.status >= 500 and s.cause != "queue_full" and s.phase != "sigterm"
        )  # the drain's: ``sigterm``
        shed = [s for s in self.samples if s.cause == "queue_full"]
        return {
            "requests": len(self.samples),
            "lost": len(lost),
            "wrong_answers": len(self.wrong_answers),
            "engine_answers_checked": self.answers_checked,
            "statuses": dict(Counter(str(s.status) for s in self.samples)),
            "restart_mispredicted": self.restart_mispredicted(),
            "predicted_within_2x": self.predicted_within_2x(),
            "predicted_counts": self.predicted_counts(),
            "unshaped_errors": sum(1 for s in self.samples if s.status and s.status >= 400 and not s.shaped),
            "compressed": sum(1 for s in self.samples if s.specprefill == "compressed"),
            "errors_5xx": dict(errors),
            "proxy_failures": self.proxy_failures,
            "shed": {
                "by_phase": dict(Counter(x.phase for x in shed)),
                "without_retry_after": sum(1 for x in shed if not x.retry_after),
                "slowest_s": round(max((x.seconds for x in shed), default=0.0), 3),
            },
            "health_slowest_s": self.health,
            "bodies": self.bodies,
            "faults": self.faults,
            "sigterm": self.sigterm,
            "warming": self.warming,
            "resources": self.resources,  # every sample: the shape of a growth says what it is
            "coefficients": self.coefficients,
            "target_prices": self.target_prices(),
        }


async def run_chaos(
    root: Path,
    out: Path,
    *,
    fault_s: float = 8.0,
    calm_s: float = 10.0,
    rate: float = 2.0,
    tokens: int = 1500,
    seed: int = 0,
    faults: tuple[str, ...] = FAULTS,
    sample_s: float = 10.0,
    max_queue_wait: float | None = 4.0,
    check_answers: bool = True,
) -> ChaosReport:
    """The whole run; the demo pair at ``root``. ``fault_s``: how long each part stays broken; ``calm_s``: the
    steady load before the first fault and after each recovery; ``rate``: requests per second;
    ``max_queue_wait``: the gateway's ``--max-queue-wait``. Without ``faults``, a soak: ``calm_s`` of steady
    load, the gateway's resident memory and open file descriptors read every ``sample_s``. ``check_answers``: ask a
    fresh engine again for the answers given (the run's last half-minute or more on 2 cores)."""
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        raise RuntimeError("the chaos run needs redis-server on PATH (Debian: apt-get install redis-server)")
    run = ChaosRun(root, redis_server, Load(tokens, seed), random.Random(seed), rate, max_queue_wait)
    await run.start()
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=httpx.Limits(max_connections=256)) as client:
            run.client = client
            run.coefficients["start"] = await _coefficients(client, run.url["gateway"])
            watcher = asyncio.ensure_future(run.watch(sample_s))
            await run.hold("calm", calm_s)
            for fault in faults:
                await run.broken(fault, fault_s, calm_s)
            await asyncio.gather(*run.tasks)
            watcher.cancel()
            run.coefficients["end"] = await _coefficients(client, run.url["gateway"])
            metrics = (await client.get(f"{run.url['gateway']}/metrics")).text
            run.warming = {outcome: int(float(n)) for outcome, n in WARMING.findall(metrics)}
            sigterm = await run.sigterm()
    finally:
        await run.stop()
    report = run.report(sigterm)
    if check_answers:
        await _check_answers(report, run.proxy, root, run.ports["oracle"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "chaos.json").write_text(
        json.dumps({"summary": report.summary(), "samples": [asdict(s) for s in run.samples]}, indent=1)
    )
    return report


def _parts(root: Path, redis_server: str, ports: dict[str, int], max_queue_wait: float | None) -> dict[str, Part]:
    """The stack's processes on ``ports``: Redis, the engine (behind the fault proxy), two draft workers and the
    gateway, all on the CPU."""
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    model = ["--device", "cpu"]
    quiet = ["--log-level", "warning", *model]

    def server(name: str, command: str, folder: str) -> Part:
        return Part(name, [*CLI, command, "--port", str(ports[name]), "--model", str(root / folder), *quiet], url[name])

    gateway = [
        *("serve", "--port", str(ports["gateway"]), "--backend-url", url["proxy"], "--backend-kind", "reference"),
        *("--target-model", str(root / "target"), "--draft-model", str(root / "draft")),
        *("--draft-worker-url", f"{url['draft0']},{url['draft1']}"),
        *("--redis-url", f"redis://127.0.0.1:{ports['redis']}/0", "--served-model-name", "chaos"),
        *("--min-prompt-tokens", "512", "--drain-timeout", str(DRAIN_S), *quiet),
        *(["--max-queue-wait", str(max_queue_wait)] if max_queue_wait else []),
    ]
    return {
        "redis": Part("redis", [redis_server, "--port", str(ports["redis"]), "--save", "", "--appendonly", "no"], None),
        "engine": server("engine", "engine", "target"),
        "draft0": server("draft0", "draft-worker", "draft"),
        "draft1": server("draft1", "draft-worker", "draft"),
        "gateway": Part("gateway", [*CLI, *gateway], None),
    }


class ChaosRun:
    """One chaos run's stack, its load and what it saw."""

    def __init__(
        self,
        root: Path,
        redis_server: str,
        load: Load,
        rng: random.Random,
        rate: float,
        max_queue_wait: float | None,
    ) -> None:
        self.ports = {
            name: free_port() for name in ("redis", "engine", "proxy", "gateway", "draft0", "draft1", "oracle")
        }
        self.url = {name: f"http://127.0.0.1:{port}" for name, port in self.ports.items()}
        self.parts = _parts(root, redis_server, self.ports, max_queue_wait)
        self.gateway = self.parts.pop("gateway")
        self.proxy = FaultProxy(self.url["engine"])
        self.load, self.rng, self.rate = load, rng, rate
        self.samples: list[ChaosSample] = []
        self.broken_parts: list[dict] = []
        self.resources: list[tuple[float, float, int]] = []
        self.tasks: list[asyncio.Task] = []
        self.coefficients: dict[str, dict[str, float]] = {}
        self.warming: dict[str, int] = {}
        self.bodies: dict = {}
        self.phase = "calm"
        self.start_s = time.perf_counter()
        self.health = HealthWatch(self.url["gateway"], lambda: self.phase)
        self.client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        import uvicorn

        config = uvicorn.Config(self.proxy, host="127.0.0.1", port=self.ports["proxy"], log_level="error")
        self.server = uvicorn.Server(config)
        self.proxy_task = asyncio.ensure_future(self.server.serve())
        for part in self.parts.values():
            await asyncio.to_thread(part.start)
        await asyncio.to_thread(self.gateway.start)
        await asyncio.to_thread(wait_healthy, self.url["gateway"], self.gateway.process, 300)
        self.start_s = time.perf_counter()
        self.health.start()

    async def stop(self) -> None:
        self.health.stop.set()
        self.proxy.closing = True  # what fails from here on is the run's own teardown
        for part in (self.gateway, *self.parts.values()):
            part.signal(signal.SIGCONT)
            part.kill()
        self.server.should_exit = True
        await self.proxy_task
        await self.proxy.client.aclose()

    def now(self) -> float:
        return time.perf_counter() - self.start_s

    async def traffic(self, until: float) -> None:
        """The load (``BURST`` times as fast in the burst) until ``until``, each request its own task."""
        speed = BURST if self.phase == "burst" else 1
        while time.perf_counter() < until:
            number = len(self.samples)
            api, stream, long, body, context = self.load(number)
            sample = ChaosSample(
                number, self.phase, api, stream, long, self.now(), user=f"chaos-{number}", context=context
            )
            self.samples.append(sample)
            self.tasks.append(asyncio.ensure_future(_request(self.client, self.url["gateway"], sample, body)))
            await asyncio.sleep(self.rng.expovariate(self.rate * speed))

    async def hold(self, name: str, seconds: float) -> None:
        self.phase = name
        await self.traffic(time.perf_counter() + seconds)
        if name not in FAULTS:
            self.coefficients[name] = await _coefficients(self.client, self.url["gateway"])

    async def watch(self, sample_s: float) -> None:
        while True:
            self.resources.append((round(self.now(), 1), *_resources(self.gateway.process.pid)))
            await asyncio.sleep(sample_s)

    async def broken(self, fault: str, fault_s: float, calm_s: float) -> None:
        """``fault`` for ``fault_s`` under the load, then ``calm_s`` after it is undone."""
        broken_at = self.now()
        await asyncio.to_thread(_fault, fault, self.parts, self.proxy, on=True)
        if fault == "bodies":
            big = asyncio.to_thread(_big_bodies, self.url["gateway"], self.gateway.process.pid, fault_s)
            sender = asyncio.ensure_future(big)
        await self.hold(fault, fault_s)
        if fault == "bodies":
            self.bodies = await sender
        await asyncio.to_thread(_fault, fault, self.parts, self.proxy, on=False)
        self.broken_parts.append({"fault": fault, "broken_s": round(broken_at, 2), "returned_s": round(self.now(), 2)})
        await self.hold(f"after {fault}", calm_s)

    async def sigterm(self) -> dict:
        """A SIGTERM while requests are in flight: the short ones finish, the long ones are cut off at the
        drain's limit in their shape, later ones get 503, nothing is lost."""
        self.phase = "sigterm"
        first = len(self.samples)
        terms = [
            ChaosSample(first + i, "sigterm", *self.load(first + i)[:3], self.now(), user=f"chaos-{first + i}")
            for i in range(8)
        ]
        self.samples.extend(terms)
        bodies = [self.load(s.number)[3] for s in terms]
        long_answers = [sample.number for sample in terms[1::2]]
        for sample, body in list(zip(terms, bodies))[1::2]:
            sample.api, bodies[sample.number - first] = _long(sample.api, body)
        gateway = self.url["gateway"]
        in_flight = [asyncio.ensure_future(_request(self.client, gateway, s, body)) for s, body in zip(terms, bodies)]
        await asyncio.sleep(0.3)
        self.gateway.signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        api, stream, long, body, _ = self.load(len(self.samples))
        refused = ChaosSample(-1, "sigterm", api, stream, long, self.now())
        await _request(self.client, gateway, refused, body)
        finished = await asyncio.gather(*in_flight)
        return {
            "sent_around_the_signal": len(finished),
            "statuses": dict(Counter(str(s.status) for s in finished)),
            "long_answers": long_answers,
            "cut_off": [{key: getattr(s, key) for key in CUT_OFF_FIELDS} for s in finished if s.status != 200],
            "sent_after_the_signal": refused.status,
            "exit_status": await asyncio.to_thread(self.gateway.process.wait, 60),
        }

    def report(self, sigterm: dict) -> ChaosReport:
        samples = self.samples
        for fault in self.broken_parts:
            fault |= _noticed(samples, fault["returned_s"])
        phase_at = sorted(((s.sent_s + self.start_s, s.phase) for s in samples if s.number >= 0), key=lambda x: x[0])
        failures = Counter(
            f"{_fault_at(self.broken_parts, when - self.start_s) or _phase_at(phase_at, when)}: {what}"
            for when, what in self.proxy.failures
        )
        return ChaosReport(
            samples,
            self.broken_parts,
            self.coefficients,
            resources=self.resources,
            warming=self.warming,
            health=self.health.slowest,
            bodies=self.bodies,
            proxy_failures=dict(failures),
            sigterm=sigterm,
        )


def _noticed(samples: list[ChaosSample], returned_s: float) -> dict[str, float | int | None]:
    """When a part's return was noticed: the first request compressed again after it, and the long prompts
    answered whole before that one (those shed, or cut off, while the queue the fault left drains say nothing of
    the return: on a slow machine they can be all that was sent in the calm after it)."""
    back = [s.sent_s for s in samples if s.sent_s >= returned_s and s.specprefill == "compressed"]
    first = min(back) if back else float("inf")
    whole = [s for s in samples if s.long and s.status == 200 and returned_s <= s.sent_s < first]
    return {
        "compressing_again_after_s": round(first - returned_s, 2) if back else None,
        "whole_before_compressing": sum(1 for s in whole if s.specprefill != "compressed"),
    }


def _fault(fault: str, parts: dict[str, Part], proxy: FaultProxy, *, on: bool) -> None:
    """Breaks (``on``) or restores what ``fault`` names (``BREAKS``)."""
    for name, how in BREAKS[fault]:
        if name == "client":
            continue  # the client's own doing: bodies sent, a burst of load (``run_chaos``)
        if how == "refuse":
            proxy.refuse_swaps = on
        elif how == "stop":
            parts[name].signal(signal.SIGSTOP if on else signal.SIGCONT)
        elif on:
            parts[name].kill()
        else:
            parts[name].start()


async def _request(client: httpx.AsyncClient, gateway: str, sample: ChaosSample, body: dict) -> ChaosSample:
    path = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses"}[sample.api]
    body = {**body, "user": sample.user}  # the engine gets the client's body: its answers are matched by it
    start = time.perf_counter()
    try:
        if sample.stream:
            text, status, headers, error = "", None, None, None
            async with client.stream("POST", gateway + path, json={**body, "stream": True}) as response:
                status, headers = response.status_code, response.headers
                if status != 200:
                    error = _json(await response.aread())
                else:
                    async for line in response.aiter_lines():
                        sample.done |= line == "data: [DONE]"
                        if line.startswith("data: {"):
                            event = json.loads(line[6:])
                            if "error" in event:
                                error = event
                            text += "".join(
                                (c.get("delta") or {}).get("content") or c.get("text") or ""
                                for c in event.get("choices") or []
                            )
            sample.status = 500 if error and status == 200 else status
        else:
            response = await client.post(gateway + path, json=body)
            sample.status, headers = response.status_code, response.headers
            error = _json(response.content) if response.status_code != 200 else None
            text = _answer_text(_json(response.content)) if response.status_code == 200 else None
    except httpx.HTTPError as exc:
        sample.cause = type(exc).__name__  # status stays None: lost
        sample.seconds = time.perf_counter() - start
        return sample
    sample.seconds = time.perf_counter() - start
    sample.retry_after = headers.get("retry-after") if headers else None
    sample.specprefill = headers.get("x-specprefill-status", "") if headers else ""
    sample.reason = headers.get("x-specprefill-reason", "") if headers else ""
    sample.answer = text if sample.status == 200 else None
    sample.predicted_cached = predicted_cached(headers.get("server-timing")) if headers else None
    timing = parse_server_timing(headers.get("server-timing")) if headers else {}
    sample.predicted_ms, sample.backend_ms = timing.get("predicted"), timing.get("backend")
    if not sample.stream and sample.status == 200:
        usage = (_json(response.content) or {}).get("usage") or {}
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        sample.reported_cached = details.get("cached_tokens")
    if error is not None:
        inner = error.get("error") if isinstance(error, dict) else None
        sample.shaped = isinstance(inner, dict) and bool(inner.get("message"))
        sample.cause = (inner.get("code") or inner.get("type") or "?") if sample.shaped else "unshaped"
    return sample


async def _check_answers(report: ChaosReport, proxy: FaultProxy, root: Path, port: int) -> None:
    """Every greedy answer the engine gave under chaos, asked again of a fresh engine; and what each client got
    against what the engine gave."""
    oracle = Part(
        "oracle",
        CLI
        + ["engine", "--port", str(port), "--model", str(root / "target"), "--log-level", "warning", "--device", "cpu"],
        f"http://127.0.0.1:{port}",
    )
    await asyncio.to_thread(oracle.start)
    by_user = {s.user: s for s in report.samples}
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
            step = max(1, len(proxy.answers) // MAX_CHECKED)  # a soak's thousands: an even sample of them
            for path, body, text in proxy.answers[::step]:
                expected = _answer_text(
                    (await client.post(oracle.health.removesuffix("/health") + path, json=body)).json()
                )
                report.answers_checked += 1
                user = body.get("user")
                sample = by_user.get(user)  # None: the gateway's own request (warming), no client's
                got = text if sample is None else sample.answer
                # a client answered with an error (a drain's cut, a fault's 502) got no answer to compare: its
                # status is judged on its own; the engine may still have finished the request after the cut
                delivered = sample is None or sample.status == 200
                if expected != text or (delivered and got != text):
                    report.wrong_answers.append({"user": user, "engine": text, "client": got, "oracle": expected})
    finally:
        oracle.kill()


class HealthWatch(threading.Thread):
    """Asks the gateway's /health every 100 ms and keeps the slowest answer's time by phase (``phase()``)."""

    def __init__(self, url: str, phase) -> None:
        super().__init__(daemon=True)
        self.url, self.phase, self.stop = url, phase, threading.Event()
        self.slowest: dict[str, float] = {}

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.wait(0.1):
                phase, start = self.phase(), time.perf_counter()
                try:
                    client.get(f"{self.url}/health")
                except httpx.HTTPError:
                    continue  # draining or gone: the SIGTERM's own checks say what happened
                self.slowest[phase] = round(max(self.slowest.get(phase, 0.0), time.perf_counter() - start), 3)


def _big_bodies(gateway: str, pid: int, seconds: float) -> dict:
    """Bodies that cannot fit, one after another for ``seconds`` (``BIG_BODIES`` in turn): each one's status and
    time, and the gateway's resident memory before the first and a second after the last."""
    text = "the quick brown fox jumps over a lazy dog " * (max(size for size, _ in BIG_BODIES) // 40)
    payloads = {}
    for size, path in BIG_BODIES:
        content = text[:size]
        body = (
            {"model": "chaos", "prompt": content}
            if path == "/v1/completions"
            else {"model": "chaos", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
        )
        payloads[(size, path)] = json.dumps(body).encode()
    before, statuses, slowest, end = rss_mib(pid), Counter(), 0.0, time.perf_counter() + seconds
    with httpx.Client(timeout=60, headers={"content-type": "application/json"}) as client:
        while time.perf_counter() < end:
            for (size, path), payload in payloads.items():
                sent = time.perf_counter()
                response = client.post(gateway + path, content=payload)
                slowest = max(slowest, time.perf_counter() - sent)
                statuses[f"{path} {size // 1_000_000} MB: {response.status_code}"] += 1
    time.sleep(1.0)
    return {"statuses": dict(statuses), "slowest_s": round(slowest, 3), "rss_mib": [before, rss_mib(pid)]}


def _long(api: str, body: dict) -> tuple[str, dict]:
    """The request asking for an answer far longer than the drain's limit allows (a Responses one as a
    completion: ``ignore_eos`` is vLLM's extension of chat and completions)."""
    if api == "responses":
        api, body = "completions", {"model": body["model"], "prompt": body["input"], "temperature": 0}
    return api, {**body, "max_tokens": 4000, "ignore_eos": True}


def _fault_at(faults: list[dict], when: float) -> str | None:
    """The fault whose window (seconds from the run's start) holds ``when``, if any."""
    return next((f["fault"] for f in faults if f["broken_s"] <= when <= f["returned_s"]), None)


def _phase_at(phases: list[tuple[float, str]], when: float) -> str:
    """The phase of the last request sent before ``when``."""
    i = bisect.bisect_right([t for t, _ in phases], when)
    return phases[i - 1][1] if i else "calm"


def _resources(pid: int) -> tuple[float, int]:
    """A process's resident memory (MiB) and open file descriptors."""
    return round(rss_mib(pid), 1), len(os.listdir(f"/proc/{pid}/fd"))


async def _coefficients(client: httpx.AsyncClient, gateway: str) -> dict[str, float]:
    text = (await client.get(f"{gateway}/metrics")).text
    return {f"{model}.{term}": float(value) for model, term, value in COEFFICIENT.findall(text)}


class Load:
    """The load's requests: a shuffled cycle of 24 shapes (api, streamed, long, shared document), greedy, a few
    tokens each. A long prompt asks about one of two shared documents or about a new one, made for that request
    (so that not every context recurs); a short chat is new each time too."""

    def __init__(self, tokens: int, seed: int) -> None:
        self.tokens, self.seed = tokens, seed
        self.sentences = synthetic_corpus(seed=seed + 11, n_sentences=4000)
        rng = random.Random(seed)
        self.shared = [self._text(rng, int(tokens * 0.7)) for _ in range(2)]
        self.shapes = []
        for i in range(24):
            long = i % 4 != 3
            api = ("chat", "chat", "completions", "responses")[i % 4] if long else "chat"
            self.shapes.append((api, api == "chat" and i % 2 == 0, long, f"document {i % 2}" if long and i % 3 else ""))
        rng.shuffle(self.shapes)

    def __call__(self, number: int) -> tuple[str, bool, bool, dict, str]:
        api, stream, long, context = self.shapes[number % len(self.shapes)]
        rng = random.Random(self.seed * 1_000_003 + number)
        words = int(self.tokens * 0.7) if long else 60
        document = self.shared[int(context[-1])] if context else self._text(rng, words)
        prompt = document + f"\n\nQuestion {number}: which number comes after sentence {number % 50}?"
        common = {"model": "chaos", "max_tokens": 4, "temperature": 0}
        if api == "chat":
            body = {**common, "messages": [{"role": "user", "content": prompt}]}
        elif api == "completions":
            body = {**common, "prompt": prompt}
        else:
            body = {"model": "chaos", "input": prompt, "max_output_tokens": 4, "temperature": 0}
        return api, stream, long, body, context

    def _text(self, rng: random.Random, words: int) -> str:
        start = rng.randrange(len(self.sentences) - 400)
        out, n = [], 0
        for sentence in self.sentences[start:]:
            out.append(sentence)
            n += len(sentence.split())
            if n >= words:
                break
        return " ".join(out)


def _answer_text(body) -> str | None:
    if not isinstance(body, dict):
        return None
    if body.get("choices"):
        choice = body["choices"][0]
        return (choice.get("message") or {}).get("content") or choice.get("text") or ""
    if body.get("object") == "response":
        return "".join(c.get("text", "") for item in body.get("output") or [] for c in item.get("content") or [])
    return None


def _json(raw: bytes):
    with contextlib.suppress(ValueError):
        return json.loads(raw)
    return None


async def _send(send, status: int, headers: list, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def format_chaos(summary: dict) -> str:
    lines = [
        f"chaos: {summary['requests']} requests, {summary['lost']} lost, {summary['unshaped_errors']} errors "
        f"not in OpenAI's shape, {summary['compressed']} compressed; {summary['wrong_answers']} wrong answers of "
        f"{summary['engine_answers_checked']} greedy engine answers asked again of an undisturbed engine",
        f"statuses: {summary['statuses']}; after the engine's restart, plans that mispredicted its cache past "
        f"each shared document's first request: {summary['restart_mispredicted']}",
        f"{'fault':>9} {'compressing again after':>24} {'long ones whole before':>23}",
    ]
    for fault in summary["faults"]:
        again = fault["compressing_again_after_s"]
        whole = fault.get("whole_before_compressing", 0)
        lines.append(f"{fault['fault']:>9} {'never' if again is None else f'{again:.1f} s':>24} {whole:>23}")
    lines.append(
        "5xx by phase and cause: " + (", ".join(f"{k} x{v}" for k, v in summary["errors_5xx"].items()) or "none")
    )
    lines.append(f"proxy's own failures to reach the engine, by phase: {summary['proxy_failures'] or 'none'}")
    lines.append(f"shed (503 queue_full): {summary['shed']}")
    lines.append(f"slowest /health by phase (s): {summary['health_slowest_s']}")
    lines.append(f"big bodies: {summary['bodies'] or 'not sent'}")
    lines.append(f"SIGTERM: {summary['sigterm']}")
    lines.append(f"warming over the run, by outcome: {summary['warming']}")
    lines.append(
        f"compressed answers predicted within 2x, by phase: {summary['predicted_within_2x']} "
        f"(of {summary['predicted_counts']} answers)"
    )
    lines.append(
        f"the target's price of (new, cached) tokens {', '.join(map(str, PRICED))} at each phase's end, "
        f"over the calm phase's: "
        + "; ".join(f"{phase} {'/'.join(map(str, prices))}" for phase, prices in summary["target_prices"].items())
    )
    return "\n".join(lines)
