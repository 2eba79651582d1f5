"""`mlasandbox bench`: the depth curve of every variant, with the instruments that make its
numbers trustworthy (the timer, the A/A floor and the control phase).

    result = run_bench()                      # defaults: 96 heads, 6 contexts, all variants
    result["rows"]                            # one row per (variant, n_ctx, phase), plain values

What one run does, in order (per cache dtype):

1. ceilings of this device, now: copy bandwidth, an f16 cuBLAS GEMM and f32 FMA (ceilings.py);
2. the time estimate of the whole run from the byte formulas and the measured bandwidth,
   printed; if it exceeds the budget, the per-measurement target shrinks;
3. the inputs, allocated once at the largest context and reused (n_ctx is a parameter);
4. the control phase q_absorb, timed (then again before every variant, and at the end);
5. a correctness spot check of every variant against the float64 reference, so that a fast
   wrong kernel is flagged (and never called the fastest);
6. the A/A noise floor: `per_head` and `split` below the split gate, interleaved;
7. per variant, per context: attn, combine and the whole step (q_absorb + attn + combine),
   and the step's launch floor (phase "floor": a CUDA graph of as many empty kernels as the
   step launches, with its grids and blocks, bench_gpu.time_floor), so a short-context step
   reads against what its launches alone cost;
8. derived: rates against the ceilings, the depth term t(long) - t(short) and its share,
   the fastest variant per context (ties within the floor named as ties), the control
   verdict.

The loop is written against a small backend interface (`CupyBackend` in bench_gpu.py on a
device; a fake in the tests), so everything except the timing itself runs on the CPU.
The result is a JSON-serialisable dict; `write_csv` flattens its rows.
"""
from __future__ import annotations

import csv
import math
import time
from dataclasses import replace

from . import bench_gpu, metrics
from .bench_config import (DEFAULT_CONTEXTS, PHASES, BenchConfig, estimate_seconds, make_config,
                           phases_of, plan_work, q_dtype_of, use_graph)
from .clocks import NO_CLOCKS
from .noise import control_report, interleave_order, noise_floor, verdict
from .timing import Timing

__all__ = ["SCHEMA", "DEFAULT_CONTEXTS", "PHASES", "BenchConfig", "make_config", "plan_work",
           "estimate_seconds", "run_bench", "depth_terms", "fastest_per_context",
           "write_csv", "CSV_COLUMNS", "q_dtype_of", "aa_floor", "ControlPhase"]

SCHEMA = "mlasandbox.bench/1"


# ---------------------------------------------------------------------------- the run

def _row(cfg, cache, variant, n_ctx, phase, timing: Timing, plan: dict, ceilings: dict):
    qd = q_dtype_of(cfg.q_dtype, cache)
    cost = metrics.phase_cost(phase, variant, cfg.dims, n_ctx, cache, qd,
                              plan.get("splits") or 1)
    return {"variant": variant, "cache": cache, "q": qd, "n_ctx": n_ctx, "phase": phase,
            **timing.as_dict(), "splits": plan.get("splits"),
            "head_blocks": plan.get("head_blocks"), "heads_per_block": plan.get("heads_per_block"),
            "attn_kernel": plan.get("attn_kernel"), "flops": cost.flops,
            "ideal_bytes": cost.ideal_bytes, "issued_bytes": cost.issued_bytes,
            **metrics.rates(cost, timing.median_us, ceilings), "check_ok": None}


def _floor_row(cfg, cache, variant, n_ctx, timing: Timing, plan: dict) -> dict:
    """The launch floor of a step: the step's launches with empty kernels (no bytes, no
    FLOPs: rates None)."""
    return {"variant": variant, "cache": cache, "q": q_dtype_of(cfg.q_dtype, cache),
            "n_ctx": n_ctx, "phase": "floor", **timing.as_dict(), "splits": plan.get("splits"),
            "head_blocks": plan.get("head_blocks"),
            "heads_per_block": plan.get("heads_per_block"),
            "attn_kernel": plan.get("attn_kernel"), "flops": None, "ideal_bytes": None,
            "issued_bytes": None, "GBps_ideal": None, "GBps_issued": None, "TFLOPs": None,
            "frac_copy_ideal": None, "frac_copy_issued": None, "frac_gemm": None,
            "frac_fma": None, "roof": None, "frac_roof": None, "check_ok": None}


