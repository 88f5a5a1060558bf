"""Binding a server's port (``gatekeeper.serving.netbind``), as the webhook's parent and the proxy's supervisor and
workers do.

A name may resolve to an IPv4 and an IPv6 loopback address (``localhost`` does on most hosts, not on every test
machine), so the resolver is replaced here by one that answers both, ``127.0.0.1`` and ``::1``.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest

from gatekeeper.serving.netbind import bind_listeners


@pytest.fixture
def both_loopbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``getaddrinfo`` answers 127.0.0.1 and ::1 (twice each, as resolvers do for several socket types)."""
    real = socket.getaddrinfo

    def resolve(host: Any, port: Any, *args: Any, **kwargs: Any) -> list[Any]:
        if host != "dual.test":
            return real(host, port, *args, **kwargs)
        v4 = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))
        v6 = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0))
        return [v4, v6, v4, v6]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)


def _refused(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_port_zero_resolves_once_for_every_address(both_loopbacks: None) -> None:
    socks = bind_listeners("dual.test", 0, reuse_port=True)
    try:
        assert [s.family for s in socks] == [socket.AF_INET, socket.AF_INET6]
        assert len({s.getsockname()[1] for s in socks}) == 1
        for s in socks:
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) and not s.getblocking()
        assert socks[1].getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
    finally:
        for s in socks:
            s.close()


def test_bound_only_refuses_connections_until_listen() -> None:
    [sock] = bind_listeners("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        assert not sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT)
        assert _refused("127.0.0.1", port)
    finally:
        sock.close()
    [sock] = bind_listeners("127.0.0.1", 0, backlog=8)
    try:
        assert not _refused("127.0.0.1", sock.getsockname()[1])
    finally:
        sock.close()


def test_an_address_taken_on_one_family_fails_and_leaves_nothing_bound(both_loopbacks: None) -> None:
    """A workers' parent reserves every address its workers will listen on, so a port taken on ``::1`` is
    reported once by the parent; the IPv4 socket it had already bound is closed, not leaked."""
    with socket.socket(socket.AF_INET6) as taken:  # plain, no SO_REUSEPORT: nobody may share it
        taken.bind(("::1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        try:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port))
        except OSError:
            pytest.skip(f"127.0.0.1:{port} is in use by someone else")
        with pytest.raises(OSError):
            bind_listeners("dual.test", port, reuse_port=True)
        with socket.socket() as again:  # the IPv4 socket bound first was closed
            again.bind(("127.0.0.1", port))
