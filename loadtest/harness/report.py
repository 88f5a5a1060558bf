"""What a scenario leaves in ``--out``: report.md (seed's figure beside ours, setup, ratios), CSVs, PNGs.

Every number in a report comes from the run that wrote it; the setup block
records the machine (cores, load average before and after), the versions and
the exact command, because on a shared 2-core machine the ratios are what count.
"""

from __future__ import annotations

import csv
import os
import platform
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import itertools

import matplotlib.pyplot as plt

MIB = 1 << 20


def _first_line(argv: Sequence[str]) -> str:
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable ({type(exc).__name__})"
    return ((p.stdout or p.stderr).strip().splitlines() or ["?"])[0]


REPO = Path(__file__).resolve().parents[2]
PROVENANCE: dict[str, str] = {}
"""The commit and tree state, read once when the run began (``cli.main``), so every report of one run names
the same commit, the one that produced it."""
VERSION_FLAGS = {"etcd": ["--version"], "kube-apiserver": ["--version"], "kube-scheduler": ["--version"],
                 "kube-controller-manager": ["--version"], "kwok": ["--version"],
                 "kubectl": ["version", "--client"], "haproxy": ["-v"], "caddy": ["version"]}


def tree_state(repo: Path = REPO) -> tuple[str, list[str]]:
    """(HEAD's full commit, the paths ``git status`` lists as changed or untracked)."""
    head = _first_line(["git", "-C", str(repo), "rev-parse", "HEAD"])
    p = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True,
                       timeout=30)
    return head, [line[3:] for line in p.stdout.splitlines() if line.strip()]


def provenance(allow_dirty: bool, repo: Path = REPO) -> dict[str, str]:
    """What a report says of the code that produced it; a changed tree only with ``allow_dirty``."""
    head, changed = tree_state(repo)
    if changed and not allow_dirty:
        shown = ", ".join(changed[:10]) + (f" and {len(changed) - 10} more" if len(changed) > 10 else "")
        raise ValueError(f"the working tree has changes ({shown}): commit them, or pass --allow-dirty and the "
                         "report says so")
    tree = "clean" if not changed else f"DIRTY: {len(changed)} changed or untracked paths (--allow-dirty)"
    return {"git commit": head, "tree": tree}


def versions(binaries: dict[str, str]) -> dict[str, str]:
    """Every component's version: the Python side here, each binary from its own version flag."""
    from importlib.metadata import version  # not ``import locust``: that would gevent-patch this process

    from gatekeeper import __version__

    out = {"gatekeeper": __version__, "python": platform.python_version(), "locust": version("locust"),
           "matplotlib": matplotlib.__version__,
           **(PROVENANCE or {"git commit": _first_line(["git", "-C", str(REPO), "rev-parse", "HEAD"]),
                             "tree": "not checked (the report was not written by python -m loadtest)"})}
    for name, path in sorted(binaries.items()):
        out[name] = _first_line([path, *VERSION_FLAGS.get(name, ["--version"])])
    return out


@dataclass
class Report:
    """A report under construction; ``write`` renders it to ``out/report.md``."""

    out: Path
    title: str
    claim: str
    """The seed's words and figure (quoted)."""
    command: str = field(default_factory=lambda: shlex.join([Path(sys.executable).name, "-m", "loadtest",
                                                             *sys.argv[1:]]))
    load_before: tuple[float, float, float] = field(default_factory=os.getloadavg)
    seed_vs_ours: list[tuple[str, str, str]] = field(default_factory=list)
    """(what, seed's figure, ours)."""
    sections: list[str] = field(default_factory=list)
    plots: list[tuple[str, str]] = field(default_factory=list)
    csvs: list[str] = field(default_factory=list)
    setup: dict[str, str] = field(default_factory=dict)
    binaries: dict[str, str] = field(default_factory=dict)
    """Component name -> binary, each reported with its version (:meth:`use_sandbox`)."""

    def use_sandbox(self, state: Any) -> None:
        """Record the binaries of every component the sandbox runs, and the clients the scenarios use."""
        from gatekeeper.sandbox.testing import kubectl_binary

        for p in state.processes:
            name = p.name.rstrip("0123456789").rstrip("-")
            if name in VERSION_FLAGS and p.cmd:
                self.binaries.setdefault(name, p.cmd[0])
        self.binaries["kubectl"] = kubectl_binary(state)
        haproxy = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/bin")
        if haproxy:
            self.binaries["haproxy"] = haproxy

    def table(self, header: Sequence[str], rows: Sequence[Sequence[object]], title: str = "") -> None:
        lines = [f"### {title}\n"] if title else []
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        lines += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
        self.sections.append("\n".join(lines) + "\n")

    def text(self, markdown: str) -> None:
        self.sections.append(markdown.strip() + "\n")

    def plot(self, name: str, caption: str) -> Path:
        self.plots.append((name, caption))
        return self.out / name

    def write(self) -> Path:
        load_after = os.getloadavg()
        setup = {
            "machine": f"{os.cpu_count()} cores, {_mem_gib():.0f} GiB, {platform.platform()}",
            "load average (1/5/15 min) before": " / ".join(f"{x:.2f}" for x in self.load_before),
            "load average (1/5/15 min) after": " / ".join(f"{x:.2f}" for x in load_after),
            **self.setup,
            **versions(self.binaries),
        }
        parts = [f"# {self.title}\n", "## The seed's claim\n", "\n".join(f"> {line}" for line in
                                                                         self.claim.strip().splitlines()) + "\n"]
        if self.seed_vs_ours:
            parts += ["## Seed vs ours\n", "| figure | seed | ours (this run) |", "|---|---|---|"]
            parts += [f"| {a} | {b} | {c} |" for a, b, c in self.seed_vs_ours]
            parts.append("")
        parts += ["## Results\n", *self.sections, *_locust_section(self.out)]
        if self.plots:
            parts.append("## Plots\n")
            parts += [f"![{cap}]({name})\n\n*{cap}*\n" for name, cap in self.plots]
        parts += ["## Setup\n", f"Command: `{self.command}`\n"]
        parts += [f"- {k}: {v}" for k, v in setup.items()]
        if self.csvs:
            parts += ["", "Raw samples: " + ", ".join(f"[{c}]({c})" for c in self.csvs)]
        path = self.out / "report.md"
        path.write_text("\n".join(parts) + "\n")
        return path


