"""``metric_sum``: the one reader of Prometheus pages that tests and bench scripts share."""

from __future__ import annotations

from gatekeeper.sandbox.testing import metric_sum

PAGE = """# HELP gatekeeper_x_total x
# TYPE gatekeeper_x_total counter
gatekeeper_x_total{a="1",b="say \\"hi\\", then {go}"} 2.0
gatekeeper_x_total{a="2"} 3
gatekeeper_x_total 1e1
gatekeeper_x_total_created 5
gatekeeper_y{a="1"} +Inf
"""


def test_metric_sum_adds_the_samples_whose_labels_match() -> None:
    assert metric_sum(PAGE, "gatekeeper_x_total") == 15.0
    assert metric_sum(PAGE, "gatekeeper_x_total", a="2") == 3.0
    assert metric_sum(PAGE, "gatekeeper_x_total", a="3") == 0.0


def test_metric_sum_reads_escaped_quotes_in_label_values_and_no_name_prefixes() -> None:
    assert metric_sum(PAGE, "gatekeeper_x_total", b='say \\"hi\\", then {go}') == 2.0  # as written, escapes kept
    assert metric_sum(PAGE, "gatekeeper_x_total", a="1") == 2.0
    assert metric_sum(PAGE, "gatekeeper_x") == 0.0  # a prefix of a name is not the name
    assert metric_sum(PAGE, "gatekeeper_y") == float("inf")
