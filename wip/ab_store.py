"""Interleaved A/B of wgmma64's epilogue stores (measurement only): as built each thread
stores its two rows' accumulators as float2 (STG.E.64, 32 a row a thread); "st128": thread
pairs (c, c ^ 1) trade halves by shuffle, so that each stores float4s of one row (STG.E.128,
half the store instructions; the same bytes at the same addresses, so bit-identical);
"halfw", timing only: the partials' accumulators half written (j < 16 of 32), the bytes
partials of 16 bits would write (results wrong).

usage: python3 ab_store.py SHAPES FORMS OUT_JSON [ROUNDS]
"""
import sys, os, json
import numpy as np
import cupy as cp
from mlasandbox import arch_specific
from mlasandbox.bench_paged import make_paged_config
from mlasandbox.bench_gpu import PagedBackend
from mlasandbox.paged_api import PagedDecodeStep
from mlasandbox.timing import time_gpu
from mlasandbox.reference import decode_paged
from mlasandbox.sources import read_source

SHAPES = {"b1h64": dict(batch=1, lengths="131072", heads=64),
          "b1": dict(batch=1, lengths="131072", heads=128),
          "b1l64k": dict(batch=1, lengths="65536", heads=128),
          "b128": dict(batch=128, lengths="4096", heads=128),
          "sq2": dict(batch=128, lengths="4096", heads=128, s_q=2, causal=True),
          "b8v": dict(batch=8, lengths="normal:32768:16384", heads=128),
          "rag": dict(batch=6, lengths="normal:3000:1500", heads=128, s_q=2, causal=True),
          "ragbf": dict(batch=6, lengths="normal:3000:1500", heads=128, s_q=2, causal=True,
                        cache_dtype="bf16"),
          "h3": dict(batch=5, lengths="0,1,63,65,700", heads=3, page_size=16)}
OLD_START = "#pragma unroll\n    for (int h = 0; h < 2; ++h) {\n        const int r = r0 + 8 * h;"
OLD_END = "// The paged launch (mla_walk.cuh, PagedWalk)"
NEW = r"""    // Thread pairs (c, c ^ 1) trade halves: c even stores row r0, c odd row r0 + 8, columns
    // 8j + 2 (c & 2) .. + 3 of its warpgroup's 256, one float4 a j.
    const int hs = c & 1, r = r0 + 8 * hs;
    const bool row_ok = head0 + r < n_rows;
    const size_t partial = part_base + head0 + r;
    const float l = lsum[r] + lsum[kWgRows + r];
    if (row_ok && wg == 0 && c < 2) {
        if (partials) {
            part_m[partial] = m_run[hs];
            part_l[partial] = l;
        }
        if (single) walk.lse[walk.latent_row(partial)] = single_pass_lse(m_run[hs], l);
    }
    const float inv_l = single_pass_inv_l(l);
    float* dst = part_acc + partial * kWgLora + wg * 256 + 2 * (c & 2);
    float* lat = single ? walk.latent + walk.latent_row(partial) * kWgLora + wg * 256 + 2 * (c & 2)
                        : nullptr;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        const float s0 = hs ? o[4 * j] : o[4 * j + 2], s1 = hs ? o[4 * j + 1] : o[4 * j + 3];
        const float x0 = __shfl_xor_sync(0xffffffffu, s0, 1);
        const float x1 = __shfl_xor_sync(0xffffffffu, s1, 1);
        const float4 v = hs ? make_float4(x0, x1, o[4 * j + 2], o[4 * j + 3])
                            : make_float4(o[4 * j], o[4 * j + 1], x0, x1);
        if (row_ok) {
            if (partials) *reinterpret_cast<float4*>(dst + 8 * j) = v;
            if (single)
                *reinterpret_cast<float4*>(lat + 8 * j) =
                    make_float4(v.x * inv_l, v.y * inv_l, v.z * inv_l, v.w * inv_l);
        }
    }
}

"""