def run_bench(*, backend=None, progress=None, log=None, as_json: bool = False,
              config: BenchConfig | None = None, **options) -> dict:
    """Run the bench; return a JSON-serialisable dict (see the module docstring).

    backend: a CupyBackend (default) or a fake with the same methods. progress(label,
    advance) and log(text) are callbacks (the CLI's progress bar and stderr). as_json only
    says the caller prints JSON on stdout; this function prints nothing itself.
    """
    cfg = config or make_config(**options)
    log = log or (lambda text: None)
    progress = progress or (lambda label, advance=1: None)
    if backend is None:
        backend = bench_gpu.CupyBackend()
    t_start = time.perf_counter()
    warnings: list[str] = []
    meta = backend.meta()
    timing_kw = {"warmup": cfg.warmup, "min_repeats": cfg.min_repeats,
                 "max_repeats": cfg.max_repeats, "target_s": cfg.target_ms / 1e3}

    progress("ceilings: copy bandwidth, f16 GEMM, f32 FMA", 0)
    ceilings = backend.ceilings(cfg.copy_bytes, cfg.gemm_n, timing_kw)
    progress("ceilings", 1)
    est = estimate_seconds(cfg, ceilings["copy_GBps"])
    if est["seconds"] > cfg.budget_s:
        scale = cfg.budget_s / est["seconds"]
        new_target = max(1.0, cfg.target_ms * scale)
        warnings.append(f"estimated {est['seconds']:.0f} s exceeds the budget of "
                        f"{cfg.budget_s:.0f} s: target per measurement cut from "
                        f"{cfg.target_ms:.0f} ms to {new_target:.1f} ms")
        cfg = replace(cfg, target_ms=new_target)
        timing_kw["target_s"] = new_target / 1e3
        est = estimate_seconds(cfg, ceilings["copy_GBps"])
    log(f"estimate: {est['measurements']} measurements, about {est['seconds']:.0f} s of GPU "
        f"work at {ceilings['copy_GBps']:.0f} GB/s (plus first-time kernel compiles); "
        f"longest: {est['slowest']} (~{est['slowest_seconds']:.1f} s)")

    rows: list[dict] = []
    plans: dict[str, dict] = {}
    checks: list[dict] = []
    control_series: list[tuple[str, float]] = []
    aa_reports: list[dict] = []
    # one allocation serves every context, the A/A's (below the gate) included
    max_ctx = max(max(cfg.contexts), cfg.aa_context)

    control = ControlPhase(backend, cfg, use_graph(cfg, None, None), timing_kw, ceilings, rows,
                           control_series, progress, len(cfg.cache_dtypes) > 1)

    for cache in cfg.cache_dtypes:
        qd = q_dtype_of(cfg.q_dtype, cache)
        backend.prepare(cfg.dims, max_ctx, cache, qd, cfg.seed)
        control(cache, "start")

        if cfg.check:
            check_dims = cfg.dims.with_heads(min(cfg.check_heads, cfg.dims.n_head))
            got = backend.check(list(cfg.variants), check_dims, cfg.check_ctx, cache, qd,
                                cfg.seed, cfg.splits)
            for c in got:
                checks.append({"cache": cache, **c})
                progress(f"check {c['variant']}", 1)
            for c in got:
                if not c["ok"]:
                    warnings.append(f"{c['variant']} ({cache}) FAILED its correctness check "
                                    f"at n_ctx={c['n_ctx']}: {c.get('detail', '')}; its "
                                    "timings are not results")

        # A/A: identical code in both arms (checked, not assumed).
        pa = backend.plan("per_head", cfg.aa_context, "auto")
        pb = backend.plan("split", cfg.aa_context, "auto")
        same_code = (pa.get("attn_kernel") == pb.get("attn_kernel") and pa.get("splits") == 1
                     and pb.get("splits") == 1)
        if not same_code:
            warnings.append(f"A/A at n_ctx={cfg.aa_context} is not A/A: per_head runs "
                            f"{pa.get('attn_kernel')} x{pa.get('splits')}, split runs "
                            f"{pb.get('attn_kernel')} x{pb.get('splits')}")
        aa_graph = use_graph(cfg, "split", cfg.aa_context)
        nf, modes = aa_floor(
            lambda name: backend.time(name, cfg.aa_context, "attn", "auto", aa_graph,
                                      timing_kw),
            ("per_head", "split"), cfg.aa_rounds,
            lambda name: progress(f"A/A {name} at {cfg.aa_context}", 1))
        aa_reports.append({"cache": cache, "n_ctx": cfg.aa_context, "phase": "attn",
                           "same_code": same_code, "kernel": pa.get("attn_kernel"),
                           "mode": modes, **nf.as_dict()})

        for v in cfg.variants:
            control(cache, f"before {v}")
            for n in cfg.contexts:
                plan = backend.plan(v, n, cfg.splits)
                plans[f"{v}@{n}@{cache}"] = {"variant": v, "n_ctx": n, "cache": cache, **plan}
                for ph in phases_of(v):
                    t = backend.time(v, n, ph, cfg.splits, use_graph(cfg, v, n), timing_kw)
                    rows.append(_row(cfg, cache, v, n, ph, t, plan, ceilings))
                    progress(f"{v} n_ctx={n} {ph}", 1)
                floor = backend.time_floor(v, n, cfg.splits, timing_kw)
                if floor is not None:
                    rows.append(_floor_row(cfg, cache, v, n, floor, plan))
            backend.release_steps()
        control(cache, "end")
        backend.release()

    floor = max(r["floor"] for r in aa_reports) if aa_reports else None
    if any(not r["same_code"] for r in aa_reports):
        floor = None
        warnings.append("no valid A/A: differences are reported without a noise floor")
    failed = {(c["variant"], c["cache"]) for c in checks if not c["ok"]}
    for r in rows:
        if r["variant"] != "-":
            r["check_ok"] = None if not cfg.check else (r["variant"], r["cache"]) not in failed
    ctl = control_report(control_series, floor)
    if ctl.warning:
        warnings.append(ctl.warning)
    depth = depth_terms(rows, floor)
    fastest = fastest_per_context(rows, floor)
    return {
        # ok: no variant failed its check (a wrong kernel's timings are not results). An
        # unstable control or a missing floor is a warning, carried in `harness_stable`.
        "schema": SCHEMA, "ok": not failed, "harness_stable": ctl.stable,
        "meta": meta, "config": cfg.as_dict(), "ceilings": ceilings, "estimate": est,
        "rows": rows, "plans": list(plans.values()), "checks": checks,
        "noise_floor": {"floor": floor, "runs": aa_reports,
                        "how": "p90 of paired |per_head - split| / split below the split "
                               "gate (identical code), at least the event timer's "
                               "resolution over the median"},
        "control": ctl.as_dict(), "depth": depth, "fastest": fastest,
        "warnings": warnings, "elapsed_s": time.perf_counter() - t_start,
    }


