"""gatekeeper_flowcontrol_* metrics follow the queues: upstream names, flow_schema/priority_level labels."""

from __future__ import annotations

import asyncio

from fc_helpers import flow_schema, group, queued_level, rr
from prometheus_client import REGISTRY
from test_middleware import Upstream, call, req, until

from gatekeeper.proxy.flowcontrol.edge.middleware import FlowControl
from gatekeeper.proxy.flowcontrol.settings import FlowControlSettings

FS = PL = "metrics-probe"


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_metrics_track_dispatch_queue_and_rejections():
    level = queued_level(PL, 1, queues=1, hand=1, qlen=1)
    schema = flow_schema(FS, PL, [{"subjects": [group("*")], "resourceRules": [rr(["list"], ["secrets"])]}], 400)
    fc = FlowControl(
        FlowControlSettings(
            server_concurrency_limit=1,
            priority_level_configurations=[level, queued_level("catch-all", 0)],
            flow_schemas=[schema],
            coalesce=False,
        )
    )
    labels = {"flow_schema": FS, "priority_level": PL}
    up = Upstream(body=b"m" * 3000)
    up.gate.clear()
    first = asyncio.create_task(call(fc, req(user="a"), up))
    await until(lambda: up.calls == 1, "the first LIST to hold the only seat")
    second = asyncio.create_task(call(fc, req(user="b"), up))
    await until(lambda: fc.controller.levels[PL].waiting == 1, "the second LIST to queue")
    status, _, _ = await call(fc, req(user="c"), up)  # the one queue (length 1) is full
    assert status == 429
    assert value("gatekeeper_flowcontrol_current_executing_requests", **labels) == 1
    assert value("gatekeeper_flowcontrol_current_inqueue_requests", **labels) == 1
    assert value("gatekeeper_flowcontrol_current_executing_seats", priority_level=PL) == 1
    assert value("gatekeeper_flowcontrol_nominal_limit_seats", priority_level=PL) == 1
    assert value("gatekeeper_flowcontrol_rejected_requests_total", reason="queue-full", **labels) == 1
    up.gate.set()
    assert [(await t)[0] for t in (first, second)] == [200, 200]
    assert value("gatekeeper_flowcontrol_dispatched_requests_total", **labels) == 2
    assert value("gatekeeper_flowcontrol_current_executing_requests", **labels) == 0
    assert value("gatekeeper_flowcontrol_current_inqueue_requests", **labels) == 0
    assert value("gatekeeper_flowcontrol_request_wait_duration_seconds_count", execute="true", **labels) == 2
    assert value("gatekeeper_flowcontrol_request_execution_seconds_count", type="regular", **labels) == 2
    assert value("gatekeeper_flowcontrol_work_estimated_seats_count", **labels) == 2
    assert value("gatekeeper_flowcontrol_peak_executing_requests", priority_level=PL) == 1
    assert fc.controller.estimator.list_bytes("secrets", "") == 3000
