"""Seat estimates come from observed LIST sizes per (resource, namespace)."""

from __future__ import annotations

from gatekeeper.proxy.flowcontrol.core.seats import SizeEstimator

MiB = 1 << 20


def test_non_list_costs_one_seat_and_unknown_list_one():
    e = SizeEstimator(bytes_per_seat=8 * MiB, max_seats=10)
    assert e.estimate("get", "secrets", "a").seats == 1
    assert e.estimate("watch", "secrets", "").seats == 1
    assert (e.estimate("list", "secrets", "a").seats, e.estimate("list", "secrets", "a").list_bytes) == (1, 0)


def test_estimate_grows_with_observed_sizes():
    e = SizeEstimator(bytes_per_seat=8 * MiB, max_seats=10)
    seats = []
    for size in (1 * MiB, 9 * MiB, 20 * MiB, 40 * MiB, 200 * MiB):
        e.observe("secrets", "", size)
        seats.append(e.estimate("list", "secrets", "").seats)
    assert seats == [1, 2, 3, 5, 10]
    assert e.estimate("list", "secrets", "").list_bytes == 200 * MiB


def test_estimate_shrinks_slowly_and_is_per_key():
    e = SizeEstimator(bytes_per_seat=8 * MiB, max_seats=10)
    e.observe("secrets", "", 80 * MiB)
    e.observe("secrets", "", 0)
    assert e.list_bytes("secrets", "") == 64 * MiB  # 0.8 * 80 + 0.2 * 0
    e.observe("secrets", "small", 100)
    assert e.estimate("list", "secrets", "small").seats == 1
    # a namespace never seen borrows the cluster-wide LIST's size (an upper bound)
    assert e.list_bytes("secrets", "unseen") == 64 * MiB
    assert e.list_bytes("configmaps", "small") == 0
