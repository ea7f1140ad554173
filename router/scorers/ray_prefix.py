"""``ray_prefix``: Ray Serve's ``PrefixCacheAffinityRouter`` decision, on Ray's own ``PrefixTree``.

What is Ray's (ray 2.60, imported from the installed ``ray``, not copied):

- the tree: ``ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree.PrefixTree``, a
  multi-tenant character radix tree with per-tenant LRU lists. Its ``add_tenants``,
  ``remove_tenants``, ``prefix_match``, ``get_smallest_tenants``, ``insert`` and
  ``evict_tenant_by_lru`` do all the tree work here;
- the constants, ``PrefixCacheAffinityRouter.initialize_state``'s defaults:
  ``imbalanced_threshold=inf`` (so by default load never overrides the tree),
  ``match_rate_threshold=0.1``, ``do_eviction=False`` (``eviction_threshold_chars=400_000``,
  ``eviction_target_chars=360_000`` when on);
- the decision, ``PrefixCacheAffinityRouter._prefix_match_best_replicas`` then Serve's
  ``_select_from_candidate_replicas``:

  1. queue lengths of the candidates (Serve's ``num_ongoing_requests`` per replica; here
     ``waiting + running``). If ``highest - lowest > imbalanced_threshold``: no preference, and
     Serve falls back to power-of-two choices (two random distinct candidates, the one with
     the shorter queue; the first on a tie).
  2. else ``prefix_match(text, candidates)``: the longest matched prefix and the tenants holding
     it. ``match_rate = len(matched) / len(text)``. Below ``match_rate_threshold``: the tenants
     with the fewest characters in the tree (``get_smallest_tenants``); else the matched
     tenants. Among those, the one with the shortest queue (the first on a tie).
  3. if that left nobody, power-of-two choices as in 1.
  4. after routing, ``insert(text, chosen)`` (``on_request_routed``); replicas that join or
     leave are ``add_tenants`` / ``remove_tenants`` (``update_replicas``).

What is ours (the glue a hash-only simulator needs):

- **Text from block hashes.** Ray's tree matches characters of the prompt text; simulated requests
  carry only ``block_hashes`` (Mooncake ``hash_ids``, or our chained xxh3 hashes). Each hash is
  scrambled by splitmix64 (``cachemap.hashing.mix64``, a bijection on 64 bits, so the small
  sequential Mooncake ids look random too) and written as ``chars_per_block`` 16-bit characters
  (surrogate code points moved to plane 1, so the mapping stays injective); the request's text is
  the concatenation. A shared leading run of blocks is therefore a shared leading run of
  characters and ``match_rate`` is matched blocks / blocks. Faithful because Ray's decision only
  looks at the length of the matched prefix relative to the prompt and at per-tenant character
  counts, both proportional to blocks here. Where it is not: real text shares partial blocks and
  its characters per token vary, so Ray's rate counts partial blocks and differs by a few percent;
  two different blocks share the first character of their code with probability 2^-16 (a fraction
  of a block of spurious match); a prompt's partial last block has no hash (whatever the caller
  leaves out of ``block_hashes`` is invisible), and a prompt with no full block becomes the empty
  string, where Ray would divide by zero (``len(matched) / len(text)``): here its rate is 0, so it
  takes Ray's low-match branch (smallest tenant).
- **Tenants.** The instance ids the caller passes (healthy or not) are the tenants: new ids are
  ``add_tenants``-ed, ids no longer passed are ``remove_tenants``-ed (Ray drops a replica that
  left the deployment). Only healthy instances are candidates. When Ray's smallest tenants
  hold no candidate (an unhealthy instance's tree is the smallest), the smallest among the
  candidates is taken (Ray would route to a non-candidate replica there).
- **Time.** The tree stamps nodes with a placement counter instead of ``time.time()`` (no clock
  reads; a unique stamp per insert, as the tree's eviction docstring recommends). With
  ``do_eviction`` on, a tenant over ``eviction_threshold_chars`` is trimmed LRU-wise to
  ``eviction_target_chars`` right after each insert (Ray checks every ``eviction_interval_secs``
  on a background thread). The thresholds count our characters: ``chars_per_block`` per block,
  not ~4 per token of real text.
- Power-of-two choices use a seeded ``random.Random`` (deterministic runs). Serve's
  ``max_ongoing_requests`` back-pressure (a full replica is skipped and the request waits) is
  not modelled: a scorer must place now.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Mapping, Sequence

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree

from cachemap import Match
from cachemap.hashing import mix64
from router.placement import InstanceView, Placement, PlacementRequest, Scorer, healthy


@functools.lru_cache(maxsize=1 << 18)  # a trace's prefixes repeat
def _block_code(h: int) -> str:
    """Four characters for one hash: splitmix64 (a bijection), 16 bits per character."""
    x = mix64(h)
    chars = []
    for shift in (0, 16, 32, 48):
        c = (x >> shift) & 0xFFFF
        # surrogate code points (U+D800..DFFF) -> plane 1 (U+1D800..1DFFF): valid, injective
        chars.append(chr(c + 0x10000 if 0xD800 <= c < 0xE000 else c))
    return "".join(chars)


def block_text(block_hashes: Sequence[int], chars_per_block: int = 4) -> str:
    """``chars_per_block`` characters per block hash (1..4), concatenated: equal leading hashes
    give equal leading characters. With 4 (all 64 bits) distinct hashes give distinct codes;
    fewer characters keep 16 bits each, and a prefix of text still matches block for block."""
    if chars_per_block == 4:
        return "".join(map(_block_code, block_hashes))
    return "".join(_block_code(h)[:chars_per_block] for h in block_hashes)


class RayPrefixScorer(Scorer):
    """Ray Serve's ``PrefixCacheAffinityRouter`` (see the module docstring)."""

    name = "ray_prefix"

    def __init__(
        self,
        imbalanced_threshold: float = float("inf"),
        match_rate_threshold: float = 0.1,
        do_eviction: bool = False,
        eviction_threshold_chars: int = 400_000,
        eviction_target_chars: int | None = 360_000,
        chars_per_block: int = 4,
        seed: int = 0,
    ) -> None:
        if not 1 <= chars_per_block <= 4:
            raise ValueError("chars_per_block: 1..4")
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self.do_eviction = do_eviction
        self.eviction_threshold_chars = eviction_threshold_chars
        self.eviction_target_chars = (
            eviction_target_chars if eviction_target_chars is not None else eviction_threshold_chars
        )
        self.chars_per_block = chars_per_block
        self.tree = PrefixTree()
        self._rng = random.Random(seed)
        self._tenants: frozenset[str] = frozenset()
        self._clock = 0  # logical time stamps for the tree's LRU

    def request_text(self, request: PlacementRequest) -> str:
        return block_text(request.block_hashes, self.chars_per_block)

    def _sync_tenants(self, instances: Sequence[InstanceView]) -> None:
        ids = frozenset(i.instance_id for i in instances)
        if ids == self._tenants:
            return
        gone = self._tenants - ids
        if gone:
            self.tree.remove_tenants(sorted(gone))
        new = [i.instance_id for i in instances if i.instance_id not in self._tenants]
        if new:
            self.tree.add_tenants(new, float(self._clock))
        self._tenants = ids

    def _pow2(self, alive: Sequence[InstanceView]) -> tuple[InstanceView, ...]:
        """Serve's ``PowerOfTwoChoicesRequestRouter.choose_replicas`` (same sampling)."""
        n = len(alive)
        if n == 1:
            return (alive[0],)
        if n == 2:
            return (alive[0], alive[1]) if self._rng.getrandbits(1) else (alive[1], alive[0])
        i = self._rng.randrange(n)
        j = self._rng.randrange(n - 1)
        if j >= i:
            j += 1
        return (alive[i], alive[j])

    def place(
        self,
        request: PlacementRequest,
        instances: Sequence[InstanceView],
        match: Mapping[str, Match],
    ) -> Placement:
        alive = healthy(instances)
        self._sync_tenants(instances)
        text = self.request_text(request)
        by_id = {i.instance_id: i for i in alive}
        queue = {iid: i.waiting + i.running for iid, i in by_id.items()}
        chosen_ids: list[str] = []
        rate = 0.0
        branch = "pow2"
        if not max(queue.values()) - min(queue.values()) > self.imbalanced_threshold:
            matched_text, matched = self.tree.prefix_match(text, list(by_id))
            rate = len(matched_text) / len(text) if text else 0.0
            if rate < self.match_rate_threshold:
                branch = "smallest"
                smallest = self.tree.get_smallest_tenants() or []
                chosen_ids = [t for t in smallest if t in by_id]
                if not chosen_ids:
                    counts = self.tree.tenant_to_char_count
                    least = min(counts.get(t, 0) for t in by_id)
                    chosen_ids = [t for t in by_id if counts.get(t, 0) == least]
            else:
                branch = "prefix"
                chosen_ids = [t for t in matched or () if t in by_id]
        if chosen_ids:
            picks: Sequence[str] = chosen_ids
        else:
            branch = "pow2"
            picks = [i.instance_id for i in self._pow2(alive)]
        chosen = min(picks, key=queue.__getitem__)  # the first of the shortest queues
        self._clock += 1
        self.tree.insert(text, chosen, float(self._clock))
        if self.do_eviction:
            size = self.tree.tenant_to_char_count.get(chosen, 0)
            if size > self.eviction_threshold_chars:
                self.tree.evict_tenant_by_lru(chosen, size - self.eviction_target_chars)
        m = match.get(chosen)
        return Placement(
            chosen,
            cached_blocks=m.total_blocks if m else 0,
            detail={"ray_branch": branch, "match_rate": rate},
        )