def form(name):
    src = read_source("mla_wgmma.cu")
    if name == "main":
        return None
    if name == "halfw":  # timing only: half the partials' bytes (results wrong)
        old = """            for (int j = 0; j < 32; ++j)
                *reinterpret_cast<float2*>(dst + 8 * j)"""
        assert src.count(old) == 1
        return src.replace(old, old.replace("j < 32", "j < 16"))
    assert name == "st128" and src.count(OLD_START) == 1 and src.count(OLD_END) == 1
    a = src.index(OLD_START)
    b = src.index(OLD_END)
    return src[:a] + NEW + src[b:]


def relL2(a, b, fin):
    a = np.asarray(a, np.float64)[fin]; b = np.asarray(b, np.float64)[fin]
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def step(be, src):
    with be.stream:
        st = PagedDecodeStep(**{**be.paged, "wv_b": None}, causal=be.cfg.causal,
                             variant="wgmma64", scale=be.paged_host.scale)
    if src is not None:
        inst = st.attn_inst
        k = arch_specific.load_function(src, inst.expression, inst.min_arch, (), inst.source)
        k.max_dynamic_shared_size_bytes = inst.smem_bytes
        k.preferred_shared_memory_carveout = 100
        st.attn_kernel = k
    return st


def main():
    tags, names, out_path = sys.argv[1].split(","), sys.argv[2].split(","), sys.argv[3]
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 5
    tk = dict(warmup=3, min_repeats=10, max_repeats=200, target_s=0.03)
    srcs = {n: form(n) for n in names}
    out = {}
    for tag in tags:
        shape = dict(SHAPES[tag])
        cfg = make_paged_config(variants=["wgmma64"], peers=[], **shape)
        be = PagedBackend(); be.prepare_paged(cfg)
        small = cfg.batch * max(cfg.lengths) * shape["heads"] <= 1 << 24
        ref = decode_paged(**{**be.paged_host.decode_args(), "wv_b": None}) if small else None
        graphs, info, first = {}, {}, None
        for name in names:
            st = step(be, srcs[name])
            with be.stream:
                st.latent.fill(cp.nan); st.lse.fill(cp.nan)
                res = st.run()
            be.stream.synchronize()
            lat, lse = cp.asnumpy(res.latent), cp.asnumpy(res.lse)
            if first is None:
                first = (lat, lse)
            d = dict(regs=st.attn_kernel.num_regs, grid=list(st.attn_grid),
                     bit_identical_to_first=bool(np.array_equal(lat, first[0], equal_nan=True)
                                                 and np.array_equal(lse, first[1], equal_nan=True)))
            if ref is not None:
                rl, rs = np.asarray(ref.latent), np.asarray(ref.lse)
                fin = np.isfinite(rs)
                d["latent_relL2"] = relL2(lat, rl, fin)
                d["lse_maxabs"] = float(np.abs(lse[fin] - rs[fin]).max()) if fin.any() else 0.0
                d["empty_rows_ok"] = bool(np.all(lat[~fin] == 0) and np.all(np.isneginf(lse[~fin])))
                d["nan"] = int(np.isnan(lat).sum())
            info[name] = d
            print(f"  {tag} {name}: {d}", flush=True)
            if tag.startswith(("rag", "h3")):
                continue  # correctness cases only
            with be.stream:
                g = st.capture()
            graphs[name] = (st, g)
        res = {k: [] for k in graphs}
        s = be.stream
        for _ in range(rounds if graphs else 0):
            for k, (st, g) in graphs.items():
                t = time_gpu(lambda g=g: g.launch(s), stream=s, flush=be.flush,
                             spinner=be.spinner, **tk)
                res[k].append(round(t.median_us, 2))
        if graphs:
            print(tag, SHAPES[tag], flush=True)
            base = np.median(res[names[0]])
            for k in graphs:
                v = np.median(res[k])
                print(f"  {k:10s} cold {v:8.2f} ({100 * (v / base - 1):+5.1f}%) "
                      f"range {min(res[k]):.2f}-{max(res[k]):.2f} regs {info[k]['regs']}",
                      flush=True)
        out[tag] = dict(shape=SHAPES[tag], rounds=res, info=info)
        del graphs
        be.release()
    json.dump(out, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
