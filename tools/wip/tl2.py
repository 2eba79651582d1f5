"""Timeline of attention programs and merge blocks of one paged mma16 step (merge only) at
B=32 x N(8192,4096) x 16, q f16, under PDL on a stream: globaltimer at each attention
program's start and end, each merge block's start, wait release and end. Sources are the
current cuda_src files with the TL prelude patched in (scratch/tl2_patch.py)."""
import sys
import cupy as cp, numpy as np
from mlasandbox.bench_paged import parse_length_spec
from mlasandbox.dims import Dims
from mlasandbox.kernels import _nvrtc_options
from mlasandbox.paged_api import PagedDecodeStep
from mlasandbox.paged_inputs import make_paged_inputs
from mlasandbox.sources import read_source
label = sys.argv[1]
spec = sys.argv[2] if len(sys.argv) > 2 else "normal:8192:4096"
lens = parse_length_spec(spec, 32, 0)
host = make_paged_inputs(Dims(n_head=16), list(lens), page_size=64, q_dtype="f16", seed=1)
dev = {k: cp.asarray(v) for k, v in host.decode_args().items() if hasattr(v, "shape")}
dev["wv_b"] = None
step = PagedDecodeStep(**dev, causal=False, scale=host.scale, variant="mma16")
def load(inst, glob):
    mod = cp.RawModule(code=read_source(inst.source), options=_nvrtc_options(),
                       name_expressions=[inst.expression])
    k = mod.get_function(inst.expression)
    if inst.smem_bytes > 48 * 1024:
        k.max_dynamic_shared_size_bytes = inst.smem_bytes
    return k, mod.get_global(glob)
step.attn_kernel, atl = load(step.attn_inst, "mla_atl")
step.combine_kernel, ctl = load(step.combine_inst, "mla_ctl")
na, nc = step.attn_grid[1], int(np.prod(step.combine_grid))
print(label, "attn grid", step.attn_grid, "combine grid", step.combine_grid, "pdl", step.pdl)
flush = cp.empty(256 << 20, cp.uint8)
s = cp.cuda.Stream(non_blocking=True)
res = []
for rep in range(8):
    with s:
        flush.fill(rep)
        za = cp.zeros(4096, cp.uint64); zc = cp.zeros(3 * 8192, cp.uint64)
        atl.copy_from_device(za.data, za.nbytes); ctl.copy_from_device(zc.data, zc.nbytes)
        s.synchronize()
        step._stream = s
        step.run_attn(); step.run_combine()
        s.synchronize()
    a = cp.ndarray((4096,), cp.uint64, atl).get()[:2 * na].reshape(na, 2).astype(np.int64)
    c = cp.ndarray((3 * 8192,), cp.uint64, ctl).get()[:3 * nc].reshape(nc, 3).astype(np.int64)
    t0 = a[:, 0].min(); a = (a - t0) / 1000.0; c = np.where(c > 0, (c - t0) / 1000.0, np.nan)
    aend = a[:, 1].max()
    res.append(dict(attn_start_max=a[:, 0].max(), attn_end_p=np.percentile(a[:, 1], [0, 10, 50, 90, 100]),
                    c_start_p=np.nanpercentile(c[:, 0], [0, 10, 50, 90, 100]),
                    c_before_end=(c[:, 0] < aend).sum(),
                    c_wait_p=np.nanpercentile(c[:, 1], [0, 50, 100]),
                    c_end_p=np.nanpercentile(c[:, 2], [0, 10, 50, 90, 100]),
                    merge_after=np.nanmax(c[:, 2]) - aend, nc_live=int(np.isfinite(c[:, 0]).sum())))
for r in res[3:]:
    print(f"  attn start<= {r['attn_start_max']:.2f} end {r['attn_end_p'].round(2)} | merge blocks {r['nc_live']} start {r['c_start_p'].round(2)} "
          f"({r['c_before_end']} before attn end) wait-release {r['c_wait_p'].round(2)} end {r['c_end_p'].round(2)} | merge after attn {r['merge_after']:.2f} us")
