"""OpenAI-compatible ingress, tokenization, KV-aware placement, admission, PD orchestration and the
Ray Serve request router (docs/architecture.md "Data flow of one request")."""

__all__: list[str] = []
