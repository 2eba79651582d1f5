"""Interleaved A/B of wgmma64 builds (measurement only; never imported by the package).

Each form is main's cuda_src/mla_wgmma.cu with -D options and/or a text patch, built by
arch_specific.load_function and swapped into a PagedDecodeStep (latent only, no wv_b);
every form's latent is checked against the float64 reference (relL2), then each form's
captured graph (attn + merge) is timed by the bench's timer (cold L2, pre-roll), `rounds`
rounds interleaved.

usage: python3 wip/ab_wgmma.py SHAPES OUT_JSON FORMS [ROUNDS]
"""
import sys, json
import numpy as np
import cupy as cp
from mlasandbox import arch_specific
from mlasandbox.bench_paged import make_paged_config
from mlasandbox.bench_gpu import PagedBackend
from mlasandbox.paged_api import PagedDecodeStep
from mlasandbox.timing import time_gpu
from mlasandbox.reference import decode_paged
from mlasandbox.sources import read_source
from mlasandbox.kernels import get_kernel

SHAPES = {"m1": dict(batch=1, lengths="131072", heads=16, variant="mma16"),
          "m32v": dict(batch=32, lengths="normal:8192:4096", heads=16, variant="mma16"),
          "m128": dict(batch=128, lengths="4096", heads=16, variant="mma16"),
          "b66": dict(batch=66, lengths="4096", heads=128),
          "b128": dict(batch=128, lengths="4096", heads=128),
          "sq2": dict(batch=128, lengths="4096", heads=128, s_q=2, causal=True),
          "b8v": dict(batch=8, lengths="normal:32768:16384", heads=128),
          "b1": dict(batch=1, lengths="131072", heads=128),
          "b1h64": dict(batch=1, lengths="131072", heads=64),
          "b1l64k": dict(batch=1, lengths="65536", heads=128),
          "b1l16k": dict(batch=1, lengths="16384", heads=128),
          "b1bf": dict(batch=1, lengths="131072", heads=128, cache_dtype="bf16")}

EXPECT = "mbarrier.arrive.expect_tx.shared::cta.b64"


def relaxed(src):
    assert src.count(EXPECT) == 1
    return src.replace(EXPECT, "mbarrier.arrive.expect_tx.relaxed.cta.shared::cta.b64")


def form(name, family):
    """(defines, source patch) of a form: aN = N tiles a block asked into L2 at its start
    (wgmma: N / 2 own tiles a warpgroup), relaxed = the expect_tx arrival .relaxed (wgmma)."""
    defines, patch = [], None
    for part in name.split("_"):
        if part == "main":
            continue
        if part == "relaxed":
            patch = relaxed
        elif part.startswith("a"):
            n = int(part[1:])
            defines.append(f"MLA_WGMMA_L2_AHEAD={n // 2}" if family == "wgmma"
                           else f"MLA_MMA_L2_AHEAD={n}")
        else:
            raise ValueError(name)
    return tuple(defines), patch


def relL2(a, b):
    a = np.asarray(a, np.float64); b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
    tags, out_path, names = sys.argv[1].split(","), sys.argv[2], sys.argv[3].split(",")
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 5
    tk = dict(warmup=3, min_repeats=10, max_repeats=200, target_s=0.03)
    base = read_source("mla_wgmma.cu")
    out = {}
    for tag in tags:
        shape = dict(SHAPES[tag]); variant = shape.pop("variant", "wgmma64")
        family = "wgmma" if variant == "wgmma64" else "mma"
        cfg = make_paged_config(variants=[variant], peers=[], **shape)
        be = PagedBackend(); be.prepare_paged(cfg)
        ref = decode_paged(**{**be.paged_host.decode_args(), "wv_b": None})
        graphs, info = {}, {}
        for name in names:
            defines, patch = form(name, family)
            if patch and family != "wgmma":
                continue
            with be.stream:
                st = PagedDecodeStep(**{**be.paged, "wv_b": None}, causal=be.cfg.causal,
                                     variant=variant, scale=be.paged_host.scale)
            inst = st.attn_inst
            if patch:
                k = arch_specific.load_function(patch(base), inst.expression, inst.min_arch,
                                                tuple(f"-D{d}" for d in defines), inst.source)
                k.max_dynamic_shared_size_bytes = inst.smem_bytes
                k.preferred_shared_memory_carveout = 100
            else:
                k = get_kernel(inst, defines)
            st.attn_kernel = k
            with be.stream:
                st.latent.fill(cp.nan); st.lse.fill(cp.nan)
                res = st.run()
            be.stream.synchronize()
            info[name] = dict(latent_relL2=relL2(cp.asnumpy(res.latent), ref.latent),
                              lse_maxabs=float(np.nanmax(np.abs(cp.asnumpy(res.lse) - ref.lse))
                                               if np.isfinite(ref.lse).all() else -1),
                              regs=k.num_regs, grid=list(st.attn_grid))
            graphs[name] = (st, st.capture())
        res = {k: [] for k in graphs}
        for _ in range(rounds):
            for k, (st, g) in graphs.items():
                res[k].append(round(time_gpu(lambda g=g: g.launch(be.stream), stream=be.stream,
                                             flush=be.flush, spinner=be.spinner, **tk).median_us, 2))
        print(tag, SHAPES[tag], flush=True)
        m0 = np.median(res[next(iter(graphs))])
        for k in graphs:
            m = np.median(res[k])
            print(f"  {k:18s} med {m:8.2f} ({min(res[k]):.2f}-{max(res[k]):.2f}) "
                  f"{100 * (m / m0 - 1):+5.1f}%  {info[k]}", flush=True)
        out[tag] = dict(shape=SHAPES[tag], rounds=res, info=info)
        del graphs
        be.release()
    json.dump(out, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
