"""Placement scorers, one module each, registered by name in ``router.placement``."""
