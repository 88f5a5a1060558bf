"""Reviews built to hold a worker: the policies' cost stays linear in the review's size.

A webhook worker is one event loop; a review that keeps it busy for minutes makes every other review on that
worker time out at the apiserver (failurePolicy Fail: Secret writes and GPU pods refused cluster-wide). The
reviews here are what any pod can POST in open mode, and what any user who may create a pod gets the apiserver
to send (annotations are limited to 256 KiB only by validation, which runs after mutating admission).

The timeouts are hang detectors, not speed assertions: each review is answered in well under a second, and
took from minutes to hours before the fix.
"""

from __future__ import annotations

import pytest
from review_fixtures import container, pod, request, review

from gatekeeper.webhook.gpu import policy as gpu
from gatekeeper.webhook.gpu.sizing import mig_need_bytes, parse_quantity
from gatekeeper.webhook.settings import GpuSettings

DIGITS = 200_000


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text", ["1" * DIGITS + "x", "1." + "1" * DIGITS + "x", "+" + "9" * DIGITS + "Kx"])
def test_a_long_non_quantity_is_refused_in_linear_time(text: str) -> None:
    """``[0-9]+\\.?[0-9]*`` split a run of digits in as many ways as it had: 200,000 digits and an ``x``
    backtracked for many minutes."""
    with pytest.raises(ValueError, match="expected a Kubernetes quantity"):
        parse_quantity(text)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text", ["1" + " " * DIGITS + "x", "1" + " " * DIGITS + "gb" + " " * DIGITS + "x"])
def test_a_mig_memory_padded_with_spaces_is_refused_in_linear_time(text: str) -> None:
    """``\\s*(unit)?\\s*$`` split a run of spaces between its two ``\\s*`` in as many ways as it had."""
    with pytest.raises(ValueError, match="gpu-memory must be a size"):
        mig_need_bytes(text)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("mode", "memory"), [("shared", "1" * DIGITS + "x"), ("mig", "1" + " " * DIGITS + "x"),
                                              ("mig-dra", "2" * DIGITS + "Gix")])
def test_a_hostile_gpu_memory_annotation_is_denied_not_a_stalled_worker(mode: str, memory: str) -> None:
    annotations = {"gatekeeper.dev/gpu-mode": mode, "gatekeeper.dev/gpu-memory": memory}
    req = request(review(pod(container("m", 1), annotations=annotations), kind="Pod"))
    d = gpu.review(req, GpuSettings())
    assert not d.allowed and d.code == 422 and "gpu-memory" in d.message
    # The message (and the auditAnnotation the apiserver logs) quotes the value trimmed, not 200 KB of it.
    assert len(d.message) < 500 and len(d.audit["gpu-denied"]) < 500


@pytest.mark.parametrize(("field", "value"), [("count", "1" * DIGITS + "x"), ("mode", "x" * DIGITS)])
def test_a_denial_quotes_a_huge_value_trimmed(field: str, value: str) -> None:
    if field == "count":
        obj = pod(container("m", value))
    else:
        obj = pod(container("m", 1), annotations={"gatekeeper.dev/gpu-mode": value})
    d = gpu.review(request(review(obj, kind="Pod")), GpuSettings(default_mode="dra"))
    assert not d.allowed and d.code == 422 and len(d.message) < 500


@pytest.mark.timeout(120)
def test_a_pod_of_100k_gpu_containers_behind_a_gpu_init_container_is_rewritten_in_linear_time() -> None:
    """Sidecars were found with ``c not in inits and c not in app``: whole containers compared pairwise, 5 x 10^9
    comparisons for the 100,000 containers a 6 MiB review holds."""
    n = 100_000
    obj = pod(*(container(f"c{i}", 1) for i in range(n)), init=[container("warmup", 1)])
    req = request(review(obj, kind="Pod"))
    d = gpu.review(req, GpuSettings(default_mode="dra"))
    assert d.allowed and d.outcome == "mutated"
    (tmpl,) = d.templates  # the init container and every app container share the pod's one claim
    assert tmpl["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] == n
