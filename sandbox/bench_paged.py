"""`mlasandbox bench --batch B`: one serving step (a batch of requests in a paged cache) timed
per variant and per peer, with the same instruments as the depth bench.

    cfg = make_paged_config(batch=128, lengths="4096", heads=128)   # or serving="b128-4k-h128"
    result = run_paged_bench(config=cfg)                # on a GPU (bench_gpu.PagedBackend)
    plan_report(cfg)                                    # without one: the chunk plans

`auto` among the variants is resolved once per run, for this batch on the device's arch
(sm_90 without one, the H200 the plans model), and the variant it names is what is checked,
timed and planned; its rows carry both names ("asked": auto, "variant": the one run), and
the variant asked by name as well is timed once.

What one run does, in order:

1. ceilings of this device (copy bandwidth, f16 GEMM, f32 FMA);
2. the batch's inputs (sandbox/paged_inputs.py: permuted table, NaN tails), drawn once;
3. the control phase q_absorb (start, before every variant and peer, end), as bench.py;
4. a correctness check of every variant and peer on a cut of the batch (its first
   `check_batch` requests, `check_heads` heads) against the float64 paged reference;
5. the A/A floor: two steps of the first variant on the same inputs, interleaved (identical
   code: the same kernels and grids, checked);
6. per variant: attn, combine, the whole step with events, the whole step as a CUDA graph
   replay (PagedDecodeStep.capture()), and `latent`: the step without wv_b (the merge writes
   latent and lse only, what the peers return), replayed the same way; per peer: its step;
7. derived: tokens/s (B x s_q / step), GB/s and TFLOP/s of metrics.paged_step_cost against
   the ceilings, the fastest of our steps and, with peers, the fastest of the same work
   (`like_for_like`: our latent steps and the peers' calls; ties within the floor named as
   ties), the control verdict.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

import numpy as np

from . import metrics, registry
from .auto_variant import WGMMA_ARCH, AutoFacts, auto_choice
from .bench import SCHEMA as _DEPTH_SCHEMA
from .bench import ControlPhase, aa_floor
from .bench_config import check_dtypes_and_splits, q_dtype_of
from .chunks import CHUNK_CAP
from .dims import PRESETS, Dims
from .geometry import theoretical_blocks_per_sm
from .limits import check_s_q
from .noise import control_report, verdict
from .paged_api import PAGE_SIZES, paged_variant, plan_for_lengths
from .paged_inputs import parse_lengths
from .peers import PEER_NAMES, PeerUnavailable
from .timing import Timing

__all__ = ["SCHEMA", "SERVING_PRESETS", "DEFAULT_PAGED_VARIANTS", "PAGED_PHASES",
           "PagedBenchConfig", "make_paged_config", "plan_report", "resolve_auto",
           "run_paged_bench", "paged_work", "serving_help", "fastest_step", "like_for_like"]

SCHEMA = _DEPTH_SCHEMA.replace("bench/", "bench-paged/")
DEFAULT_PAGED_VARIANTS = ("mma16", "mma32", "split", "batched16")
# attn, combine, the whole step with events, the whole step replayed as one CUDA graph, the
# step without wv_b (latent and lse, the peers' work) replayed likewise, and the launch
# floor: a graph of the step's launches with empty kernels (bench_gpu.time_floor)
PAGED_PHASES = ("attn", "combine", "step", "graph", "latent", "floor")
# the phases whose work is the whole step (with wv_b) and the step without it
_WHOLE_STEP, _LATENT_STEP = ("step", "graph"), ("latent",)

# The serving shapes the bench reports against FlashMLA: name -> the options they set.
SERVING_PRESETS = {
    "b128-4k-h128": dict(batch=128, lengths="4096", heads=128, s_q=1, causal=False),
    "b128-4k-h128-mtp2": dict(batch=128, lengths="4096", heads=128, s_q=2, causal=True),
    "b128-4k-h16": dict(batch=128, lengths="4096", heads=16, s_q=1, causal=False),
    "b32-8k-var-h16": dict(batch=32, lengths="normal:8192:4096", heads=16, s_q=1,
                           causal=False),
    "b8-32k-var-h128": dict(batch=8, lengths="normal:32768:16384", heads=128, s_q=1,
                            causal=False),
}


def serving_help() -> str:
    return "; ".join(f"{k}: B={v['batch']} x {v['lengths']} x {v['heads']} heads"
                     + (f", s_q {v['s_q']}" if v["s_q"] > 1 else "")
                     + (" causal" if v["causal"] else "") for k, v in SERVING_PRESETS.items())


@dataclass(frozen=True)
class PagedBenchConfig:
    dims: Dims
    batch: int
    lengths: tuple                       # one per request, resolved from lengths_spec
    lengths_spec: str
    s_q: int = 1
    causal: bool = False
    page_size: int = 64
    serving: str | None = None
    variants: tuple = DEFAULT_PAGED_VARIANTS
    peers: tuple = ()
    cache_dtype: str = "f16"
    q_dtype: str = "cache"               # "f32" or "cache"; FlashMLA takes 16-bit q
    splits: object = "auto"
    max_repeats: int = 100
    min_repeats: int = 10
    warmup: int = 3
    target_ms: float = 150.0
    seed: int = 0
    graph: bool = True
    aa_rounds: int = 10
    check: bool = True
    check_batch: int = 8
    check_heads: int = 16
    copy_bytes: int = 1 << 30
    gemm_n: int = 8192

    @property
    def cache_dtypes(self) -> tuple:
        return (self.cache_dtype,)

    @property
    def tokens(self) -> int:
        """Query tokens of one step: B x s_q."""
        return self.batch * self.s_q

    def check_lengths(self) -> tuple:
        return self.lengths[:self.check_batch]

    def check_dims(self) -> Dims:
        return self.dims.with_heads(min(self.check_heads, self.dims.n_head))

    def as_dict(self) -> dict:
        d = asdict(self)
        d["dims"] = asdict(self.dims)
        for k in ("lengths", "variants", "peers"):
            d[k] = list(d[k])
        return d


def make_paged_config(*, batch=None, lengths=None, s_q=None, causal=None, page_size=64,
                      serving=None, preset="dsv3", heads=None, variants=None, peers=None,
                      cache_dtype="f16", q_dtype="cache", splits="auto", seed=0,
                      **kw) -> PagedBenchConfig:
    """Validate the options of a paged bench (ValueError naming the bad one). A serving
    preset sets batch, lengths, heads, s_q and causal; an explicit option overrides it."""
    base: dict = {}
    if serving is not None:
        if serving not in SERVING_PRESETS:
            raise ValueError(f"unknown serving preset {serving!r}; known: "
                             f"{', '.join(SERVING_PRESETS)}")
        base = dict(SERVING_PRESETS[serving])
    for name, value in (("batch", batch), ("lengths", lengths), ("s_q", s_q),
                        ("causal", causal), ("heads", heads)):
        if value is not None:
            base[name] = value
    if "batch" not in base:
        raise ValueError("the paged bench needs --batch B (or --serving PRESET)")
    batch = base["batch"]
    if isinstance(batch, bool) or int(batch) != batch or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    spec = str(base.get("lengths", "4096"))
    lens = parse_lengths(spec, int(batch), seed)
    if page_size not in PAGE_SIZES:
        raise ValueError(f"page size must be one of {', '.join(map(str, PAGE_SIZES))}, got "
                         f"{page_size}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    dims = PRESETS[preset]
    if base.get("heads") is not None:
        h = base["heads"]
        if int(h) != h or h < 1:
            raise ValueError(f"heads must be an integer >= 1, got {h!r}")
        dims = dims.with_heads(int(h))
    # before any work that grows with s_q (the cost model, the inputs)
    s_q = check_s_q(base.get("s_q", 1), dims.n_head, int(batch))
    splits = check_dtypes_and_splits((cache_dtype,), q_dtype, splits)
    qd = q_dtype_of(q_dtype, cache_dtype)
    names = tuple(dict.fromkeys(variants or DEFAULT_PAGED_VARIANTS))
    for n in names:
        v = paged_variant(n, s_q, dims.n_head)   # ValueError for per_head, tiled16, unknown
        if not v.is_cuda:
            raise ValueError(f"variant {n} is the cuBLAS engine: it reads the lengths to the "
                             "host and cannot be captured; the paged bench times the CUDA "
                             "variants")
        # the dtypes each kernel is built for (wgmma64: q in the cache dtype only)
        if v.family == "user":
            v.instance(cache_dtype, qd)
        else:
            registry.paged_attention_instance(v, cache_dtype, qd)
    peers = tuple(dict.fromkeys(peers or ()))
    for p in peers:
        if p not in PEER_NAMES:
            raise ValueError(f"unknown peer {p!r}; known: {', '.join(PEER_NAMES)}")
    if splits != "auto" and splits > CHUNK_CAP:
        raise ValueError(f"splits (every request's chunk cap in the paged step) must be at "
                         f"most {CHUNK_CAP}, got {splits}")
    cfg = PagedBenchConfig(dims=dims, batch=int(batch), lengths=tuple(int(n) for n in lens),
                           lengths_spec=spec, s_q=s_q, causal=bool(base.get("causal", False)),
                           page_size=int(page_size), serving=serving, variants=names,
                           peers=peers, cache_dtype=cache_dtype, q_dtype=q_dtype,
                           splits=splits, seed=int(seed), **kw)
    if not 1 <= cfg.min_repeats <= cfg.max_repeats:
        raise ValueError(f"need 1 <= min_repeats <= repeats, got {cfg.min_repeats}, "
                         f"{cfg.max_repeats}")
    if cfg.aa_rounds < 2:
        raise ValueError(f"the A/A needs at least 2 rounds, got {cfg.aa_rounds}")
    if cfg.check_batch < 1 or cfg.check_heads < 1:
        raise ValueError("check_batch and check_heads must be >= 1")
    return cfg


def paged_work(cfg: PagedBenchConfig) -> int:
    """Units of work of a run (the progress bar's total; `auto` resolved as on an sm_90)."""
    n_var = len(resolve_auto(cfg)[0])
    n = 1 + 1 + 2 * cfg.aa_rounds + 1
    if cfg.check:
        n += n_var + len(cfg.peers)
    n += n_var * (1 + len(PAGED_PHASES)) + 2 * len(cfg.peers)
    return n


def resolve_auto(cfg: PagedBenchConfig, arch: str = WGMMA_ARCH) -> tuple[tuple, dict | None]:
    """(the variants a run checks and times, the pick). `auto` is replaced by the variant it
    resolves to for this batch on a device of `arch`, with the facts of the table
    make_paged_inputs builds (what PagedDecodeStep would take), and every variant comes
    once: a variant asked by name and through auto is timed once. The pick: {"asked":
    "auto", "variant", "why", "arch", "also_asked": whether it was asked by name too}, None
    where auto was not asked."""
    if "auto" not in cfg.variants:
        return cfg.variants, None
    qd = q_dtype_of(cfg.q_dtype, cfg.cache_dtype)
    facts = AutoFacts.of_lengths(cfg.lengths, cfg.page_size, qd, cfg.cache_dtype, arch)
    name, why = auto_choice(cfg.s_q, cfg.dims.n_head, facts)
    names = tuple(dict.fromkeys(name if v == "auto" else v for v in cfg.variants))
    return names, {"asked": "auto", "variant": name, "why": why, "arch": arch,
                   "also_asked": name in cfg.variants}


def _asked(name: str, pick: dict | None) -> str:
    """The name the user gave for the variant `name` runs: auto where auto resolved to it."""
    return pick["asked"] if pick and pick["variant"] == name else name


def _plan_facts(v, cache: str, q: str, blocks_per_sm) -> tuple:
    """(instance, blocks/SM, how it was had) of variant `v` for the no-GPU plan: a user
    kernel's from its own header and compile (user_kernel.compile_report), a built-in's from
    the registry and the occupancy model of its batch-1 instance."""
    user = v.family == "user"
    inst = v.instance(cache, q) if user else registry.attention_instance(v, cache, q)
    if blocks_per_sm is not None:
        return inst, blocks_per_sm, f"{blocks_per_sm} blocks/SM (given)"
    if user:
        from .user_kernel import compile_report

        row = compile_report(v, params_override={k: [x] for k, x in v.params.items()},
                             cache=cache, q=q)[0]
        if row.blocks_per_sm < 1:
            raise ValueError(f"{row.name} does not fit on an SM of sm_90 "
                             f"(limiter: {row.limiter})")
        return inst, row.blocks_per_sm, (f"{row.blocks_per_sm} blocks/SM from its compile: "
                                         f"{row.registers} registers x {row.threads} threads, "
                                         f"limiter {row.limiter}")
    bps = theoretical_blocks_per_sm(v, cache, q)["blocks_per_sm"]
    return inst, bps, f"{bps} blocks/SM from the occupancy model of the batch-1 instance"


def plan_report(cfg: PagedBenchConfig, *, num_sms: int = 132, blocks_per_sm=None) -> dict:
    """What runs without a GPU: per variant its instance's rows per block and tile (from the
    registry), the chunk plan of the batch (paged_api.plan_for_lengths with `num_sms` and the
    occupancy model's blocks/SM, or `blocks_per_sm`), and the chunks each request runs.
    A variant whose facts cannot be had (no compiler, no paged instance) says why. `auto`
    is resolved as on the device this report models (an H200: sm_90, num_sms SMs)."""
    rows, problems = [], []
    n_rows = cfg.s_q * cfg.dims.n_head
    qd = q_dtype_of(cfg.q_dtype, cfg.cache_dtype)
    names, pick = resolve_auto(cfg)
    for name in names:
        v = paged_variant(name, cfg.s_q, cfg.dims.n_head)
        try:
            inst, bps, how = _plan_facts(v, cfg.cache_dtype, qd, blocks_per_sm)
            plan = plan_for_lengths(cfg.lengths, cfg.page_size, n_rows, inst,
                                    num_sms=num_sms, blocks_per_sm=bps, splits=cfg.splits)
            n_chunks, chunk_len = plan.for_lengths(cfg.lengths)
            cost = metrics.paged_step_cost(v.name, cfg.dims, cfg.lengths, cfg.s_q, cfg.causal,
                                           cfg.cache_dtype, qd, n_chunks, plan.head_blocks)
            rows.append({"variant": v.name, "asked": _asked(name, pick),
                         "rows_per_block": inst.heads,
                         "tile": inst.tile_rows, "grid": list(plan.grid),
                         "max_chunks": plan.max_chunks, "min_chunk": plan.min_chunk,
                         "target": plan.target,
                         "programs": plan.programs, "programs_run": int(
                             (n_chunks * plan.head_blocks).sum()),
                         "chunks_min": int(n_chunks.min()), "chunks_max": int(n_chunks.max()),
                         "chunk_len_max": int(chunk_len.max()), "reason": plan.reason,
                         "waves": [plan.waves_taken(cfg.lengths), plan.waves],
                         "merge": ("none: one chunk a request" if plan.single_pass else
                                   "attention kernel" if registry.attn_merges(
                                       v.family, plan.max_chunks, qd, cfg.cache_dtype)
                                   else "merge kernel"),
                         "blocks_per_sm": how, "flops": cost.flops,
                         "ideal_bytes": cost.ideal_bytes, "issued_bytes": cost.issued_bytes})
        except Exception as exc:  # no compiler here: say so, keep the others
            problems.append(f"{v.name}: {type(exc).__name__}: {exc}")
    lens = np.asarray(cfg.lengths)
    return {"batch": cfg.batch, "lengths": {"spec": cfg.lengths_spec, "min": int(lens.min()),
                                            "mean": float(lens.mean()), "max": int(lens.max()),
                                            "sum": int(lens.sum())},
            "s_q": cfg.s_q, "causal": cfg.causal, "page_size": cfg.page_size,
            "heads": cfg.dims.n_head, "num_sms": num_sms, "auto": pick, "plans": rows,
            "problems": problems}


# ---------------------------------------------------------------------------- the run

def _row(cfg, name, phase, t: Timing, cost, ceilings, kind="variant", plan=None, asked=None):
    r = {"variant": name, "asked": asked or name, "kind": kind, "phase": phase,
         "cache": cfg.cache_dtype,
         "q": q_dtype_of(cfg.q_dtype, cfg.cache_dtype), **t.as_dict(),
         "flops": cost.flops if cost else None,
         "ideal_bytes": cost.ideal_bytes if cost else None,
         "issued_bytes": cost.issued_bytes if cost else None, "check_ok": None}
    if cost is not None:
        r.update(metrics.rates(cost, t.median_us, ceilings))
        if kind == "peer":   # the peers' arithmetic is tensor-core MMA
            r["roof"], r["frac_roof"] = "GEMM", r["frac_gemm"]
    r["tokens_per_s"] = (cfg.tokens / (t.median_us * 1e-6)
                         if phase in _WHOLE_STEP + _LATENT_STEP and t.median_us > 0 else None)
    if plan is not None:
        r.update({"max_chunks": plan.get("max_chunks"), "grid": plan.get("grid")})
    return r


def run_paged_bench(*, backend=None, progress=None, log=None,
                    config: PagedBenchConfig | None = None, **options) -> dict:
    """Run the paged bench; return a JSON-serialisable dict (see the module docstring).
    backend: bench_gpu.PagedBackend (default) or a fake with the same methods and `arch`."""
    asked = config or make_paged_config(**options)
    log = log or (lambda text: None)
    progress = progress or (lambda label, advance=1: None)
    if backend is None:
        from .bench_gpu import PagedBackend  # imports CuPy: only on a GPU run

        backend = PagedBackend()
    names, pick = resolve_auto(asked, backend.arch)
    # the backend checks, plans and times the resolved variants: auto's check must be of the
    # kernel timed, not of what auto would pick on the check's cut of the batch
    cfg = replace(asked, variants=names)
    t_start = time.perf_counter()
    warnings: list[str] = []
    meta = backend.meta()
    timing_kw = {"warmup": cfg.warmup, "min_repeats": cfg.min_repeats,
                 "max_repeats": cfg.max_repeats, "target_s": cfg.target_ms / 1e3}
    qd = q_dtype_of(cfg.q_dtype, cfg.cache_dtype)
    progress("ceilings: copy bandwidth, f16 GEMM, f32 FMA", 0)
    ceilings = backend.ceilings(cfg.copy_bytes, cfg.gemm_n, timing_kw)
    progress("ceilings", 1)
    backend.prepare_paged(cfg)
    progress("inputs", 1)
    rows: list[dict] = []
    series: list = []
    control = ControlPhase(backend, cfg, cfg.graph, timing_kw, ceilings, rows, series,
                           progress, False)
    control(cfg.cache_dtype, "start")

    checks = []
    if cfg.check:
        checks = backend.check_paged(cfg)
        for c in checks:
            progress(f"check {c['variant']}", 1)
            if not c["ok"]:
                warnings.append(f"{c['variant']} FAILED its correctness check: "
                                f"{c.get('detail', '')}; its timings are not results")
    skipped = backend.skipped_peers()   # after the check: it may find a shape a peer refuses
    for s in skipped:
        warnings.append(f"peer {s['name']} skipped: {s['reason']}")

    # A/A: two steps of one variant on the same inputs; identical code checked, not assumed
    aa_v = cfg.variants[0]
    pa, pb = backend.paged_plan(aa_v, 0), backend.paged_plan(aa_v, 1)
    same_code = pa == pb
    if not same_code:
        warnings.append(f"A/A of {aa_v} is not A/A: its two steps plan {pa} and {pb}")
    nf, modes = aa_floor(lambda arm: backend.time_paged(aa_v, "step", timing_kw, arm),
                         (0, 1), cfg.aa_rounds, lambda arm: progress(f"A/A {aa_v} #{arm}", 1))
    aa = {"variant": aa_v, "phase": "step", "same_code": same_code, "mode": modes,
          **nf.as_dict()}
    floor = nf.floor if same_code else None
    if floor is None:
        warnings.append("no valid A/A: differences are reported without a noise floor")

    plans = {}
    for v in cfg.variants:
        control(cfg.cache_dtype, f"before {v}")
        plan = backend.paged_plan(v, 0)
        plans[v] = plan
        costs = {wv: metrics.paged_step_cost(v, cfg.dims, cfg.lengths, cfg.s_q, cfg.causal,
                                             cfg.cache_dtype, qd, plan["n_chunks"],
                                             plan["head_blocks"], with_wv_b=wv)
                 for wv in (True, False)}
        for ph in PAGED_PHASES:
            if ph == "graph" and not cfg.graph:
                continue
            t = backend.time_paged(v, ph, timing_kw)
            cost = (costs[True] if ph in _WHOLE_STEP else
                    costs[False] if ph in _LATENT_STEP else None)
            rows.append(_row(cfg, v, ph, t, cost, ceilings, plan=plan, asked=_asked(v, pick)))
            progress(f"{v} {ph}", 1)
        backend.release_steps()
    for p in backend.available_peers():
        control(cfg.cache_dtype, f"before {p}")
        cost = metrics.paged_step_cost(p, cfg.dims, cfg.lengths, cfg.s_q, cfg.causal,
                                       cfg.cache_dtype, cfg.cache_dtype, None, 1,
                                       with_wv_b=False)
        try:
            t = backend.time_peer(p, timing_kw)
        except PeerUnavailable as exc:  # a shape this peer does not take
            skipped.append({"name": p, "reason": str(exc)})
            warnings.append(f"peer {p} skipped: {exc}")
            continue
        rows.append(_row(cfg, p, "step", t, cost, ceilings, kind="peer"))
        progress(f"peer {p}", 1)
    control(cfg.cache_dtype, "end")
    backend.release()

    failed = {c["variant"] for c in checks if not c["ok"]}
    for r in rows:
        if r["variant"] != "-":
            r["check_ok"] = None if not cfg.check else r["variant"] not in failed
    ctl = control_report(series, floor)
    if ctl.warning:
        warnings.append(ctl.warning)
    # ok: none of OUR variants failed its check; a peer that fails is a warning above
    ours_failed = failed & set(cfg.variants)
    return {"schema": SCHEMA, "ok": not ours_failed, "harness_stable": ctl.stable, "meta": meta,
            "config": asked.as_dict(), "auto": pick, "ceilings": ceilings, "rows": rows,
            "plans": plans, "checks": checks, "skipped_peers": skipped,
            "noise_floor": {"floor": floor, "runs": [aa],
                            "how": "p90 of paired |a - b| / b of two steps of the same "
                                   "variant on the same inputs (identical code), at least "
                                   "the event timer's resolution over the median"},
            "control": ctl.as_dict(), "fastest": fastest_step(rows, floor),
            "like_for_like": like_for_like(rows, floor),
            "warnings": warnings, "elapsed_s": time.perf_counter() - t_start}


def _fastest(best: dict, floor) -> dict | None:
    if not best:
        return None
    win = min(best.values(), key=lambda r: r["median_us"])
    ties = [n for n, r in best.items() if r is not win and floor is not None
            and not verdict(r["median_us"], win["median_us"], floor).measurable]
    return {"variant": win["variant"], "asked": win.get("asked", win["variant"]),
            "phase": win["phase"], "median_us": win["median_us"], "ties": ties}


def _passed(r) -> bool:
    return r["variant"] != "-" and r.get("check_ok") is not False


def fastest_step(rows, floor) -> dict | None:
    """The fastest of our whole steps (graph replay where timed, else events) among the
    variants that passed their check, and those within the floor of it (a tie is not a win).
    The peers are not in it: their call does not apply wv_b (like_for_like compares them)."""
    best: dict = {}
    for r in rows:
        if not _passed(r) or r["kind"] == "peer":
            continue
        if r["phase"] == "graph" or (r["phase"] == "step" and r["variant"] not in best):
            best[r["variant"]] = r
    return _fastest(best, floor)


def like_for_like(rows, floor) -> dict | None:
    """With peers: the fastest of the same work, our `latent` steps (no wv_b) and the peers'
    calls, among those that passed their check, ties within the floor named. None without a
    timed peer."""
    best = {r["variant"]: r for r in rows if _passed(r) and (
        (r["kind"] == "peer" and r["phase"] == "step") or r["phase"] in _LATENT_STEP)}
    if not any(r["kind"] == "peer" for r in best.values()):
        return None
    return _fastest(best, floor)
