"""The launch guard, bad input, and the compile-time reports checked against the device.

Faults that corrupt the CUDA context (an out-of-bounds access, a trap) are sticky for the
whole process, so those tests run their kernel in a subprocess and read its error message.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from gpu_support import device_inputs, gpu, poison
from mlasandbox import registry
from mlasandbox.dims import Dims

pytestmark = gpu


def run_script(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300)


def test_an_oversized_launch_is_reported_at_its_phase():
    from mlasandbox.api import DecodeStep
    from mlasandbox.guard import PhaseError

    inp, _ = device_inputs(Dims(n_head=16), 100)
    step = DecodeStep(**inp.decode_args(), variant="split")
    step.run()
    p = step.plan
    with pytest.raises(PhaseError) as err:  # grid.y past 65535: the driver refuses the launch
        step.guard.launch("attn", step.attn_kernel, (p.head_blocks, 70000, 1), (256, 1, 1),
                          (), smem_bytes=step.attn_inst.smem_bytes,
                          kernel_name=step.attn_inst.name)
    msg = str(err.value)
    assert "phase 'attn'" in msg and f"grid ({p.head_blocks}, 70000, 1)" in msg
    assert "variant 'split'" in msg and "CUDA_ERROR_INVALID_VALUE" in msg
    # the error was raised at launch and is not sticky: the next phase runs clean
    step.run_combine()


def test_the_launcher_rejects_a_grid_the_device_cannot_run_before_launching():
    from mlasandbox.api import DecodeStep

    inp, _ = device_inputs(Dims(n_head=16), 100)
    with pytest.raises(ValueError,
                       match=r"splits must be <= 65,535 \(the grid's y dimension.*got 70,000"):
        DecodeStep(**inp.decode_args(), variant="split", splits=70000)


OOB_SCRIPT = """
import cupy, numpy as np
from mlasandbox.guard import PhaseGuard, PhaseError
bad = cupy.RawKernel(r'''
extern "C" __global__ void planted_oob(float* p) { p[threadIdx.x + (1ll << 38)] = 1.f; }
''', 'planted_oob')
good = cupy.ElementwiseKernel('float32 x', 'float32 y', 'y = x + 1', 'good')
guard = PhaseGuard('planted', sync_check={sync})
buf = cupy.zeros(32, cupy.float32)
try:
    with guard.phase('q_absorb'):
        good(buf, buf)
    guard.launch('attn', bad, (1, 1, 1), (32, 1, 1), (buf,), kernel_name='planted_oob')
    with guard.phase('combine'):
        good(buf, buf)
    with guard.phase('after'):
        cupy.cuda.get_current_stream().synchronize()
    print('NO ERROR')
except PhaseError as e:
    print('PHASE', e.phase)
    print(e)
