"""OpenTelemetry for the router: spans per request (ingress, placement, engine call) with the
caller's ``traceparent`` honoured. Export is configured by the standard OTel environment: with
``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) set, spans go out over OTLP/HTTP;
without it no tracer provider is installed (unless the embedding program installs one), and
``span`` then opens no span at all: the API's no-op spans still cost ~5 us each, and the ingress
opens two per request."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext

from opentelemetry import propagate, trace

log = logging.getLogger(__name__)
_configured = False
tracer = trace.get_tracer("kvroute.router")


def tracing_on() -> bool:
    """Whether this process has a tracer provider installed (by ``setup_tracing``, a test, or
    the program embedding the router): until then every span would be a no-op."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def span(name: str, carrier: Mapping[str, str] | None = None) -> AbstractContextManager[trace.Span]:
    """``name``'s span as the current one, its parent the trace context in ``carrier`` (a
    request's headers: ``traceparent``) if given; without a tracer provider, the invalid span
    (whose attributes go nowhere) and OpenTelemetry's context left alone."""
    if not tracing_on():
        return nullcontext(trace.INVALID_SPAN)
    context = propagate.extract(dict(carrier)) if carrier is not None else None
    return tracer.start_as_current_span(name, context=context)


def setup_tracing(service_name: str = "kvroute-router") -> bool:
    """Install an OTLP-exporting tracer provider once per process; returns whether it did."""
    global _configured
    if _configured:
        return True
    if not (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _configured = True
    log.info("exporting traces over OTLP to %s", os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    return True