def aa_floor(time_arm, names: tuple, rounds: int, done) -> tuple:
    """The A/A test: arms names[0] and names[1] (identical code; the caller checks that)
    timed interleaved for `rounds` rounds; returns (NoiseFloor, the timer modes met).
    time_arm(name) -> Timing; done(name) after each measurement."""
    arms: dict[str, list[float]] = {n: [] for n in names}
    modes = set()
    for first, second in interleave_order(rounds):
        for arm in (first, second):
            name = names[0] if arm == "a" else names[1]
            t = time_arm(name)
            arms[name].append(t.median_us)
            modes.add(t.mode)
            done(name)
    return noise_floor(arms[names[0]], arms[names[1]]), "/".join(sorted(modes))


class ControlPhase:
    """The control phase q_absorb, timed when called (`control(cache, label)`): a row in
    `rows` and a point of `series`, which control_report judges against the floor. `cfg`
    needs .dims and .q_dtype; `backend` needs time_control."""

    def __init__(self, backend, cfg, graph: bool, timing_kw: dict, ceilings: dict,
                 rows: list, series: list, progress, label_cache: bool):
        self.backend, self.cfg, self.graph, self.timing_kw = backend, cfg, graph, timing_kw
        self.ceilings, self.rows, self.series = ceilings, rows, series
        self.progress, self.label_cache = progress, label_cache

    def __call__(self, cache: str, label: str) -> Timing:
        t = self.backend.time_control(self.graph, self.timing_kw)
        self.series.append((f"{label} ({cache})" if self.label_cache else label, t.median_us))
        self.rows.append({"variant": "-", "cache": cache,
                          "q": q_dtype_of(self.cfg.q_dtype, cache), "n_ctx": None,
                          "phase": "q_absorb", "control_label": label, **t.as_dict(),
                          **_control_metrics(self.cfg, cache, t, self.ceilings)})
        self.progress(f"control q_absorb ({label})", 1)
        return t


