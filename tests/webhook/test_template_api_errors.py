"""When the apiserver refuses a ResourceClaimTemplate, the user and the log get the apiserver's reason.

kubernetes-asyncio's ``ApiException.reason`` is only the HTTP reason phrase: "HTTP 403 Forbidden" told nobody
whether RBAC, a quota or another admission plugin said no. Its ``str()`` is worse for a log: every response
header and the whole body, over many lines. The ``Status.message`` is remote text, so it arrives as one
bounded, printable line. Here a real kubernetes-asyncio client talks to a local server that answers like an
apiserver (tests/webhook/test_webhook_sandbox.py checks the real apiserver's quota message end to end).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web

from gatekeeper.kube.status import MAX_REMOTE_MESSAGE_CHARS, one_line, status_message
from gatekeeper.webhook.kube_api import template_creator, template_ops
from gatekeeper.webhook.template_lifecycle import TemplateLifecycle
from gatekeeper.webhook.templates import TemplateError

QUOTA = ('resourceclaimtemplates.resource.k8s.io "gpu-1" is forbidden: exceeded quota: gpu-templates, '
         "requested: count/resourceclaimtemplates.resource.k8s.io=1, used: count/resourceclaimtemplates."
         "resource.k8s.io=0, limited: count/resourceclaimtemplates.resource.k8s.io=0")
HOSTILE = ("denied\n2026-12-01 INFO gatekeeper: all good\x1b[2J\x1b[31m \u202eoverride" + " pad" * 2000)
TEMPLATE = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "gpu-1", "namespace": "team"}, "spec": {"spec": {}}}


def status(code: int, reason: str, message: str) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}
    return web.Response(status=code, text=json.dumps(body), content_type="application/json",
                        headers={"X-Secret-Looking-Header": "header-value-not-for-logs"})


@pytest.fixture
async def apiserver(aiohttp_server: Any) -> AsyncIterator[Callable[[web.Response], Any]]:
    """A kubernetes-asyncio ApiClient pointed at a server that answers every request with ``answer``."""
    from kubernetes_asyncio import client

    clients: list[Any] = []

    async def start(answer: web.Response) -> Any:
        async def handle(request: web.Request) -> web.Response:
            return answer

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        server = await aiohttp_server(app)
        cfg = client.Configuration(host=f"http://127.0.0.1:{server.port}")
        api = client.ApiClient(configuration=cfg)
        clients.append(api)
        return api

    yield start
    for api in clients:
        await api.close()


async def test_a_refused_template_carries_the_apiservers_status_message(apiserver: Any) -> None:
    create = template_creator(await apiserver(status(403, "Forbidden", QUOTA)))
    with pytest.raises(TemplateError) as err:
        await create(TEMPLATE)
    assert str(err.value) == (f"gatekeeper could not create ResourceClaimTemplate team/gpu-1: HTTP 403 Forbidden: "
                              f"{QUOTA}; the pod would stay Pending, so it was not admitted")


async def test_a_hostile_status_message_arrives_as_one_bounded_printable_line(apiserver: Any) -> None:
    create = template_creator(await apiserver(status(403, "Forbidden", HOSTILE)))
    with pytest.raises(TemplateError) as err:
        await create(TEMPLATE)
    message = str(err.value)
    assert "denied 2026-12-01 INFO gatekeeper: all good\\u001b[2J\\u001b[31m \\u202eoverride pad" in message
    assert message.isprintable(), "a newline, ESC or bidi override reached the message"
    assert len(message) < MAX_REMOTE_MESSAGE_CHARS + 200 and "pad..." in message


async def test_the_reconcilers_log_names_the_apiservers_message_not_its_headers(
        apiserver: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The reconciliation loop logged ``str(ApiException)``: every response header and the whole body."""
    life = TemplateLifecycle(template_ops(await apiserver(status(403, "Forbidden", HOSTILE))), 3600, 60, set)
    with caplog.at_level(logging.WARNING, logger="gatekeeper.webhook.template_lifecycle"):
        task = asyncio.create_task(life.run())
        for _ in range(500):
            if caplog.records:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    line = caplog.records[0].getMessage()
    assert line.startswith("template reconciliation failed: HTTP 403 Forbidden: denied 2026-12-01 INFO"), line
    assert line.isprintable() and "header-value-not-for-logs" not in line
    assert len(line) < MAX_REMOTE_MESSAGE_CHARS + 100


@pytest.mark.parametrize(("body", "expected"), [
    pytest.param(b'{"kind":"Status","message":"exceeded quota"}', "exceeded quota", id="status"),
    pytest.param(b"<html>502 Bad Gateway</html>", "", id="not-json"),
    pytest.param(b'["message"]', "", id="not-an-object"),
    pytest.param(b'{"message": 7}', "", id="message-not-a-string"),
    pytest.param(b'{"message":"' + b"x" * 70000 + b'"}', "", id="too-large-to-parse"),
    pytest.param(None, "", id="no-body"),
])
def test_only_a_status_message_is_taken_from_an_error_body(body: bytes | None, expected: str) -> None:
    assert status_message(body) == expected


def test_one_line_collapses_whitespace_escapes_the_unprintable_and_marks_the_cut() -> None:
    assert one_line("a \n\t b\x00c\u200b") == "a b\\u0000c\\u200b"
    assert one_line("x" * 50, 10) == "xxxxxxx..."
    assert one_line("word " * 10_000, 20) == "word word word wo..."
