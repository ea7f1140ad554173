"""Traces (Mooncake, Qwen-Bailian), synthetic workloads, the open-loop HTTP runner, metrics and
reports (``kvroute loadgen``). The HTTP runner imports nothing of kvroute's but
``cachemap.hashing``. The simulators that replay these workloads are ``simulation``'s."""

from loadgen.traces import Trace, TraceFormatError, TraceRequest, load_trace

__all__ = ["Trace", "TraceFormatError", "TraceRequest", "load_trace"]
