"""Benchmark: how long a flow-control policy reload keeps an event loop from running.

Not a test: it prints figures measured on one machine. A ~1 MB policy file (FlowSchemas, one per document,
near ``YamlLimits.max_bytes``) is read with :func:`gatekeeper.base.yamlfiles.load_yaml_all` while a ticker task on the
same loop sleeps 1 ms at a time; the largest gap between its ticks is how long the loop could answer nothing.
Arms: the parse on the loop (how reloads ran before) and on a thread (how they run now), each with the
pure-Python and the libyaml parser.

    python -m loadtest.bench_policy_reload [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from gatekeeper.base import yamlfiles as config


def policy_text(size: int = 1_000_000) -> str:
    docs: list[str] = []
    total, i = 0, 0
    while total < size:
        doc = yaml.safe_dump({
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema", "metadata": {"name": f"s{i}"},
            "spec": {"priorityLevelConfiguration": {"name": "tenants"}, "matchingPrecedence": 500,
                     "rules": [{"subjects": [{"kind": "User", "user": {"name": f"u{j}"}} for j in range(5)],
                                "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                                                   "namespaces": ["*"]}]}]}})
        docs.append(doc)
        total, i = total + len(doc) + 4, i + 1
    return "---\n".join(docs)


async def one(path: Path, on_thread: bool) -> tuple[float, float]:
    """(seconds the parse took, largest gap between the ticker's ticks)."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    started = time.perf_counter()
    if on_thread:
        await asyncio.to_thread(config.load_yaml_all, path, what="policy file")
    else:
        config.load_yaml_all(path, what="policy file")
    took = time.perf_counter() - started
    done.set()
    await task
    return took, max(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    loaders = {"pure-Python": config.PURE_YAML_LOADER}
    if config.LIBYAML_LOADER is not None:
        loaders["libyaml"] = config.LIBYAML_LOADER
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "policy.yaml"
        path.write_text(policy_text())
        print(f"policy file: {path.stat().st_size} bytes; medians of {args.rounds} rounds")
        for on_thread in (False, True):
            for name, loader in loaders.items():
                config.YAML_LOADER = loader
                runs = [asyncio.run(one(path, on_thread)) for _ in range(args.rounds)]
                where = "thread" if on_thread else "loop"
                print(f"{where:6s} {name:11s} parse {statistics.median(r[0] for r in runs):6.2f} s   "
                      f"largest loop gap {statistics.median(r[1] for r in runs) * 1000:7.0f} ms")


if __name__ == "__main__":
    main()
