"""Occupancy is a step function of registers and shared memory (the register wall), and a
block that cannot launch is refused by name."""
from __future__ import annotations

import pytest

from mlasandbox.occupancy import (ARCHS, arch_limits, device_limits, idle_sms, occupancy,
                                  waves)
from mlasandbox.registry import (ATTN_THREADS, HPB_VALUES, attn_instance, attn_smem_bytes,
                                 rows_smem_bytes)
from mlasandbox.splits import plan_splits


@pytest.mark.parametrize("regs, blocks", [(96, 2), (125, 2), (148, 1)])
def test_the_register_wall_at_256_threads(regs, blocks):
    o = occupancy("sm_90", regs, 256, 0)
    assert o.blocks_per_sm == blocks
    assert o.limiter == "registers"
    assert o.active_warps == 8 * blocks


def test_the_register_step_is_where_the_allocation_unit_says():
    # 256 threads = 8 warps, 2 per sub-partition. A sub-partition holds 16384 registers:
    # 2 blocks need 4 warps each <= 4096 regs, i.e. <= 128 regs/thread. One more register
    # rounds a warp up to 4352 regs and halves the resident blocks.
    assert occupancy("sm_90", 128, 256).blocks_per_sm == 2
    assert occupancy("sm_90", 129, 256).blocks_per_sm == 1
    # the 256-register warp granularity: 121..128 regs all allocate 4096 per warp
    assert {occupancy("sm_90", r, 256).regs_per_block for r in range(121, 129)} == {8 * 4096}


@pytest.mark.parametrize("hpb, regs, blocks", [(8, 96, 2), (12, 125, 2), (16, 148, 1)])
def test_the_register_wall_table_with_the_kernels_shared_memory(hpb, regs, blocks):
    o = occupancy("sm_90", regs, ATTN_THREADS, attn_smem_bytes(hpb))
    assert o.blocks_per_sm == blocks, o


def test_shared_memory_limits_at_the_two_block_boundary():
    # 115344 B and 129216 B: attn<12> and attn<16> when the cross-warp score partials had a
    # buffer of their own. On sm_90 (228 KB/SM) the first fits twice, the second once.
    at12 = occupancy("sm_90", 64, ATTN_THREADS, 115344)
    at16 = occupancy("sm_90", 64, ATTN_THREADS, 129216)
    assert (at12.blocks_per_sm, at12.limiter) == (2, "shared memory")
    assert (at16.blocks_per_sm, at16.limiter) == (1, "shared memory")
    # the 1 KB reserve and the 128 B unit are part of the arithmetic
    assert at12.smem_allocated_per_block == 116480
    # on a 100 KB-per-SM part, that block does not even fit once
    with pytest.raises(ValueError, match="smem_per_block"):
        occupancy("sm_89", 64, ATTN_THREADS, 115344)


@pytest.mark.parametrize("hpb", HPB_VALUES)
def test_shared_memory_fits_two_blocks_up_to_hpb_16_and_one_above(hpb):
    # Shared memory is O(head dims + tile), never O(n_ctx). Up to HPB 16 it leaves room for
    # two blocks per SM on sm_90 (registers then decide); HPB 24's q alone is 55 KB, and the
    # block stands alone on its SM: the occupancy step the HPB sweep shows. HPB 1 (attn_rows,
    # one tile) leaves room for six.
    inst = attn_instance(hpb)
    o = occupancy("sm_90", 64, inst.threads, inst.smem_bytes)
    if hpb == 1:
        assert o.limits["shared memory"] == 6, (inst.smem_bytes, o)
    elif hpb <= 16:
        assert o.limits["shared memory"] >= 2, (hpb, inst.smem_bytes, o)
    else:
        assert o.limits["shared memory"] == 1, (hpb, inst.smem_bytes, o)


def test_attn_rows_needs_80_registers_for_its_six_blocks():
    # 6 blocks of 4 warps: 24 warps, 6 per sub-partition, 16384 / 6 / 32 = 85 registers, in
    # units of 8: 80 fits, 88 leaves room for 5 (the launch bounds ask for 6).
    assert occupancy("sm_90", 80, 128, rows_smem_bytes()).blocks_per_sm == 6
    assert occupancy("sm_90", 88, 128, rows_smem_bytes()).blocks_per_sm == 5


