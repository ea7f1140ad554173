"""Prefill/decode disaggregation: kvroute's own KV transfer for vLLM 0.32 (docs/architecture.md).

``transfer`` is the data path: ``KVTransport`` moves a request's KV blocks between two engine
workers with ``torch.distributed`` point-to-point (NCCL on GPUs, Gloo on CPU tensors); ``wire``
holds its header, errors and stats, ``layout`` how vLLM's per-layer caches are read and written
(``LayerSpec``, gather/scatter of blocks). ``protocol`` holds the connector's pure parts
(settings, ``kv_transfer_params`` parsing, control messages, the lease). ``connector`` is the
vLLM KV connector (``KvrouteConnector``) built on both, loaded by vLLM with
``kv_connector_module_path="engines.pd.connector"``; ``connector.kv_transfer_config`` builds its
config. It hands each call to ``connector_scheduler`` (engine core) or ``connector_worker``
(workers), which share ``connector_records``. All of it runs inside vLLM's processes: nothing
here imports Ray or ``router``, and only the ``connector*`` modules import vLLM (``nixl``
validates its config with vLLM when asked).
"""
