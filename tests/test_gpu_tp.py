"""Tensor parallelism on the device: world size 1 through the real NCCL engines (one GPU is
enough for that), the planted fault located on the device, and two devices in one process
(skipped, with the reason, where fewer than two are visible)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from gpu_support import fresh_seed, gpu
from mlasandbox.compare import DEFAULT_TOLERANCE, rel_l2
from mlasandbox.dims import Dims
from mlasandbox.reference import decode_paged
from mlasandbox.tp_bench import check_y
from mlasandbox.tp_comm import NO_MULTICAST_ENV, engine_available, resolve_engine, visible_gpus
from mlasandbox.tp_launch import TPJob, launch
from mlasandbox.tp_rank import make_w_o

pytestmark = gpu


def job(engine, **kw):
    # Mixed lengths (empty, one position, across pages, many chunks), 20 heads: mma32
    return TPJob(**({"dims": Dims(n_head=20), "lengths": (0, 1, 300, 5000), "seed":
                     fresh_seed(), "engine": engine, "executor": "gpu", "d_model": 512}
                    | kw))


def check_against_reference(j, report, tol=DEFAULT_TOLERANCE.out):
    # Tolerances: the project's f32 relL2 on out (compare.DEFAULT_TOLERANCE), or the bound of
    # a variant that rounds p (bench_gpu.tolerance_for); y by the f32 GEMM bound of
    # tp_bench.check_y.
    host = j.host_inputs()
    ref = decode_paged(host["q"], host["kv_cache"], host["block_table"],
                       host["cache_seqlens"], host["wv_b"], causal=j.causal)
    assert rel_l2(report["out"], ref.out) <= tol, f"seed {j.seed}"
    w = make_w_o(j.dims.n_head, j.dims.v_head, j.d_model, seed=j.seed)
    assert check_y(report["y"], report["out"], w)["ok"], f"seed {j.seed}"


def need(engine):
    ok, why = engine_available(engine)
    if not ok:
        pytest.skip(f"engine {engine}: {why}")


@pytest.mark.parametrize("engine", ["cupy", "torch"])
def test_world_size_1_through_the_real_nccl_engine(engine):
    need(engine)
    j = job(engine)
    run = launch(j, 1, gpus=visible_gpus(), timeout_s=240)
    assert run.ok, run.reports
    r = run.reports[0]
    assert r["engine"] == engine and r["env"] == NO_MULTICAST_ENV and r["buffers_on"] == [0]
    check_against_reference(j, r)


def test_a_fault_in_the_attention_kernel_is_located_on_the_device():
    try:
        engine = resolve_engine("auto")
    except RuntimeError as exc:
        pytest.skip(str(exc))
    run = launch(job(engine, fault_rank=0, lengths=(700,)), 1, gpus=visible_gpus(),
                 timeout_s=240)
    (r,) = run.failures()
    assert r["rank"] == 0 and r["phase"] == "attn", r
    assert "illegal" in r["error"].lower()
    assert r["launch"]["grid"] == r["plans"]["band"]["grid"]


def test_two_devices_in_one_process_keep_each_steps_buffers_on_its_own_device():
    n = visible_gpus()
    if n < 2:
        pytest.skip(f"needs 2 GPUs in one process, {n} visible")
    j = job("fake", budgets=("band", "unsharded"))
    run = launch(j, 2, mode="thread", gpus=n, timeout_s=240)
    assert run.ok, run.reports
    assert [r["buffers_on"] for r in run.reports] == [[0], [1]]
    check_against_reference(j, run.reports[0])
    one = launch(replace(j, budgets=("band",)), 1, mode="thread", gpus=n)
    assert rel_l2(run.reports[0]["out"], one.reports[0]["out"]) <= 2 * DEFAULT_TOLERANCE.out


def test_auto_on_a_rank_runs_what_one_gpu_runs_for_the_band():
    """A band of 64 of 128 heads, q f16, 4 requests of 8192: 64 rows x 8192 x 4 = 2^21, a
    large step (wgmma64 on an H200, where the rows alone would say mma32). The rank resolves
    auto with its device's facts as a single-GPU step of the same heads does; its unsharded
    budget is the plan of all 128 heads on one GPU."""
    import cupy

    from mlasandbox.bench_gpu import tolerance_for
    from mlasandbox.paged_api import PagedDecodeStep
    from mlasandbox.toolkit import arch_of_device
    from mlasandbox.tp import head_bands
    from mlasandbox.tp_comm import FakeCommunicator
    from mlasandbox.tp_rank import TensorParallelStep, band_view

    j = job("fake", dims=Dims(n_head=128), lengths=(8192,) * 4, q_dtype="f16")
    host = j.host_inputs()
    shared = [cupy.asarray(host[k]) for k in ("kv_cache", "block_table", "cache_seqlens")]
    q, wv_b = (cupy.asarray(a) for a in band_view(head_bands(128, 2)[0], host["q"],
                                                 host["wv_b"])[:2])
    one = PagedDecodeStep(q, *shared, wv_b, variant="auto")
    rank = TensorParallelStep(FakeCommunicator(0, 2, None, "/nonexistent"), q, *shared, wv_b,
                              n_head=128, budget="unsharded")
    assert rank.variant == one.variant.name == rank.step.variant.name
    if arch_of_device() == "sm_90":
        assert rank.variant == "wgmma64"
    full = PagedDecodeStep(cupy.asarray(host["q"]), *shared, cupy.asarray(host["wv_b"]),
                           variant="auto")
    assert rank.plan.max_chunks == full.plan.max_chunks, (rank.plan, full.plan)

    # the whole step of those 64 heads on one rank, against the float64 reference within
    # the tolerance of the variant it ran
    j64 = replace(j, dims=Dims(n_head=64))
    run = launch(j64, 1, mode="thread", gpus=visible_gpus(), timeout_s=240)
    assert run.ok, run.reports
    assert run.reports[0]["plans"]["band"]["variant"] == rank.variant
    check_against_reference(j64, run.reports[0], tolerance_for(rank.variant, "f16").out)
