"""OpenTelemetry traces, off unless configured: ``--otlp-endpoint`` (an OTLP/HTTP collector's base URL, or its
``/v1/traces``), or the standard variables (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``,
``OTEL_TRACES_EXPORTER=otlp``; ``OTEL_SDK_DISABLED=true`` wins). On, each service has its own tracer provider
(its spans batched to the collector over OTLP/HTTP); off, nothing of OpenTelemetry is imported and every
``span`` is a null context.

A request's spans are written down as it runs (``Written``: two IDs, two times, a dict of attributes) and made
into the SDK's finished spans once its answer has gone (``RequestTrace.finish``, from the request's middleware,
``common.telemetry``), for the SDK's batch processor and OTLP exporter; as vLLM makes its request span when the
request is done. On the request path, a traced request pays for its IDs, its clock readings and, where it calls
another service, its ``traceparent``: the SDK's span objects, their attribute checks and locks and the span
processor's queue come after the answer. The sampling decision is the SDK's sampler's (``OTEL_TRACES_SAMPLER``,
``parentbased_always_on`` by default), made on arrival; a request not sampled still sends its trace context on,
marked so."""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Iterator
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import Event, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace import SpanContext, SpanKind, Status


def configured(endpoint: str | None) -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if endpoint:
        return True
    variables = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    return any(os.environ.get(v) for v in variables) or os.environ.get("OTEL_TRACES_EXPORTER", "") == "otlp"


class Tracing:
    """One service's span writer, or none (off)."""

    def __init__(self, service: str, endpoint: str | None = None) -> None:
        self.writer: SpanWriter | None = None
        self._provider: TracerProvider | None = None
        if not configured(endpoint):
            return
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if endpoint and not endpoint.rstrip("/").endswith("/v1/traces"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or service})
        self._provider = TracerProvider(resource=resource)
        processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint or None))
        self._provider.add_span_processor(processor)
        self.writer = SpanWriter(self._provider, processor)

    @property
    def on(self) -> bool:
        return self.writer is not None

    def shutdown(self) -> None:
        """Every span finished so far sent on (the exporter's batch flushed)."""
        if self._provider is not None:
            self._provider.shutdown()


@dataclass(slots=True)
class Written:
    """A span as the request writes it down; the SDK's span is made from it after the answer."""

    name: str
    context: SpanContext
    parent: SpanContext | None
    kind: SpanKind
    attributes: dict[str, Any]
    start: int = field(default_factory=time.time_ns)
    end: int | None = None
    status: Status | None = None
    events: list[Event] = field(default_factory=list)

    def failed(self, error: BaseException) -> None:
        from opentelemetry.sdk.trace import Event
        from opentelemetry.trace import Status, StatusCode

        message = f"{type(error).__name__}: {error}"
        self.status = Status(StatusCode.ERROR, message)
        attributes = {"exception.type": type(error).__name__, "exception.message": str(error)}
        self.events.append(Event("exception", attributes))


@dataclass(slots=True)
class RequestTrace:
    """One request's spans: its server span first, then its children as they start."""

    writer: SpanWriter
    client: Context | None  # the context the client sent (its trace, its baggage), or None
    spans: list[Written]

    @property
    def server(self) -> Written:
        return self.spans[0]

    def child(self, name: str, parent: Written, attributes: dict[str, Any]) -> Written:
        from opentelemetry.trace import SpanContext, SpanKind

        mine = parent.context
        context = SpanContext(mine.trace_id, _span_id(), False, mine.trace_flags, mine.trace_state)
        written = Written(name, context, mine, SpanKind.INTERNAL, attributes)
        self.spans.append(written)
        return written

    def finish(self) -> None:
        """The SDK's spans, made from what was written, to the processor (where the request is sampled)."""
        if not self.server.context.trace_flags.sampled:
            return
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import Status

        writer = self.writer
        for s in self.spans:
            span = ReadableSpan(
                s.name,
                s.context,
                s.parent,
                writer.resource,
                s.attributes,
                s.events,
                kind=s.kind,
                status=s.status or Status(),
                start_time=s.start,
                end_time=s.end if s.end is not None else time.time_ns(),
                instrumentation_scope=writer.scope,
            )
            writer.processor.on_end(span)


class SpanWriter:
    """A service's tracer: the provider's sampler and resource, and the processor its finished spans go to."""

    def __init__(self, provider: TracerProvider, processor: BatchSpanProcessor) -> None:
        from opentelemetry.propagate import get_global_textmap
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self.sampler, self.resource, self.processor = provider.sampler, provider.resource, processor
        self.scope = InstrumentationScope("specprefill")
        # the configured propagators' headers (traceparent, tracestate, baggage...)
        self.fields = frozenset(f.lower().encode("latin-1") for f in get_global_textmap().fields)

    def begin(self, name: str, headers: dict[bytes, bytes], attributes: dict[str, Any]) -> RequestTrace:
        """A request's trace from its arrival: its server span, continuing the client's trace where its headers
        carry one, sampled as the sampler says."""
        from opentelemetry import trace
        from opentelemetry.sdk.trace.sampling import Decision
        from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

        client = parent = None
        if not self.fields.isdisjoint(headers):  # no trace context sent: a new trace, without the propagators
            from opentelemetry.propagate import extract

            client = extract({k.decode("latin-1"): v.decode("latin-1") for k, v in headers.items()})
            parent = trace.get_current_span(client).get_span_context()
            parent = parent if parent.is_valid else None
        trace_id = parent.trace_id if parent is not None else random.getrandbits(128) or 1
        decision = self.sampler.should_sample(client, trace_id, name, SpanKind.SERVER, attributes)
        sampled = decision.decision in (Decision.RECORD_AND_SAMPLE,)
        flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
        context = SpanContext(trace_id, _span_id(), False, flags, decision.trace_state)
        attributes = {**attributes, **dict(decision.attributes or {})}
        return RequestTrace(self, client, [Written(name, context, parent, SpanKind.SERVER, attributes)])


def _span_id() -> int:
    return random.getrandbits(64) or 1


# the span that code running now belongs to, and its request's trace; None outside a traced request
_current: ContextVar[tuple[RequestTrace, Written] | None] = ContextVar("specprefill_span", default=None)


def enter(trace: RequestTrace) -> Token[tuple[RequestTrace, Written] | None]:
    """The request's server span current for the code that serves it (``span`` hangs children under it)."""
    return _current.set((trace, trace.server))


def leave(token: Token[tuple[RequestTrace, Written] | None]) -> None:
    _current.reset(token)


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[Written | None]:
    """A child span of the current one, where the request is traced (a null context otherwise: the cost of one
    contextvar read)."""
    now = _current.get()
    if now is None:
        yield None
        return
    trace, parent = now
    child = trace.child(name, parent, attributes)
    token = _current.set((trace, child))
    try:
        yield child
    except BaseException as error:
        child.failed(error)
        raise
    finally:
        child.end = time.time_ns()
        _current.reset(token)


def inject_context(headers: dict[str, str]) -> None:
    """The current span's trace context into ``headers`` (``traceparent``, and whatever else the configured
    propagators carry, the client's baggage included), for a request made on its behalf."""
    now = _current.get()
    if now is None:
        return
    from opentelemetry import trace
    from opentelemetry.propagate import inject

    request, current = now
    inject(headers, context=trace.set_span_in_context(trace.NonRecordingSpan(current.context), request.client))
