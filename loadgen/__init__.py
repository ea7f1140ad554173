"""Traces (Mooncake, Qwen-Bailian), synthetic workloads and the flags that describe them
(``loadgen.args``), the open-loop HTTP runner, metrics and reports: what ``kvroute loadgen``
(``deploy.commands.loadgen``) runs. The HTTP runner imports nothing of kvroute's but
``cachemap.hashing``. The simulators that replay these workloads are ``simulation``'s."""

from loadgen.traces import Trace, TraceFormatError, TraceRequest, load_trace

__all__ = ["Trace", "TraceFormatError", "TraceRequest", "load_trace"]
