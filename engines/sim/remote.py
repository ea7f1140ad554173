"""How KV that an engine did not compute reaches it in the sim engines (``engines.sim.scheduler``).

Prefill/decode disaggregation, as vLLM's scheduler with its ``NixlConnector`` (pull mode):

- Prefill side (``do_remote_decode`` in the request's ``kv_transfer_params``): the request runs
  as any other (the router sends it with ``max_tokens=1``); when it finishes (length or stop,
  not abort) it carries ``kv_transfer_params`` for the decode engine (``handover_params``).
  Its blocks are freed at finish and stay in the prefix cache, where vLLM would keep them
  referenced until the decode engine has read them or their lease (30 s) expires: the sim
  does not model that lease, so a prefill engine under KV pressure may evict a handed-over
  prefix that vLLM would still hold (the sim's decode side never reads the blocks back).
- Decode side (``do_remote_prefill``): at admission the local prefix cache is matched as
  usual; the rest of the prompt is pulled (``get_num_new_matched_tokens``): its blocks are
  allocated, the request leaves the waiting queue without using token budget or a batch slot
  and waits ``transfer_s`` (``SchedulerConfig.transfer_gbps``, ``transfer_latency_ms``) in
  ``pulling`` (vLLM's ``WAITING_FOR_REMOTE_KVS``). Once its KV has arrived, it is admitted
  before the waiting queue, the pulled blocks are cached then (``BlockStored``), and the whole
  prompt counts as computed except its last token, which is recomputed (vLLM's
  ``_update_waiting_for_remote_kv``). A pull that is preempted later recomputes locally.

Loads from the cluster KV pool (``engines.sim.pool``) are asynchronous, as vLLM's
``MooncakeStoreConnector`` does them by default (``load_async``): a request whose lookup finds
blocks in the pool beyond its GPU and CPU-tier hit (and whose router did not say to recompute
them: ``SimRequest.pool_load``) leaves the queue for ``pulling`` while the blocks come over
the engine's link (one load at a time per link, ``SimPool.load_s`` each), then goes back to
the head of the queue and is admitted with them as cached. The batch runs meanwhile; the
blocks' GPU memory is taken at that admission, not during the load.
"""

from __future__ import annotations

from typing import Any

from engines.sim.request import SimRequest

# what a prefill engine writes for the side channel the decode engine would connect to; vLLM's
# defaults (VLLM_NIXL_SIDE_CHANNEL_HOST/PORT). Placeholders: the sim never reads them back.
SIDE_CHANNEL_HOST = "localhost"
SIDE_CHANNEL_PORT = 5600


def handover_params(engine_id: str, r: SimRequest) -> dict[str, Any]:
    """The ``kv_transfer_params`` a finished prefill hands to the decode engine: the keys
    and values vLLM 0.32's ``NixlConnector.request_finished`` returns (pull mode, one KV
    cache group, no TP/PP/DCP), plus ``remote_prefill_cached_tokens`` that its scheduler
    adds. ``remote_block_ids`` lists the blocks the request held at finish, one list per
    KV cache group, as vLLM's ``BlockIds``; ``remote_host``/``remote_port`` are vLLM's
    defaults. The sim never reads block ids, host or port back."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[b.block_id for b in r.blocks]],
        "remote_engine_id": engine_id,
        "remote_request_id": r.request_id,
        "remote_host": SIDE_CHANNEL_HOST,
        "remote_port": SIDE_CHANNEL_PORT,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": r.num_computed,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": max(r.cached_tokens, 0) + r.remote_tokens,
    }
