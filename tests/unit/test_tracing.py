"""The router's spans: none at all until a tracer provider is installed, then real ones with the
caller's trace context. In a fresh interpreter, as OpenTelemetry takes one provider per process
(and the test process's is installed by ``tests.support.span_exporter``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    from opentelemetry import context, trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from router import tracing

    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert not tracing.tracing_on()
    before = context.get_current()
    with tracing.span("kvroute.ingress", {"traceparent": parent}) as span:
        assert span is trace.INVALID_SPAN and not span.is_recording()
        span.set_attribute("kvroute.prompt_tokens", 3)  # goes nowhere, raises nothing
        assert context.get_current() is before  # OpenTelemetry's context left alone

    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    assert tracing.tracing_on()
    with tracing.span("kvroute.ingress", {"traceparent": parent}) as span:
        span.set_attribute("kvroute.prompt_tokens", 3)
        with tracing.span("kvroute.placement"):
            pass
    spans = {s.name: s for s in exporter.get_finished_spans()}
    outer, inner = spans["kvroute.ingress"], spans["kvroute.placement"]
    assert format(outer.context.trace_id, "032x") == parent.split("-")[1]
    assert inner.parent.span_id == outer.context.span_id
    assert outer.attributes["kvroute.prompt_tokens"] == 3
    print("ok")
    """
)


def test_spans_exist_only_once_a_tracer_provider_is_installed() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
