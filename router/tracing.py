"""OpenTelemetry for the router: spans per request (ingress, placement, engine call) with the
caller's ``traceparent`` honoured. Export is configured by the standard OTel environment: with
``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) set, spans go out over OTLP/HTTP;
without it, the API's no-op tracer costs next to nothing."""

from __future__ import annotations

import logging
import os

from opentelemetry import trace

log = logging.getLogger(__name__)
_configured = False


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
