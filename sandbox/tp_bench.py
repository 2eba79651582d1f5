"""`mlasandbox bench --batch B --tp N`: the paged step sharded over N GPUs by heads, timed
per rank, against the same step on one GPU.

    result = run_tp_bench(cfg, tp=8)         # cfg: bench_paged.make_paged_config(...)
    tp_plan_report(cfg, tp=8)                # without a GPU: every rank's chunk plan

What one run does, per variant:

1. TP 1: one rank (GPU 0) runs all H heads; TP N: N ranks, one per GPU, each its band, with
   the chunk budget re-derived for the band ("band") and, as the comparison, with the chunks
   all H heads would get ("unsharded"; tp.py). At TP 1 the two are the same plan.
2. Per rank (tp_launch._timed, CUDA events, L2 flushed, the same number of runs on every
   rank): attn, combine, o_proj (the band's partial output projection), all_gather (of out),
   all_reduce (of the partial projections), and the whole step (all of them in a row).
3. Correctness: rank 0's gathered `out` of the first `check_batch` requests against the
   float64 paged reference (relL2 within the tolerance of the variants the ranks ran,
   out_tolerance) and against TP 1's, and
   `y` against the float64 projection of that gathered out (a bound from the arithmetic).
4. Derived: per TP size the slowest rank's phase times (a step is as slow as its slowest
   rank), the collectives' share of the step, the scaling efficiency
   t(TP 1) / (N x t(TP N)) of attention and of the step, and the budget's effect
   t(unsharded) / t(band) - 1 on attention.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .bench_config import q_dtype_of
from .compare import DEFAULT_TOLERANCE, rel_l2
from .tp import BUDGETS, check_tp, rank_plans
from .tp_launch import FORMS, TPJob, launch

__all__ = ["SCHEMA", "TP_PHASES", "tp_job", "run_tp_bench", "tp_plan_report", "summarize_tp",
           "check_y", "out_tolerance"]

SCHEMA = "mlasandbox/bench-tp/1"
TP_PHASES = ("attn", "combine", "o_proj", "all_gather", "all_reduce", "step")
U32 = 2.0 ** -24


def tp_job(cfg, variant: str, *, engine: str = "auto", repeats: int = 20,
           d_model: int | None = None) -> TPJob:
    """The launcher's job for one variant of a paged bench config."""
    kw = {} if d_model is None else {"d_model": d_model}
    return TPJob(dims=cfg.dims, lengths=tuple(cfg.lengths), s_q=cfg.s_q, causal=cfg.causal,
                 page_size=cfg.page_size, cache_dtype=cfg.cache_dtype,
                 q_dtype=q_dtype_of(cfg.q_dtype, cfg.cache_dtype), seed=cfg.seed,
                 variant=variant, splits=None if cfg.splits == "auto" else cfg.splits,
                 engine=engine, executor="gpu", check_requests=cfg.check_batch,
                 timing={"warmup": cfg.warmup, "repeats": repeats, "flush": True}, **kw)


