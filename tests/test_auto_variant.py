"""`variant="auto"` of the paged step (sandbox/auto_variant.py): the rule, on the shapes its
thresholds were measured at (no GPU needed; test_gpu_wgmma.py runs it on the device)."""
from __future__ import annotations

import pytest

from mlasandbox.auto_variant import (LARGE_STEP, WGMMA_MIN_LENGTH, AutoFacts, auto_choice,
                                     auto_name)
from mlasandbox.dims import Dims
from mlasandbox.paged import PagedShape


def h200(batch, max_len, q16=True):
    return AutoFacts("sm_90", q16, batch, max_len)


# (batch, room, heads, s_q) -> what won on the H200 (docs/wgmma-deep-dive.md's crossover
# table, us, mma16 / mma32 / wgmma64)
@pytest.mark.parametrize("batch, room, heads, s_q, want", [
    (1, 64, 128, 1, "mma16"),         # 11.8 / 18.4 / 22.5
    (1, 4096, 128, 1, "mma16"),       # 23.1 / 24.3 / 30.7
    (1, 8192, 128, 1, "mma16"),       # 30.5 / 30.4 / 30.5: a tie
    (2, 4096, 128, 1, "mma16"),       # 29.7 / 31.4 / 31.1
    (8, 1024, 128, 1, "mma16"),       # 30.5 / 30.9 / 32.5
    (1, 16384, 64, 1, "mma16"),       # 29.6 / 31.9 / 33.7
    (1, 32768, 32, 1, "mma16"),       # 30.7 / 34.4 / 36.4
    (1, 16384, 128, 1, "wgmma64"),    # 45.2 / 42.2 / 36.2
    (4, 4096, 128, 1, "wgmma64"),     # - / 43.5 / 35.6
    (128, 4096, 128, 1, "wgmma64"),   # 970 / 800 / 255
    (128, 4096, 128, 2, "wgmma64"),   # s_q 2
    (1, 131072, 64, 1, "wgmma64"),    # - / 115.9 / 66.8
    (1, 131072, 32, 1, "wgmma64"),    # - / 71.7 / 64.4
    (32, 512, 128, 1, "mma32"),       # 45.4 / 41.1 / 54.1: large, short requests
    (1, 131072, 16, 1, "mma16"),      # 16 rows: mma16 whatever the size
    (128, 4096, 4, 4, "mma16"),
])
def test_auto_picks_what_won_on_the_h200(batch, room, heads, s_q, want):
    assert auto_name(s_q, heads, h200(batch, room)) == want


def test_auto_keeps_the_mma_kernels_where_wgmma64_cannot_run():
    big = (128, 4096)
    assert auto_name(1, 128, h200(*big)) == "wgmma64"          # the control: it would
    assert auto_name(1, 128, h200(*big, q16=False)) == "mma32"  # f32 q
    for arch in ("sm_80", "sm_89", "sm_100"):                 # no wgmma.mma_async
        assert auto_name(1, 128, AutoFacts(arch, True, *big)) == "mma32", arch
        assert auto_name(1, 128, AutoFacts(arch, True, 1, 64)) == "mma16", arch
    assert auto_name(1, 128) == "mma32"                        # no device facts
    assert auto_name(1, 128, h200(1, 64, q16=False)) == "mma32"  # f32 q: not measured


def test_the_thresholds_are_inclusive_and_both_bind():
    rows = 128
    at = LARGE_STEP // rows                      # room of one request at the large step
    assert at >= WGMMA_MIN_LENGTH
    assert auto_name(1, rows, h200(1, at)) == "wgmma64"
    assert auto_name(1, rows, h200(1, at - 64)) == "mma16"
    # the length threshold alone: a batch far over the large step, requests too short
    short = WGMMA_MIN_LENGTH - 64
    assert rows * short * 1000 >= LARGE_STEP
    assert auto_name(1, rows, h200(1000, short)) == "mma32"
    assert auto_name(1, rows, h200(1000, WGMMA_MIN_LENGTH)) == "wgmma64"


def test_facts_from_a_shape_and_from_host_lengths():
    shape = PagedShape(batch=3, s_q=1, num_pages=10, page_size=64, max_pages=70,
                       dims=Dims(n_head=128), cache_dtype="bf16", q_dtype="bf16",
                       has_wv_b=False)
    assert AutoFacts.of(shape, "sm_90") == AutoFacts("sm_90", True, 3, 70 * 64)
    f32 = PagedShape(**{**shape.__dict__, "q_dtype": "f32"})
    assert not AutoFacts.of(f32, "sm_90").q_in_cache_dtype
    # the table make_paged_inputs builds: room for the longest request, at least a page
    assert AutoFacts.of_lengths([100, 4097, 0], 64, "f16", "f16") == \
        AutoFacts("sm_90", True, 3, 65 * 64)
    assert AutoFacts.of_lengths([0, 0], 16, "f32", "f16").max_len == 16


def test_the_reason_names_the_branch_that_chose():
    # what the CLI prints after "auto -> NAME": the condition that decided, with its numbers
    big = (128, 4096)
    for facts, want, words in (
            (None, "mma32", "no device facts"),
            (h200(*big), "wgmma64", f"batch 128 = 67,108,864 >= {LARGE_STEP:,}"),
            (h200(*big, q16=False), "mma32", "q not in the cache dtype"),
            (AutoFacts("sm_80", True, *big), "mma32", "on sm_80, where wgmma64 cannot run"),
            (h200(1000, WGMMA_MIN_LENGTH - 64), "mma32", f"under {WGMMA_MIN_LENGTH} positions"),
            (h200(1, 64), "mma16", f"a small step: 128 rows x 64 positions of room x batch 1 "
                                   f"= 8,192 < {LARGE_STEP:,}")):
        name, why = auto_choice(1, 128, facts)
        assert (name, name) == (want, auto_name(1, 128, facts)) and words in why, (facts, why)
    assert auto_choice(2, 8, h200(*big)) == ("mma16", "16 query rows, at most 16 (a 64-row "
                                                      "wgmma64 tile: most padding)")
