"""The bench's configuration: options validated into a BenchConfig, the list of work a run
does (the progress bar's total), and the time estimate of that work.

Kept apart from bench.py (the run itself) so that the CLI can validate options, size its
progress bar and print an estimate without importing the runner.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from . import metrics, registry
from .dims import PRESETS, Dims
from .splits import SPLIT_MIN_CTX, default_gate
from .timing import choose_repeats

__all__ = ["DEFAULT_CONTEXTS", "PHASES", "BenchConfig", "make_config", "q_dtype_of",
           "WorkItem", "plan_work", "phases_of", "use_graph", "estimate_seconds",
           "check_dtypes_and_splits"]

DEFAULT_CONTEXTS = (64, 512, 4096, 8192, 32768, 131072)
PHASES = ("attn", "combine", "step")
# Per-run cost outside the timed region (flush enqueue + Python), used by the estimate only.
_RUN_OVERHEAD_US = 60.0
# Per-kernel launch latency the estimate adds to the byte-bound time.
_LAUNCH_US = 5.0


@dataclass(frozen=True)
class BenchConfig:
    dims: Dims
    preset: str | None = "h96"
    contexts: tuple = DEFAULT_CONTEXTS
    variants: tuple = tuple(registry.variant_names())
    cache_dtypes: tuple = ("f16",)
    q_dtype: str = "f32"                 # "f32" or "cache"
    splits: object = "auto"              # "auto" or an int (split/batched only)
    max_repeats: int = 100
    min_repeats: int = 10
    warmup: int = 3
    target_ms: float = 150.0             # GPU time each measurement aims for
    seed: int = 0
    graph: str = "auto"                  # "auto" | "always" | "never"
    graph_max_ctx: int = 4096            # auto: replay a graph at n_ctx <= this
    min_ctx: int = SPLIT_MIN_CTX         # the split gate of `split` (the A/A pair below it)
    aa_ctx: int | None = None            # default: min_ctx - 1
    aa_rounds: int = 10
    check: bool = True
    check_ctx: int = 20000
    check_heads: int = 16
    copy_bytes: int = 1 << 30
    gemm_n: int = 8192
    budget_s: float = 480.0

    @property
    def aa_context(self) -> int:
        return self.aa_ctx if self.aa_ctx is not None else self.min_ctx - 1

    def as_dict(self) -> dict:
        d = asdict(self)
        d["dims"] = asdict(self.dims)
        d["contexts"], d["variants"] = list(self.contexts), list(self.variants)
        d["cache_dtypes"] = list(self.cache_dtypes)
        d["aa_ctx"] = self.aa_context
        return d


def q_dtype_of(cfg_q: str, cache_dtype: str) -> str:
    return cache_dtype if cfg_q == "cache" else cfg_q


def make_config(*, preset: str | None = "h96", heads: int | None = None,
                dims: Dims | None = None, contexts=None, variants=None, hpbs=None,
                cache_dtypes=None, q_dtype: str = "f32", splits="auto", **kw) -> BenchConfig:
    """Validate the options into a BenchConfig (ValueError naming the bad one)."""
    if dims is None:
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
        dims = PRESETS[preset or "h96"]
    if heads is not None:
        if int(heads) != heads or heads < 1:
            raise ValueError(f"heads must be an integer >= 1, got {heads!r}")
        dims = dims.with_heads(int(heads))
    registry.check_cuda_dims(dims.kv_lora, dims.rope)
    contexts = tuple(int(c) for c in (contexts or DEFAULT_CONTEXTS))
    if any(c < 1 for c in contexts):
        raise ValueError(f"contexts must be >= 1, got {contexts}")
    contexts = tuple(sorted(set(contexts)))
    names = list(variants) if variants else registry.variant_names()
    if hpbs:
        # --hpb narrows the batched family to these values (1 is `split`)
        want = {registry.variant_for_hpb(h) for h in hpbs}  # ValueError for an HPB not built
        names = [n for n in names if registry.variant(n).family not in ("batched", "split")
                 or n in want] + sorted(want - set(names), key=lambda n: registry.variant(n).hpb)
    for n in names:
        registry.variant(n)  # ValueError naming the known variants
        if n in registry.PAGED_ONLY_VARIANTS:
            raise ValueError(f"variant {n} serves the paged step only: bench it with "
                             "--batch B (the paged serving step)")
    names = list(dict.fromkeys(names))
    cache_dtypes = tuple(cache_dtypes or ("f16",))
    splits = check_dtypes_and_splits(cache_dtypes, q_dtype, splits)
    cfg = BenchConfig(dims=dims, preset=preset, contexts=contexts, variants=tuple(names),
                      cache_dtypes=cache_dtypes, q_dtype=q_dtype, splits=splits, **kw)
    if cfg.graph not in ("auto", "always", "never"):
        raise ValueError(f"graph must be auto, always or never, got {cfg.graph!r}")
    if not 1 <= cfg.min_repeats <= cfg.max_repeats:
        raise ValueError(f"need 1 <= min_repeats <= repeats, got {cfg.min_repeats}, "
                         f"{cfg.max_repeats}")
    if cfg.aa_rounds < 2:
        raise ValueError(f"the A/A needs at least 2 rounds, got {cfg.aa_rounds}")
    if not 1 <= cfg.aa_context < cfg.min_ctx:
        raise ValueError(f"the A/A context (aa_context, --aa-ctx) must be below the split "
                         f"gate ({cfg.min_ctx}), got {cfg.aa_context}: above it split and "
                         "per_head run different code")
    if cfg.target_ms <= 0 or cfg.budget_s <= 0:
        raise ValueError("target_ms and budget_s must be > 0")
    return cfg


def check_dtypes_and_splits(cache_dtypes, q_dtype: str, splits):
    """Validate cache dtypes, the q choice and a split count; return splits as 'auto' or an
    int (ValueError naming the bad one)."""
    for c in cache_dtypes:
        if c not in ("f16", "bf16"):
            raise ValueError(f"cache dtype must be f16 or bf16, got {c!r}")
    if q_dtype not in ("f32", "cache"):
        raise ValueError(f"q dtype must be 'f32' or 'cache', got {q_dtype!r}")
    if splits in (None, "auto"):
        return "auto"
    if isinstance(splits, bool) or int(splits) != splits or splits < 1:
        raise ValueError(f"splits must be 'auto' or an integer >= 1, got {splits!r}")
    return int(splits)


def phases_of(variant: str) -> tuple:
    """Every variant, the cuBLAS engine included (its combine is the wv_b projection)."""
    registry.variant(variant)  # an unknown name raises here, naming the known ones
    return PHASES


def use_graph(cfg: BenchConfig, variant: str, n_ctx: int | None) -> bool:
    if cfg.graph == "never" or (variant and not registry.variant(variant).is_cuda):
        return False  # the engine allocates per call: its memory cannot live in a graph
    return cfg.graph == "always" or n_ctx is None or n_ctx <= cfg.graph_max_ctx


@dataclass(frozen=True)
class WorkItem:
    kind: str                # "ceilings" | "check" | "control" | "aa" | "time"
    cache: str | None = None
    variant: str | None = None
    n_ctx: int | None = None
    phase: str | None = None
    label: str = ""


def plan_work(cfg: BenchConfig) -> list[WorkItem]:
    """Every unit of work of a run, in order (the progress bar's total, the estimate's list)."""
    items = [WorkItem("ceilings", label="ceilings: copy bandwidth, f16 GEMM")]
    for cache in cfg.cache_dtypes:
        items.append(WorkItem("control", cache, label=f"control q_absorb (start, {cache})"))
        if cfg.check:
            items += [WorkItem("check", cache, v, cfg.check_ctx, label=f"check {v} ({cache})")
                      for v in cfg.variants]
        for i in range(cfg.aa_rounds):
            for arm in ("per_head", "split"):
                items.append(WorkItem("aa", cache, arm, cfg.aa_context, "attn",
                                      f"A/A round {i + 1}: {arm} at {cfg.aa_context}"))
        for v in cfg.variants:
            items.append(WorkItem("control", cache, v, label=f"control q_absorb (before {v})"))
            for n in cfg.contexts:
                for ph in phases_of(v):
                    items.append(WorkItem("time", cache, v, n, ph, f"{v} n_ctx={n} {ph}"))
        items.append(WorkItem("control", cache, label=f"control q_absorb (end, {cache})"))
    return items


def _estimate_us(cfg: BenchConfig, item: WorkItem, cache: str, copy_GBps: float) -> float:
    """Rough GPU time of one run of a work item: as-issued bytes at the copy bandwidth plus
    launch latency. Latency-bound kernels run slower than this; the budget has headroom."""
    qd = q_dtype_of(cfg.q_dtype, cache)
    if item.kind == "control":
        cost = metrics.q_absorb_cost(cfg.dims, cache, qd)
        kernels = 1
    else:
        v = registry.variant(item.variant)
        splits = _guess_splits(cfg, v, item.n_ctx)
        cost = metrics.phase_cost(item.phase, item.variant, cfg.dims, item.n_ctx, cache, qd,
                                  splits)
        kernels = {"attn": 1, "combine": 1, "step": 3}[item.phase] * (1 if v.is_cuda else 8)
    return cost.issued_bytes / (copy_GBps * 1e3) + _LAUNCH_US * kernels


def _guess_splits(cfg: BenchConfig, v, n_ctx: int) -> int:
    if not v.is_cuda or not v.splits or n_ctx < default_gate(v.hpb, cfg.min_ctx):
        return 1
    if cfg.splits != "auto":
        return int(cfg.splits)
    hb = metrics.head_blocks_of(v.family, cfg.dims.n_head, v.hpb)
    return max(1, min(256, -(-264 // hb), n_ctx // 128))


def estimate_seconds(cfg: BenchConfig, copy_GBps: float, target_ms: float | None = None,
                     flush_bytes: int = 100 << 20) -> dict:
    """Seconds the timed work of `cfg` should take (not counting first-time compiles)."""
    target_s = (target_ms if target_ms is not None else cfg.target_ms) / 1e3
    flush_us = 2 * flush_bytes / (copy_GBps * 1e3)
    total, n_meas, slowest = 0.0, 0, (0.0, "")
    for item in plan_work(cfg):
        if item.kind in ("ceilings", "check"):
            continue
        t = _estimate_us(cfg, item, item.cache, copy_GBps)
        runs = cfg.warmup + 1 + choose_repeats(t, target_s, cfg.min_repeats, cfg.max_repeats)
        cost = runs * (t + flush_us + _RUN_OVERHEAD_US) * 1e-6
        total += cost
        n_meas += 1
        if cost > slowest[0]:
            slowest = (cost, item.label)
    # ceilings (~100 runs of 1 GiB copies and 8192^3 GEMMs) and checks (small), roughly
    fixed = 1.0 + (0.3 * len(cfg.variants) * len(cfg.cache_dtypes) if cfg.check else 0.0)
    return {"seconds": total + fixed, "measurements": n_meas, "copy_GBps_assumed": copy_GBps,
            "target_ms": target_s * 1e3, "slowest": slowest[1],
            "slowest_seconds": slowest[0]}