"""


def test_an_out_of_bounds_kernel_is_reported_at_its_own_phase_with_sync_check():
    r = run_script(OOB_SCRIPT.replace("{sync}", "True"))
    assert "PHASE attn" in r.stdout, r.stdout + r.stderr
    assert "planted_oob" in r.stdout and "illegal" in r.stdout.lower()


def test_without_sync_check_the_fault_surfaces_at_a_later_checkpoint():
    """Why --sync-check exists: the default poll does not wait, so the asynchronous fault is
    caught by the first guard that finds it finished, which need not be its own phase."""
    r = run_script(OOB_SCRIPT.replace("{sync}", "False"))
    assert "PHASE" in r.stdout, r.stdout + r.stderr  # caught by some guard, never silent
    assert "NO ERROR" not in r.stdout


@pytest.mark.parametrize("variant", ["batched12", "tiled16", "mma16"])
def test_a_launch_with_too_little_shared_memory_traps_instead_of_computing_garbage(variant):
    """The kernel's own check (mla_common.cuh, require_dynamic_smem: __trap() where the
    dynamic shared memory is short, before any of it is touched) stops it. The error is the
    trap's, cudaErrorLaunchFailure, "unspecified launch failure" (CUDA_ERROR_LAUNCH_FAILED
    from the driver API), and no illegal address or instruction: a kernel that ran on with
    wrong offsets into global memory would raise "an illegal memory access was encountered".
    (CUDA reports an out-of-range shared-memory access as a launch failure too: the name
    alone does not tell that one from the trap.)"""
    r = run_script("""
        import numpy as np, cupy
        from mlasandbox.api import DecodeStep
        from mlasandbox.inputs import make_inputs
        from mlasandbox.dims import Dims
        from mlasandbox.guard import PhaseError
        inp = make_inputs(Dims(n_head=12), 100, 100, xp=cupy, seed=1)
        step = DecodeStep(**inp.decode_args(), variant='{variant}', sync_check=True)
        p = step.plan
        try:
            step.guard.launch('attn', step.attn_kernel, p.grid + (1,), (step.attn_inst.threads, 1, 1),
                (step.q, step.cache, np.int32(12), np.int32(100), np.int32(p.splits),
                 np.float32(0.1), step.part_acc, step.part_m, step.part_l, step.latent, step.lse),
                smem_bytes=step.attn_inst.smem_bytes - 1024, kernel_name=step.attn_inst.name)
            print('NO ERROR')
        except PhaseError as e:
            print('PHASE', e.phase)
            print(e)
    """.replace("{variant}", variant))
    assert "PHASE attn" in r.stdout, r.stdout + r.stderr
    assert "unspecified launch failure" in r.stdout, r.stdout + r.stderr
    assert "illegal" not in r.stdout.lower(), r.stdout + r.stderr


def _inputs(**over):
    import cupy

    inp, _ = device_inputs(Dims(n_head=12), 64)
    args = inp.decode_args()
    args.update(over)
    return args, cupy


@pytest.mark.parametrize("mutate, match", [
    (lambda a, cp: {"q": a["q"][:, :500]}, r"q must be \[n_head=12, kv_lora\+rope=576\]"),
    (lambda a, cp: {"cache": a["cache"][:, :500]}, r"cache rows \(500\) are shorter than"),
    (lambda a, cp: {"q": cp.concatenate([a["q"], a["q"][:, :8]], axis=1)},
     r"q must be \[n_head=12, kv_lora\+rope=576\]"),
    (lambda a, cp: {"q": a["q"][:5]}, "wv_b must be"),
    (lambda a, cp: {"cache": a["cache"].astype(cp.float32)}, "cache must be float16 or bfloat16"),
    (lambda a, cp: {"q": a["q"].astype(cp.float64)}, "dtype float64 is not supported"),
    (lambda a, cp: {"wv_b": a["wv_b"].view(cp.uint16)}, "wv_b must have the cache dtype"),
    (lambda a, cp: {"n_ctx": 72}, r"n_ctx must be in 1..N_alloc=71"),
    (lambda a, cp: {"n_ctx": 0}, r"n_ctx must be in 1..N_alloc"),
    (lambda a, cp: {"scale": float("nan")}, "scale must be finite"),
    (lambda a, cp: {"cache": cp.asfortranarray(a["cache"])}, "cache must be C-contiguous"),
    (lambda a, cp: {"q": cp.asfortranarray(a["q"])}, "q must be C-contiguous"),
    (lambda a, cp: {"q": cp.asnumpy(a["q"])}, "q must be a CuPy array"),
])
def test_bad_input_is_rejected_before_any_launch(mutate, match):
    from mlasandbox.api import DecodeStep

    args, cp = _inputs()
    args.update(mutate(args, cp))
    with pytest.raises((ValueError, TypeError), match=match):
        DecodeStep(**args, variant="batched12")


def test_unknown_variant_and_uninstantiated_hpb_are_rejected():
    from mlasandbox.api import DecodeStep

    args, _ = _inputs()
    with pytest.raises(ValueError, match="unknown variant 'nope'; known: per_head, split"):
        DecodeStep(**args, variant="nope")
    with pytest.raises(ValueError,
                       match=r"heads_per_block must be one of 1, 2, 4, 8, 12, 16, 24 \(the "):
        DecodeStep(**args, variant="batched", heads_per_block=6)
    with pytest.raises(ValueError, match="use variant batched with heads_per_block=4"):
        DecodeStep(**args, variant="split", heads_per_block=4)


def test_ptxas_registers_match_the_loaded_kernels_and_the_driver_occupancy():
    """-Xptxas -v through NVRTC (no GPU needed) agrees with RawKernel.num_regs, and the
    occupancy model agrees with the driver's occupancy API."""
    from mlasandbox.kernels import blocks_per_sm, device_info, get_kernel
    from mlasandbox.occupancy import occupancy
    from mlasandbox.ptxas import ptxas_report

    arch = device_info().arch
    insts = [registry.attn_instance(h, "f16", "f32") for h in registry.HPB_VALUES]
    insts += [registry.tiled_instance(16, "f16", "f32"),
              registry.mma_instance(16, "f16", "f32"), registry.mma_instance(32, "f16", "f32"),
              registry.combine_instance("f16"),
              registry.q_absorb_instance("f16", "f32"), registry.project_instance("f16")]
    report = ptxas_report(insts, arch=arch)
    for inst in insts:
        k = get_kernel(inst)
        assert report[inst.name].registers == k.num_regs, inst.name
        assert report[inst.name].spill_stores == 0, f"{inst.name} spills"
        model = occupancy(arch, k.num_regs, inst.threads, inst.smem_bytes + k.shared_size_bytes)
        assert model.blocks_per_sm == blocks_per_sm(inst), inst.name
    # the occupancy step (the register wall): up to HPB 16 two blocks fit an SM; HPB 24 needs
    # 154 registers and 132 KB of shared memory, and falls to one
    assert blocks_per_sm(registry.attn_instance(16)) == 2
    assert blocks_per_sm(registry.attn_instance(24)) == 1
    # attn_rows (per_head, split): one tile and 80 registers, six blocks of four warps
    assert blocks_per_sm(registry.attn_instance(1)) == 6
    # the other side of the wall: tiled16's three tile buffers, q and score partials (187 KiB)
    # take the whole SM
    assert blocks_per_sm(registry.tiled_instance(16)) == 1


