"""Per block class: how often an access is followed by a reuse, learned online.

The two learned policies (``prefix-reuse``, ``prefix-odds``) sort blocks into classes (access
count, prompt tail, depth) and keep, per class, the accesses, the reuses that followed them
and (for ``prefix-odds``) the gaps before those reuses. A class's reuse probability is its
reuses over its accesses, shrunk towards the pooled rate by ``prior_weight`` pseudo-accesses
(so a rare class does not swing on a few samples), clipped away from 0 and 1; its mean gap is
shrunk the same way towards the pooled gap. Once the accesses counted pass
``memory_accesses`` every count is halved, so the estimates track a drifting workload.
"""

from __future__ import annotations

import math

# a class's reuse probability stays within [_CLIP, 1 - _CLIP]: its logit stays finite
_CLIP = 1e-4
# the pooled gap before any reuse was seen, seconds
_PRIOR_GAP_S = 60.0


class ClassOdds:
    __slots__ = ("accesses", "gaps", "memory_accesses", "prior_weight", "reuses")

    def __init__(self, classes: int, prior_weight: float, memory_accesses: int) -> None:
        self.prior_weight, self.memory_accesses = prior_weight, memory_accesses
        self.accesses = [0.0] * classes
        self.reuses = [0.0] * classes
        self.gaps = [0.0] * classes  # summed reuse gaps, seconds

    def reused(self, cls: int, gap_s: float) -> None:
        self.reuses[cls] += 1.0
        self.gaps[cls] += max(gap_s, 0.0)

    def logits(self) -> list[float]:
        """Per class the logit of its shrunk reuse probability."""
        acc, reu = self.accesses, self.reuses
        total_a, total_r = sum(acc), sum(reu)
        prior = total_r / total_a if total_a else 0.5
        w = self.prior_weight
        out = []
        for a, r in zip(acc, reu, strict=True):
            p = min(max((r + w * prior) / (a + w), _CLIP), 1.0 - _CLIP)
            out.append(math.log(p / (1.0 - p)))
        return out

    def mean_gaps(self) -> list[float]:
        """Per class its shrunk mean gap before a reuse, seconds."""
        reu, gaps = self.reuses, self.gaps
        total_r = sum(reu)
        prior = sum(gaps) / total_r if total_r else _PRIOR_GAP_S
        w = self.prior_weight
        return [(g + w * prior) / (r + w) for r, g in zip(reu, gaps, strict=True)]

    def age(self) -> None:
        """Halve every count once the accesses pass ``memory_accesses``."""
        if sum(self.accesses) > self.memory_accesses:
            for counts in (self.accesses, self.reuses, self.gaps):
                counts[:] = [x / 2.0 for x in counts]
