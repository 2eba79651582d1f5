"""The architectures the package supports, and which kernel family needs a newer one.

The arch table is occupancy.ARCHS: every command that takes an arch reports or plans with
the occupancy calculator, so an arch it has no limits for cannot be served. `check_arch` is
the one check every command runs on `--arch`, before any compile.
"""
from __future__ import annotations

from . import registry
from .occupancy import ARCHS

__all__ = ["ARCH_NAMES", "check_arch", "arch_number", "variant_needs", "instance_needs"]

ARCH_NAMES = tuple(ARCHS)


def check_arch(arch, param: str = "--arch") -> str:
    """`arch` if the table knows it, else ValueError naming `param` and the known archs."""
    if arch not in ARCHS:
        raise ValueError(f"{param} must be one of {', '.join(ARCH_NAMES)} (the archs whose "
                         f"occupancy limits the package knows), got {arch!r}")
    return arch


def arch_number(arch: str) -> int:
    """90 for 'sm_90': the order of compute capabilities."""
    return int(check_arch(arch)[3:])


def instance_needs(arch: str, inst) -> str | None:
    """The arch a KernelInstance needs (its `min_arch`) when `arch` cannot run it: too old,
    or, for an arch-specific target (sm_90a), any arch but that one (sm_90)."""
    need = inst.min_arch
    if need.endswith("a"):
        return need if check_arch(arch) != need[:-1] else None
    return need if arch_number(arch) < int(need[3:]) else None


def variant_needs(arch: str, variant_name: str) -> str | None:
    """The arch a variant's attention kernel needs when `arch` is too old for it, else None."""
    var = registry.variant(variant_name)
    return instance_needs(arch, registry.attention_instance(var)) if var.is_cuda else None
