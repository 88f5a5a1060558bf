"""The image's run-time contract, without a container daemon: what the Containerfile builds runs as the chart runs it.

The final stage of ``Containerfile`` is the base interpreter plus gatekeeper's wheel and its dependencies,
installed into a prefix; the chart and the static pod run it as uid 65532 on a read-only root with only
``/tmp`` (an emptyDir) writable and the config and certificates mounted read-only. Here the wheel is built
from this checkout and installed into a fresh directory the same way, then ``gatekeeper webhook`` and
``gatekeeper proxy --workers 2`` run from it in a private mount namespace: the root remounted read-only,
a fresh tmpfs on ``/tmp``, the repository hidden behind an empty read-only tmpfs, uid/gid 65532 with no
supplementary groups. Each must answer ``/readyz`` and ``/metrics`` (with ``gatekeeper_build_info``) and exit
0 on SIGTERM. The Containerfile lint below fails on what would make the image unsafe or unreproducible.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gatekeeper import __version__
from gatekeeper.certs.pki import PKI
from gatekeeper.runtime.compiled import MODULES
from gatekeeper.sandbox.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "Containerfile"
SYSTEM_PYTHON = Path("/usr/bin/python3")
UID = 65532
INSTALL_AT, CONFIG_AT = "/srv", "/media"
"""Where the installed prefix and the read-only config are bind-mounted inside the namespace (empty dirs)."""
COMPILED = f"{len(MODULES)}/{len(MODULES)}"
"""The wheel is built here, where a C compiler is: every hot module loads compiled (gatekeeper/runtime/compiled.py)."""
BUILD_INFO = f'gatekeeper_build_info{{compiled="{COMPILED}",version="{__version__}"}} 1.0'
"""As the multiprocess collector writes it (labels sorted by name)."""


# ---- the Containerfile lint ---------------------------------------------------------------------------------

def lint(text: str) -> list[str]:
    """What would make the image unsafe or unreproducible: a base not pinned by digest, ``latest``, root."""
    problems: list[str] = []
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, re.MULTILINE))
    froms = re.findall(r"^FROM\s+(\S+)", text, re.MULTILINE)
    if not froms:
        problems.append("no FROM")
    stages = {m for m in re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", text, re.MULTILINE | re.IGNORECASE)}
    for image in froms:
        ref = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), image)
        if ref in stages:
            continue
        if "@sha256:" not in ref or not re.search(r"@sha256:[0-9a-f]{64}$", ref):
            problems.append(f"base image {ref} is not pinned by a sha256 digest")
        if re.search(r":latest(@|$)", ref) or ("@" not in ref and ":" not in ref.rsplit("/", 1)[-1]):
            problems.append(f"base image {ref} uses latest")
    users = re.findall(r"^USER\s+(\S+)", text, re.MULTILINE)
    if not users:
        problems.append("no USER: the image would run as root")
    elif users[-1].split(":")[0] in ("root", "0") or not users[-1].split(":")[0].isdigit():
        problems.append(f"USER {users[-1]}: the final user must be a numeric non-root uid")
    entry = re.findall(r"^ENTRYPOINT\s+(.+)$", text, re.MULTILINE)
    if not entry or not entry[-1].strip().startswith("["):
        problems.append("ENTRYPOINT must be the exec form (no shell at run time)")
    return problems


def test_the_containerfile_passes_its_lint() -> None:
    text = CONTAINERFILE.read_text()
    assert lint(text) == []
    assert re.search(r"^USER 65532:65532$", text, re.MULTILINE)
    assert 'ENTRYPOINT ["gatekeeper"]' in text
    for label in ("source", "version", "licenses"):
        assert f"org.opencontainers.image.{label}=" in text


GOOD = textwrap.dedent("""\
    ARG BASE=docker.io/library/python:3.11-slim@sha256:%s
    FROM ${BASE} AS build
    FROM ${BASE}
    COPY --from=build /install /usr/local
    USER 65532:65532
    ENTRYPOINT ["gatekeeper"]
    """) % ("a" * 64)


@pytest.mark.parametrize(("change", "problem"), [
    (("@sha256:" + "a" * 64, ""), "not pinned by a sha256 digest"),
    (("3.11-slim@sha256:" + "a" * 64, "latest"), "uses latest"),
    (("USER 65532:65532", "USER root"), "numeric non-root uid"),
    (("USER 65532:65532", "USER 0"), "numeric non-root uid"),
    (("USER 65532:65532\n", ""), "no USER"),
    (('ENTRYPOINT ["gatekeeper"]', "ENTRYPOINT gatekeeper"), "exec form"),
])
def test_the_lint_fails_an_unsafe_containerfile(change: tuple[str, str], problem: str) -> None:
    assert lint(GOOD) == []
    bad = GOOD.replace(*change)
    assert bad != GOOD
    assert any(problem in p for p in lint(bad)), lint(bad)


def test_the_dockerignore_keeps_the_context_to_what_the_build_copies() -> None:
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert ignore[0] == "*" or "*" in ignore
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = set(re.findall(r"^COPY\s+(?!--from)(.+?)\s+\S+$", CONTAINERFILE.read_text(), re.MULTILINE))
    assert {p for c in copied for p in c.split()} <= kept | {"./"}, (copied, kept)
    for private in (".venv", ".sandbox", "tests", "loadtest", ".git"):
        assert private not in kept


# ---- the image's run-time contract ----------------------------------------------------------------------------

def _contract_possible() -> str:
    if os.geteuid() != 0:
        return "needs root (a mount namespace and setpriv to uid 65532)"
    if not SYSTEM_PYTHON.exists() or not shutil.which("unshare") or not shutil.which("setpriv"):
        return "needs /usr/bin/python3, unshare and setpriv"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        return f"no mount namespace here: {probe.stderr.decode()[-200:]}"
    return ""


@pytest.fixture(scope="module")
def installed() -> Iterator[Path]:
    """gatekeeper's wheel and its dependencies installed into a fresh prefix, as the final stage has them."""
    why = _contract_possible()
    if why:
        pytest.skip(why)
    work = Path(tempfile.mkdtemp(prefix="gk-image-", dir="/var/tmp"))  # outside /tmp, which gets its own tmpfs
    try:
        wheels = work / "wheels"
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                        "--wheel-dir", str(wheels), str(ROOT)], check=True, timeout=600)
        (wheel,) = wheels.glob("gatekeeper-*.whl")
        site = work / "site"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-compile", "--target", str(site),
                        str(wheel)], check=True, timeout=900)
        for path in (work, site):
            path.chmod(0o755)
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _as_the_image_runs(install: Path, config: Path, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    """``argv`` (after ``gatekeeper``) as uid 65532 on a read-only root, only /tmp writable, the repo hidden.

    The repository is hidden before /tmp gets its tmpfs: a checkout under /tmp has no mount point after it."""
    script = f"""set -e
mount --bind {install} {INSTALL_AT} && mount -o remount,bind,ro {INSTALL_AT}
mount --bind {config} {CONFIG_AT} && mount -o remount,bind,ro {CONFIG_AT}
mount -t tmpfs -o ro,mode=000 tmpfs {ROOT}
mount -t tmpfs -o mode=1777,size=64m tmpfs /tmp
mount -o remount,bind,ro /
exec setpriv --reuid {UID} --regid {UID} --clear-groups env -i PATH=/usr/bin:/bin HOME=/nonexistent \
  PYTHONPATH={INSTALL_AT}/site PYTHONDONTWRITEBYTECODE=1 PYTHONSAFEPATH=1 PROMETHEUS_MULTIPROC_DIR=/tmp/metrics \
  {SYSTEM_PYTHON} -m gatekeeper {' '.join(argv)}
"""
    with log.open("wb") as out:
        return subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                                stdout=out, stderr=subprocess.STDOUT, cwd="/")