LOCUST_CSV = "locust-cpu.csv"


def _locust_section(out: Path) -> list[str]:
    """Locust's own CPU per arm (``run.run_locust`` writes it): on a 2-core machine the load generator can be
    what limits a run, and then the run measures Locust."""
    path = out / LOCUST_CSV
    if not path.exists():
        return []
    with path.open() as fh:
        rows = list(csv.DictReader(fh))
    lines = ["### The load generator: Locust's own CPU per arm (its log beside this report)\n",
             "| arm | Locust CPU s | wall s | share of one core | Locust's CPU warnings | load average (1 min) "
             "after | Locust the bottleneck? |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        share = float(r["cpu_seconds"]) / max(0.001, float(r["wall_seconds"]))
        limited = share >= 0.9 or int(r["cpu_warnings"]) > 0
        lines.append(f"| {r['arm']} | {float(r['cpu_seconds']):.1f} | {float(r['wall_seconds']):.1f} | "
                     f"{share:.2f} | {r['cpu_warnings']} | {r['load1']} | {'yes' if limited else 'no'} |")
    return ["\n".join(lines) + "\n"]


def _cell(c: object) -> str:
    if isinstance(c, float):
        return f"{c:.2f}" if abs(c) < 100 else f"{c:.0f}"
    return str(c)


def _mem_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / (1 << 20)
    return 0.0


def line_plot(path: Path, title: str, ylabel: str, series: dict[str, list[tuple[float, float]]],
              events: Sequence[tuple[float, str]] = (), scale: float = 1.0, xlabel: str = "seconds") -> None:
    """One line per series (values divided by ``scale``), vertical dashed lines at ``events``."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for label, points in series.items():
        if points:
            xs, ys = _with_gaps(points, scale)
            ax.plot(xs, ys, label=label, linewidth=1.4)
    for t, what in events:
        ax.axvline(t, linestyle="--", color="grey", linewidth=0.8)
        ax.annotate(what, (t, ax.get_ylim()[1]), fontsize=7, rotation=90, va="top", ha="right")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _with_gaps(points: list[tuple[float, float]], scale: float) -> tuple[list[float], list[float]]:
    """The points, with the line broken where samples stop for more than 5 sampling intervals (a process that
    was down), instead of a straight line drawn across the time it was gone."""
    steps = sorted(b[0] - a[0] for a, b in itertools.pairwise(points))
    gap = 5 * steps[len(steps) // 2] if steps else float("inf")
    xs: list[float] = []
    ys: list[float] = []
    for i, (t, v) in enumerate(points):
        if i and t - points[i - 1][0] > gap:
            xs.append(float("nan"))
            ys.append(float("nan"))
        xs.append(t)
        ys.append(v / scale)
    return xs, ys


def bar_plot(path: Path, title: str, ylabel: str, bars: dict[str, float]) -> None:
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(list(bars), list(bars.values()), color="#4a7ab5")
    for i, v in enumerate(bars.values()):
        ax.annotate(f"{v:.0f}", (i, v), ha="center", va="bottom", fontsize=8)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def locust_rows(prefix: Path) -> dict[str, dict[str, str]]:
    """Locust's PREFIX_stats.csv by request name (``Aggregated`` for the total)."""
    with prefix.with_name(prefix.name + "_stats.csv").open() as fh:
        return {r["Name"]: r for r in csv.DictReader(fh)}
