"""Which apiserver a front (HAProxy, the gatekeeper proxy) holds connections to, read from /proc.

The seeds' memory skew follows connection skew, so the skew scenario counts a
front's established connections per apiserver port over time, the same way for
every front: the kernel's TCP tables (``/proc/net/tcp``, ``tcp6``) joined with
the socket inodes the front's processes (its whole process group: the proxy's
workers) hold open. No front-specific stats socket, so the arms compare alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path

ESTABLISHED = "01"
LISTEN = "0A"


def tcp_sockets(proc: Path = Path("/proc")) -> list[tuple[int, int, str, int]]:
    """Every TCP socket as (local port, remote port, state, inode), IPv4 and IPv6."""
    out = []
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in (proc / "net" / table).read_text().splitlines()[1:]:
                f = line.split()
                if len(f) < 10:
                    continue
                out.append((int(f[1].rsplit(":", 1)[1], 16), int(f[2].rsplit(":", 1)[1], 16), f[3], int(f[9])))
    return out


def socket_inodes(pids: Iterable[int], proc: Path = Path("/proc")) -> set[int]:
    """The inodes of the sockets ``pids`` hold open (``socket:[N]`` links in their fd tables)."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in (proc / str(pid) / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = str(fd.readlink())
                    if target.startswith("socket:["):
                        inodes.add(int(target[8:-1]))
    return inodes


def process_group(pid_dir: Path) -> int | None:
    """The process group of the process at ``/proc/<pid>`` (the 5th field of its stat), or None if it is gone."""
    try:
        return int((pid_dir / "stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


def group_members(pgid: int, proc: Path = Path("/proc")) -> list[int]:
    """Processes of process group ``pgid`` (sandbox fronts lead their own group, workers included)."""
    return [int(d.name) for d in proc.iterdir() if d.name.isdigit() and process_group(d) == pgid]


def listener_group(port: int, proc: Path = Path("/proc")) -> int | None:
    """The process group of whoever listens on ``port`` (the front behind a URL), or None."""
    listening = {inode for local, _, state, inode in tcp_sockets(proc) if local == port and state == LISTEN}
    if not listening:
        return None
    for d in proc.iterdir():
        if d.name.isdigit() and socket_inodes([int(d.name)], proc) & listening:
            return process_group(d)
    return None


def connections_to(pgid: int, ports: Iterable[int], proc: Path = Path("/proc")) -> dict[int, int]:
    """Established connections from process group ``pgid`` to each of ``ports`` (0 where none)."""
    wanted = set(ports)
    counts = dict.fromkeys(wanted, 0)
    inodes = socket_inodes(group_members(pgid, proc), proc)
    for _, remote, state, inode in tcp_sockets(proc):
        if state == ESTABLISHED and remote in wanted and inode in inodes:
            counts[remote] += 1
    return counts
