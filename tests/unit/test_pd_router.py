"""Prefill/decode placement (router.pd) through the routing core: both legs, conditional
disaggregation priced by the TTFT estimate, decode by load, room and cached prefix, and the
placement record."""

from __future__ import annotations

import pytest

from cachemap.map import Tier
from engines.base import LoadSnapshot
from engines.profile import LatencyProfile
from router.core import RouterCore
from router.pd import PdPlanner, TransferModel
from router.placement import NoInstanceError, PlacementRequest
from router.pools import Pool
from router.recorder import MemoryRecorder
from router.settings import DEFAULTS

H100 = LatencyProfile.load("h100-llama3.1-8b")
BS = 16
CAP = H100.kv_capacity_tokens // BS
POOLS = (
    Pool("prefill", "prefill", BS, H100, CAP),
    Pool("decode", "decode", BS, H100, CAP),
)


def core(threshold: int = 1000, **kw: object) -> RouterCore:
    planner = PdPlanner(
        TransferModel(H100.kv_bytes_per_token), threshold, DEFAULTS.pd_overload_factor
    )
    c = RouterCore(pools=POOLS, planner=planner, **kw)  # type: ignore[arg-type]
    c.sync_instances(["p1", "p2"], "prefill")
    c.sync_instances(["d1", "d2"], "decode")
    return c


def sample(c: RouterCore, iid: str, waiting: int = 0, running: int = 0, kv: float = 0.0) -> None:
    c.load.on_snapshot(LoadSnapshot(iid, 0.0, waiting, running, kv, 0.0, 0))


def req(tokens: int, rid: str = "r", first_hash: int = 1) -> PlacementRequest:
    hashes = list(range(first_hash, first_hash + tokens // BS))
    return PlacementRequest(rid, tokens, hashes, max_tokens=64)


def test_a_long_cold_prompt_is_split_and_the_transfer_priced() -> None:
    c = core()
    sample(c, "p1", waiting=3)  # busier: the prefill goes to p2
    p = c.place(req(8000), 0.0)
    assert p.prefill is not None and p.prefill.instance_id == "p2"
    assert p.instance_id in ("d1", "d2") and p.transfer_tokens == 8000
    transfer = TransferModel(H100.kv_bytes_per_token).seconds(8000)
    assert transfer == pytest.approx(0.001 + 8000 * 131072 / 25e9)
    assert p.prefill.estimated_ttft_s is not None and p.estimated_ttft_s is not None
    assert p.estimated_ttft_s > p.prefill.estimated_ttft_s + transfer


def test_a_short_uncached_part_runs_whole_on_the_decode_engine() -> None:
    c = core()
    hit = req(4000)
    c.cache_map.store("d2", Tier.GPU, list(hit.block_hashes))  # the earlier turn decoded on d2
    longer = PlacementRequest("r2", 4300, [*hit.block_hashes, *range(900, 918)], max_tokens=64)
    p = c.place(longer, 0.0)
    assert p.instance_id == "d2" and p.prefill is None and p.cached_blocks == 250
    # with a threshold of 0 (and no overload rule) the same request is split
    p0 = core(threshold=0)
    p0.planner = PdPlanner(TransferModel(H100.kv_bytes_per_token), 0, overload_factor=None)
    p0.cache_map.store("d2", Tier.GPU, list(hit.block_hashes))
    split = p0.place(longer, 0.0)
    assert split.prefill is not None and split.transfer_tokens == 300


def test_a_backed_up_prefill_pool_sends_long_prompts_to_the_decode_engines() -> None:
    c = core()
    for iid in ("p1", "p2"):  # ~6 s of prefill queued on each prefill engine
        c.load.on_snapshot(LoadSnapshot(iid, 0.0, 20, 0, 0.5, 0.0, 200_000))
    rec = MemoryRecorder()
    c.recorder = rec
    p = c.place(req(8000), 0.0)
    assert p.prefill is None and rec.records[0]["pd"]["reason"] == "split too slow"
    lenient = core()
    lenient.planner = PdPlanner(
        TransferModel(H100.kv_bytes_per_token), DEFAULTS.pd_max_local_prefill_tokens, None
    )
    for iid in ("p1", "p2"):
        lenient.load.on_snapshot(LoadSnapshot(iid, 0.0, 20, 0, 0.5, 0.0, 200_000))
    assert lenient.place(req(8000), 0.0).prefill is not None


def test_decode_goes_where_there_is_room_and_least_load() -> None:
    c = core()
    sample(c, "d1", running=5)
    assert c.place(req(4000, "a"), 0.0).instance_id == "d2"
    sample(c, "d1", running=0)
    sample(c, "d2", running=0, kv=0.999)  # d2 full: no room for the request's blocks
    assert c.place(req(4000, "b"), 0.0).instance_id == "d1"


def test_without_a_prefill_engine_it_runs_colocated_and_without_a_decoder_it_fails() -> None:
    c = core()
    p = c.place(req(8000), 0.0, exclude={"p1", "p2"})
    assert p.prefill is None and p.instance_id in ("d1", "d2")
    with pytest.raises(NoInstanceError, match="decode"):
        c.place(req(8000), 0.0, exclude={"d1", "d2"})
    again = c.place(req(8000), 0.0, exclude={"d1"}, rerun=True)  # a failed hand-over: whole
    assert again.instance_id == "d2" and again.prefill is None


def test_the_placement_record_has_both_legs() -> None:
    rec = MemoryRecorder()
    c = core(recorder=rec)
    c.place(req(8000), 0.0)
    (entry,) = rec.records
    assert entry["pd"]["prefill"] in ("p1", "p2") and entry["pd"]["reason"] == "split"
    assert entry["pd"]["transfer_tokens"] == 8000


def test_a_disaggregated_core_without_a_planner_says_so() -> None:
    c = RouterCore(pools=POOLS)
    c.sync_instances(["p1"], "prefill")
    c.sync_instances(["d1"], "decode")
    with pytest.raises(RuntimeError, match="PdPlanner"):
        c.place(req(100), 0.0)


@pytest.mark.parametrize(
    ("kw", "error"),
    [
        ({"kv_bytes_per_token": 0}, "kv_bytes_per_token"),
        ({"kv_bytes_per_token": 1, "gbps": 0}, "gbps"),
        ({"kv_bytes_per_token": 1, "latency_s": -1}, "latency"),
    ],
)
def test_a_bad_transfer_model_names_the_field(kw: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        TransferModel(**kw)
