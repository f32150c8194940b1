"""OpenTelemetry traces, off unless configured: ``--otlp-endpoint`` (an OTLP/HTTP collector's base URL, or its
``/v1/traces``), or the standard variables (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``,
``OTEL_TRACES_EXPORTER=otlp``; ``OTEL_SDK_DISABLED=true`` wins). On, each service has its own tracer provider
(its spans batched to the collector over OTLP/HTTP); off, nothing of OpenTelemetry is imported and every
``span`` is a null context. The request's server span is ``common.telemetry``'s; the app's child spans
(``span``) hang under whichever span is current."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from common.telemetry import current


def configured(endpoint: str | None) -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if endpoint:
        return True
    variables = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    return any(os.environ.get(v) for v in variables) or os.environ.get("OTEL_TRACES_EXPORTER", "") == "otlp"


class Tracing:
    """One service's tracer, or none (off)."""

    def __init__(self, service: str, endpoint: str | None = None) -> None:
        self.tracer: Any = None
        self._provider: Any = None
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
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint or None)))
        self.tracer = self._provider.get_tracer("specprefill")

    @property
    def on(self) -> bool:
        return self.tracer is not None

    def shutdown(self) -> None:
        """Every span ended so far sent on (the exporter's batch flushed)."""
        if self._provider is not None:
            self._provider.shutdown()


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[Any]:
    """A child span of the current one, where the request is traced (a null context otherwise: the cost of one
    contextvar read)."""
    record = current()
    if record is None or record.tracer is None:
        yield None
        return
    from opentelemetry import context, trace

    # start_span and attach by hand: the SDK's start_as_current_span does the same through two more context
    # managers, a third of a child span's cost on a 2-core machine
    child = record.tracer.start_span(name, attributes=attributes)
    token = context.attach(trace.set_span_in_context(child))
    try:
        yield child
    except BaseException as error:
        child.record_exception(error)
        child.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        raise
    finally:
        context.detach(token)
        child.end()
