"""``gpu.kep5004``: whether ``dra`` steps aside for a KEP-5004 DeviceClass mapping is a setting, rewrite by default.

The default is the measured one (loadtest dra-scale: the scheduler-made claims of the KEP-5004 path cost the
scheduler far more memory than the template path), so a mapped cluster keeps getting our rewrite unless the
operator opts into ``step-aside``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from review_fixtures import container, pod, request, review

from gatekeeper.base.config import ConfigError, load_config
from gatekeeper.webhook import policies
from gatekeeper.webhook.gpu import policy as gpu
from gatekeeper.webhook.settings import GpuSettings, WebhookSettings


def decide(settings: GpuSettings, mapped: bool, count: int = 1) -> Any:
    return gpu.review(request(review(pod(container("c", count)), kind="Pod")), settings, mapped)


def test_default_is_rewrite() -> None:
    assert GpuSettings().kep5004 == "rewrite"


def test_by_default_a_mapped_one_gpu_dra_pod_is_still_rewritten() -> None:
    d = decide(GpuSettings(default_mode="dra"), mapped=True)
    assert d.outcome == "mutated" and d.templates
    assert not any("KEP-5004" in w for w in d.warnings)
    assert "gpu-kep5004" not in d.audit


def test_rewrite_gives_the_same_patch_whether_or_not_a_class_maps_the_gpu() -> None:
    s = GpuSettings(default_mode="dra")
    mapped, unmapped = decide(s, mapped=True), decide(s, mapped=False)
    assert mapped.templates == unmapped.templates
    assert [op["path"] for op in mapped.patch] == [op["path"] for op in unmapped.patch]


def test_step_aside_leaves_the_mapped_pod_to_the_scheduler() -> None:
    d = decide(GpuSettings(default_mode="dra", kep5004="step-aside"), mapped=True)
    assert d.outcome == "skipped" and not d.patch and not d.templates
    assert d.audit["gpu-kep5004"] == "served"


def test_step_aside_without_a_mapping_still_rewrites() -> None:
    assert decide(GpuSettings(default_mode="dra", kep5004="step-aside"), mapped=False).outcome == "mutated"


def test_mutate_route_follows_the_setting() -> None:
    req = request(review(pod(container("c", 1)), kind="Pod"))
    rewrite = WebhookSettings(gpu=GpuSettings(default_mode="dra"))
    aside = WebhookSettings(gpu=GpuSettings(default_mode="dra", kep5004="step-aside"))
    assert policies.mutate(req, rewrite, True)[1].outcome == "mutated"
    assert policies.mutate(req, aside, True)[1].outcome == "skipped"


@pytest.mark.parametrize("value", ["rewrite", "step-aside"])
def test_both_values_load_from_yaml(tmp_path: Path, value: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(f"webhook:\n  gpu:\n    defaultMode: dra\n    kep5004: {value}\n")
    assert load_config(f, need="webhook").webhook.gpu.kep5004 == value


@pytest.mark.parametrize("value", ["skip", "true", "Rewrite", "[rewrite]"])
def test_a_bad_value_is_refused_naming_the_file_key_and_choices(tmp_path: Path, value: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(f"webhook:\n  gpu:\n    kep5004: {value}\n")
    with pytest.raises(ConfigError) as err:
        load_config(f, need="webhook")
    text = str(err.value)
    assert str(f) in text and "kep5004" in text
    assert "'rewrite'" in text and "'step-aside'" in text


def test_validate_refuses_a_bad_value_built_in_code() -> None:
    with pytest.raises(ValueError, match="kep5004 must be one of rewrite, step-aside"):
        GpuSettings(kep5004="skip").validate()  # type: ignore[arg-type]
