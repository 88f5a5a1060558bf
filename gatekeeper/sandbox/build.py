"""Build the control-plane binaries from the committed Go consumer modules.

``go install k8s.io/kubernetes/cmd/...@v`` does not work (the module replaces
its staging repos), so ``gomod/<component>/`` holds a small module that
``require``s the upstream one and pins every staging module. ``build`` copies
that module into a build directory under the cache, runs ``go build`` and
installs the binaries into ``<cache>/bin/<component>-<version>/``.

A stamp file (hash of go.mod, go.sum, the package list and the ldflags) makes
a rerun instant. Binaries that are already there without a stamp (e.g. from a
manual build with the same command) are verified by running ``--version`` and
adopted instead of spending twenty minutes rebuilding them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

GOMOD_ROOT = Path(__file__).parent / "gomod"
STAMP = ".gatekeeper-stamp.json"
KWOK_STAGES = "stages.yaml"
KWOK_STAGE_KUSTOMIZATION = "kustomize/stage/fast"
"""KWOK's own 'fast' stage set: node initialize, heartbeat with lease, pod ready/complete/delete."""


class BuildError(Exception):
    """A build or verification step failed; the message says which command and why."""


def cache_root() -> Path:
    """``$GATEKEEPER_CACHE``, else ``$XDG_CACHE_HOME/gatekeeper``, else ``~/.cache/gatekeeper``."""
    env = os.environ.get("GATEKEEPER_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "gatekeeper"


@dataclass(frozen=True)
class Component:
    """One Go consumer module and the binaries built from it."""

    name: str
    """Cache key prefix and the gomod/ subdirectory, e.g. ``k8s``."""
    gomod: str
    """Directory under gomod/ holding go.mod, go.sum and tools.go."""
    module: str
    """The upstream module whose version names the cache directory."""
    packages: tuple[str, ...]
    """Main packages to build."""
    binaries: tuple[str, ...]
    """File names the build produces, in the same order as packages."""
    ldflags_template: str
    """``-ldflags`` value; ``{version}``, ``{major}``, ``{minor}`` are filled from the module version."""
    version_args: tuple[str, ...] = ("--version",)
    """Arguments that make each binary print its version and exit 0."""
    gomod_root: Path = GOMOD_ROOT
    """Where ``gomod`` lives; only tests point it elsewhere."""
    tags: tuple[str, ...] = ()
    """Go build tags (promtool drops its service-discovery plugins with ``remove_all_sd``)."""

    def source_dir(self) -> Path:
        return self.gomod_root / self.gomod

    def version(self) -> str:
        return module_version((self.source_dir() / "go.mod").read_text(), self.module)

    def ldflags(self) -> str:
        v = self.version()
        major, minor = v.lstrip("v").split(".")[:2]
        return self.ldflags_template.format(version=v, major=major, minor=minor, bare=v.lstrip("v"))

    def bin_dir(self, root: Path | None = None) -> Path:
        return (root or cache_root()) / "bin" / f"{self.name}-{self.version()}"

    def build_dir(self, root: Path | None = None) -> Path:
        return (root or cache_root()) / "build" / f"{self.name}-{self.version()}"

    def own_sources(self) -> list[Path]:
        """Go files of our own under go.mod's directory (load generators' main packages); ``tools.go`` only pins
        imports."""
        return sorted(p for p in self.source_dir().rglob("*.go") if p.name != "tools.go")

    def stamp(self) -> str:
        src = self.source_dir()
        gomod, gosum = (src / "go.mod").read_bytes(), (src / "go.sum").read_bytes()
        tags = f" -tags={','.join(self.tags)}" if self.tags else ""
        own = "".join(f" {p.relative_to(src)}:{hashlib.sha256(p.read_bytes()).hexdigest()}"
                      for p in self.own_sources())
        return stamp_of(gomod, gosum, self.ldflags() + tags + own, self.packages)


_K8S_LDFLAGS = (
    "-s -w -X k8s.io/component-base/version.gitVersion={version} "
    "-X k8s.io/component-base/version.gitMajor={major} -X k8s.io/component-base/version.gitMinor={minor} "
    "-X k8s.io/component-base/version.gitTreeState=clean "
    "-X k8s.io/client-go/pkg/version.gitVersion={version} "
    "-X k8s.io/client-go/pkg/version.gitMajor={major} -X k8s.io/client-go/pkg/version.gitMinor={minor}"
)

K8S = Component("k8s", "kubernetes", "k8s.io/kubernetes",
                tuple(f"k8s.io/kubernetes/cmd/{b}" for b in
                      ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")),
                ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl"), _K8S_LDFLAGS)
KUBEADM = Component("kubeadm", "kubeadm", "k8s.io/kubernetes", ("k8s.io/kubernetes/cmd/kubeadm",), ("kubeadm",),
                    _K8S_LDFLAGS, version_args=("version", "-o", "short"))
"""kubeadm from the same k8s.io/kubernetes version as K8S, in a module of its own: its extra dependencies
(system-validators, coredns migration) would change K8S's go.sum, and so its stamp, forcing a rebuild of the
sandbox's binaries. Not used by ``up``: tests render the kube-apiserver static pod with it (deploy/proxy/kubeadm/)."""
ETCD = Component("etcd", "etcd", "go.etcd.io/etcd/server/v3", ("go.etcd.io/etcd/server/v3",), ("etcd",), "-s -w")
KWOK = Component("kwok", "kwok", "sigs.k8s.io/kwok", ("sigs.k8s.io/kwok/cmd/kwok",), ("kwok",),
                 "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version={version}")
H2SPEC = Component("h2spec", "h2spec", "github.com/summerwind/h2spec", ("github.com/summerwind/h2spec/cmd/h2spec",),
                   ("h2spec",), "-s -w -X main.VERSION={version}")
"""HTTP/2 conformance checker; tests/proxy/test_h2spec.py runs it against the proxy (not used by ``up``)."""
HELM = Component("helm", "helm", "helm.sh/helm/v3", ("helm.sh/helm/v3/cmd/helm",), ("helm",),
                 "-s -w -X helm.sh/helm/v3/internal/version.version={version}", version_args=("version", "--short"))
INFORMERS = Component("informers", "informers", "k8s.io/client-go",
                      ("gatekeeper.local/sandbox/informers", "gatekeeper.local/sandbox/informers/noopwebhook"),
                      ("informers", "noopwebhook"), "-s -w -X main.clientGoVersion={version}")
"""Real client-go Secrets informers, one per tenant identity (``gomod/informers/main.go``): the seeds' storm as
today's controllers send it, a watch-list per informer (tests/flowcontrol, ``python -m loadtest list-storm``). Beside
them ``noopwebhook``, a webhook that allows everything and decides nothing: the admission scenario's floor."""
PROMTOOL = Component("promtool", "promtool", "github.com/prometheus/prometheus",
                     ("github.com/prometheus/prometheus/cmd/promtool",), ("promtool",),
                     "-s -w -X github.com/prometheus/common/version.Version={bare}", tags=("remove_all_sd",))
"""Deploy tooling: ``helm lint``/``helm template`` and ``promtool check|test rules`` in the suite.

promtool is built without Prometheus' service-discovery plugins (cloud SDKs), which
halves its build; rule checking and rule unit tests do not use them.
"""
CRD_MODULES = {
    "cert-manager": ("github.com/cert-manager/cert-manager", "v1.21.2", "deploy/crds"),
    "prometheus-operator": ("github.com/prometheus-operator/prometheus-operator", "v0.85.0",
                            "example/prometheus-operator-crd"),
}
"""CRDs the chart's optional objects need, taken from the projects' Go modules (no other source
is reachable from the build machine): name -> (module, version, directory of CRD YAML)."""
CADDY = Component("caddy", "caddy", "github.com/caddyserver/caddy/v2", ("github.com/caddyserver/caddy/v2/cmd/caddy",),
                  ("caddy",), "-s -w -X github.com/caddyserver/caddy/v2.CustomVersion={version}",
                  version_args=("version",))
"""Caddy, the Go reverse proxy ``python -m loadtest bench proxy`` measures the proxy against. Not in
:data:`COMPONENTS`: only that benchmark needs it, and it builds it on first use (or ``sandbox build --only caddy``)."""
COMPONENTS = (ETCD, KWOK, K8S, KUBEADM, H2SPEC, HELM, PROMTOOL, INFORMERS)
ON_DEMAND = (CADDY,)
"""Built only when named (``--only``) or when a benchmark asks for them."""


def module_version(gomod_text: str, module: str) -> str:
    """The version a go.mod requires of ``module`` (single-line or block form)."""
    pattern = re.compile(rf"^\s*(?:require\s+)?{re.escape(module)}\s+(v\S+)", re.MULTILINE)
    m = pattern.search(gomod_text)
    if not m:
        raise BuildError(f"go.mod does not require {module}")
    return m.group(1)


def stamp_of(gomod: bytes, gosum: bytes, ldflags: str, packages: tuple[str, ...]) -> str:
    """Everything that changes the output binaries, hashed; equal stamps mean no rebuild."""
    h = hashlib.sha256()
    for part in (gomod, gosum, ldflags.encode(), "\n".join(packages).encode()):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.hexdigest()


def read_stamp(bin_dir: Path) -> dict[str, object] | None:
    try:
        data = json.loads((bin_dir / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_current(component: Component, bin_dir: Path) -> bool:
    """True if the stamp matches and every binary is present (pure file checks, no process)."""
    stamp = read_stamp(bin_dir)
    if not stamp or stamp.get("stamp") != component.stamp():
        return False
    return all((bin_dir / b).is_file() for b in component.binaries)


def verify(component: Component, bin_dir: Path) -> list[str]:
    """Run every binary's version command; returns their first output lines.

    The version string must appear: it proves the ldflags stamp took effect, which
    matters because kube-apiserver's ``/version`` and kubectl's skew checks read it.
    """
    version = component.version()
    lines = []
    for binary in component.binaries:
        path = bin_dir / binary
        args = ("version", "--client") if binary == "kubectl" else component.version_args
        try:
            out = subprocess.run([str(path), *args], capture_output=True, text=True, timeout=60)
        except OSError as exc:
            raise BuildError(f"{path}: cannot run: {exc}") from None
        text = (out.stdout + out.stderr).strip()
        if out.returncode != 0 or version.lstrip("v") not in text:
            raise BuildError(
                f"{path} {' '.join(args)} exited {out.returncode}, "
                f"expected version {version} in: {text[:300]!r}"
            )
        lines.append(f"{binary}: {text.splitlines()[0]}")
    return lines


def write_stamp(component: Component, bin_dir: Path, *, adopted: bool, seconds: float | None) -> None:
    data = {
        "stamp": component.stamp(),
        "version": component.version(),
        "ldflags": component.ldflags(),
        "adopted": adopted,
        "build_seconds": seconds,
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (bin_dir / STAMP).write_text(json.dumps(data, indent=2) + "\n")


def go_env() -> dict[str, str]:
    """The caller's environment (GOFLAGS, GOPROXY, ... are respected) pinned to the local toolchain."""
    env = dict(os.environ)
    env["GOTOOLCHAIN"] = "local"
    env["CGO_ENABLED"] = "0"
    return env


def _prepare_build_dir(component: Component, build_dir: Path) -> None:
    build_dir.mkdir(parents=True, exist_ok=True)
    src = component.source_dir()
    for path in (src / "go.mod", src / "go.sum", *component.own_sources(), *src.glob("tools.go")):
        dest = build_dir / path.relative_to(src)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)


def go_build_argv(component: Component, out: Path) -> list[str]:
    """``-o DIR/`` for several packages; one package gets an explicit file name.

    etcd's main package path ends in ``/v3``, which go would name ``v3``/``server``.
    """
    target = str(out / component.binaries[0]) if len(component.packages) == 1 else str(out) + os.sep
    tags = ["-tags", ",".join(component.tags)] if component.tags else []
    return ["go", "build", "-v", "-trimpath", *tags, "-ldflags", component.ldflags(), "-o", target,
            *component.packages]


def _count_deps(component: Component, build_dir: Path) -> int | None:
    try:
        out = subprocess.run(
            ["go", "list", "-deps", *component.packages], cwd=build_dir, env=go_env(),
            capture_output=True, text=True, timeout=600,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return len(out.stdout.split()) if out.returncode == 0 else None


def _run_go_build(component: Component, build_dir: Path, out: Path, say: Callable[[str], None]) -> None:
    """Run go build, turning its ``-v`` package lines into a periodic progress line."""
    total = _count_deps(component, build_dir)
    argv = go_build_argv(component, out)
    say(f"[{component.name}] {' '.join(argv[:4])} ... ({total or '?'} packages in the graph)")
    log_path = build_dir / "build.log"
    compiled = 0
    last = time.monotonic()
    tail: list[str] = []
    with log_path.open("w") as log, subprocess.Popen(
        argv, cwd=build_dir, env=go_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            tail = [*tail[-40:], line.rstrip()]
            if re.match(r"^[\w.\-]+(/[\w.\-~]+)*$", line.strip()):
                compiled += 1
            if time.monotonic() - last >= 10:
                last = time.monotonic()
                say(f"[{component.name}] compiled {compiled}{f'/{total}' if total else ''} packages")
        rc = proc.wait()
    if rc != 0:
        raise BuildError(
            f"go build for {component.name} failed (exit {rc}) in {build_dir}; full log {log_path}:\n"
            + "\n".join(tail[-25:])
        )


def kwok_stages_yaml(module_dir: Path, kustomization: str = KWOK_STAGE_KUSTOMIZATION) -> str:
    """Flatten KWOK's own kustomization of default stages into one multi-document YAML.

    The kwok binary has no stages compiled in (it refuses to start without any);
    kwokctl feeds it these files. Following the kustomization ``resources`` keeps
    us on exactly the set KWOK ships, not a copy that drifts.
    """
    docs: list[str] = []

    def walk(directory: Path) -> None:
        kust = yaml.safe_load((directory / "kustomization.yaml").read_text()) or {}
        for res in kust.get("resources", []):
            path = (directory / res).resolve()
            if path.is_dir():
                walk(path)
            else:
                docs.append(path.read_text().strip() + "\n")

    walk(module_dir / kustomization)
    if not docs:
        raise BuildError(f"no KWOK stages found under {module_dir / kustomization}")
    return "---\n".join(docs)


def _install_kwok_stages(build_dir: Path, bin_dir: Path) -> None:
    out = subprocess.run(
        ["go", "list", "-m", "-f", "{{.Dir}}", KWOK.module], cwd=build_dir, env=go_env(),
        capture_output=True, text=True, timeout=600,
    )
    module_dir = Path(out.stdout.strip())
    if out.returncode != 0 or not module_dir.is_dir():
        raise BuildError(f"cannot locate the {KWOK.module} module source: {out.stderr.strip()}")
    (bin_dir / KWOK_STAGES).write_text(kwok_stages_yaml(module_dir))


def build_component(component: Component, *, force: bool = False, say: Callable[[str], None] = print) -> Path:
    """Make ``bin_dir`` current for ``component``; returns it. Idempotent."""
    bin_dir = component.bin_dir()
    build_dir = component.build_dir()
    _prepare_build_dir(component, build_dir)
    if not force and is_current(component, bin_dir):
        say(f"[{component.name}] {component.version()} up to date in {bin_dir}")
    elif not force and read_stamp(bin_dir) is None and all((bin_dir / b).is_file()
                                                           for b in component.binaries):
        # Built by hand with the same command before the stamp existed: check, then adopt.
        # A stamp that does not match means the inputs changed, so that case rebuilds.
        for line in verify(component, bin_dir):
            say(f"[{component.name}] adopting {line}")
        write_stamp(component, bin_dir, adopted=True, seconds=None)
    else:
        started = time.monotonic()
        staging = bin_dir.with_name(bin_dir.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        _run_go_build(component, build_dir, staging, say)
        seconds = time.monotonic() - started
        for line in verify(component, staging):
            say(f"[{component.name}] built {line}")
        bin_dir.mkdir(parents=True, exist_ok=True)
        for b in component.binaries:
            os.replace(staging / b, bin_dir / b)
        shutil.rmtree(staging, ignore_errors=True)
        write_stamp(component, bin_dir, adopted=False, seconds=seconds)
        say(f"[{component.name}] {component.version()} built in {seconds:.0f}s -> {bin_dir}")
    if component is KWOK and (force or not (bin_dir / KWOK_STAGES).is_file()):
        _install_kwok_stages(build_dir, bin_dir)
        say(f"[kwok] default stages written to {bin_dir / KWOK_STAGES}")
    return bin_dir


def build_all(*, force: bool = False, only: tuple[str, ...] = (), say: Callable[[str], None] = print) -> None:
    if shutil.which("go") is None:
        raise BuildError("`go` is not on PATH; install Go >= 1.26 (the modules pin go 1.26.0)")
    for c in (*COMPONENTS, *ON_DEMAND):
        if (only and c.name not in only) or (not only and c in ON_DEMAND):
            continue
        build_component(c, force=force, say=say)
        sys.stdout.flush()
    if not only or "crds" in only:
        install_crds(force=force, say=say)


def crd_dir(name: str, root: Path | None = None) -> Path:
    """``<cache>/crds/<name>-<version>``: the CRD YAML of one CRD_MODULES entry."""
    _module, version, _sub = CRD_MODULES[name]
    return (root or cache_root()) / "crds" / f"{name}-{version}"


def install_crds(*, force: bool = False, say: Callable[[str], None] = print) -> None:
    """Copy each project's CRD YAML out of its module (``go mod download``) into the cache."""
    for name, (module, version, sub) in CRD_MODULES.items():
        dest = crd_dir(name)
        if not force and any(dest.glob("*.yaml")):
            say(f"[crds] {name} {version} up to date in {dest}")
            continue
        cache_root().mkdir(parents=True, exist_ok=True)
        out = subprocess.run(
            ["go", "mod", "download", "-json", f"{module}@{version}"], cwd=cache_root(), env=go_env(),
            capture_output=True, text=True, timeout=600,
        )
        try:
            module_dir = Path(json.loads(out.stdout)["Dir"])
        except (ValueError, KeyError, TypeError):
            raise BuildError(
                f"go mod download {module}@{version} failed: {(out.stderr or out.stdout)[-500:]}"
            ) from None
        files = sorted((module_dir / sub).glob("*.yaml"))
        if not files:
            raise BuildError(f"no CRD YAML under {module_dir / sub}")
        staging = dest.with_name(dest.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for f in files:
            shutil.copyfile(f, staging / f.name)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(staging, dest)
        say(f"[crds] {name} {version}: {len(files)} files -> {dest}")


def deploy_tool(component: Component) -> Path:
    """Path of a test/deploy tool (h2spec, helm, promtool), or a BuildError naming the fix."""
    path = component.bin_dir() / component.binaries[0]
    if not path.is_file():
        raise BuildError(f"{path} is not built; run `gatekeeper sandbox build`")
    return path


def kubeadm_binary() -> Path:
    """Path of the built kubeadm, or a BuildError naming the fix."""
    return deploy_tool(KUBEADM)


def informers_binary() -> Path:
    """Path of the built client-go informers load generator, or a BuildError naming the fix."""
    return deploy_tool(INFORMERS)


def noop_webhook_binary() -> Path:
    """Path of the do-nothing admission webhook (``gomod/informers/noopwebhook``), built beside the informers."""
    return INFORMERS.bin_dir() / "noopwebhook"


def caddy_binary(say: Callable[[str], None] = print) -> Path:
    """Path of Caddy, built from its module on first use (a few minutes) and cached like the sandbox's binaries."""
    if shutil.which("go") is None and not is_current(CADDY, CADDY.bin_dir()):
        raise BuildError("Caddy is not built and `go` is not on PATH; install Go >= 1.26")
    return build_component(CADDY, say=say) / CADDY.binaries[0]


def h2spec_binary() -> Path:
    """Path of the built h2spec, or a BuildError naming the fix."""
    return deploy_tool(H2SPEC)


@dataclass(frozen=True)
class Binaries:
    """Absolute paths of everything ``up`` runs."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    kwok: Path
    kwok_stages: Path


def installed() -> Binaries:
    """Paths of the built binaries, or a BuildError naming what is missing and the fix."""
    k8s, etcd, kwok = K8S.bin_dir(), ETCD.bin_dir(), KWOK.bin_dir()
    b = Binaries(
        etcd=etcd / "etcd",
        kube_apiserver=k8s / "kube-apiserver",
        kube_controller_manager=k8s / "kube-controller-manager",
        kube_scheduler=k8s / "kube-scheduler",
        kubectl=k8s / "kubectl",
        kwok=kwok / "kwok",
        kwok_stages=kwok / KWOK_STAGES,
    )
    missing = [str(p) for p in vars(b).values() if not Path(p).is_file()]
    if missing:
        raise BuildError(
            "sandbox binaries are not built (missing: " + ", ".join(missing)
            + "); run `gatekeeper sandbox build`"
        )
    return b
