"""Traces, synthetic workloads, the open-loop HTTP runner, metrics, reports, the cluster simulator
and the capacity planner."""

__all__: list[str] = []
