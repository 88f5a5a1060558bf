"""GPU memory sizes: Kubernetes quantities and the MIG profile catalog (pure).

Why a real quantity parser: ``gatekeeper.dev/gpu-memory`` is written by people
who also write ``resources.limits``, so it follows the same grammar. ``20Gi``
is 20 x 2^30 bytes, ``20G`` is 20 x 10^9, and ``500m`` is half a byte (milli),
not 500 MiB. The shared mode hands the amount to the scheduler as a DRA
capacity request in whole MiB (the NVIDIA driver's ``requestPolicy`` step),
always rounded up: a pod that gets less memory than it asked for fails at
runtime, one that gets a little more does not.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from gatekeeper.kube.admission import quoted

MIB = 1024**2
GIB = 1024**3
MAX_BYTES = 2**63 - 1
"""The largest quantity Kubernetes represents as an integer (int64)."""

_SUFFIX: dict[str, Decimal | int] = {
    "": 1, "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}
_QUANTITY = re.compile(r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]{1,3})?")
"""ASCII digits only (``\\d`` also matches other scripts' digits, which the apiserver refuses), and exponents of
at most three digits, so ``1e999999999`` cannot make Decimal build a huge number. Used with ``fullmatch``.

Every input has at most one way to match, so a failing match costs time linear in its length: with
``[0-9]+\\.?[0-9]*`` a run of digits could be split between the two digit groups in as many ways as it had
digits, and an annotation of 200,000 digits and an ``x`` kept a worker's event loop busy for minutes (every
review on that worker then timed out)."""


def parse_quantity(text: str) -> Decimal:
    """The exact value of a Kubernetes quantity (``2``, ``1000m``, ``1e3``, ``1k``, ``20Gi``); ValueError if not one."""
    m = _QUANTITY.fullmatch(text.strip())
    if not m:
        raise ValueError(f"expected a Kubernetes quantity like '20Gi', '16G' or '512Mi', got {quoted(text)}")
    try:
        number = Decimal(m.group(1))
    except InvalidOperation:
        raise ValueError(f"expected a Kubernetes quantity, got {quoted(text)}") from None
    suffix = m.group(2) or ""
    if suffix[:1] in ("e", "E"):
        return number * Decimal(10) ** int(suffix[1:])
    return number * _SUFFIX[suffix]


def parse_quantity_bytes(text: str) -> int:
    """Bytes (rounded up) from a Kubernetes quantity such as ``20Gi``, ``16G``, ``512Mi`` or ``1e9``."""
    value = parse_quantity(text)
    if value > MAX_BYTES:  # 1e999 bytes overflowed the MiB rounding: a 500 with a traceback, not a denial
        raise ValueError(f"GPU memory must be at most {MAX_BYTES} bytes (8Ei), got {quoted(text)}")
    if value <= 0:
        raise ValueError(f"GPU memory must be positive, got {quoted(text)}")
    return math.ceil(value)


def mib_quantity(nbytes: int) -> str:
    """``nbytes`` rounded up to whole MiB, as a quantity (``20480Mi``): never less than asked."""
    return f"{math.ceil(nbytes / MIB)}Mi"


@dataclass(frozen=True)
class MigProfile:
    """One MIG GPU-instance profile: compute slices (of 7) and memory in GB, as in its name."""

    name: str
    slices: int
    memory_gb: int


def _profiles(*specs: str) -> tuple[MigProfile, ...]:
    out = []
    for s in specs:
        g, mem = s.split(".")
        out.append(MigProfile(s, int(g.removesuffix("g")), int(mem.removesuffix("gb"))))
    return tuple(out)


_A100_80 = _profiles("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")
MIG_CATALOG: dict[str, tuple[MigProfile, ...]] = {
    # NVIDIA MIG User Guide, "Supported MIG Profiles" (the +me media-extension variants are left
    # out: one per GPU, meant for video decode, never the right answer to "how much memory").
    "A30-24GB": _profiles("1g.6gb", "2g.12gb", "4g.24gb"),  # 4 slices, not 7
    "A100-40GB": _profiles("1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
    "A100-80GB": _A100_80,
    "H100-80GB": _A100_80,
    "H100-94GB": _profiles("1g.12gb", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"),
    "H100-96GB": _profiles("1g.12gb", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"),
    "H200-141GB": _profiles("1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
    "B200-180GB": _profiles("1g.23gb", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"),
    # GB200 HGX (186 GB): NVIDIA/mig-parted's shipped config (deployments/systemd/config-default.yaml,
    # "GB200 HGX", device 0x294110DE) lists exactly these; 1g.23gb is shared with B200.
    "GB200-186GB": _profiles("1g.23gb", "1g.47gb", "2g.47gb", "3g.93gb", "4g.93gb", "7g.186gb"),
}

MIG_LAYOUTS: dict[str, dict[str, tuple[str, ...]]] = {
    # The ``all-balanced`` MIG config of NVIDIA/mig-parted (the GPU operator's default
    # ``nvidia.com/mig.config``), per model: which profiles a node labelled with it really has.
    "all-balanced": {
        "A30-24GB": ("1g.6gb", "2g.12gb"),
        "A100-40GB": ("1g.5gb", "2g.10gb", "3g.20gb"),
        "A100-80GB": ("1g.10gb", "2g.20gb", "3g.40gb"),
        "H100-80GB": ("1g.10gb", "2g.20gb", "3g.40gb"),
        "H100-94GB": ("1g.12gb", "2g.24gb", "3g.47gb"),
        "H100-96GB": ("1g.12gb", "2g.24gb", "3g.48gb"),
        "H200-141GB": ("1g.18gb", "2g.35gb", "3g.71gb"),
        "B200-180GB": ("1g.23gb", "2g.45gb", "3g.90gb"),
        "GB200-186GB": ("1g.23gb", "2g.47gb", "3g.93gb"),
    },
}


def layout_profiles(model: str, layout: str) -> tuple[str, ...]:
    """Profiles a MIG config (``all-balanced``, or ``all-<profile>`` of one profile) creates on ``model``."""
    if layout in MIG_LAYOUTS:
        by_model = MIG_LAYOUTS[layout]
        if model not in by_model:
            raise ValueError(f"layout {layout!r} is not known for {model}; list its profiles instead")
        return by_model[model]
    one = layout.removeprefix("all-")
    if layout.startswith("all-") and any(p.name == one for p in MIG_CATALOG.get(model, ())):
        return (one,)
    raise ValueError(f"layout {layout!r} is not known for {model}; expected all-balanced or all-<profile> "
                     f"({', '.join('all-' + p.name for p in MIG_CATALOG.get(model, ()))}), or list the profiles")

_LEGACY_UNIT = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(?:(gib|gb|gi|g|mib|mb|mi|m)\s*)?", re.IGNORECASE)
"""Used with ``fullmatch``. The spaces after the number and after the unit are one ``\\s*`` when there is no unit
(not ``\\s*(unit)?\\s*``, which could split a run of spaces in as many ways as it had: quadratic backtracking on
``'1' + ' ' * n + 'x'``)."""
_LEGACY_SUFFIX = {"gib": "Gi", "gi": "Gi", "gb": "G", "g": "G", "mib": "Mi", "mi": "Mi", "mb": "M", "m": "M"}


def mig_need_bytes(text: str) -> int:
    """Bytes (rounded up) a mig pod's ``gatekeeper.dev/gpu-memory`` asks for.

    Exact Kubernetes units, so ``20Gi`` is 21.5 GB, not 20 GB (reading it as 20 would pick a
    profile ~7% too small). The forms the mig mode always accepted keep their meaning: a bare
    number is GB (as profile names count), and ``gb``/``mb``/``g``/``m`` in any case are GB/MB.
    """
    m = _LEGACY_UNIT.fullmatch(text)
    if m:
        unit = (m.group(2) or "g").lower()
        text = m.group(1) + _LEGACY_SUFFIX[unit]
    try:
        return parse_quantity_bytes(text)
    except ValueError:
        raise ValueError(f"gatekeeper.dev/gpu-memory must be a size like '20Gi' or '10G', got {quoted(text)}") from None


def smallest_mig_profile(model: str, need_bytes: int, allowed: tuple[str, ...] | None = None) -> MigProfile | None:
    """Profile names count GB (10^9 bytes), a lower bound of what each profile really has.

    ``allowed``: only these profile names (the MIG layout a node pool runs); None = all of the model's.
    """
    fits = [p for p in MIG_CATALOG[model] if p.memory_gb * 10**9 >= need_bytes
            and (allowed is None or p.name in allowed)]
    return min(fits, key=lambda p: (p.memory_gb, p.slices)) if fits else None
