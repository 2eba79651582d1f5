"""Small cases of every CUDA kernel for compute-sanitizer (`.ci/gpu-sanitize` runs this file
under memcheck, racecheck, synccheck and initcheck).

Each attention variant runs, with the synchronizing phase guard, on shapes that reach the
paths a long-context bench never does: a last partial head group (13 heads), a slice shorter
than a tile, more slices than rows (empty slices write their neutral partial), a bf16 cache
with 16-bit q, and `split` forced past its gate so its combine runs too. q_absorb runs once
per case. The paged variants run batches of mixed lengths (0 included) in page sizes 1, 16
and 64, causal with two query tokens, after the index validator, through tables whose
unused entries hold INVALID_PAGE (a read of one faults under memcheck); wgmma64 too where q is
16-bit and the device is sm_90 (an odd tile count included). Every result is also
checked against the float64 reference: under a sanitizer a kernel must still be right. Both
projection kernels also run alone on a partial block of rows and of wv_b rows (70 x 200),
with a NaN guard row past the output. Prints one line per case and exits 1 if any check
failed.

`--planted TOOL` runs instead a kernel with the defect that TOOL exists to find (memcheck: writes
past the end of a buffer; racecheck: two warps' shared-memory write and read with no
barrier between; synccheck: a __syncthreads that half of each warp skips (on the H200,
synccheck does not report a whole warp skipping one); initcheck: a read of
never-written device memory): a sanitizer run that reports nothing there has no power.
"""
import dataclasses
import sys

import cupy

from mlasandbox import reference, registry
from mlasandbox.api import DecodeStep, QAbsorb
from mlasandbox.bench_gpu import tolerance_for
from mlasandbox.compare import compare
from mlasandbox.compare_paged import compare_paged
from mlasandbox.dims import Dims
from mlasandbox.inputs import make_inputs
from mlasandbox.paged_api import PagedDecodeStep
from mlasandbox.paged_inputs import make_paged_inputs
from mlasandbox.toolkit import device_available

# (heads, n_ctx, splits, cache, q): several slices; a partial head group and uneven slices;
# more slices than rows; 16-bit storage for both.
CASES = ((16, 100, 3, "f16", "f32"), (13, 777, 5, "f16", "f32"), (12, 70, 100, "f16", "f32"),
         (16, 333, 4, "bf16", "bf16"))

# Paged: (heads, lengths, page_size, s_q, causal, splits, cache, q): a partial row block and
# one-row pages; causal MTP rows of which some see nothing, in bf16; FlashMLA's page size with
# the auto chunk plan; pages of 64 with 16-bit q, where wgmma64 copies whole tiles by TMA;
# one chunk a request (splits 1), where wgmma64 runs its instance without partials. With a
# 16-bit q under splits 3 and 5 the mma family merges in its own kernel
# (PagedDecodeStep.merges_in_attn); with an f32 q, or under the auto plan of 3 requests (88
# chunk slots), the merge kernel does, in the form registry.merge_form picks for its rows
# (each line prints it): the deep merge at 52 rows (13 heads x 4 requests), the warp merge at
# 512 (128 heads x 4, f32 q, 3 chunk slots) on 132 SMs.
PAGED_CASES = ((13, (0, 1, 70, 300), 1, 1, False, 3, "f16", "f32"),
               (16, (0, 17, 129, 64), 16, 2, True, 5, "bf16", "bf16"),
               (5, (200, 0, 5), 64, 2, True, None, "f16", "f32"),
               (64, (0, 700, 65, 2000), 16, 1, False, 3, "f16", "f16"),
               (32, (200, 0, 129), 64, 2, True, 3, "bf16", "bf16"),
               (128, (0, 700, 65, 200), 64, 1, False, 1, "f16", "f16"),
               (128, (0, 700, 65, 200), 64, 1, False, 3, "f16", "f32"))
PAGED_VARIANTS = ("split", "batched4", "mma16", "mma32", "mma16r", "mma32r")
# wgmma64 takes q in the cache dtype only (and runs on sm_90a): the cases whose q is 16-bit
WGMMA_VARIANTS = ("wgmma64",)


_PLANTED = r"""
extern "C" __global__ void planted_memcheck(float* out, int n) {
    out[n + threadIdx.x] = 1.f;  // one past the end and beyond
}
extern "C" __global__ void planted_racecheck(float* out) {
    __shared__ float buf[64];
    buf[threadIdx.x] = threadIdx.x;
    out[threadIdx.x] = buf[63 - threadIdx.x];  // another warp's element, no barrier
}
extern "C" __global__ void planted_synccheck(float* out) {
    __shared__ float buf[64];
    buf[threadIdx.x] = threadIdx.x;
    if (threadIdx.x & 1) __syncthreads();  // only the odd lanes of each warp arrive
    out[threadIdx.x] = buf[threadIdx.x];
}
extern "C" __global__ void planted_initcheck(const float* in, float* out) {
    out[threadIdx.x] = in[threadIdx.x];  // `in` was allocated, never written
}
"""


def planted(tool: str) -> int:
    # Straight cudaMalloc, no memory pool: a pool's chunk would hide the overrun of a buffer
    # carved from it, and could hand back memory that was written before.
    cupy.cuda.set_allocator(None)
    module = cupy.RawModule(code=_PLANTED)
    kernel = module.get_function(f"planted_{tool}")
    out = cupy.zeros(64, cupy.float32)
    if tool == "memcheck":
        kernel((1,), (32,), (out, cupy.int32(64)))
    elif tool == "initcheck":
        kernel((1,), (64,), (cupy.empty(64, cupy.float32), out))
    else:
        kernel((1,), (64,), (out,))
    cupy.cuda.Device().synchronize()
    print(f"planted {tool} defect launched", flush=True)
    return 0


