"""Theoretical occupancy: how many blocks of a kernel fit on one SM, and what stops more.

The arithmetic is that of CUDA's occupancy calculator (`cuda_occupancy.h`,
cudaOccMaxActiveBlocksPerMultiprocessor), which is what the driver's occupancy API computes:

* registers: per warp, regs/thread x 32 rounded up to the allocation unit (256); warps are
  placed per SM sub-partition (4 per SM, each a quarter of the register file), so the
  floor is taken per sub-partition. This is the register wall's step function: at 256
  threads, 125 registers fit 2 blocks and 148 fit 1.
* warps: max warps/SM // warps per block.
* blocks: the per-SM block-slot limit.
* shared memory: (static + dynamic + the 1 KB the driver reserves per block on sm_80+)
  rounded up to 128 B, against the SM's shared-memory capacity. This assumes the largest
  carveout; the driver picks a carveout per kernel and may pick a smaller one unless the
  kernel asks for max shared (cudaFuncAttributePreferredSharedMemoryCarveout).

A block that cannot launch at all (too many threads, registers or shared memory) raises
ValueError naming the parameter and the limit, rather than reporting zero blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .toolkit import device_properties

__all__ = ["ArchLimits", "ARCHS", "arch_limits", "Occupancy", "occupancy", "waves",
           "idle_sms", "DeviceLimits", "device_limits"]

KB = 1024


@dataclass(frozen=True)
class ArchLimits:
    """Per-SM resource limits of one compute capability."""

    arch: str
    max_threads_per_sm: int
    max_blocks_per_sm: int
    smem_per_sm: int                 # shared-memory capacity of an SM (largest carveout)
    smem_per_block_max: int          # opt-in maximum per block (above 48 KB needs the opt-in)
    max_threads_per_block: int = 1024
    warp_size: int = 32
    regs_per_sm: int = 64 * KB
    regs_per_block: int = 64 * KB
    max_regs_per_thread: int = 255
    reg_alloc_unit: int = 256        # registers, allocated per warp
    sub_partitions: int = 4
    smem_reserved_per_block: int = 1 * KB   # driver-reserved, sm_80 and later
    smem_alloc_unit: int = 128
    smem_per_block_default: int = 48 * KB   # without cudaFuncAttributeMaxDynamicSharedMemorySize

    @property
    def max_warps_per_sm(self) -> int:
        return self.max_threads_per_sm // self.warp_size


# Sources, per arch: the CUDA C++ Programming Guide, "Technical Specifications per Compute
# Capability" table (threads/blocks/warps per SM, 64K registers per SM and per block, 255
# registers per thread, shared memory per SM and per block), and cuda_occupancy.h for the
# allocation units (256 registers per warp, 4 sub-partitions, 128 B shared-memory unit,
# reservedSharedMemPerBlock = 1 KB from compute capability 8.0 on).
ARCHS = {
    # 8.0 (A100): 2048 threads, 32 blocks, 164 KB per SM, 163 KB per block.
    # Also the NVIDIA Ampere Tuning Guide, "Occupancy" and "Shared Memory".
    "sm_80": ArchLimits("sm_80", max_threads_per_sm=2048, max_blocks_per_sm=32,
                        smem_per_sm=164 * KB, smem_per_block_max=163 * KB),
    # 8.6 (GA10x): 1536 threads (48 warps), 16 blocks, 100 KB per SM, 99 KB per block.
    # Also the Ampere Tuning Guide: "48 ... for devices of compute capability 8.6".
    "sm_86": ArchLimits("sm_86", max_threads_per_sm=1536, max_blocks_per_sm=16,
                        smem_per_sm=100 * KB, smem_per_block_max=99 * KB),
    # 8.9 (Ada): 1536 threads, 24 blocks, 100 KB per SM, 99 KB per block.
    # Also the Ada Tuning Guide, "Occupancy": 24 thread blocks per SM.
    "sm_89": ArchLimits("sm_89", max_threads_per_sm=1536, max_blocks_per_sm=24,
                        smem_per_sm=100 * KB, smem_per_block_max=99 * KB),
    # 9.0 (H100/H200): 2048 threads, 32 blocks, 228 KB per SM, 227 KB per block.
    # Also the Hopper Tuning Guide, "Occupancy" and "Unified Shared Memory/L1/Texture Cache".
    "sm_90": ArchLimits("sm_90", max_threads_per_sm=2048, max_blocks_per_sm=32,
                        smem_per_sm=228 * KB, smem_per_block_max=227 * KB),
    # 10.0 (B200): 2048 threads (64 warps), 32 blocks, 228 KB per SM, 227 KB per block.
    # Programming Guide table, and the Blackwell Tuning Guide, "Occupancy" and "Unified
    # Shared Memory/L1/Texture Cache".
    "sm_100": ArchLimits("sm_100", max_threads_per_sm=2048, max_blocks_per_sm=32,
                         smem_per_sm=228 * KB, smem_per_block_max=227 * KB),
}


def arch_limits(arch) -> ArchLimits:
    """The limits of an arch name ('sm_90', '90', '9.0'), or an ArchLimits passed through."""
    if isinstance(arch, ArchLimits):
        return arch
    key = str(arch).strip().lower()
    if not key.startswith("sm_"):
        key = "sm_" + key.replace(".", "")
    try:
        return ARCHS[key]
    except KeyError:
        raise ValueError(f"unknown arch {arch!r}; known: {', '.join(ARCHS)}") from None


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


@dataclass(frozen=True)
class Occupancy:
    arch: str
    regs_per_thread: int
    threads_per_block: int
    smem_per_block: int
    blocks_per_sm: int
    limiter: str                     # "registers" | "warps" | "blocks" | "shared memory"
    limiters: tuple                  # every resource that allows exactly blocks_per_sm
    limits: dict                     # blocks/SM each resource alone allows
    warps_per_block: int
    active_warps: int
    max_warps: int
    regs_per_block: int              # as allocated (per-warp rounding applied)
    smem_allocated_per_block: int    # as allocated (reserved 1 KB and rounding applied)

    @property
    def fraction(self) -> float:
        """Active warps over the SM's warp slots."""
        return self.active_warps / self.max_warps

    def __str__(self) -> str:
        return (f"{self.blocks_per_sm} blocks/SM ({self.active_warps}/{self.max_warps} warps, "
                f"{self.fraction:.0%}), limited by {self.limiter}")


