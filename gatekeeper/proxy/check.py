"""`gatekeeper proxy --config FILE --check`: everything the proxy would refuse at start, found before a rollout.

A bad config crash-loops every replica at once, and a policy that fails to reload silently keeps the old one, so
this also checks what only socket setup finds (files exist, key matches certificate, CA files parse), reporting
the listener's and the upstream's TLS problems together. Nothing listens or connects.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable

from gatekeeper.base.errors import UsageError
from gatekeeper.proxy.flowcontrol.edge.loading import load_policy
from gatekeeper.proxy.listen.server import make_ssl_context as serving_context
from gatekeeper.proxy.settings import ProxySettings
from gatekeeper.proxy.upstream.client import make_ssl_context as upstream_context


def _attempt(problems: list[str], what: str, fn: Callable[[], object]) -> None:
    try:
        fn()
    except (OSError, ssl.SSLError, ValueError, UsageError) as exc:
        problems.append(f"{what}: {exc}")


def check(settings: ProxySettings, files_check: Callable[[ProxySettings], None]) -> tuple[list[str], list[str]]:
    """``(summary lines, problems)`` for a loaded config; no problems means the proxy would start on it."""
    problems: list[str] = []
    _attempt(problems, "files", lambda: files_check(settings))
    if not problems:  # the TLS checks would only repeat "does not exist"
        _attempt(problems, "proxy.listener (serving certificate, key, client CA)",
                 lambda: serving_context(settings.listener))
        upstream = settings.upstream
        _attempt(problems, "proxy.upstream (CA, front-proxy client certificate)",
                 lambda: upstream_context(upstream, client_cert=bool(upstream.client_cert_file)))
    summary = [f"backends: {', '.join(b.url for b in settings.backends)}",
               f"workers: {settings.workers or 'one per usable core'} (at most {settings.max_workers})"]
    fc = settings.flow_control
    if fc.enabled:
        try:
            policy = load_policy(fc)
        except ValueError as exc:  # the config loader checked it; a file may have changed since
            problems.append(f"proxy.flowControl: {exc}")
        else:
            summary.append(f"flow control: {len(policy.schemas)} FlowSchemas, {len(policy.levels)} priority levels, "
                           f"serverConcurrencyLimit {fc.server_concurrency_limit}")
            for name, level in sorted(policy.levels.items()):
                seats = "exempt" if level.exempt else f"{policy.limits.get(name, 0)} seats"
                summary.append(f"  {name}: {seats}")
    else:
        summary.append("flow control: off")
    return summary, problems
