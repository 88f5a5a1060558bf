"""The goawayChance decision, kept pure so tests can make it deterministic.

kube-apiserver (``WithProbabilisticGoaway``) draws ``rand.Float64() < chance``
once per HTTP/2 request. Gatekeeper draws once per request too, after that
request's response is complete (h2) or when its response head is written
(http/1.1, where ``Connection: close`` must be in the head; the connection is
then closed after the body), and applies it to both protocols because
HTTP/1.1 clients pin connections as well.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

Reason = str
"""One of ``chance``, ``shutdown``, ``idle``: the label of ``gatekeeper_proxy_goaway_sent_total``."""


def should_goaway(chance: float, draw: float) -> bool:
    """True when a uniform draw in [0, 1) falls under ``chance`` (never when chance is 0)."""
    return chance > 0.0 and draw < chance


@dataclass
class GoawayDecider:
    """Per-request coin with an injectable random source (``rng`` returns a float in [0, 1))."""

    chance: float
    rng: Callable[[], float] = field(default=random.random)

    def decide(self) -> bool:
        if self.chance <= 0.0:
            return False  # don't consume draws when disabled: keeps seeded sequences comparable
        return should_goaway(self.chance, self.rng())
