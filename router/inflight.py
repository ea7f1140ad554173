"""Prompts a router replica has sent whose KV its cache map cannot show yet.

The cache map learns a prompt's blocks from the engine's KV events, once they are computed:
after the request's wait in the engine's queue and its prefill, plus the events' transit. Until
then a second request with the same prefix sees no holder, or only an older one, and may go
cold on a third engine, or queue behind a busy holder, while the engine that will hold the
prefix first is one placement away (SGLang's router inserts a prompt into its approximate tree
when it routes it; Dynamo's router can assume the reuse of blocks it has sent). ``InFlightPrompts``
holds each sent prompt's block hashes under its instance from ``sent`` until ``done`` (its
first token: the engine's events carry the blocks from then on; or its end), and ``extend``
lengthens a request's match with them.

An in-flight prompt counts only on an instance where more prefill waits than one engine step
computes (``queued_past_a_step``). vLLM's prefix cache gives a request the blocks computed when
it is admitted; a request that comes while the work ahead of it fits one step is admitted
beside its prompt's first copy and computes it again, so counting the copy there sends a burst
of parallel calls after the first one onto one engine while others sit idle. Behind a longer
queue it is admitted after the copy's blocks are computed. On the routing suite (6 seeds,
kv_ttft, mean excess TTFT over ideal, against not counting in-flight prompts) the rule lowered
L2 on agentic (174 -> 131 ms), rag (683 -> 624) and conversation (991 -> 942), and left L1
where it was (agentic 71 -> 68; rag, mix, to-b and azure-conv unchanged to the byte); mix L2
moved 150 -> 151 (one seed of six). Counted everywhere instead, it cost agentic L1 (71 -> 80).
The whole shared Mooncake trace (16 engines, 3 seeds) is unchanged at 1.5x and 2x and within
0.5% of mean excess at 3x. On by default (``DEFAULT_INFLIGHT_PROMPTS``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cachemap import CacheMap, Match, Tier
from router.placement import InstanceView

# whether a router counts its in-flight prompts (``RouterCore``, the simulator's
# ``SimSettings``, a deployment's ``router.inflight_prompts``)
DEFAULT_INFLIGHT_PROMPTS = True


def queued_past_a_step(views: Sequence[InstanceView]) -> set[str]:
    """The instances where more prefill waits than one step of theirs computes."""
    return {
        v.instance_id for v in views if v.pending_prefill_tokens > v.latency.max_num_batched_tokens
    }


class InFlightPrompts:
    def __init__(self) -> None:
        self._map = CacheMap()  # the in-flight blocks, as GPU blocks of their instances
        self._sent: dict[str, tuple[str, tuple[int, ...]]] = {}  # request id -> its blocks
        self._refs: dict[tuple[str, int], int] = {}  # requests in flight holding a block

    def __len__(self) -> int:
        return len(self._sent)

    def sent(self, request_id: str, instance: str, hashes: Sequence[int]) -> None:
        """``request_id`` went to ``instance``: its prompt's full blocks ``hashes`` are on their
        way into that instance's cache."""
        self.done(request_id)
        blocks = tuple(hashes)
        if not blocks:
            return
        refs, new = self._refs, []
        for h in blocks:
            key = (instance, h)
            n = refs.get(key, 0)
            if n == 0:
                new.append(h)
            refs[key] = n + 1
        if new:
            self._map.store(instance, Tier.GPU, new)
        self._sent[request_id] = (instance, blocks)

    def done(self, request_id: str) -> None:
        """``request_id``'s blocks are computed (or never will be): the map speaks for them."""
        got = self._sent.pop(request_id, None)
        if got is None:
            return
        instance, blocks = got
        refs, gone = self._refs, []
        for h in blocks:
            key = (instance, h)
            n = refs[key] - 1
            if n:
                refs[key] = n
            else:
                del refs[key]
                gone.append(h)
        if gone:
            self._map.remove(instance, Tier.GPU, gone)

    def drop_instance(self, instance: str) -> None:
        for rid in [r for r, (iid, _) in self._sent.items() if iid == instance]:
            self.done(rid)

    def extend(
        self, hashes: Sequence[int], match: Mapping[str, Match], only: set[str] | None = None
    ) -> Mapping[str, Match]:
        """``match`` (the cache map's answer for ``hashes``) with each instance's leading run
        lengthened to the in-flight prompts it will hold first; only on the instances in
        ``only`` where given."""
        if not self._sent:
            return match
        pending = self._map.match(hashes)
        if not len(pending):
            return match
        out = dict(match.items())
        for iid, p in pending.items():
            if only is not None and iid not in only:
                continue
            g = p.gpu_blocks
            m = out.get(iid)
            if m is None:
                out[iid] = Match(g, g)
            elif g > m.gpu_blocks:
                out[iid] = Match(g, max(m.total_blocks, g))
        return out
