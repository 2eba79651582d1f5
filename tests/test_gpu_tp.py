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


def check_against_reference(j, report):
    # Tolerances: the project's f32 relL2 on out (compare.DEFAULT_TOLERANCE); y by the
    # f32 GEMM bound of tp_bench.check_y.
    host = j.host_inputs()
    ref = decode_paged(host["q"], host["kv_cache"], host["block_table"],
                       host["cache_seqlens"], host["wv_b"], causal=j.causal)
    assert rel_l2(report["out"], ref.out) <= DEFAULT_TOLERANCE.out, f"seed {j.seed}"
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
