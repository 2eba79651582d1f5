"""Interleaved A/B of the chunk slots bounded by the table's capacity (plan_chunks's max_len)
against the plan without the bound, the same kernels: a paged step planned for a short cache
(the bench's tight table). Latent graph (attn + merge where one runs), cold L2, the bench's
timer; each form checked against the float64 reference.

usage: python3 ab_bound.py SHAPES OUT_JSON [ROUNDS]
"""
import sys, json
import numpy as np
import cupy as cp
from mlasandbox import paged_api, chunks
import dataclasses
from mlasandbox.bench_paged import make_paged_config, resolve_auto
from mlasandbox.bench_gpu import PagedBackend
from mlasandbox.paged_api import PagedDecodeStep
from mlasandbox.timing import time_gpu
from mlasandbox.reference import decode_paged

SHAPES = {f"{n}x{h}": dict(batch=1, lengths=str(n), heads=h)
          for n in (64, 1024, 4096) for h in (16, 128)}
SHAPES["b4x1000x16"] = dict(batch=4, lengths="1000,200,0,700", heads=16)
SHAPES["b2x300x128sq2"] = dict(batch=2, lengths="300,65", heads=128, s_q=2, causal=True)


def unbounded(*a, max_len=None, **k):
    return chunks.plan_chunks(*a, **k)


def relL2(a, b, fin):
    a = np.asarray(a, np.float64)[fin]; b = np.asarray(b, np.float64)[fin]
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def step(be, form):
    paged_api.plan_chunks = chunks.plan_chunks if form == "bounded" else unbounded
    try:
        with be.stream:
            return PagedDecodeStep(**{**be.paged, "wv_b": None}, causal=be.cfg.causal,
                                   variant="auto", scale=be.paged_host.scale)
    finally:
        paged_api.plan_chunks = chunks.plan_chunks


def main():
    tags, out_path = sys.argv[1].split(","), sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    tk = dict(warmup=3, min_repeats=10, max_repeats=200, target_s=0.03)
    out = {}
    for tag in tags:
        shape = dict(SHAPES[tag])
        cfg = make_paged_config(variants=["auto"], peers=[], **shape)
        cfg = dataclasses.replace(cfg, variants=resolve_auto(cfg)[0])
        be = PagedBackend(); be.prepare_paged(cfg)
        ref = decode_paged(**{**be.paged_host.decode_args(), "wv_b": None})
        rl, rs = np.asarray(ref.latent), np.asarray(ref.lse)
        fin = np.isfinite(rs)
        graphs, info = {}, {}
        for form in ("unbounded", "bounded"):
            st = step(be, form)
            with be.stream:
                st.latent.fill(cp.nan); st.lse.fill(cp.nan)
                res = st.run()
            be.stream.synchronize()
            lat, lse = cp.asnumpy(res.latent), cp.asnumpy(res.lse)
            d = dict(variant=st.variant.name, max_chunks=st.plan.max_chunks,
                     grid=list(st.plan.grid), launches=[l.kernel for l in st.launches()],
                     latent_relL2=relL2(lat, rl, fin) if fin.any() else 0.0,
                     lse_maxabs=float(np.abs(lse[fin] - rs[fin]).max()) if fin.any() else 0.0,
                     empty_rows_ok=bool(np.all(lat[~fin] == 0) and np.all(np.isneginf(lse[~fin]))),
                     nan=int(np.isnan(lat).sum()))
            info[form] = d
            print(f"  {tag} {form}: {d}", flush=True)
            with be.stream:
                g = st.capture()
            graphs[form] = (st, g)
        res = {k: [] for k in graphs}
        s = be.stream
        for _ in range(rounds):
            for k, (st, g) in graphs.items():
                t = time_gpu(lambda g=g: g.launch(s), stream=s, flush=be.flush,
                             spinner=be.spinner, **tk)
                res[k].append(round(t.median_us, 2))
        base = np.median(res["unbounded"])
        print(tag, SHAPES[tag], flush=True)
        for k in graphs:
            v = np.median(res[k])
            print(f"  {k:10s} cold {v:8.2f} ({100 * (v / base - 1):+5.1f}%) "
                  f"range {min(res[k]):.2f}-{max(res[k]):.2f}", flush=True)
        out[tag] = dict(shape=SHAPES[tag], rounds=res, info=info)
        del graphs
        be.release()
    json.dump(out, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
