"""list-storm-oom's kills, read and judged without a sandbox: which apiserver died when, of what, and the verdicts.

A reviewer found the old "cascade" (at least two apiservers killed) mostly counted simultaneous deaths: three
apiservers each running its own LISTs reach the limit within a second of each other, and none of them died of
another's clients. The seeds' cascade is different: an apiserver is killed, the load balancer sends its clients to
the others, and that moved load kills them. So every kill is classified here, as own-load or failover, from the
supervisor's kill events, their timing, and (when sampled) the killed apiserver's tenant requests in flight.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gatekeeper.sandbox.supervisor import EVENTS
from loadtest.harness.rounds import apart_verdict, bound_verdict, floor_verdict, spread

FAILOVER_MIN_LAG = 1.0
"""Seconds from a peer's kill before a kill can be that peer's failover. A moved client first sees its connection
cut, backs off (client-go's reflector: 0.8 s first), reconnects through the balancer and starts its LIST, and a
LIST needs seconds to grow an apiserver by the ~0.7 GiB that kills it; the reviewed report's simultaneous deaths
were 0.5 s apart."""
FAILOVER_WINDOW = 20.0
"""Seconds after a peer's kill within which a kill can still be the load that moved from it: the first retries
(0.8 + 1.6 + 3.2 s of back-off) plus one storage LIST's time on this machine (p50 17 s through gatekeeper)."""
Kind = Literal["own-load", "failover"]


@dataclass(frozen=True)
class Kill:
    """One OOM kill, classified."""

    t: float
    """Seconds from the arm's start."""
    apiserver: str
    kind: Kind
    after: str = ""
    """For a failover kill: the peer whose kill sent it the load."""
    evidence: str = ""
    """How a failover kill was told: its tenant requests in flight rose after the peer's kill, or (no samples in
    the window) the timing alone."""


def read_events(directory: str | Path) -> list[dict[str, Any]]:
    """The supervisor's events (``apiserver-events.jsonl``); a torn last line is skipped."""
    out = []
    path = Path(directory) / EVENTS
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def kills_between(events: Sequence[dict[str, Any]], start: float, end: float) -> list[tuple[float, str]]:
    """(seconds from ``start``, apiserver) of every OOM kill in [start, end] (wall clock), in order."""
    return sorted((e["time"] - start, str(e["component"])) for e in events
                  if e.get("event") == "oom_kill" and start <= e["time"] <= end)


def several_killed(kills: Sequence[tuple[float, str]]) -> bool:
    """At least two different apiservers were killed (not yet a cascade: they may have died of their own load)."""
    return len({name for _, name in kills}) >= 2


def failover_possible(target: str) -> bool:
    """Whether a killed apiserver's clients can reach another one: not when each is pinned to one (``direct``)."""
    return target != "direct"


def classify_kills(kills: Sequence[tuple[float, str]], *, failover: bool,
                   inflight: Mapping[str, Sequence[tuple[float, float]]] | None = None,
                   min_lag: float = FAILOVER_MIN_LAG, window: float = FAILOVER_WINDOW) -> list[Kill]:
    """Each kill as own-load or failover.

    A kill of X at t is a failover kill when clients can move (``failover``), another apiserver Y was killed at
    t_y with ``min_lag <= t - t_y <= window``, and, when ``inflight`` has X's tenant requests in flight
    ((t, count) in the kills' time base) sampled in (t_y, t], they rose above their last value at or before t_y:
    X took load that moved from Y. The latest such peer is named. Every other kill is own-load: X died of the
    clients it already served."""
    out = []
    for t, name in sorted(kills):
        peers = sorted(((t_y, y) for t_y, y in kills if y != name and min_lag <= t - t_y <= window), reverse=True)
        found: Kill | None = None
        for t_y, y in peers if failover else ():
            rose = _rose((inflight or {}).get(name, ()), t_y, t)
            if rose:
                found = Kill(t, name, "failover", y, "in flight rose")
                break
            if rose is None and found is None:  # unsampled: the timing alone, unless a peer's evidence follows
                found = Kill(t, name, "failover", y, "timing only")
        out.append(found or Kill(t, name, "own-load"))
    return out


def _rose(series: Sequence[tuple[float, float]], since: float, until: float) -> bool | None:
    """Whether the count rose after ``since`` (up to ``until``) above its last value at or before ``since``;
    None when there is no sample after it (an apiserver under a storm answers /metrics slowly)."""
    before = [v for t, v in series if t <= since]
    after = [v for t, v in series if since < t <= until]
    if not after:
        return None
    return max(after) > (before[-1] if before else 0.0)


def downtime(events: Sequence[dict[str, Any]], names: Sequence[str], start: float, end: float
             ) -> tuple[dict[str, float], float]:
    """Seconds each apiserver was down (from an OOM kill in [start, end] to its restart) and seconds all of them
    were down at once (the control plane gone). Kills before ``start`` belong to an earlier arm: every arm
    starts on apiservers the harness has just restarted."""
    down: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    since: dict[str, float] = {}
    for e in sorted(events, key=lambda e: e["time"]):
        name, t = str(e.get("component")), float(e["time"])
        if name not in down or not start <= t <= end:
            continue
        if e.get("event") == "oom_kill":
            since.setdefault(name, t)
        elif e.get("event") == "restart" and name in since:
            down[name].append((since.pop(name), t))
    for name, begun in since.items():
        down[name].append((begun, end))
    per = {n: sum(b - a for a, b in spans) for n, spans in down.items()}
    edges = sorted({start, end, *(x for spans in down.values() for span in spans for x in span)})
    together = sum(b - a for a, b in itertools.pairwise(edges)
                   if all(any(s <= a and b <= e for s, e in down[n]) for n in names))
    return per, together


CASCADE_FLOOR = 1
"""The seeds' cascade reproduced through HAProxy TCP: at least this many failover kills in every run."""
GATEKEEPER_FAILOVER_BOUND = 0
"""Gatekeeper's arms: at most this many failover kills in any run (its queue holds the moved LISTs)."""
BALANCER = "haproxy"
"""The arm every fix is compared with at the same memory limit: the seeds' load balancer, no fix."""
FIXES = ("haproxy-kube-apf", "gatekeeper")
"""Arms (by prefix of their target) that apply a fix: the seeds' APF in the apiservers, or gatekeeper."""


def balancer_of(arm: str) -> str:
    """The no-fix arm of the same kind of client: HAProxy TCP with Locust listers or with informers of that sync."""
    if arm.startswith("informers-"):
        return "informers-haproxy-watch-list" if arm.endswith("-watch-list") else "informers-haproxy-list"
    return BALANCER


def verdicts(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """The report's verdicts, per memory limit, from each run's ``arm``, ``limit``, ``kills`` and ``failover``
    (the count of its failover kills). Thresholds are the constants above, fixed before any run; a verdict over
    ranges that overlap says "not distinguished". Each fix is compared with HAProxy TCP with clients of its kind."""
    lines = []
    for limit in sorted({int(r["limit"]) for r in results}):
        runs: dict[str, list[Mapping[str, Any]]] = {}
        for r in results:
            if int(r["limit"]) == limit:
                runs.setdefault(str(r["arm"]), []).append(r)
        at = f"at {limit >> 20} MiB"
        for arm, arm_runs in runs.items():
            kills = [float(len(r["kills"])) for r in arm_runs]
            fo = [float(r["failover"]) for r in arm_runs]
            target = arm.removeprefix("informers-")
            if arm == balancer_of(arm):
                lines.append(f"- {at}, {arm} shows the seeds' cascade (>= {CASCADE_FLOOR} failover kill per run): "
                             f"**{floor_verdict(fo, CASCADE_FLOOR)}**: failover kills {spread(fo).show('g')}")
                continue
            if not target.startswith(FIXES):
                continue
            if target.startswith("gatekeeper"):
                lines.append(f"- {at}, {arm} has no failover kill (<= {GATEKEEPER_FAILOVER_BOUND} per run): "
                             f"**{bound_verdict(fo, GATEKEEPER_FAILOVER_BOUND)}**: {spread(fo).show('g')}")
            base = [float(len(r["kills"])) for r in runs.get(balancer_of(arm), [])]
            if base and max(base) == 0:
                lines.append(f"- {at}, {arm} against {balancer_of(arm)}: no kill through HAProxy TCP at this limit, "
                             "nothing to decrease")
            elif base:
                lines.append(f"- {at}, {arm} has fewer OOM kills than {balancer_of(arm)} in every run: "
                             f"**{apart_verdict(kills, base)}**: {spread(kills).show('g')} against "
                             f"{spread(base).show('g')}")
    return lines