def tp_plan_report(cfg, tp: int, *, num_sms: int = 132, blocks_per_sm=None) -> dict:
    """Every rank's chunk plan per variant and budget, without a GPU (the occupancy model's
    blocks/SM unless given). "auto" is resolved per band as on the H200 the plans model
    (bench_paged.plan_report's facts). A variant whose facts cannot be had says why."""
    from . import registry
    from .auto_variant import AutoFacts
    from .geometry import theoretical_blocks_per_sm
    from .paged import tight_max_len
    from .paged_api import paged_variant

    tp = check_tp(tp, cfg.dims.n_head)
    qd = q_dtype_of(cfg.q_dtype, cfg.cache_dtype)
    auto = AutoFacts.of_lengths(cfg.lengths, cfg.page_size, qd, cfg.cache_dtype)
    max_len = tight_max_len(cfg.lengths, cfg.page_size)  # the run's table
    out, problems = [], []
    known: dict = {}   # instance name -> its facts: one occupancy compile each

    for name in cfg.variants:
        def facts(heads):
            v = paged_variant(name, cfg.s_q, heads, auto)
            inst = registry.paged_attention_instance(v, cfg.cache_dtype, qd)
            if inst.name not in known:
                bps = blocks_per_sm or theoretical_blocks_per_sm(v, cfg.cache_dtype,
                                                                 qd)["blocks_per_sm"]
                known[inst.name] = (inst.heads, inst.tile_rows, bps)
            return known[inst.name]
        try:
            for budget in BUDGETS:
                for rp in rank_plans(cfg.batch, cfg.s_q, cfg.dims.n_head, tp, facts,
                                     num_sms=num_sms, budget=budget,
                                     splits=None if cfg.splits == "auto" else cfg.splits,
                                     max_len=max_len):
                    v = paged_variant(name, cfg.s_q, rp.band.heads, auto)
                    out.append({"variant": v.name, "asked": name, **rp.as_dict()})
        except Exception as exc:   # no compiler here: say so, keep the others
            problems.append(f"{name}: {type(exc).__name__}: {exc}")
    return {"tp": tp, "heads": cfg.dims.n_head, "batch": cfg.batch, "num_sms": num_sms,
            "ranks": out, "problems": problems}


def check_y(y, out, w_o) -> dict:
    """y [T, D] (f32, summed over ranks) against the float64 projection of the gathered out
    [T, H, v] by w_o [H, v, D]. Each y entry is a sum of K = H*v products rounded in f32
    (the band GEMMs, then N - 1 additions of the partials): |y - y64| <= gamma_K *
    (|out| @ |w_o|) with gamma_K = K u / (1 - K u), u = 2^-24 (Higham, Thm 3.1)."""
    o = np.asarray(out, np.float64).reshape(out.shape[0] * out.shape[1], -1)
    w = np.asarray(w_o, np.float64).reshape(o.shape[1], -1)
    y = np.asarray(y, np.float64).reshape(o.shape[0], -1)
    k = o.shape[1] + 1
    gamma = k * U32 / (1 - k * U32)
    bound = gamma * (np.abs(o) @ np.abs(w))
    err = np.abs(y - o @ w)
    return {"ok": bool(np.all(err <= bound)), "worst_err_over_bound":
            float(np.max(err / np.maximum(bound, np.finfo(float).tiny)))}


def _slowest(reports, budget) -> dict:
    """Per phase, the median of the slowest rank (a collective step waits for it)."""
    out = {}
    for ph in TP_PHASES:
        vals = [r["timings"][budget][ph]["median_us"] for r in reports
                if ph in r.get("timings", {}).get(budget, {})]
        if vals:
            out[ph] = {"max_us": max(vals), "min_us": min(vals),
                       "rank_of_max": int(np.argmax(vals))}
    return out


def summarize_tp(runs: dict, tp: int) -> dict:
    """Scaling, the collectives' share and the budget's effect from the runs' reports:
    runs[(n, budget)] = the reports of the TP-n run under that budget's timings."""
    def med(n, budget, ph):
        return runs[n]["slowest"].get(budget, {}).get(ph, {}).get("max_us")
    s = {}
    t1a, t1s = med(1, "band", "attn"), med(1, "band", "step")
    for n in sorted(runs):
        for budget in runs[n]["slowest"]:
            a, st = med(n, budget, "attn"), med(n, budget, "step")
            coll = sum(med(n, budget, ph) or 0.0 for ph in FORMS)
            s[f"tp{n}/{budget}"] = {
                "attn_us": a, "step_us": st, "collective_us": coll,
                "collective_share": coll / st if st else None,
                "attn_efficiency": t1a / (n * a) if a and t1a else None,
                "step_efficiency": t1s / (n * st) if st and t1s else None,
                "attn_vs_ideal": (a / (t1a / n)) if a and t1a else None}
    if tp > 1 and "unsharded" in runs[tp]["slowest"]:
        a_b, a_u = med(tp, "band", "attn"), med(tp, "unsharded", "attn")
        s["budget_effect_attn"] = a_u / a_b - 1 if a_b and a_u else None
    return s