# Order decides which name a tie reports: the resources a kernel author can change first.
_LIMIT_ORDER = ("registers", "shared memory", "warps", "blocks")


def occupancy(arch, regs_per_thread: int, threads_per_block: int,
              smem_per_block: int = 0) -> Occupancy:
    """Blocks of (threads_per_block, regs_per_thread, smem_per_block bytes of static +
    dynamic shared memory) resident on one SM of `arch` (a name or an ArchLimits)."""
    a = arch_limits(arch)
    for name, value, low in (("regs_per_thread", regs_per_thread, 0),
                             ("threads_per_block", threads_per_block, 1),
                             ("smem_per_block", smem_per_block, 0)):
        if isinstance(value, bool) or int(value) != value or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if threads_per_block > a.max_threads_per_block:
        raise ValueError(f"threads_per_block={threads_per_block} exceeds the {a.arch} limit of "
                         f"{a.max_threads_per_block} threads per block")
    if regs_per_thread > a.max_regs_per_thread:
        raise ValueError(f"regs_per_thread={regs_per_thread} exceeds the {a.arch} limit of "
                         f"{a.max_regs_per_thread} registers per thread")
    if smem_per_block > a.smem_per_block_max:
        raise ValueError(
            f"smem_per_block={smem_per_block} B exceeds the {a.arch} limit of "
            f"{a.smem_per_block_max} B ({a.smem_per_block_max // KB} KB) per block")

    warps = -(-threads_per_block // a.warp_size)
    regs_per_warp = _round_up(regs_per_thread * a.warp_size, a.reg_alloc_unit)
    regs_per_block = regs_per_warp * warps
    # The hardware check assumes a block's warps spread over every sub-partition.
    if regs_per_warp * _round_up(warps, a.sub_partitions) > a.regs_per_block:
        spread = _round_up(warps, a.sub_partitions)
        raise ValueError(
            f"regs_per_thread={regs_per_thread} x threads_per_block={threads_per_block} needs "
            f"{regs_per_warp * spread} registers per block as the hardware checks it ({warps} "
            f"warps spread over {a.sub_partitions} sub-partitions count as {spread}, "
            f"{regs_per_warp} registers each); the {a.arch} limit is {a.regs_per_block} "
            "registers per block")

    if regs_per_warp:
        warps_per_sub = (a.regs_per_sm // a.sub_partitions) // regs_per_warp
        by_regs = warps_per_sub * a.sub_partitions // warps
    else:
        by_regs = a.max_blocks_per_sm
    smem_alloc = _round_up(smem_per_block + a.smem_reserved_per_block, a.smem_alloc_unit)
    by_smem = a.smem_per_sm // smem_alloc if smem_alloc else a.max_blocks_per_sm
    limits = {
        "registers": by_regs,
        "shared memory": by_smem,
        "warps": a.max_warps_per_sm // warps,
        "blocks": a.max_blocks_per_sm,
    }
    blocks = min(limits.values())
    limiters = tuple(name for name in _LIMIT_ORDER if limits[name] == blocks)
    return Occupancy(arch=a.arch, regs_per_thread=int(regs_per_thread),
                     threads_per_block=int(threads_per_block),
                     smem_per_block=int(smem_per_block), blocks_per_sm=blocks,
                     limiter=limiters[0], limiters=limiters, limits=limits, warps_per_block=warps,
                     active_warps=blocks * warps, max_warps=a.max_warps_per_sm,
                     regs_per_block=regs_per_block, smem_allocated_per_block=smem_alloc)


def waves(grid_blocks: int, blocks_per_sm: int, num_sms: int) -> float:
    """Grid blocks over resident slots: 0.73 means a partial first wave, 1.02 a tail wave."""
    if blocks_per_sm < 1 or num_sms < 1:
        raise ValueError(f"blocks_per_sm and num_sms must be >= 1, got {blocks_per_sm}, {num_sms}")
    return grid_blocks / (blocks_per_sm * num_sms)


def idle_sms(grid_blocks: int, num_sms: int) -> int:
    """SMs that get no block at all (one block per head: 96 blocks on 132 SMs leave 36 idle)."""
    return max(0, num_sms - grid_blocks)


@dataclass(frozen=True)
class DeviceLimits:
    """What the current device reports, next to the arch table's view of it."""

    name: str
    arch: str
    num_sms: int
    l2_bytes: int
    smem_per_sm: int
    smem_per_block_optin: int
    smem_per_block: int
    smem_reserved_per_block: int
    regs_per_sm: int
    max_threads_per_sm: int

    def arch_limits(self) -> ArchLimits:
        """The table's limits for this arch with the device's own shared-memory figures (the
        device wins where they differ); an arch the table lacks raises ValueError."""
        return replace(arch_limits(self.arch), smem_per_sm=self.smem_per_sm,
                       smem_per_block_max=self.smem_per_block_optin,
                       smem_reserved_per_block=self.smem_reserved_per_block)


def device_limits(device_id: int | None = None) -> DeviceLimits:
    """SM count, L2 size and shared-memory limits of a CUDA device (toolkit.device_properties).

    Raises RuntimeError (toolkit.NoDeviceError) when CuPy or a device is missing, saying which."""

    d = device_properties(device_id)
    return DeviceLimits(
        name=d["name"], arch=d["arch"], num_sms=d["sms"], l2_bytes=d["l2_bytes"],
        smem_per_sm=d["smem_per_sm"], smem_per_block_optin=d["smem_per_block_optin"],
        smem_per_block=d["smem_per_block"], smem_reserved_per_block=d["smem_reserved_per_block"],
        regs_per_sm=d["regs_per_sm"], max_threads_per_sm=d["max_threads_per_sm"],
    )