def main() -> int:
    failed = 0
    cuda_variants = [v for v in registry.variant_names() if registry.variant(v).is_cuda]
    for heads, n_ctx, splits, cache, q in CASES:
        host = make_inputs(Dims(n_head=heads), n_ctx + 5, n_ctx, cache, q, seed=heads + n_ctx)
        ref = reference.decode(**host.decode_args())
        inp = dataclasses.replace(host, **{f.name: cupy.asarray(getattr(host, f.name))
                                           for f in dataclasses.fields(host)
                                           if hasattr(getattr(host, f.name), "shape")})
        for name in cuda_variants:
            kw = {} if name == "per_head" else {"splits": splits, "min_ctx": 1}
            res = DecodeStep(**inp.decode_args(), variant=name, sync_check=True, **kw).run()
            ok = compare(res, ref, tolerance_for(name, cache)).ok   # mma16r: p's bound
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {name:10s} H={heads:3d} n_ctx={n_ctx:4d} S={splits:3d} "
                  f"cache={cache} q={q}", flush=True)
        QAbsorb(inp.q_nope, inp.q_rope, inp.wk_b, "f32" if q == "f32" else "cache",
                sync_check=True).run()
    failed += paged_cases()
    failed += projection_cases()
    cupy.cuda.Device().synchronize()
    print(f"sanitize cases: {failed} failed", flush=True)
    return 1 if failed else 0


def paged_cases() -> int:
    failed = 0
    for heads, lengths, page, s_q, causal, splits, cache, q in PAGED_CASES:
        host = make_paged_inputs(Dims(n_head=heads), lengths, s_q=s_q, page_size=page,
                                 cache_dtype=cache, q_dtype=q, causal=causal, seed=heads + page)
        ref = reference.decode_paged(**host.decode_args())
        dev = dataclasses.replace(host, **{f: cupy.asarray(getattr(host, f)) for f in
                                           ("q", "kv_cache", "block_table", "cache_seqlens",
                                            "wv_b")})
        wgmma = q == cache and cupy.cuda.Device().compute_capability == "90"
        for name in PAGED_VARIANTS + (WGMMA_VARIANTS if wgmma else ()):
            step = PagedDecodeStep(**dev.decode_args(), variant=name, splits=splits,
                                   sync_check=True)
            step.check_indices()
            # wgmma64, mma16r, mma32r round p to the cache dtype: their bound, as the bench's
            ok = compare_paged(step.run(), ref, tolerance_for(name, cache)).ok
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} paged {name:8s} H={heads:3d} lengths={lengths} "
                  f"page={page} s_q={s_q} causal={causal} splits={splits} cache={cache} q={q} "
                  f"merge={merge_label(step)}", flush=True)
    return failed


def merge_label(step) -> str:
    """Which merge the step ran: none (one pass), the attention kernel's own, the combine in
    one kernel, or the merge kernel's form (kind, column blocks, prefetch)."""
    if not step.launches_merge:
        return "in-attn" if step.merges_in_attn else "none"
    if step.fused_combine:
        return "fused"
    m = step.merge
    return f"{m.kind}/{m.col_blocks}/{m.prefetch}"


def projection_cases() -> int:
    import numpy as np

    from mlasandbox.bf16 import as_f64, to_storage
    from mlasandbox.compare import rel_l2
    from mlasandbox.kernels import get_kernel

    failed, (m_rows, heads, v_head) = 0, (70, 3, 200)
    rng = np.random.default_rng(7)
    latent = rng.standard_normal((m_rows, heads, 512)).astype(np.float32)
    for cache in ("f16", "bf16"):
        wv = to_storage(rng.standard_normal((heads, v_head, 512)).astype(np.float32) * 0.05,
                        cache)
        want = np.einsum("mhc,hvc->mhv", latent.astype(np.float64), as_f64(wv))
        for kind in ("project", "project_wide"):
            inst = registry.project_instance(cache, kind)
            out = cupy.full((m_rows + 1, heads, v_head), cupy.nan, cupy.float32)
            get_kernel(inst)(registry.project_grid(heads, v_head, m_rows, kind), (inst.threads,),
                             (cupy.asarray(latent), cupy.asarray(wv), np.int32(heads),
                              np.int32(m_rows), np.int32(v_head), out))
            got = cupy.asnumpy(out)
            ok = bool(rel_l2(got[:m_rows], want) < 1e-5 and np.isnan(got[m_rows:]).all())
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {kind:12s} rows={m_rows} heads={heads} "
                  f"v_head={v_head} wv_b={cache}", flush=True)
    return failed


PLANTED_TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")


def _refuse(message: str) -> int:
    print(message, file=sys.stderr)
    return 2


def cli(args: list[str]) -> int:
    if args and not (len(args) == 2 and args[0] == "--planted" and args[1] in PLANTED_TOOLS):
        return _refuse(f"usage: sanitize_cases.py [--planted {{{','.join(PLANTED_TOOLS)}}}] "
                       f"(got: {' '.join(args)})")
    ok, why = device_available()
    if not ok:
        return _refuse(f"sanitize_cases.py needs a CUDA device: {why}")
    return planted(args[1]) if args else main()


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
