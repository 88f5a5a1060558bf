"""Balancer choice, health and skew, driven by a fake clock and a seeded RNG."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from gatekeeper.proxy.pipeline.balancer import Balancer, EjectionPolicy
from gatekeeper.proxy.settings import BackendSettings


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make(n: int = 3, weights: list[int] | None = None, **policy: float) -> tuple[Balancer, FakeClock]:
    clock = FakeClock()
    weights = weights or [1] * n
    settings = [BackendSettings(url=f"https://127.0.0.1:{6441 + i}", weight=w) for i, w in enumerate(weights)]
    return Balancer(settings, policy=EjectionPolicy(**policy), clock=clock, rng=random.Random(7)), clock


def test_names_default_to_host_port() -> None:
    b, _ = make(2)
    assert [x.name for x in b.backends] == ["127.0.0.1:6441", "127.0.0.1:6442"]


def test_duplicate_backends_are_rejected() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        Balancer([BackendSettings(url="https://a:1"), BackendSettings(url="https://a:1")])


def test_choice_avoids_the_backend_with_most_in_flight() -> None:
    b, _ = make(3)
    busy = b.backends[0]
    for _ in range(50):
        b.acquire(busy)
    picks = Counter(b.choose().name for _ in range(600))  # type: ignore[union-attr]
    # With P2C the busiest backend is picked only if drawn twice, which cannot happen (distinct draws).
    assert picks[busy.name] == 0
    assert picks[b.backends[1].name] > 200 and picks[b.backends[2].name] > 200


def test_choice_under_mild_skew_prefers_less_loaded() -> None:
    b, _ = make(3)
    loads = [10, 5, 0]
    for backend, n in zip(b.backends, loads, strict=True):
        for _ in range(n):
            b.acquire(backend)
    picks = Counter(b.choose().name for _ in range(900))  # type: ignore[union-attr]
    names = [x.name for x in b.backends]
    # least loaded wins both of its pairs (2/3 of draws), middle wins its pair with the busiest (1/3)
    assert picks[names[2]] > picks[names[1]] > picks[names[0]] == 0


def test_p2c_spreads_sequential_requests_evenly() -> None:
    b, _ = make(3)
    for _ in range(300):
        chosen = b.choose()
        assert chosen is not None
        b.acquire(chosen)  # never released: in-flight keeps growing
    counts = [x.in_flight for x in b.backends]
    assert max(counts) - min(counts) <= 2


def test_weights_shift_share() -> None:
    b, _ = make(2, weights=[3, 1])
    for _ in range(400):
        chosen = b.choose()
        assert chosen is not None
        b.acquire(chosen)
    heavy, light = (x.in_flight for x in b.backends)
    assert 2.5 <= heavy / light <= 3.5


def test_watches_count_as_in_flight_until_released() -> None:
    b, _ = make(2)
    lease = b.acquire(b.backends[0], long_running=True)
    assert (b.backends[0].in_flight, b.backends[0].watches) == (1, 1)
    lease.release()
    lease.release()  # idempotent
    assert (b.backends[0].in_flight, b.backends[0].watches) == (0, 0)


def test_connect_failure_ejects_with_exponential_backoff_and_recovers() -> None:
    b, clock = make(3, base_ejection_seconds=1.0, max_ejection_seconds=8.0)
    bad = b.backends[0]
    b.report_connect_failure(bad)
    assert b.health(bad) == "ejected"
    assert all(b.choose().name != bad.name for _ in range(100))  # type: ignore[union-attr]
    clock.advance(1.01)
    assert b.health(bad) == "healthy"
    b.report_connect_failure(bad)  # second failure soon after: 2 s
    clock.advance(1.5)
    assert b.health(bad) == "ejected"
    clock.advance(0.6)
    assert b.health(bad) == "healthy"
    b.report_connect_failure(bad)  # third: 4 s
    clock.advance(3.9)
    assert b.health(bad) == "ejected"
    clock.advance(0.2)
    for _ in range(3):  # 8, then capped at 8
        b.report_connect_failure(bad)
        clock.advance(7.9)
        assert b.health(bad) == "ejected"
        clock.advance(0.2)
    assert b.health(bad) == "healthy"
    assert bad.ejections_total == 6 and bad.connect_failures_total == 6
    # staying healthy long enough resets the backoff
    clock.advance(20)
    b.report_connect_failure(bad)
    clock.advance(1.01)
    assert b.health(bad) == "healthy"


def test_successful_probe_lifts_connect_ejection_early() -> None:
    b, clock = make(2, base_ejection_seconds=10.0)
    bad = b.backends[1]
    b.report_connect_failure(bad)
    clock.advance(1)
    assert b.health(bad) == "ejected"
    b.report_probe(bad, ok=True)
    assert b.health(bad) == "healthy"


def test_5xx_storm_ejects_but_isolated_errors_do_not() -> None:
    b, clock = make(2, storm_min_responses=10, storm_ratio=0.5, storm_window_seconds=10)
    bad = b.backends[0]
    for i in range(20):
        b.report_response(bad, 503 if i % 4 == 0 else 200)  # 25 % errors
    assert b.health(bad) == "healthy"
    for _ in range(20):
        b.report_response(bad, 500)
        clock.advance(0.1)
    assert b.health(bad) == "ejected"
    b.report_probe(bad, ok=True)  # a probe does not lift a 5xx ejection
    assert b.health(bad) == "ejected"


def test_5xx_storm_never_ejects_the_last_eligible_backend() -> None:
    b, _ = make(2)
    b.report_connect_failure(b.backends[1])
    for _ in range(50):
        b.report_response(b.backends[0], 503)
    assert b.health(b.backends[0]) == "healthy"


def test_readyz_failures_take_backend_out_after_threshold() -> None:
    b, _ = make(2, unhealthy_threshold=2)
    x = b.backends[0]
    b.report_probe(x, ok=False)
    assert b.health(x) == "healthy"
    b.report_probe(x, ok=False)
    assert b.health(x) == "unready"
    assert all(b.choose().name != x.name for _ in range(50))  # type: ignore[union-attr]
    b.report_probe(x, ok=True)
    assert b.health(x) == "healthy"


def test_all_ejected_falls_back_to_ready_backends_instead_of_failing() -> None:
    b, _ = make(2)
    for x in b.backends:
        b.report_connect_failure(x)
    assert b.choose() is not None
    b.report_probe(b.backends[0], ok=False)
    b.report_probe(b.backends[0], ok=False)
    assert all(b.choose() is b.backends[1] for _ in range(20))


def test_exclude_skips_backends_already_tried() -> None:
    b, _ = make(3)
    tried = {b.backends[0].name, b.backends[1].name}
    assert all(b.choose(tried) is b.backends[2] for _ in range(20))
    assert b.choose({x.name for x in b.backends}) is None


def test_skew_ratios_reflect_in_flight_and_rate() -> None:
    b, clock = make(2, rate_window_seconds=10)
    assert b.skew().in_flight_ratio == 1.0
    for _ in range(9):
        b.acquire(b.backends[0]).release()
    b.acquire(b.backends[0])
    s = b.skew()
    assert s.in_flight_ratio == 2.0  # (1+1)/(0+1)
    assert s.rate_ratio == 11.0  # (10+1)/(0+1)
    clock.advance(11)
    assert b.skew().rate_ratio == 1.0  # window slid past
