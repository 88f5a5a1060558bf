"""The goawayChance decision, kept pure so tests can make it deterministic. Drawn once per request like
kube-apiserver's, for both protocols (HTTP/1.1 clients pin connections too)."""

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
