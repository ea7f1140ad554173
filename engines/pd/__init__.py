"""Prefill/decode disaggregation: kvroute's own KV transfer for vLLM 0.32 (DESIGN.md).

``transfer`` is the data path: it moves a request's KV blocks between two engine workers with
``torch.distributed`` point-to-point (NCCL on GPUs, Gloo on CPU tensors). It runs inside vLLM's
worker processes, so nothing in this package imports Ray, vLLM or ``router``.
"""
