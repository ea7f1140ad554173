"""Pure eviction policies for the CPU KV tier and the adapter to vLLM's out-of-tree CachePolicy.
Not built yet: see DESIGN.md "Eviction policies"."""

__all__: list[str] = []
