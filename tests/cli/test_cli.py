"""The `gatekeeper` command line as an operator meets it: help texts, certs round trip, readable errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gatekeeper.cli import main


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gatekeeper", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("command", ["webhook", "proxy", "certs", "sandbox"])
def test_every_subcommand_has_a_real_help_text(command: str) -> None:
    out = run(command, "--help")
    assert out.returncode == 0, out.stderr
    assert "not implemented" not in out.stdout.lower()
    assert len(out.stdout.split()) > 20


def test_certs_round_trip_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = str(tmp_path / "c")
    assert main(["certs", "init", "--dir", d]) == 0
    assert main(["certs", "issue", "serving", "--dir", d, "--name", "web", "--ip", "127.0.0.1"]) == 0
    assert main(["certs", "issue", "client", "--dir", d, "--name", "bob", "--user", "bob", "--group", "dev"]) == 0
    capsys.readouterr()
    assert main(["certs", "ca-bundle", "--dir", d]) == 0
    assert capsys.readouterr().out.strip().startswith("LS0t")  # base64 of "-----BEGIN"
    assert main(["certs", "check", "--dir", d]) == 0


def test_bad_ip_is_a_one_line_error_not_a_traceback(tmp_path: Path) -> None:
    d = str(tmp_path / "c")
    assert run("certs", "init", "--dir", d).returncode == 0
    out = run("certs", "issue", "serving", "--dir", d, "--name", "x", "--ip", "not-an-ip")
    assert out.returncode == 2
    assert "not-an-ip" in out.stderr and "Traceback" not in out.stderr


def test_missing_config_file_is_reported_with_its_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    out = run("proxy", "--config", str(missing))
    assert out.returncode != 0
    assert str(missing) in out.stderr and "Traceback" not in out.stderr


def test_non_positive_validity_is_refused_by_the_parser(tmp_path: Path) -> None:
    d = str(tmp_path / "c")
    assert run("certs", "init", "--dir", d).returncode == 0
    out = run("certs", "issue", "serving", "--dir", d, "--name", "x", "--ip", "127.0.0.1", "--days", "-3")
    assert out.returncode == 2 and "argument --days: must be >= 1, got -3" in out.stderr
    assert not (tmp_path / "c" / "x.crt").exists()


def test_ca_bundle_before_init_names_the_fix(tmp_path: Path) -> None:
    out = run("certs", "ca-bundle", "--dir", str(tmp_path / "none"))
    assert out.returncode == 2 and "run `gatekeeper certs init" in out.stderr and "Traceback" not in out.stderr


def test_building_the_parser_does_not_import_prometheus_client() -> None:
    # `gatekeeper webhook --workers N` sets PROMETHEUS_MULTIPROC_DIR after parsing; prometheus_client
    # reads it at import, so an import while building the parser would leave each worker counting alone.
    code = ("import sys; from gatekeeper.cli import build_parser; build_parser(); "
            "print('prometheus_client' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_proxy_workers_refuse_a_metrics_dir_another_user_owns(tmp_path: Path) -> None:
    """Another local user's PROMETHEUS_MULTIPROC_DIR: one line naming it, exit 2, nothing started."""
    import os

    theirs = tmp_path / "metrics"
    theirs.mkdir()
    os.chown(theirs, 4242, 4242)  # the tests run as root
    config = tmp_path / "proxy.yaml"
    config.write_text("proxy:\n  backends: [{url: 'https://127.0.0.1:1'}]\n  upstream: {caFile: /etc/hostname}\n"
                      "  listener: {address: 127.0.0.1, port: 0, metricsPort: -1,\n"
                      "             certFile: /etc/hostname, keyFile: /etc/hostname}\n")
    out = subprocess.run([sys.executable, "-m", "gatekeeper", "proxy", "--config", str(config), "--workers", "2"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(theirs)})
    assert out.returncode == 2, out.stderr
    assert f"PROMETHEUS_MULTIPROC_DIR={theirs}: is owned by uid 4242" in out.stderr
    assert "Traceback" not in out.stderr