def test_the_reserved_kilobyte_decides_the_last_block():
    # 228 KB / 2 = 116736 B per block: 2 blocks fit only while smem + 1 KB, rounded to
    # 128 B, stays within it.
    limit = 114 * 1024 - 1024
    assert occupancy("sm_90", 32, 128, limit).limits["shared memory"] == 2
    assert occupancy("sm_90", 32, 128, limit + 1).limits["shared memory"] == 1


def test_warps_and_block_slots_limit_small_kernels():
    big = occupancy("sm_90", 16, 1024, 0)
    assert (big.blocks_per_sm, big.limiter, big.fraction) == (2, "warps", 1.0)
    # at 32 registers both registers and warps allow exactly 2: a tie names both
    tie = occupancy("sm_90", 32, 1024, 0)
    assert tie.blocks_per_sm == 2 and set(tie.limiters) == {"registers", "warps"}
    assert tie.limiter == "registers"  # a tie names the first of _LIMIT_ORDER
    tiny = occupancy("sm_90", 16, 32, 0)
    assert (tiny.blocks_per_sm, tiny.limiter) == (32, "blocks")
    assert occupancy("sm_86", 16, 32, 0).blocks_per_sm == 16
    assert occupancy("sm_89", 16, 32, 0).blocks_per_sm == 24
    assert occupancy("sm_86", 32, 1024, 0).blocks_per_sm == 1  # 48 warps per SM
    assert occupancy("sm_89", 32, 1024, 0).blocks_per_sm == 1  # 48 warps per SM too
    assert occupancy("sm_89", 16, 512, 0).blocks_per_sm == 3   # 1536 threads
    assert tiny.fraction == pytest.approx(32 / 64)


@pytest.mark.parametrize("args, match", [
    (("sm_90", 32, 1025, 0), "threads_per_block=1025 .* 1024"),
    (("sm_90", 256, 128, 0), "regs_per_thread=256 .* 255"),
    (("sm_90", 255, 1024, 0), "65536 registers per block"),
    (("sm_90", 32, 256, 227 * 1024 + 1), "232448 B \\(227 KB\\)"),
    (("sm_86", 32, 256, 99 * 1024 + 1), "99 KB"),
    (("sm_80", 32, 256, 163 * 1024 + 1), "163 KB"),
    (("sm_75", 32, 256, 0), "unknown arch"),
    (("sm_90", 32, 0, 0), "threads_per_block must be an integer >= 1"),
])
def test_a_block_that_cannot_launch_is_refused_by_name(args, match):
    with pytest.raises(ValueError, match=match):
        occupancy(*args)


def test_the_largest_block_that_fits_is_accepted():
    assert occupancy("sm_90", 32, 256, 227 * 1024).blocks_per_sm == 1
    assert occupancy("sm_90", 64, 1024, 0).blocks_per_sm == 1  # exactly 65536 registers


def test_arch_names_and_tables():
    assert arch_limits("9.0") is arch_limits("sm_90") is arch_limits("90")
    for name, a in ARCHS.items():
        assert a.arch == name
        assert a.max_warps_per_sm in (48, 64)
        assert a.smem_per_block_max < a.smem_per_sm  # the 1 KB the driver keeps
    assert arch_limits("sm_100").smem_per_sm == 228 * 1024


def test_waves_and_idle_sms_name_the_one_block_per_head_bug():
    # 96 heads, one block each, on a 132-SM H200: 36 SMs get nothing.
    assert idle_sms(96, 132) == 36
    assert waves(96, 1, 132) == pytest.approx(96 / 132)
    assert idle_sms(96 * 16, 132) == 0
    plan = plan_splits(131072, 96, 12, num_sms=132, blocks_per_sm=2)
    assert waves(plan.blocks, 2, 132) == pytest.approx(plan.waves)
    assert idle_sms(plan.blocks, 132) == plan.idle_sms
    with pytest.raises(ValueError):
        waves(10, 0, 132)