def test_scratch_is_per_device():
    import cupy

    from mlasandbox.api import DecodeStep, _scratch

    inp, _ = device_inputs(Dims(n_head=12), 5000)
    step = DecodeStep(**inp.decode_args(), variant="split")
    step.run()
    dev = cupy.cuda.Device().id
    assert step.part_acc.device.id == dev and dev in _scratch
    assert np.isfinite(step.lse.get()).all()


def test_inside_a_graph_capture_the_guard_skips_its_poll_and_the_replay_is_the_same_work():
    """A stream query, or --sync-check's sync, would end a CUDA-graph capture: the guard sees
    the capture and skips them (the bench captures the phases through their own guards)."""
    import cupy

    from mlasandbox.api import DecodeStep
    from mlasandbox.timing import capture_graph

    inp, seed = device_inputs(Dims(n_head=12), 9000)
    step = DecodeStep(**inp.decode_args(), variant="split", sync_check=True)
    res = step.run()
    want = [res.out.get(), res.latent.get(), res.lse.get()]
    polls = step.guard.polls
    stream = cupy.cuda.Stream(non_blocking=True)
    graph = capture_graph(step.run, stream)
    assert step.guard.captured == len(step.launches) and step.guard.polls == polls
    # the eager run left this step's partials in the scratch: a replay that ran the merge
    # alone would reproduce every word from them, so they are poisoned with the outputs
    poison(step)
    cupy.cuda.Device().synchronize()   # the fills are on the current stream, the replay not
    graph.launch(stream)
    stream.synchronize()
    for got, ref in zip((step.out, step.latent, step.lse), want):
        np.testing.assert_array_equal(got.get(), ref, err_msg=f"seed={seed}")
