"""Pool keys (engines/pool/keys.py): every input that makes KV bytes differ changes the key;
nothing a client sends appears in it."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachemap.hashing import block_hashes, salt_hash
from engines.pool.keys import KEY_VERSION, PoolNamespace, pool_key, pool_keys, prompt_pool_keys

NS = PoolNamespace("llama-3.1-8b", "vllm/NHD/layers=32/kv_heads=8/head_dim=128", "bfloat16", 16)
TOKENS = list(range(100, 164))  # four blocks of 16
KEY = re.compile(r"^kvr1/[0-9a-f]{32}/[0-9a-f]{16}$")


@pytest.mark.parametrize(
    "change",
    [
        {"model": "llama-3.1-70b"},
        {"kv_layout": "vllm/HND/layers=32/kv_heads=8/head_dim=128"},
        {"kv_dtype": "fp8_e4m3"},
        {"block_size": 32},
        {"tp_rank": 1, "tp_size": 2},
        {"tp_size": 2},
        {"revision": "refs/pr/7"},
    ],
    ids=lambda c: "+".join(c),
)
def test_each_namespace_field_changes_every_key(change: dict[str, object]) -> None:
    """The same chained hashes under another model, layout, dtype, block size, TP shard or
    revision are other keys: an engine never loads bytes laid out for another."""
    other = dataclasses.replace(NS, **change)  # type: ignore[arg-type]
    hashes = [1, 2, 3, 1 << 63]
    assert set(pool_keys(NS, hashes)).isdisjoint(pool_keys(other, hashes))


def test_the_model_changes_a_prompts_keys_through_the_chain_too() -> None:
    other = dataclasses.replace(NS, model="another-model")
    assert set(prompt_pool_keys(NS, TOKENS)).isdisjoint(prompt_pool_keys(other, TOKENS))


def test_cache_salt_and_lora_isolate_through_the_chained_hash() -> None:
    """``cache_salt`` is folded into the chain's root (``salt_hash``), so two tenants' prompts
    share no key from the first block on, although the salt is not spelled in the key."""
    plain = prompt_pool_keys(NS, TOKENS)
    salted = prompt_pool_keys(NS, TOKENS, cache_salt="tenant-a")
    other = prompt_pool_keys(NS, TOKENS, cache_salt="tenant-b")
    lora = prompt_pool_keys(NS, TOKENS, lora_name="adapter-1")
    assert len(plain) == len(salted) == len(other) == len(lora) == 4
    groups = [set(plain), set(salted), set(other), set(lora)]
    for i, g in enumerate(groups):
        for h in groups[i + 1 :]:
            assert g.isdisjoint(h)
    assert prompt_pool_keys(NS, TOKENS, cache_salt="tenant-a") == salted  # deterministic


def test_prompt_keys_are_the_routers_chained_hashes() -> None:
    """The pool and the router's map name a block by the same hash."""
    root = salt_hash(NS.model, None, "s")
    hashes = block_hashes(TOKENS, NS.block_size, root)
    assert prompt_pool_keys(NS, TOKENS, cache_salt="s") == [pool_key(NS, h) for h in hashes]


def test_a_prefix_shares_keys_with_its_extension() -> None:
    assert prompt_pool_keys(NS, [*TOKENS, *range(16)])[:4] == prompt_pool_keys(NS, TOKENS)
    assert len(prompt_pool_keys(NS, TOKENS[:15])) == 0  # no full block, no key


@given(salt=st.text(max_size=64), model=st.text(min_size=1, max_size=64))
def test_no_client_text_reaches_a_key(salt: str, model: str) -> None:
    """Any salt (and any model name) yields keys of one fixed shape: hex digests only."""
    ns = dataclasses.replace(NS, model=model)
    for key in prompt_pool_keys(ns, TOKENS, cache_salt=salt):
        assert KEY.match(key), key


def test_field_boundaries_are_unambiguous() -> None:
    """Fields are length-prefixed: moving text across a field boundary changes the key."""
    a = PoolNamespace("m", "ab", "c", 16)
    b = PoolNamespace("m", "a", "bc", 16)
    assert a.digest != b.digest


def test_keys_are_stable_across_runs() -> None:
    """The key format is part of the pool's contents: a change must come with a new
    KEY_VERSION (blocks under the old one are then simply not found)."""
    assert KEY_VERSION == "kvr1"
    assert pool_key(PoolNamespace("m", "l", "d", 16), 0xABC) == (
        "kvr1/7b145f7a1f9ad5ab7cb13bcaaafec31d/0000000000000abc"
    )
    assert len(PoolNamespace("m", "l", "d", 16).digest) == 32


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0},
        {"tp_rank": 2, "tp_size": 2},
        {"model": ""},
        {"kv_layout": ""},
        {"kv_dtype": ""},
    ],
)
def test_bad_namespaces_are_refused(kwargs: dict[str, object]) -> None:
    fields: dict[str, object] = {"model": "m", "kv_layout": "l", "kv_dtype": "d", "block_size": 16}
    with pytest.raises(ValueError):
        PoolNamespace(**{**fields, **kwargs})  # type: ignore[arg-type]


def test_hashes_outside_64_bits_are_refused() -> None:
    with pytest.raises(ValueError):
        pool_key(NS, -1)
    with pytest.raises(ValueError):
        pool_keys(NS, [1 << 64])
