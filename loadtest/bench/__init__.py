"""``python -m loadtest bench NAME [options]``: the benchmarks that still answer a question, one subcommand each.

Each prints figures as ratios against a reference run in the same run (direct apiserver, HAProxy,
another build); none asserts anything. ``python -m loadtest bench`` lists them; ``NAME --help`` says
what each needs (most need a running sandbox: ``gatekeeper sandbox up --state-dir DIR``).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

BENCHES: dict[str, tuple[str, str]] = {
    "proxy": ("loadtest.bench_proxy", "the proxy beside HAProxy: throughput, LIST memory, restart share, "
                                      "open/closed-loop latency and CPU per request"),
    "ab": ("loadtest.split_ab", "CPU per request of this tree and another build (--base DIR), interleaved"),
    "layers": ("loadtest.bench_layers", "where the proxy's CPU per request goes, layer by layer"),
    "profile": ("loadtest.profile_proxy", "a py-spy profile of the proxy under closed-loop small GETs"),
    "pipeline": ("loadtest.bench_pipeline", "CPU per request of the pipeline alone, in process"),
    "codec-ir": ("loadtest.bench_codec_ir", "instructions per GET of the HTTP/2 codec path, in process (run it under "
                                            "callgrind): pure against mypyc-compiled modules"),
    "proxy-ir": ("loadtest.bench_proxy_ir", "instructions per GET of the whole proxy process under callgrind, for a "
                                            "pure or a compiled tree"),
    "flowcontrol": ("loadtest.bench_flowcontrol:cli", "CPU of the flow-control middleware per request, in process"),
    "ledger": ("loadtest.bench_ledger", "what proxy-wide seats (the worker ledger) cost per request"),
    "policy-reload": ("loadtest.bench_policy_reload", "how long a policy reload keeps the event loop from running"),
    "list-storm": ("loadtest.bench_list_storm", "the seeds' secret-LIST storm in miniature, three arms"),
    "storm-probe": ("loadtest.bench_storm_probe", "other tenants' latency during the seeds' LIST storm"),
    "slow-readers": ("loadtest.bench_slow_readers", "two slow readers on the seeds' 2-seat level: read ahead, none, "
                                                    "and direct"),
    "read-ahead-memory": ("loadtest.soak.readahead", "a worker's RSS with its read-ahead budget full"),
    "soak": ("loadtest.soak.run", "does the proxy's RSS level off under a steady load? (--minutes N --rps R)"),
    "workers": ("loadtest.bench.workers", "--workers N: connections per worker, and new clients with one stopped"),
    "webhook": ("loadtest.bench_webhook", "the admission webhook over TLS: reviews per second and latency"),
    "webhook-worstcase": ("loadtest.bench_webhook_worstcase", "webhook RSS under what its budgets do not count"),
    "webhook-decode-shapes": ("loadtest.bench_webhook_decode_shapes", "why reviews are not refused by brace counts"),
    "gpu-packing": ("loadtest.gpu_packing", "the same inference pods whole-GPU and shared, side by side; on a mixed "
                                            "fleet 48 pods with mixed asks in three arms"),
}
"""Name -> (module, with ``:function`` when its entry is not ``main()``; the question it answers).
Modules load only when run."""


def usage() -> str:
    width = max(map(len, BENCHES))
    return "usage: python -m loadtest bench NAME [options]  (NAME --help for its options)\n\n" + "\n".join(
        f"  {name:<{width}}  {about}" for name, (_, about) in BENCHES.items())


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], list(argv[1:])
    if name not in BENCHES:
        print(f"python -m loadtest bench: unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    path, _, entry = BENCHES[name][0].partition(":")
    run = getattr(importlib.import_module(path), entry or "main")
    sys.argv = [f"python -m loadtest bench {name}", *rest]  # each benchmark parses sys.argv itself
    code = run()
    return int(code or 0)
