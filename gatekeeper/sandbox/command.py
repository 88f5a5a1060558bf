"""`gatekeeper sandbox build|up|status|down`: thin CLI over build.py and lifecycle.py."""

from __future__ import annotations

import argparse
from pathlib import Path

from gatekeeper.base.errors import UsageError, non_negative_int, positive_int
from gatekeeper.sandbox import fleet, gpu, memlimit, mig
from gatekeeper.sandbox.build import COMPONENTS, ON_DEMAND, BuildError, build_all
from gatekeeper.sandbox.lifecycle import SandboxError, UpOptions, down, status, up

NAME = "sandbox"
HELP = "build and run a local control plane (etcd, apiservers, scheduler, KWOK GPU nodes)"
DESCRIPTION = (
    "A real Kubernetes control plane as local processes on 127.0.0.1: one etcd, N kube-apiservers "
    "sharing it, optionally kube-scheduler and kube-controller-manager, and KWOK-simulated GPU nodes "
    "that advertise nvidia.com/gpu and publish DRA ResourceSlices. Binaries are built from the Go "
    "modules in gatekeeper/sandbox/gomod."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's options and handler (``set_defaults(func=...)``); the CLI makes the parser."""
    ssub = p.add_subparsers(dest="sandbox_command", metavar="ACTION", required=True)

    b = ssub.add_parser(
        "build", help="build etcd, kube-* and kwok from Go modules into the cache (idempotent)",
        description="Build (or adopt already built) binaries into $GATEKEEPER_CACHE/bin "
                    "(default ~/.cache/gatekeeper/bin). A rerun with unchanged inputs is instant.",
    )
    b.add_argument("--force", action="store_true", help="rebuild even if the stamp says up to date")
    b.add_argument("--only", action="append",
                   choices=[*(c.name for c in (*COMPONENTS, *ON_DEMAND)), "crds"], default=[],
                   help="build only this component (repeatable)")
    b.set_defaults(func=_build)

    _up_arguments(ssub)

    s = ssub.add_parser("status", help="show each sandbox process and its health")
    _state_dir(s)
    s.set_defaults(func=_status)

    d = ssub.add_parser("down", help="stop every sandbox process (TERM, then KILL); safe to repeat")
    _state_dir(d)
    d.set_defaults(func=_down)


def _up_arguments(ssub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``sandbox up``: what the control plane runs with, and which add-ons."""
    u = ssub.add_parser(
        "up", help="start the control plane and wait until every component is healthy",
        description="Start the sandbox in --state-dir (certs, kubeconfigs, logs, sandbox.json). "
                    "On failure prints the failing component and its log tail, stops what it "
                    "started and exits non-zero.",
    )
    _state_dir(u)
    u.add_argument("--apiservers", type=positive_int, default=3, help="kube-apiservers sharing etcd (default 3)")
    u.add_argument("--gpu-nodes", type=non_negative_int, default=0, help="KWOK GPU nodes (default 0)")
    u.add_argument("--gpus-per-node", type=positive_int, default=8, help="GPUs per node (default 8)")
    u.add_argument("--gpu-sharing", type=_sharing, default="none",
                   help="publish the --gpu-nodes GPUs exclusive (none, default) or shareable like the NVIDIA DRA "
                        "driver's --consumable-shares: memory (for the webhook's shared mode), unlimited, or a "
                        "share count N (N pods per GPU, the webhook's shares mode)")
    u.add_argument("--gpu-pool", action="append", default=[], type=_pool, metavar="SPEC",
                   help="a pool of GPU nodes: name=NAME,nodes=N,gpus=G,model=MODEL,sharing=SHARING (e.g. "
                        "name=a100,nodes=1,gpus=4,model=A100-40GB,sharing=4); nodes gpu-NAME-<i>; repeatable")
    u.add_argument("--mixed-fleet", action="store_true",
                   help="the mixed fleet: H100s shared by memory, whole H100s, A100s shared 4 ways, whole A100s "
                        "(1 node x 4 GPUs each) and one dynamic-MIG node (adds --mig-dra-nodes 1)")
    u.add_argument("--gpu-extended-resource-mapping", action="store_true",
                   help="the GPU DeviceClass maps nvidia.com/gpu (KEP-5004 extendedResourceName) and the "
                        "nodes do not advertise it, so the scheduler serves unchanged GPU pods through DRA")
    u.add_argument("--mig-node", action="append", default=[], metavar="MODEL", choices=sorted(mig.PRODUCTS),
                   help="a KWOK node of MODEL GPUs (e.g. A100-40GB) in MIG all-balanced, as the device plugin's "
                        "mixed strategy advertises it (nvidia.com/mig-* capacity, nvidia.com/gpu.product label); "
                        "repeatable")
    u.add_argument("--mig-dra-nodes", type=non_negative_int, default=0,
                   help="KWOK nodes whose GPUs are DRA partitionable devices like the NVIDIA driver's dynamic MIG "
                        "(shared counters per GPU, one device per MIG profile placement; "
                        "--gpus-per-node GPUs, at most 3)")
    u.add_argument("--with-scheduler", action="store_true",
                   help="also run kube-scheduler and kube-controller-manager")
    u.add_argument("--apiserver-arg", action="append", default=[], metavar="ARG",
                   help="extra kube-apiserver flag, e.g. --apiserver-arg=--watch-cache-sizes=secrets#0 "
                        "(repeatable; appended after the sandbox's own flags)")
    u.add_argument("--gogc", type=positive_int, default=None, help="GOGC for the control-plane processes")
    u.add_argument("--timeout", type=float, default=300.0,
                   help="seconds each component may take (default 300)")
    u.add_argument("--with-webhook", action="store_true", help="also run the gatekeeper webhook add-on")
    u.add_argument("--webhook-config", default=None,
                   help="YAML file whose webhook: section (GPU modes, defaults, limits) overrides the webhook "
                        "add-on's; server and kubeconfig stay the sandbox's")
    u.add_argument("--controller-manager-arg", action="append", default=[], metavar="ARG",
                   help="extra kube-controller-manager flag, e.g. --controller-manager-arg=--kube-api-qps=200 "
                        "(repeatable)")
    u.add_argument("--scheduler-arg", action="append", default=[], metavar="ARG",
                   help="extra kube-scheduler flag, e.g. --scheduler-arg=--kube-api-qps=200 (repeatable)")
    u.add_argument("--etcd-arg", action="append", default=[], metavar="ARG",
                   help="extra etcd flag, e.g. --etcd-arg=--quota-backend-bytes=8589934592 (repeatable)")
    u.add_argument("--apiserver-memory-limit", default="", metavar="SIZE",
                   help="each apiserver in a memory cgroup of its own with this limit (e.g. 1536Mi); an OOM-killed "
                        "apiserver is restarted with kubelet's back-off, kills and restarts counted "
                        "(apiserver-events.jsonl). Needs a writable memory cgroup; never runs unlimited instead")
    u.add_argument("--with-proxy", action="store_true", help="also run the gatekeeper front proxy add-on")
    u.add_argument("--proxy-goaway-chance", type=float, default=None,
                   help="GOAWAY probability per request for the proxy add-on")
    u.add_argument("--proxy-config", default=None, help="YAML config file for the proxy add-on")
    u.add_argument("--proxies", type=positive_int, default=None,
                   help="the deployed topology: N proxy processes, each in front of every apiserver as the static "
                        "pods are, sharing one flow-control budget through Leases and publishing the kubernetes "
                        "Service's endpoints (flowControl.fleet); the scheduler, controller manager, KWOK and the "
                        "webhook call through them. Without it: one proxy, beside direct access")
    u.add_argument("--client-lb", choices=("none", "haproxy-tcp"), default="none",
                   help="haproxy-tcp: an HAProxy TCP front over the proxies (a VIP or cloud LB); proxy.kubeconfig "
                        "points at it")
    u.add_argument("--proxy-workers", type=non_negative_int, default=None,
                   help="worker processes of the proxy add-on (default proxy.workers: one per usable core)")
    u.set_defaults(func=_up)


def _sharing(text: str) -> str:
    try:
        return gpu.check_sharing(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _pool(text: str) -> fleet.GpuPool:
    try:
        return fleet.parse_pool(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _state_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", required=True, type=Path, help="sandbox directory (e.g. ./.sandbox)")


def _build(args: argparse.Namespace) -> int:
    try:
        build_all(force=args.force, only=tuple(args.only))
    except BuildError as exc:
        raise UsageError(str(exc)) from None
    return 0


def _up(args: argparse.Namespace) -> int:
    if (args.proxies is not None or args.client_lb != "none") and not args.with_proxy:
        raise UsageError("--proxies and --client-lb need --with-proxy")
    addons = tuple(n for n, on in (("webhook", args.with_webhook), ("proxy", args.with_proxy)) if on)
    opts = UpOptions(
        state_dir=args.state_dir, apiservers=args.apiservers, gpu_nodes=args.gpu_nodes,
        gpus_per_node=args.gpus_per_node, with_scheduler=args.with_scheduler, gogc=args.gogc,
        timeout=args.timeout, addons=addons, apiserver_args=tuple(args.apiserver_arg), gpu_sharing=args.gpu_sharing,
        gpu_extended_resource_mapping=args.gpu_extended_resource_mapping,
        mig_nodes=tuple(args.mig_node), mig_dra_nodes=max(args.mig_dra_nodes, 1 if args.mixed_fleet else 0),
        gpu_pools=tuple(args.gpu_pool) + (fleet.MIXED_FLEET if args.mixed_fleet else ()),
        controller_manager_args=tuple(args.controller_manager_arg), scheduler_args=tuple(args.scheduler_arg),
        etcd_args=tuple(args.etcd_arg),
        apiserver_memory_limit=memlimit.parse_limit(args.apiserver_memory_limit) if args.apiserver_memory_limit else 0,
    )
    try:
        up(opts, args)
    except (BuildError, SandboxError) as exc:
        raise UsageError(str(exc)) from None
    return 0


def _status(args: argparse.Namespace) -> int:
    return status(args.state_dir)


def _down(args: argparse.Namespace) -> int:
    return down(args.state_dir)