def _get(url: str, ctx: ssl.SSLContext | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5, context=ctx) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path, ctx: ssl.SSLContext | None = None) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited {proc.returncode}: {log.read_text()[-3000:]}"
        try:
            if _get(url, ctx)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} never answered 200: {log.read_text()[-3000:]}")


def _runs_as_65532(proc: subprocess.Popen[bytes]) -> bool:
    """The process (unshare, then sh, then setpriv exec'd into python: one pid) has uid and gid 65532."""
    status = Path(f"/proc/{proc.pid}/status").read_text()
    ids = {line.split(":")[0]: line.split()[1:] for line in status.splitlines() if line.startswith(("Uid", "Gid"))}
    return ids["Uid"] == [str(UID)] * 4 and ids["Gid"] == [str(UID)] * 4


def _stop(proc: subprocess.Popen[bytes], log: Path) -> int:
    proc.send_signal(signal.SIGTERM)  # unshare forwards nothing: sh exec'd setpriv, setpriv exec'd python
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"no exit 60 s after SIGTERM: {log.read_text()[-3000:]}") from None


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    """Certificates and configs, readable by uid 65532 as the chart's secret and configMap mounts are."""
    pki = PKI(tmp_path / "config" / "pki")
    pki.init()
    pki.issue_serving("serving", dns=["localhost"], ips=["127.0.0.1"])
    for path in [tmp_path / "config", *(tmp_path / "config").rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    tmp_path.chmod(0o755)
    return tmp_path / "config"


def test_the_installed_package_reports_its_version(installed: Path, config_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "version.log"
    proc = _as_the_image_runs(installed, config_dir, ["--version"], log)
    assert proc.wait(60) == 0, log.read_text()
    assert log.read_text().strip() == f"gatekeeper {__version__} (compiled modules: {COMPILED})"


def test_the_webhook_serves_as_uid_65532_on_a_read_only_root(installed: Path, config_dir: Path,
                                                               tmp_path: Path) -> None:
    port = free_port()
    cfg = {"webhook": {"server": {"address": "127.0.0.1", "port": port, "workers": 2,
                                  "certFile": f"{CONFIG_AT}/pki/serving.crt",
                                  "keyFile": f"{CONFIG_AT}/pki/serving.key"}}}
    (config_dir / "webhook.yaml").write_text(yaml.safe_dump(cfg))
    (config_dir / "webhook.yaml").chmod(0o644)
    ctx = ssl.create_default_context(cafile=str(config_dir / "pki" / "ca.crt"))
    log = tmp_path / "webhook.log"
    proc = _as_the_image_runs(installed, config_dir, ["webhook", "--config", f"{CONFIG_AT}/webhook.yaml"], log)
    try:
        _wait_ready(proc, f"https://127.0.0.1:{port}/readyz", log, ctx)
        assert _runs_as_65532(proc)
        status, page = _get(f"https://127.0.0.1:{port}/metrics", ctx)
        assert status == 200 and BUILD_INFO in page, page[:2000]
    finally:
        code = _stop(proc, log)
    assert code == 0, log.read_text()[-3000:]
    assert "Read-only file system" not in log.read_text() and "Permission denied" not in log.read_text()


async def test_the_proxy_serves_as_uid_65532_on_a_read_only_root(installed: Path, config_dir: Path,
                                                                 tmp_path: Path, aiohttp_server) -> None:  # type: ignore[no-untyped-def]
    from aiohttp import web

    pki = PKI(config_dir / "pki")
    backend_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    backend_ctx.load_cert_chain(pki.cert_path("serving"), pki.key_path("serving"))
    app = web.Application()
    async def readyz(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/readyz", readyz)
    backend = await aiohttp_server(app, ssl=backend_ctx)
    port, metrics = free_port(), free_port()
    cfg = {"proxy": {
        "workers": 2,
        "listener": {"address": "127.0.0.1", "port": port, "metricsAddress": "127.0.0.1", "metricsPort": metrics,
                     "certFile": f"{CONFIG_AT}/pki/serving.crt", "keyFile": f"{CONFIG_AT}/pki/serving.key"},
        "backends": [{"url": f"https://127.0.0.1:{backend.port}"}],
        "upstream": {"caFile": f"{CONFIG_AT}/pki/ca.crt", "healthIntervalSeconds": 0.5},
        "flowControl": {"enabled": False},
    }}
    (config_dir / "proxy.yaml").write_text(yaml.safe_dump(cfg))
    (config_dir / "proxy.yaml").chmod(0o644)
    log = tmp_path / "proxy.log"
    proc = _as_the_image_runs(installed, config_dir, ["proxy", "--config", f"{CONFIG_AT}/proxy.yaml"], log)
    try:
        import asyncio

        deadline = time.monotonic() + 60
        while True:  # the backend runs on this test's event loop: wait without blocking it
            assert proc.poll() is None, f"exited {proc.returncode}: {log.read_text()[-3000:]}"
            try:
                ready = await asyncio.to_thread(_get, f"http://127.0.0.1:{metrics}/readyz")
                if ready[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"the proxy never became ready: {log.read_text()[-3000:]}"
            await asyncio.sleep(0.3)
        assert _runs_as_65532(proc)
        status, page = await asyncio.to_thread(_get, f"http://127.0.0.1:{metrics}/metrics")
        assert status == 200 and BUILD_INFO in page, page[:2000]
    finally:
        code = await asyncio.to_thread(_stop, proc, log)
    assert code == 0, log.read_text()[-3000:]
    assert "Read-only file system" not in log.read_text() and "Permission denied" not in log.read_text()