def test_device_limits_reads_the_device_or_says_there_is_none():
    try:
        import cupy

        cupy.zeros(1)
        has_device = True
    except Exception:
        has_device = False
    if not has_device:
        with pytest.raises(RuntimeError, match="CUDA device"):
            device_limits()
        return
    d = device_limits()
    assert d.arch.startswith("sm_") and d.num_sms > 0 and d.l2_bytes > 0
    assert d.smem_per_block_optin <= d.smem_per_sm
    if d.arch in ARCHS:
        table = ARCHS[d.arch]
        assert (d.smem_per_sm, d.smem_per_block_optin) == (table.smem_per_sm,
                                                           table.smem_per_block_max)
        assert d.arch_limits().smem_per_sm == d.smem_per_sm


def test_mma_score_partials_reuse_q_staging_buffer_and_fit_one_block_per_sm():
    # Once each warp holds its k-group's q fragments in registers, q's staging buffer takes
    # the four k-groups' score partials ([4][heads][64 + 8] f32, smaller than q's hi/lo
    # halves), so neither variant needs a buffer for them and both issue the next tile's copy
    # before the scores. mma32 is within 3 KB of what a Hopper block may use.
    # (mma_smem_bytes itself is checked against MmaSmem by the compile: test_kernel_facts.py)
    from mlasandbox.registry import MMA_SCORE_KGROUPS, MMA_TILE, mma_smem_bytes
    block_max = arch_limits("sm_90").smem_per_block_max
    for heads in (16, 32):
        q_halves = 2 * heads * 576 * 2
        partials = MMA_SCORE_KGROUPS * heads * (MMA_TILE + 8) * 4
        assert partials < q_halves
    assert block_max - 3 * 1024 < mma_smem_bytes(32) <= block_max
    for heads in (16, 32):
        o = occupancy("sm_90", 128, 256, mma_smem_bytes(heads))
        assert o.blocks_per_sm == 1, (heads, o)


def test_the_paged_ladder_is_judged_against_itself_not_the_batch_one_rows():
    """resource_rows marks an occupancy step only against the previous heads-per-block row of
    the same launch: the paged rows open a ladder of their own."""
    from types import SimpleNamespace

    from mlasandbox import geometry

    insts = geometry.instances_for((1, 2), ("f16",), ("f32",), False, ("attn_rows", "attn"))
    assert any(i.paged for i in insts) and any(not i.paged for i in insts)

    def fake(inst):  # the paged rows take 120 KB of static smem more: one block per SM
        return SimpleNamespace(registers=32, spill_stores=0, spill_loads=0, stack_bytes=0,
                               smem_bytes=120_000 if inst.paged else 0, cmem0_bytes=0,
                               barriers=1, code_bytes=4096)

    rows = geometry.resource_rows(hpbs=(1, 2), caches=("f16",), q_dtypes=("f32",),
                                  controls=False, kinds=("attn_rows", "attn"),
                                  report={i.name: fake(i) for i in insts})
    first_paged = next(r for r in rows if r["name"].endswith("paged=true>"))
    last_batch_one = rows[rows.index(first_paged) - 1]
    assert first_paged["blocks_per_sm"] < last_batch_one["blocks_per_sm"]
    assert not first_paged["step"]


def test_registers_are_shared_out_per_sub_partition():
    # sm_90: 65536 registers an SM in 4 sub-partitions of 16384; a warp of 88-register
    # threads takes 88 x 32 = 2816 (a multiple of the 256-register unit). A sub-partition
    # holds 16384 // 2816 = 5 such warps, so 4 x 5 = 20 one-warp blocks, where the SM's file
    # as one pool would say 65536 // 2816 = 23.
    assert occupancy("sm_90", 88, 32).blocks_per_sm == 20
    # 10 warps of 192-register threads (6144 each) land 3 on some sub-partition: 3 x 6144 =
    # 18432 > 16384, so the block cannot launch, though 10 x 6144 = 61440 fits in 65536.
    with pytest.raises(ValueError, match="10 warps spread over 4 sub-partitions count as 12"):
        occupancy("sm_90", 192, 320)