def out_tolerance(runs, cache_dtype: str) -> float:
    """The relL2 bound on `out` of the loosest variant the ranks of `runs` ran (those that
    round p, wgmma64 among them, have a looser one than the f32 kernels: bench_gpu's
    tolerance_for). A gathered out is within its worst band's bound: its squared error and
    its squared norm are sums over the bands."""
    from .bench_gpu import tolerance_for

    ran = {p["variant"] for run in runs for r in run.reports
           for p in (r.get("plans") or {}).values() if p.get("variant")}
    return max((tolerance_for(v, cache_dtype).out for v in ran), default=DEFAULT_TOLERANCE.out)


def _check(cfg, job, run1, runn) -> dict:
    from .reference import decode_paged

    host = job.host_inputs()
    k = min(cfg.check_batch, cfg.batch)
    ref = decode_paged(host["q"][:k], host["kv_cache"], host["block_table"][:k],
                       host["cache_seqlens"][:k], host["wv_b"], causal=cfg.causal)
    got = runn.reports[0].get("out")
    one = run1.reports[0].get("out")
    tol = out_tolerance((run1, runn), cfg.cache_dtype)
    res = {"requests": k, "tolerance_relL2": tol}
    if got is None:
        return {**res, "ok": False, "detail": "rank 0 returned no gathered out"}
    res["out_vs_reference_relL2"] = rel_l2(got, ref.out)
    res["out_vs_tp1_relL2"] = rel_l2(got, one) if one is not None else None
    # both within tol of the reference, so within 2 tol of each other
    ok = res["out_vs_reference_relL2"] <= tol and (one is None
                                                   or res["out_vs_tp1_relL2"] <= 2 * tol)
    from .tp_rank import make_w_o

    y = runn.reports[0].get("y")
    if y is not None:
        w = make_w_o(cfg.dims.n_head, cfg.dims.v_head, job.d_model, seed=job.seed)
        res["y"] = check_y(y, got, w)
        ok = ok and res["y"]["ok"]
    return {**res, "ok": bool(ok)}


def run_tp_bench(cfg, tp: int, *, engine: str = "auto", repeats: int = 20, gpus=None,
                 launcher=launch, progress=None, timeout_s: float = 600.0) -> dict:
    """The TP bench of a paged config (see the module docstring); a JSON-able dict.
    `launcher` is tp_launch.launch (tests pass a fake with its signature)."""
    progress = progress or (lambda label, advance=1: None)
    tp = check_tp(tp, cfg.dims.n_head, gpus)
    out = {"schema": SCHEMA, "tp": tp, "engine": None, "config": cfg.as_dict(),
           "variants": {}, "warnings": [], "ok": True}
    for v in cfg.variants:
        job = tp_job(cfg, v, engine=engine, repeats=repeats)
        runs, raw = {}, {}
        for n in sorted({1, tp}):
            budgets = ("band",) if n == 1 else BUDGETS
            progress(f"{v}: TP {n}", 0)
            run = launcher(replace(job, budgets=budgets), n, timeout_s=timeout_s, gpus=gpus)
            progress(f"{v}: TP {n}", 1)
            raw[n] = run
            out["engine"] = run.engine
            failed = run.failures() or [r for r in run.reports if not r.get("ok")]
            if failed:
                f = failed[0]
                out["ok"] = False
                out["variants"][v] = {"error": {k: f.get(k) for k in
                                                ("rank", "phase", "error", "launch")}}
                break
            runs[n] = {"slowest": {b: _slowest(run.reports, b) for b in budgets},
                       "ranks": [{k: r.get(k) for k in ("rank", "device", "band", "plans",
                                                        "timings", "env", "buffers_on")}
                                 for r in run.reports]}
        if v in out["variants"]:
            continue
        check = _check(cfg, job, raw[1], raw[tp])
        if not check["ok"]:
            out["ok"] = False
            out["warnings"].append(f"{v} FAILED its check at TP {tp}: its timings are not "
                                   "results")
        out["variants"][v] = {"runs": {str(n): r for n, r in runs.items()},
                              "summary": summarize_tp(runs, tp), "check": check}
    return out
