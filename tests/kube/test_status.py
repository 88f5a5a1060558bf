"""The one Kubernetes Status failure builder (proxy errors and flow control's 429 share it)."""

from __future__ import annotations

import orjson

from gatekeeper.kube.status import failure, failure_json


def test_failure_has_the_metav1_status_shape_kubectl_prints():
    assert orjson.loads(failure_json(404, "NotFound", "no such thing")) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": "no such thing", "reason": "NotFound", "code": 404,
    }


def test_retry_after_goes_into_details_like_the_apiserver():
    status = failure(429, "TooManyRequests", "slow down", retry_after=3)
    assert status["details"] == {"retryAfterSeconds": 3}
    assert "details" not in failure(500, "InternalError", "x")
