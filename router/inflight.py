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
computes (``extend`` with a lookup of the views). vLLM's prefix cache gives a request the blocks
computed when it is admitted; a request that comes while the work ahead of it fits one step is
admitted beside its prompt's first copy and computes it again, so counting the copy there sends
a burst of parallel calls after the first one onto one engine while others sit idle. Behind a
longer queue it is admitted after the copy's blocks are computed. On by default
(``RouterSettings.inflight_prompts``); what the rule measured on the routing suite, against not
counting and against counting everywhere, is in ``docs/simulation.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from cachemap import Match
from router.placement import InstanceView, queued_past_a_step


class InFlightPrompts:
    def __init__(self) -> None:
        self._sent: dict[str, tuple[str, tuple[int, ...]]] = {}  # request id -> its blocks
        # block -> instance -> requests in flight to it holding the block
        self._refs: dict[int, dict[str, int]] = {}

    def __len__(self) -> int:
        return len(self._sent)

    def sent(self, request_id: str, instance: str, hashes: Sequence[int]) -> None:
        """``request_id`` went to ``instance``: its prompt's full blocks ``hashes`` are on their
        way into that instance's cache."""
        self.done(request_id)
        blocks = tuple(hashes)
        if not blocks:
            return
        refs = self._refs
        for h in blocks:
            holders = refs.get(h)
            if holders is None:
                refs[h] = {instance: 1}
            else:
                holders[instance] = holders.get(instance, 0) + 1
        self._sent[request_id] = (instance, blocks)

    def done(self, request_id: str) -> None:
        """``request_id``'s blocks are computed (or never will be): the map speaks for them."""
        got = self._sent.pop(request_id, None)
        if got is None:
            return
        instance, blocks = got
        refs = self._refs
        for h in blocks:
            holders = refs[h]
            n = holders[instance] - 1
            if n:
                holders[instance] = n
            elif len(holders) == 1:
                del refs[h]
            else:
                del holders[instance]

    def drop_instance(self, instance: str) -> None:
        for rid in [r for r, (iid, _) in self._sent.items() if iid == instance]:
            self.done(rid)

    def extend(
        self,
        hashes: Sequence[int],
        match: Mapping[str, Match],
        view_of: Callable[[str], InstanceView | None] | None = None,
    ) -> Mapping[str, Match]:
        """``match`` (the cache map's answer for ``hashes``) with each instance's leading run
        lengthened to the in-flight prompts it will hold first; with ``view_of`` (an instance's
        view, None for one without), only on the instances ``queued_past_a_step``.
        A lookup, not the views: the few instances with prompts in flight are looked up, not
        the whole cluster walked, on every placement."""
        refs = self._refs
        first = refs.get(hashes[0]) if refs and hashes else None
        if not first:
            return match
        runs = dict.fromkeys(first, 1)
        alive = list(first)
        for i in range(1, len(hashes)):
            holders = refs.get(hashes[i])
            if holders is None:
                break
            alive = [iid for iid in alive if iid in holders]
            if not alive:
                break
            for iid in alive:
                runs[iid] = i + 1
        if view_of is not None:
            runs = {iid: g for iid, g in runs.items() if _queued_past_a_step(view_of(iid))}
        longer: dict[str, Match] = {}
        for iid, g in runs.items():
            m = match.get(iid)
            if m is None:
                longer[iid] = Match(g, g)
            elif g > m.gpu_blocks:
                longer[iid] = Match(g, max(m.total_blocks, g))
        if not longer:
            return match  # NOTE: the map's own answer, uncopied, where nothing is longer
        out = dict(match.items())
        out.update(longer)
        return out


def _queued_past_a_step(view: InstanceView | None) -> bool:
    return view is not None and queued_past_a_step(view)
