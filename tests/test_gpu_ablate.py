"""The memory ablation on the device: the ablated build is another kernel (its results
differ from the real one's), the real kernel is still right after the ablated one ran (the
two builds never share a cache entry), and a context with nothing to ablate is refused.
No timing is asserted: speed is shown by benchmarks, not by tests."""
from __future__ import annotations

import pytest

from gpu_support import device_inputs, fresh_seed, gpu, run_poisoned
from mlasandbox import reference
from mlasandbox.ablate import ablate, ablate_paged
from mlasandbox.api import DecodeStep
from mlasandbox.compare import compare
from mlasandbox.dims import Dims

pytestmark = gpu

SHORT = {"warmup": 1, "min_repeats": 3, "max_repeats": 5, "target_s": 0.005}


@pytest.mark.parametrize("variant", ["per_head", "split", "batched16", "tiled16", "mma16",
                                     "mma32"])
def test_the_ablated_kernel_is_another_kernel_and_the_real_one_stays_right(variant):
    dims = Dims(n_head=16)
    seed = fresh_seed()
    res = ablate(variant, dims, 20000, rounds=2, seed=seed, timing_kw=SHORT)
    # reusing the first tiles' rows for all 20000 is far from the real attention (inf where
    # the spare buffer's score partials were read as cache rows)
    assert res.output_change > 1e-2, (seed, res)
    assert res.real_us > 0 and res.ablated_us > 0 and 0.0 <= res.share < 1.0
    assert len(res.floor.a_us) == 2
    inp, seed = device_inputs(dims, 20000)
    step = DecodeStep(**inp.decode_args(), variant=variant)
    cmp = compare(run_poisoned(step), reference.decode(**inp.decode_args()))
    assert cmp.ok, f"{variant} after its ablation, seed={seed}\n{cmp.summary()}"


@pytest.mark.parametrize("variant,n_ctx", [("per_head", 32), ("mma16", 100)])
def test_a_context_that_fits_the_stage_buffers_has_nothing_to_ablate(variant, n_ctx):
    # per_head: one 32-row tile in its one buffer; mma16 (below the split gate, one slice):
    # 100 rows in its two 64-row buffers. The ablated build loads what the real one does.
    with pytest.raises(ValueError, match="ablate a longer context"):
        ablate(variant, Dims(n_head=16), n_ctx, rounds=2, timing_kw=SHORT)


@pytest.mark.parametrize("variant, q", [("mma16", "f32"), ("split", "f32"), ("wgmma64", "f16")])
def test_the_paged_ablation_is_another_kernel_on_the_paged_step(variant, q):
    # requests long enough that their chunks outgrow two tiles, one of them empty
    seed = fresh_seed()
    res = ablate_paged(variant, Dims(n_head=16), [20000, 0, 9000], page_size=16, s_q=2,
                       causal=True, q=q, rounds=2, seed=seed, timing_kw=SHORT)
    assert res.output_change > 1e-2, (seed, res)
    assert res.real_us > 0 and res.ablated_us > 0 and 0.0 <= res.share < 1.0
    assert res.paged["batch"] == 3 and res.kernel.endswith("paged=true>")


def test_a_paged_batch_that_fits_the_stage_buffers_has_nothing_to_ablate():
    with pytest.raises(ValueError, match="ablate longer requests"):
        ablate_paged("mma16", Dims(n_head=16), [100, 30], page_size=64, rounds=2,
                     timing_kw=SHORT)