def _control_metrics(cfg, cache, t: Timing, ceilings):
    cost = metrics.q_absorb_cost(cfg.dims, cache, q_dtype_of(cfg.q_dtype, cache))
    return {"flops": cost.flops, "ideal_bytes": cost.ideal_bytes,
            "issued_bytes": cost.issued_bytes, **metrics.rates(cost, t.median_us, ceilings)}


# ---------------------------------------------------------------------------- derived

def _medians(rows, phase):
    out: dict[tuple, dict[int, float]] = {}
    for r in rows:
        if r["phase"] == phase and r["variant"] != "-":
            out.setdefault((r["variant"], r["cache"]), {})[r["n_ctx"]] = r["median_us"]
    return out


def depth_terms(rows, floor: float | None, phase: str = "step") -> list[dict]:
    """Per variant: t(long) - t(short) of `phase` and its share of t(long): the depth term."""
    out = []
    for (v, cache), by_ctx in _medians(rows, phase).items():
        if len(by_ctx) < 2:
            continue
        short, long_ = min(by_ctx), max(by_ctx)
        ts, tl = by_ctx[short], by_ctx[long_]
        vd = verdict(tl, ts, floor) if floor is not None else None
        d = tl - ts
        out.append({"variant": v, "cache": cache, "phase": phase, "short_ctx": short,
                    "long_ctx": long_, "t_short_us": ts, "t_long_us": tl, "depth_us": d,
                    "share": d / tl if tl > 0 else None,
                    "slope_us_per_1k": d / (long_ - short) * 1000,
                    "measurable": None if vd is None else vd.measurable,
                    "text": (f"{d:,.1f} us ({d / tl:.0%} of the step at {long_})"
                             if vd is None or vd.measurable else vd.text)})
    return out


def fastest_per_context(rows, floor: float | None, phase: str = "step") -> list[dict]:
    """Per (cache, n_ctx): the fastest variant that passed its check, and every other variant
    within the noise floor of it (a tie is not a win)."""
    out = []
    ok_rows = [r for r in rows if r["phase"] == phase and r["variant"] != "-"
               and r.get("check_ok") is not False]
    keys = sorted({(r["cache"], r["n_ctx"]) for r in ok_rows})
    for cache, n in keys:
        cand = [r for r in ok_rows if r["cache"] == cache and r["n_ctx"] == n]
        best = min(cand, key=lambda r: r["median_us"])
        ties = []
        for r in cand:
            if r is best:
                continue
            if floor is not None and not verdict(r["median_us"], best["median_us"],
                                                 floor).measurable:
                ties.append(r["variant"])
        out.append({"cache": cache, "n_ctx": n, "phase": phase, "variant": best["variant"],
                    "median_us": best["median_us"], "ties": ties})
    return out


# ---------------------------------------------------------------------------- CSV

CSV_COLUMNS = ("variant", "cache", "q", "n_ctx", "phase", "control_label", "median_us",
               "min_us", "p10_us", "p90_us", "max_us", "mad_us", "n", "mode", "note",
               "splits", "head_blocks", "heads_per_block", "attn_kernel", "flops",
               "ideal_bytes", "issued_bytes", "GBps_ideal", "GBps_issued", "TFLOPs",
               "frac_copy_ideal", "frac_copy_issued", "frac_gemm", "frac_fma", "roof",
               "frac_roof", "check_ok", *NO_CLOCKS)


def write_csv(result: dict, path) -> None:
    """One line per measured row (phase rows and the control series)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in result["rows"]:
            w.writerow({k: ("" if r.get(k) is None else
                            (f"{r[k]:.6g}" if isinstance(r.get(k), float) and math.isfinite(r[k])
                             else r[k])) for k in CSV_COLUMNS})
