"""The cluster simulator and what runs on it: a workload replayed in virtual time on sim engines
placed by the production router core (``simulation.cluster``, its settings and records in
``simulation.settings``), the autoscaler's what-if runs (``simulation.whatif``), the capacity
planner (``simulation.planner``, pricing each configuration with ``simulation.pricing``), the
trace-driven cache simulator (``simulation.cachesim``), what a run's records measure
(``simulation.measures``), and the flags their commands (``kvroute simulate``, ``kvroute plan``,
in ``deploy.commands``) share (``simulation.options``). It reads workloads from ``loadgen``;
``loadgen`` imports nothing of it."""
