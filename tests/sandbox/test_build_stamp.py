"""`sandbox build` bookkeeping without running Go: stamps, adoption of manual builds, KWOK stages."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import yaml

from gatekeeper.sandbox import build
from gatekeeper.sandbox.build import Component

GOMOD = """module gatekeeper.local/sandbox/fake

go 1.26.0

require example.com/fake v1.2.3

require (
\texample.com/other v0.1.0 // indirect
)
"""


def fake_component(root: Path, version_output: str = "fake version v1.2.3") -> Component:
    src = root / "gomod" / "fake"
    src.mkdir(parents=True)
    (src / "go.mod").write_text(GOMOD)
    (src / "go.sum").write_text("example.com/fake v1.2.3 h1:abc=\n")
    (src / "tools.go").write_text("//go:build tools\npackage tools\n")
    return Component(
        name="fake", gomod="fake", module="example.com/fake", packages=("example.com/fake/cmd/fake",),
        binaries=("fake",), ldflags_template="-s -w -X example.com/fake.Version={version}",
        gomod_root=root / "gomod",
    )


def install_script(path: Path, output: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho '{output}'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GATEKEEPER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_module_version_reads_single_line_and_block_requires() -> None:
    assert build.module_version(GOMOD, "example.com/fake") == "v1.2.3"
    assert build.module_version(GOMOD, "example.com/other") == "v0.1.0"
    with pytest.raises(build.BuildError, match=r"does not require example\.com/missing"):
        build.module_version(GOMOD, "example.com/missing")


def test_committed_modules_name_the_versions_the_cache_is_keyed_by() -> None:
    assert build.K8S.version().startswith("v1.")
    assert int(build.K8S.version().split(".")[1]) >= 34, "DRA resource.k8s.io/v1 needs Kubernetes >= 1.34"
    assert build.ETCD.version().startswith("v3.6.")
    assert build.KWOK.version().startswith("v0.8.")
    assert build.K8S.bin_dir().name == f"k8s-{build.K8S.version()}"
    ld = build.K8S.ldflags()
    assert f"gitVersion={build.K8S.version()}" in ld and "gitMinor=" in ld


def test_stamp_changes_with_every_build_input() -> None:
    base = build.stamp_of(b"mod", b"sum", "-s -w", ("a",))
    assert base == build.stamp_of(b"mod", b"sum", "-s -w", ("a",))
    assert base != build.stamp_of(b"mod2", b"sum", "-s -w", ("a",))
    assert base != build.stamp_of(b"mod", b"sum2", "-s -w", ("a",))
    assert base != build.stamp_of(b"mod", b"sum", "-s", ("a",))
    assert base != build.stamp_of(b"mod", b"sum", "-s -w", ("a", "b"))
    # Length-prefixed parts: moving bytes across a boundary is a different input.
    assert build.stamp_of(b"ab", b"c", "", ()) != build.stamp_of(b"a", b"bc", "", ())


def test_unstamped_binaries_are_verified_and_adopted_without_go(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    comp = fake_component(tmp_path)
    install_script(comp.bin_dir() / "fake", "fake version v1.2.3")
    monkeypatch.setattr(build, "_run_go_build", lambda *a: pytest.fail("must adopt, not rebuild"))
    said: list[str] = []
    build.build_component(comp, say=said.append)
    assert any("adopting fake: fake version v1.2.3" in s for s in said)
    stamp = json.loads((comp.bin_dir() / build.STAMP).read_text())
    assert stamp["adopted"] is True and stamp["stamp"] == comp.stamp()
    assert build.is_current(comp, comp.bin_dir())
    said.clear()
    build.build_component(comp, say=said.append)
    assert said == [f"[fake] v1.2.3 up to date in {comp.bin_dir()}"]


def test_unstamped_binary_with_the_wrong_version_is_not_adopted(tmp_path: Path, cache: Path) -> None:
    comp = fake_component(tmp_path)
    install_script(comp.bin_dir() / "fake", "fake version v9.9.9")
    with pytest.raises(build.BuildError, match=r"expected version v1\.2\.3"):
        build.build_component(comp, say=lambda _: None)
    assert build.read_stamp(comp.bin_dir()) is None


def test_changed_go_sum_makes_a_stamped_build_stale_and_rebuilds(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    comp = fake_component(tmp_path)
    install_script(comp.bin_dir() / "fake", "fake version v1.2.3")
    build.write_stamp(comp, comp.bin_dir(), adopted=False, seconds=1.0)
    assert build.is_current(comp, comp.bin_dir())
    (comp.source_dir() / "go.sum").write_text("example.com/fake v1.2.3 h1:changed=\n")
    assert not build.is_current(comp, comp.bin_dir())
    calls: list[Path] = []

    def fake_go_build(component: Component, build_dir: Path, out: Path, say: object) -> None:
        assert (build_dir / "go.sum").read_text().endswith("changed=\n"), "builds from a copy of the inputs"
        calls.append(out)
        install_script(out / "fake", "fake version v1.2.3 (rebuilt)")

    monkeypatch.setattr(build, "_run_go_build", fake_go_build)
    build.build_component(comp, say=lambda _: None)
    assert len(calls) == 1
    assert "rebuilt" in (comp.bin_dir() / "fake").read_text()
    assert build.is_current(comp, comp.bin_dir())
    assert not calls[0].exists(), "the staging directory is cleaned up"


def test_go_build_argv_names_a_single_binary_and_uses_a_dir_for_several(tmp_path: Path) -> None:
    argv = build.go_build_argv(build.ETCD, tmp_path)
    assert argv[argv.index("-o") + 1] == str(tmp_path / "etcd")
    argv = build.go_build_argv(build.K8S, tmp_path)
    assert argv[argv.index("-o") + 1].endswith("/")
    assert "-trimpath" in argv and argv[-4:] == list(build.K8S.packages)


def test_go_environment_keeps_goproxy_and_pins_the_local_toolchain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOPROXY", "https://proxy.example")
    monkeypatch.setenv("GOTOOLCHAIN", "auto")
    env = build.go_env()
    assert env["GOPROXY"] == "https://proxy.example"
    assert env["GOTOOLCHAIN"] == "local" and env["CGO_ENABLED"] == "0"


def test_kwok_stages_follow_the_kustomization_resources(tmp_path: Path) -> None:
    stage = tmp_path / "kustomize" / "stage"
    (stage / "fast").mkdir(parents=True)
    (stage / "node").mkdir()
    (stage / "pod").mkdir()
    (stage / "fast" / "kustomization.yaml").write_text("resources:\n- ../node\n- ../pod\n")
    (stage / "node" / "kustomization.yaml").write_text("resources:\n- init.yaml\n")
    (stage / "node" / "init.yaml").write_text("kind: Stage\nmetadata: {name: node-initialize}\n")
    (stage / "node" / "unused.yaml").write_text("kind: Stage\nmetadata: {name: not-listed}\n")
    (stage / "pod" / "kustomization.yaml").write_text("resources:\n- ready.yaml\n- delete.yaml\n")
    (stage / "pod" / "ready.yaml").write_text("kind: Stage\nmetadata: {name: pod-ready}\n")
    (stage / "pod" / "delete.yaml").write_text("kind: Stage\nmetadata: {name: pod-delete}\n")
    docs = list(yaml.safe_load_all(build.kwok_stages_yaml(tmp_path)))
    assert [d["metadata"]["name"] for d in docs] == ["node-initialize", "pod-ready", "pod-delete"]


def test_missing_binaries_name_the_fix(cache: Path) -> None:
    with pytest.raises(build.BuildError, match="run `gatekeeper sandbox build`"):
        build.installed()
