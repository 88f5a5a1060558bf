"""``?timeout=`` is read with Go's time.ParseDuration by kube-apiserver; the proxy reads it the same way."""

from __future__ import annotations

import pytest

from gatekeeper.kube.duration import DurationError, go_duration, go_duration_ns


@pytest.mark.parametrize(("text", "ns"), [
    ("0", 0), ("1s", 1_000_000_000), ("1m30s", 90_000_000_000), ("1.5h", 5_400_000_000_000),
    ("-2s", -2_000_000_000), ("+5ms", 5_000_000), (".5s", 500_000_000), ("1.s", 1_000_000_000),
    ("300us", 300_000), ("2\u00b5s", 2_000), ("2\u03bcs", 2_000), ("1h2m3.5s", 3_723_500_000_000),
    ("1.0000000001s", 1_000_000_000),  # sub-nanosecond digits truncate, as in Go
    ("2562047h47m16.854775807s", (1 << 63) - 1),  # Go's largest duration
])
def test_durations_go_accepts_mean_what_go_says(text: str, ns: int) -> None:
    assert go_duration_ns(text) == ns


@pytest.mark.parametrize(("text", "message"), [
    ("", 'invalid duration ""'), ("1", 'missing unit in duration "1"'), ("s", 'invalid duration "s"'),
    (".", 'invalid duration "."'), ("1x", 'unknown unit "x"'), ("--1s", 'invalid duration "--1s"'),
    ("1.2.3s", "missing unit"), ("2562047h47m16.854775808s", "invalid duration"), ("1 s", 'unknown unit " s"'),
    ("0s ", 'unknown unit "s "'),
])
def test_durations_go_refuses_are_refused_with_gos_words(text: str, message: str) -> None:
    with pytest.raises(DurationError, match=message.replace(".", r"\.")):
        go_duration(text)
