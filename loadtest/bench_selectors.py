"""Time per MiB of the selector checks in request classification on hostile selectors (the worker's one
thread is busy meanwhile): ``labelselector.valid`` and the fieldSelector read of ``requestinfo``.

Not a test. Classification runs before flow control, for any caller, on whatever it sends, up to the
listener's header limit (1 MiB): the fieldSelector on every list, the label selector only when the
ListOptions decode matters (a non-ASCII ``watch`` value, a ``metadata.name`` fieldSelector).
``--base DIR`` times another tree too (``git archive <commit> gatekeeper | tar -x -C DIR``), each in its
own process, in turns; the figure to read is the ratio::

    python loadtest/bench_selectors.py [--base /tmp/base] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

MIB = 1 << 20
CASES = {
    "a,a,...": "a," * (MIB // 2) + "a",
    "a=b,...": "a=b," * (MIB // 4) + "a=b",
    "a>1,...": "a>1," * (MIB // 4) + "a>1",
    "!a,...": "!a," * (MIB // 3) + "!a",
    "a in (v,v,...)": "a in (" + "v," * (MIB // 2) + "v)",
    "spaces": " " * MIB,
    "one identifier": "a" * MIB,
}
FIELD_CASES = {
    "field a=b,...": "a=b," * (MIB // 4),
    "field 256 KiB, no =": "a" * (MIB // 4),  # quadratic before the review (a MiB took about 16 s)
    "field a=\\,...": "a=\\," * (MIB // 4),
    "field name=x,...": "metadata.name=x," * (MIB // 16),
}


def measure() -> dict[str, float]:
    from gatekeeper.kube import requestinfo
    from gatekeeper.kube.labelselector import valid

    out = {}
    for cases, check in ((CASES, valid), (FIELD_CASES, requestinfo._field_selector_name)):
        for name, selector in cases.items():
            t0 = time.process_time()
            check(selector)
            out[name] = (time.process_time() - t0) * MIB / len(selector)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="another source tree to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure()))
        return
    trees = {"this": None, **({"base": args.base} if args.base else {})}
    best: dict[str, dict[str, float]] = {t: {} for t in trees}
    for _ in range(args.rounds):
        for tree, path in trees.items():
            env_path = [path] if path else []
            code = f"import sys; sys.path[:0] = {env_path!r}; sys.argv = ['', '--child']; " \
                   f"exec(open({__file__!r}).read())"
            figures = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                check=True).stdout)
            for name, seconds in figures.items():
                best[tree][name] = min(best[tree].get(name, float("inf")), seconds)
    for name in [*CASES, *FIELD_CASES]:
        line = f"{name:20s} {best['this'][name] * 1e3:9.1f} ms/MiB"
        if args.base:
            base = best["base"][name]
            line += f"   base {base * 1e3:9.1f} ms/MiB   base/this {base / best['this'][name]:6.1f}x"
        print(line)


if __name__ == "__main__":
    main()
