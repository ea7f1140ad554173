"""Traces (Mooncake, Qwen-Bailian), synthetic workloads, the open-loop HTTP runner, metrics and
reports (``kvroute loadgen``), and the trace-driven cache simulator (``kvroute cachesim``).
The HTTP runner imports nothing of kvroute's but ``cachemap.hashing``."""

from loadgen.traces import Trace, TraceFormatError, TraceRequest, load_trace

__all__ = ["Trace", "TraceFormatError", "TraceRequest", "load_trace"]
