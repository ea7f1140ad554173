"""Composition root: builds the Ray Serve application from a config, the `kvroute` CLI and its
commands (``deploy.commands``), and the ray-up and Serve YAML files."""

__all__: list[str] = []
