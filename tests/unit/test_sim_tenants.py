"""Tenants in the simulator (simulation.tenants): with isolation, two tenants sending the same
prompt get disjoint block hashes, as the ingress's per-key cache salt gives them; without, the
blocks are shared."""

from __future__ import annotations

import json

import pytest

from cachemap.hashing import block_hashes, salt_hash
from deploy.cli import main as kvroute
from engines.profile import LatencyProfile
from loadgen.traces import TraceRequest
from loadgen.workloads import Planned, build_schedule
from router.keys import tenant_salt
from simulation.cluster import simulate
from simulation.settings import EXACT, SimSettings
from simulation.tenants import (
    ID_BITS,
    TENANT_MODEL,
    isolate,
    keyed_hash_ids,
    session_keys,
    tenant_of,
    tenant_root,
    tenants_of,
)
from tests.support import load_benchmark

PROMPT = (0, 11, 12, 13)  # a Mooncake-shaped prompt: the shared first block, then its own


def _two_tenants(tenants: int) -> tuple[int, int]:
    """Two chat ids whose sessions fall to different tenants among ``tenants``."""
    first = tenant_of(0, tenants)
    other = next(c for c in range(1, 1000) if tenant_of(2 * c, tenants) != first)
    return 0, other


def _same_prompt_plan(chats: tuple[int | None, int | None]) -> list[Planned]:
    reqs = [TraceRequest(float(i), 4 * 512, 8, PROMPT, chat) for i, chat in enumerate(chats)]
    return build_schedule(reqs)


def test_two_tenants_sending_the_same_prompt_share_no_block_with_isolation():
    a, b = _two_tenants(4)
    plan = _same_prompt_plan((a, b))
    keyed = isolate(plan, 4)
    ka, kb = (p.req.hash_ids for p in keyed)
    assert len(ka) == len(kb) == len(PROMPT)
    assert not set(ka) & set(kb)  # not even the first block every request opens with
    assert all(0 <= h < 2**ID_BITS for h in ka + kb)
    # everything else about the requests is kept
    assert [(p.index, p.offset_s, p.req.chat_id) for p in keyed] == [
        (p.index, p.offset_s, p.req.chat_id) for p in plan
    ]


@pytest.mark.parametrize("tenants", [0, 1])
def test_without_isolation_the_same_prompt_is_the_same_blocks(tenants):
    plan = _same_prompt_plan((0, 5))
    assert isolate(plan, tenants) is plan
    assert plan[0].req.hash_ids == plan[1].req.hash_ids == PROMPT


def test_keyed_ids_are_the_ingress_chain_from_the_tenants_salt():
    root = salt_hash(TENANT_MODEL, None, tenant_salt("tenant-3", None))
    assert tenant_root(3) == root
    words = [w for h in PROMPT for w in (h & 0xFFFFFFFF, h >> 32)]
    expect = tuple(h & (2**ID_BITS - 1) for h in block_hashes(words, 2, root))
    assert keyed_hash_ids(PROMPT, root) == expect
    # a chain: a shared prefix stays shared within the tenant, and only that prefix
    longer = keyed_hash_ids((*PROMPT[:2], 99), root)
    assert longer[:2] == expect[:2] and longer[2] != expect[2]
    assert keyed_hash_ids((), root) == ()


def test_a_session_stays_in_one_tenant():
    # Bailian-shaped: turns chained by parent_chat_id keep the first turn's session
    turns = [
        TraceRequest(0.0, 600, 8, (1, 2), chat_id=7),
        TraceRequest(1.0, 900, 8, (1, 2, 3), chat_id=8, parent_chat_id=7),
        TraceRequest(2.0, 1200, 8, (1, 2, 3, 4), chat_id=9, parent_chat_id=8),
        TraceRequest(3.0, 600, 8, (1, 5), chat_id=10),
    ]
    keys = session_keys(build_schedule(turns))
    assert keys[0] == keys[1] == keys[2] != keys[3]
    # Mooncake-shaped (no chat ids): the second block names the conversation
    moon = [
        TraceRequest(0.0, 1500, 8, (0, 1, 2)),
        TraceRequest(1.0, 2500, 8, (0, 1, 2, 3, 4)),  # its next turn
        TraceRequest(2.0, 1500, 8, (0, 6, 7)),  # another conversation, same system prompt
        TraceRequest(3.0, 300, 8, (0,)),
    ]
    keys = session_keys(build_schedule(moon))
    assert keys[0] == keys[1] != keys[2] and keys[3] not in keys[:3]
    many = build_schedule([*turns, *moon])
    for k in (4, 16, 64):
        got = tenants_of(many, k, seed=1)
        assert got[0] == got[1] == got[2] and got[4] == got[5]
        assert all(0 <= t < k for t in got)
    assert tenants_of(many, 1) == [0] * len(many)


def test_tenants_are_drawn_evenly_and_by_the_seed():
    sessions = [2 * c for c in range(4000)]
    for k in (4, 16):
        counts = [0] * k
        for s in sessions:
            counts[tenant_of(s, k)] += 1
        assert max(counts) < 1.25 * len(sessions) / k
    assert [tenant_of(s, 16, 0) for s in sessions[:50]] != [
        tenant_of(s, 16, 1) for s in sessions[:50]
    ]


def test_the_simulator_hits_across_tenants_only_without_isolation():
    """Two tenants send the same prompt one after the other to one engine: the second hits the
    first's blocks only in one shared namespace."""
    a, b = _two_tenants(2)
    # 2,000 tokens: three full blocks of 512, and a partial one that is never cached
    reqs = [TraceRequest(float(i), 2000, 4, PROMPT, chat) for i, chat in enumerate((a, b))]
    plan = build_schedule(reqs)
    profile = LatencyProfile.load("h100-llama3.1-8b")
    settings = SimSettings(instances=1, perturbation=EXACT)
    for tenants, second_hit in ((1, 3 * 512), (2, 0)):
        sim = simulate(isolate(plan, tenants), 512, profile, "round_robin", settings)
        assert [r.cached_tokens for r in sim.records] == [0, second_hit]


def test_cli_takes_tenants_and_says_so_in_the_json(capsys):
    argv = ["simulate", "--workload", "to-b", "--duration", "3", "--no-progress", "--json"]
    assert kvroute([*argv, "--router", "round_robin", "--tenants", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["meta"]["tenants"] == 4
    assert kvroute([*argv, "--router", "round_robin"]) == 0
    assert "tenants" not in json.loads(capsys.readouterr().out)["meta"]


@pytest.mark.parametrize("value", ["-1", "-64"])
def test_cli_refuses_a_bad_tenant_count_naming_the_flag(value, capsys):
    rc = kvroute(["simulate", "--workload", "to-b", "--duration", "3", "--tenants", value])
    assert rc == 2
    assert f"--tenants must be a whole number >= 0 (0 or 1: no isolation), got {value}" in (
        capsys.readouterr().err
    )


def test_routing_suite_refuses_a_bad_tenant_count_naming_the_flag(capsys):
    main = load_benchmark("routing_suite").main
    assert main(["--tenants", "-2", "--workloads", "mix"]) == 2
    assert "--tenants must be a whole number >= 0" in capsys.readouterr().err
