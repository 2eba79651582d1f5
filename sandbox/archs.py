"""The architectures the package supports, and which kernel family needs a newer one.

The arch table is occupancy.ARCHS: every command that takes an arch reports or plans with
the occupancy calculator, so an arch it has no limits for cannot be served. `check_arch` is
the one check every command runs on `--arch`, before any compile.
"""
from __future__ import annotations

from . import registry
from .occupancy import ARCHS

__all__ = ["ARCH_NAMES", "MIN_ARCH", "check_arch", "arch_number", "variant_needs",
           "instance_needs"]

ARCH_NAMES = tuple(ARCHS)

# Kernel family -> the oldest arch its source compiles for. attn_tiled waits on its tile
# buffers with mbarrier.try_wait.parity, which PTX offers from sm_90 on; every other family
# compiles for each arch of the table. (A fact of the kernel: it belongs on KernelInstance.)
MIN_ARCH = {"tiled": "sm_90"}

# The family of each attention source file, derived from the registry.
_SOURCE_FAMILY = {registry.attention_instance(v).source: v.family
                  for v in registry.VARIANTS.values() if v.is_cuda}


def check_arch(arch, param: str = "--arch") -> str:
    """`arch` if the table knows it, else ValueError naming `param` and the known archs."""
    if arch not in ARCHS:
        raise ValueError(f"{param} must be one of {', '.join(ARCH_NAMES)} (the archs whose "
                         f"occupancy limits the package knows), got {arch!r}")
    return arch


def arch_number(arch: str) -> int:
    """90 for 'sm_90': the order of compute capabilities."""
    return int(check_arch(arch)[3:])


def _needs(arch: str, family: str | None) -> str | None:
    need = MIN_ARCH.get(family)
    if need is not None and arch_number(arch) < arch_number(need):
        return need
    return None


def variant_needs(arch: str, variant_name: str) -> str | None:
    """The arch a variant needs when `arch` is too old for it, else None."""
    return _needs(arch, registry.variant(variant_name).family)


def instance_needs(arch: str, inst) -> str | None:
    """The arch a KernelInstance needs when `arch` is too old for it, else None."""
    return _needs(arch, _SOURCE_FAMILY.get(inst.source))
