"""The engine protocol, the sim engine (real-time and virtual-time), the vLLM adapter and their Ray
Serve deployments. Not built yet: see DESIGN.md "Engines"."""

__all__: list[str] = []
