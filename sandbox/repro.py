"""`mlasandbox repro`: write one self-contained Python script that reproduces a case.

The script pins everything that decides what runs: the variant, its template values (the
NVRTC name expressions), the shape, the dtypes, the contexts, the exact split count of each
context, the seed and the scale. It embeds the include-expanded CUDA source of the kernels it
launches (sources.read_source) and, for the `cublas` variant, the engine's code; it imports
CuPy and NumPy only. Its launches are DecodeStep's (api.py): attn with (q, cache, n_head,
n_ctx, splits, scale * log2(e), part_acc, part_m, part_l) over (head_blocks, splits) x the
instance's threads (128 for attn_rows, 256 for the others) and its dynamic shared memory
(KernelInstance.smem_bytes); combine with (part_acc, part_m,
part_l, n_head, splits, wv_b, v_head, out, latent, lse) over (H,) x COMBINE_THREADS.

Split counts: `splits=S` pins S. `splits="auto"` applies the launcher's rule (splits.plan_splits)
at generation time: with the device's SM count and the driver's blocks/SM when there is a
GPU, otherwise with `num_sms` (default 132, H100/H200) and the occupancy model's blocks/SM from
a ptxas compile for `arch`. The script then runs those counts on any device, and its header
says where they came from.

`--negative-control` builds the combine without its exp(m_i - m) rescale; with a single slice
the rescale is the identity, so the control needs S >= 2 at every context (the generator
refuses otherwise: a control that cannot fail proves nothing).

The batched paged script (make_paged_case, render_paged_script) launches PagedDecodeStep's
kernels. Who merges a request's chunks is decided at generation by the step's rule
(registry.attn_merges): where it holds (mma, q in the cache dtype, 2 to ATTN_MERGE_MAX_CHUNKS
slots a request) the attention kernel merges with zeroed tickets and the script launches the
projection alone, as the step does; elsewhere the combine's one-kernel form merges and projects.
It takes the paged-only wgmma64 too, whose sm_90a kernel CuPy's RawModule(code=...)
cannot build: the script compiles it with NVRTC for that target itself (compile_for_arch),
checks it against registry.ROUND_P_RELL2_BOUND, and on a device that is not sm_90 says NOT RUN
(exit 3) instead of compiling.
"""
from __future__ import annotations

import datetime as _dt
import inspect
import math
import os
import textwrap
from dataclasses import dataclass
from importlib import metadata

from . import arch_specific, cublas_engine, registry, tensor_map, toolkit
from .api import SINGLE_PASS_FAMILIES
from .archs import check_arch, instance_needs, variant_needs
from .dims import PRESETS, Dims
from .geometry import theoretical_blocks_per_sm
from .kernels import blocks_per_sm, device_info
from .limits import check_host_memory, check_problem, check_s_q
from .chunks import CHUNK_CAP
from .auto_variant import AutoFacts, auto_choice
from .paged_api import check_page_size, paged_variant, plan_for_lengths
from .paged_inputs import check_inputs_fit, parse_lengths
from .repro_template import (ENGINE_WRAPPER, HELPERS, NO_ENGINE, PAGED_TEMPLATE, TEMPLATE,
                             TENSOR_MAP)
from .sources import read_source
from .splits import SPLIT_MIN_CTX, default_gate, plan_splits

__all__ = ["ReproCase", "make_case", "render_script", "write_script", "default_filename",
           "REPRO_CONTEXTS", "NVRTC_OPTIONS", "ATTN_ARGS", "COMBINE_ARGS", "PagedReproCase",
           "make_paged_case", "render_paged_script", "write_paged_script",
           "default_paged_filename", "paged_runs_on", "PAGED_ATTN_ARGS", "PAGED_WGMMA_ARGS",
           "PAGED_MMA_ARGS", "PAGED_COMBINE_ARGS", "PAGED_PROJECT_ARGS"]

REPRO_CONTEXTS = (4095, 4096, 20000)
# The kernel arguments of api.DecodeStep.run_attn / run_combine, in order, by name (the
# script maps each name to an array or a scalar). tests/test_repro.py parses api.py and
# fails if these drift from it.
ATTN_ARGS = ("q", "cache", "n_head", "n_ctx", "splits", "scale", "part_acc", "part_m",
             "part_l", "latent", "lse")
COMBINE_ARGS = ("part_acc", "part_m", "part_l", "n_head", "splits", "wv_b", "v_head", "out",
                "latent", "lse", "out_part", "tickets")
# The paged kernels' arguments (paged_api.PagedDecodeStep.attn_args / combine_args), in order.
PAGED_ATTN_ARGS = ("q", "kv_cache", "block_table", "cache_seqlens", "n_rows", "n_head", "s_q",
                   "causal", "max_pages", "page_shift", "max_chunks", "min_chunk",
                   "scale_log2", "part_acc", "part_m", "part_l", "target", "batch",
                   "chunk_counts", "latent", "lse")
# The wgmma family's launch takes the cache's tensor maps after them
# (PagedDecodeStep.attn_launch_args).
PAGED_WGMMA_ARGS = PAGED_ATTN_ARGS + ("kv_map",)
# The mma family's launch takes its own merge's tickets and rescale flag after them: zeroed
# tickets where the kernel merges (PagedReproCase.attn_merges), else a null pointer.
PAGED_MMA_ARGS = PAGED_ATTN_ARGS + ("attn_tickets", "merge_rescale")
PAGED_COMBINE_ARGS = ("part_acc", "part_m", "part_l", "cache_seqlens", "n_rows", "n_head",
                      "max_chunks", "attn_writes_single", "wv_b", "v_head", "out", "latent",
                      "lse", "out_part", "tickets", "chunk_counts")
# The projection's arguments (PagedDecodeStep.project_args), launched alone where the attention
# kernel merges; m_rows is B * s_q, the latent rows of a head.
PAGED_PROJECT_ARGS = ("latent", "wv_b", "n_head", "m_rows", "v_head", "out")
PAGED_SPARE_PAGES = 2   # as make_paged_inputs' default
# The registry's launch values go along, so the script's kernels static_assert them too.
NVRTC_OPTIONS = ("-std=c++17", f"-DMLA_KV_LORA={registry.KV_LORA}",
                 f"-DMLA_ROPE={registry.ROPE}", *registry.compile_defines())


def _arch_target(inst) -> str | None:
    """The arch-specific target an attention instance is built for (sm_90a), which the script
    compiles for itself; None for the others (a user kernel's instance included)."""
    arch = getattr(inst, "min_arch", None)
    return arch if arch and arch_specific.is_arch_specific(arch) else None


def _kernel_tolerance(inst, cache: str) -> tuple[dict, str, str]:
    """(TOLERANCE, the header's sentence, the comment above TOLERANCE) of a script. A kernel
    that rounds p to the cache dtype before the value product (wgmma64, mma16r, mma32r) has
    the relL2 bound registry.ROUND_P_RELL2_BOUND (the bench's spot check of those variants);
    every other kernel computes in f32 on exact inputs (compare.py's 1e-4)."""
    if getattr(inst, "round_p", False):
        t = registry.ROUND_P_RELL2_BOUND[cache]
        u = f"2^{round(math.log2(registry.UNIT_ROUNDOFF[cache]))}"
        return ({"out": t, "latent": t, "lse": 1e-4},
                f"Tolerances: relL2 {t:.6g} (out, latent), 1e-4 absolute (lse): the kernel "
                f"rounds p to {cache} before the value product; the bound is 4 x u / sqrt(3) "
                f"+ 1e-4 with u = {u}, {cache}'s unit roundoff (MARGIN times the rms relL2 "
                "of that rounding plus the f32 tolerance: mlasandbox's "
                "registry.ROUND_P_RELL2_BOUND, derived in tests/test_gpu_wgmma.py); lse stays f32.",
                f"# relL2 bound = 4 * {u} / sqrt(3) + 1e-4: p rounded to {cache}\n# (mlasandbox's "
                f"registry.ROUND_P_RELL2_BOUND['{cache}'], derived in tests/test_gpu_wgmma.py)")
    return ({"out": 1e-4, "latent": 1e-4, "lse": 1e-4},
            "Tolerances: relL2 1e-4 (out, latent), 1e-4 absolute (lse): f32 arithmetic on "
            "inputs exact in float64.",
            "# f32 arithmetic on inputs exact in float64: mlasandbox compare.py's 1e-4")


@dataclass(frozen=True)
class ReproCase:
    variant: str
    dims: Dims
    contexts: tuple
    cache_dtype: str
    q_dtype: str                 # resolved: f32, f16 or bf16
    splits: dict                 # n_ctx -> S (None for cublas)
    splits_from: str
    seed: int
    scale: float
    negative_control: bool = False
    command: str = ""

    @property
    def is_cuda(self) -> bool:
        return registry.variant(self.variant).is_cuda

    @property
    def attn_instance(self):
        v = registry.variant(self.variant)
        return (registry.attention_instance(v, self.cache_dtype, self.q_dtype) if v.is_cuda
                else None)

    @property
    def combine_instance(self):
        return (registry.combine_instance(self.cache_dtype, not self.negative_control)
                if self.is_cuda else None)


def _auto_blocks_per_sm(var, inst, cache, q, arch, num_sms):
    """(num_sms, blocks/SM, how) for the 'auto' split rule."""

    ok, why = toolkit.device_available()
    if ok:
        info = device_info()
        bps = blocks_per_sm(inst)
        return info.num_sms, bps, (f"the launcher's rule on {info.name}: {info.num_sms} SMs, "
                                   f"{bps} blocks/SM from the driver")
    arch = arch or "sm_90"
    num_sms = num_sms or 132

    row = theoretical_blocks_per_sm(var, cache, q, arch)
    return num_sms, row["blocks_per_sm"], (
        f"the launcher's rule with {num_sms} SMs and {row['blocks_per_sm']} blocks/SM from the "
        f"occupancy model of {arch} ({row['registers']} registers; no GPU at generation)")


def make_case(variant: str, *, preset: str = "h96", heads: int | None = None,
              contexts=REPRO_CONTEXTS, cache: str = "f16", q: str = "f32", splits="auto",
              seed: int = 0, negative_control: bool = False, num_sms: int | None = None,
              blocks_per_sm="auto", arch: str | None = None, min_ctx: int | None = None,
              command: str = "") -> ReproCase:
    """Resolve a case (ValueError naming any bad value)."""
    v = registry.variant(variant)
    gate = default_gate(v.hpb) if min_ctx is None else int(min_ctx)
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    dims = PRESETS[preset] if heads is None else PRESETS[preset].with_heads(int(heads))
    if dims.n_head < 1:
        raise ValueError("heads must be >= 1")
    contexts = tuple(sorted({int(c) for c in contexts}))
    if not contexts or contexts[0] < 1:
        raise ValueError(f"contexts must be >= 1, got {contexts}")
    if cache not in ("f16", "bf16"):
        raise ValueError(f"cache dtype must be f16 or bf16, got {cache!r}")
    q = cache if q == "cache" else q
    if q not in ("f32", cache):
        raise ValueError(f"q dtype must be f32 or the cache dtype ({cache}), got {q!r}")
    if splits not in ("auto", None):
        if isinstance(splits, bool) or int(splits) != splits or splits < 1:
            raise ValueError(f"splits must be 'auto' or an integer >= 1, got {splits!r}")
        splits = int(splits)
    else:
        splits = "auto"
    check_problem(n_ctx=contexts[-1], n_head=dims.n_head, splits=splits,
                  names={"n_ctx": "contexts", "n_head": "heads"})
    # the script draws its inputs and runs its float64 reference on the host, as
    # mlasandbox.reference does: refuse what this machine could not hold (as `check` does)
    check_host_memory(contexts[-1], dims.n_head, dims.key_dim, what="context",
                      engine="the script's inputs and float64 reference")
    if arch is not None:
        check_arch(arch, "arch")
        need = variant_needs(arch, v.name)
        if need:
            raise ValueError(f"{v.name} needs {need} (arch is {arch})")
    if not v.is_cuda:
        if negative_control:
            raise ValueError("the negative control is a CUDA combine; the cublas engine has none")
        if splits != "auto":
            raise ValueError("the cublas engine does not split; leave splits at 'auto'")
        plan = {n: None for n in contexts}
        how = "the cuBLAS engine does not split"
    else:
        inst = registry.attention_instance(v, cache, q)  # ValueError for a bad dtype pair
        if splits != "auto":
            if not v.splits:
                raise ValueError(f"{variant} does not split over context; splits must be 'auto'")
            plan = {n: splits for n in contexts}
            how = f"pinned: splits={splits}"
        elif not v.splits:
            plan = {n: 1 for n in contexts}
            how = "per_head: one block per head walks all of n_ctx"
        else:
            if blocks_per_sm in (None, "auto"):
                sms, bps, how = _auto_blocks_per_sm(v, inst, cache, q, arch, num_sms)
            else:
                sms, bps = num_sms or 132, int(blocks_per_sm)
                how = f"the launcher's rule with {sms} SMs and {bps} blocks/SM (given)"
            plan = {n: plan_splits(n, dims.n_head, v.hpb, num_sms=sms, blocks_per_sm=bps,
                                   split=True, min_ctx=gate, tile=inst.tile_rows).splits
                    for n in contexts}
            how += f"; split gate {gate}" if gate > 1 else "; no split gate"
    if negative_control:
        single = [n for n, s in plan.items() if s < 2]
        if single:
            raise ValueError(
                f"the negative control needs a split (S >= 2) at every context, but n_ctx "
                f"{', '.join(map(str, single))} runs one slice, where dropping the rescale "
                f"changes nothing and the script would pass; use a longer context (split: "
                f"n_ctx >= {SPLIT_MIN_CTX}), or --splits S >= 2")
    return ReproCase(variant=v.name, dims=dims, contexts=contexts, cache_dtype=cache,
                     q_dtype=q, splits=plan, splits_from=how, seed=int(seed),
                     scale=dims.default_scale, negative_control=bool(negative_control),
                     command=command)


def default_filename(case: ReproCase) -> str:
    ctx = "-".join(str(n) for n in case.contexts)
    neg = "_negctl" if case.negative_control else ""
    return (f"repro_{case.variant}_H{case.dims.n_head}_{case.cache_dtype}_q{case.q_dtype}"
            f"_n{ctx}{neg}.py")


def _engine_source() -> str:
    """cublas_engine.py, pasted into the script: only its two imports change."""

    src = inspect.getsource(cublas_engine)
    future = "from __future__ import annotations\n"
    rel = "from .bf16 import bf16_bits_to_f32, f32_to_bf16_bits\n"
    for needle in (future, rel):
        if needle not in src:
            raise RuntimeError(f"cublas_engine.py changed: {needle.strip()!r} not found; "
                               "update repro._engine_source")
    src = src.replace(future, "")
    return src.replace(rel, "# (bf16 helpers f32_to_bf16_bits, bf16_bits_to_f32: defined "
                            "above in this script)\n")


def _tensor_map_source() -> str:
    """tensor_map.py, pasted into a wgmma script: only its __future__ import goes."""
    src = inspect.getsource(tensor_map)
    future = "from __future__ import annotations\n"
    if future not in src:
        raise RuntimeError("tensor_map.py changed: its __future__ import not found; update "
                           "repro._tensor_map_source")
    return src.replace(future, "")


def _paged_attn_args(inst) -> tuple:
    """The attention kernel's arguments by name: the wgmma family's take the tensor map, the
    mma family's its merge's tickets and rescale flag."""
    kind = getattr(inst, "kind", None)
    return {"wgmma_attn": PAGED_WGMMA_ARGS, "mma_attn": PAGED_MMA_ARGS}.get(kind, PAGED_ATTN_ARGS)


def _kernel_spec(inst, **launch) -> dict:
    """What a script embeds of one kernel instance: its file, name expression, name and block
    threads, and the launch facts given (shared memory, grid, argument names...)."""
    return {"source": inst.source, "expression": inst.expression, "name": inst.name,
            "threads": inst.threads, **launch}


def _check_embeddable(name: str, text: str) -> str:
    if '"""' in text or text.rstrip().endswith("\\"):
        raise RuntimeError(f"{name} cannot be embedded in a raw triple-quoted string")
    return text


def render_script(case: ReproCase, filename: str | None = None) -> str:
    """The script's text."""

    try:
        version = metadata.version("mlasandbox")
    except metadata.PackageNotFoundError:
        version = "unknown"
    filename = filename or default_filename(case)
    d = case.dims
    ai, ci = case.attn_instance, case.combine_instance
    if ai is not None:
        attn = _kernel_spec(ai, smem_bytes=ai.smem_bytes,
                            heads_per_block=registry.variant(case.variant).hpb,
                            arch=_arch_target(ai), args=ATTN_ARGS)
        combine = _kernel_spec(ci, col_blocks=getattr(registry, "COMBINE_COL_BLOCKS", 1),
                               args=COMBINE_ARGS)
        attn_src = _check_embeddable(ai.source, read_source(ai.source))
        combine_src = _check_embeddable(ci.source, read_source(ci.source))
        engine = NO_ENGINE
        tol, tol_says, _ = _kernel_tolerance(ai, case.cache_dtype)
        kernels = f"{ai.name} + {ci.name}"
    else:
        attn = combine = None
        attn_src = combine_src = ""
        engine = ENGINE_WRAPPER.replace("@@ENGINE_SOURCE@@", _engine_source())
        t = cublas_engine.CUBLAS_TOLERANCE[case.cache_dtype]
        tol = {"out": t, "latent": t, "lse": t}
        kernels = "CuPy matmuls (cuBLAS) + softmax"
    title = (f"mlasandbox repro: {case.variant} ({kernels}), H={d.n_head}, "
             f"n_ctx={list(case.contexts)}, cache {case.cache_dtype}, q {case.q_dtype}, "
             f"seed {case.seed}" + (" [NEGATIVE CONTROL: must FAIL]" if case.negative_control
                                    else ""))
    stamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    header = (f"Generated by mlasandbox {version} on {stamp}"
              + (f":\n    {case.command}" if case.command else ".")
              + f"\nSplit counts: {case.splits_from}."
              + ("\n" + tol_says if ai is not None else
                 f"\nTolerance {tol['out']:g}: the engine rounds q, p and latent to "
                 f"{case.cache_dtype} for its tensor-core GEMMs."))
    if case.negative_control:
        header += ("\nThis is the NEGATIVE CONTROL: the combine drops the exp(m_i - m) rescale "
                   "of the slice merge, so the comparison must FAIL (exit 1). If it passes, the "
                   "check has no power at this shape.")
    values = {
        "@@TITLE@@": title, "@@HEADER@@": header, "@@FILENAME@@": filename,
        "@@VARIANT@@": repr(case.variant),
        "@@DIMS@@": repr((d.n_head, d.kv_lora, d.rope, d.v_head, d.nope)),
        "@@CACHE@@": repr(case.cache_dtype), "@@Q@@": repr(case.q_dtype),
        "@@CONTEXTS@@": repr(tuple(case.contexts)), "@@SPLITS@@": repr(dict(case.splits)),
        "@@SPLITS_FROM@@": repr(case.splits_from), "@@SEED@@": repr(case.seed),
        "@@SCALE@@": repr(float(case.scale)), "@@NEGATIVE@@": repr(case.negative_control),
        "@@TOLERANCE@@": repr(tol), "@@EXPECT@@": repr("FAIL" if case.negative_control
                                                       else "PASS"),
        "@@OPTIONS@@": repr(NVRTC_OPTIONS), "@@ATTN@@": repr(attn),
        "@@COMBINE@@": repr(combine), "@@ENGINE@@": engine,
    }
    return _fill(TEMPLATE, values, {"@@ATTN_SOURCE@@": attn_src,
                                    "@@COMBINE_SOURCE@@": combine_src})


def _fill(template: str, values: dict, sources: dict) -> str:
    """The template with its markers replaced: `values`, then `sources` (marker -> CUDA text)
    last, so nothing inside a source is taken for a marker."""
    text = template.replace("@@HELPERS@@", HELPERS)
    for k, v in {**values, **sources}.items():
        if k not in text:
            raise RuntimeError(f"the repro template lost its {k} marker")
        text = text.replace(k, v)
    return text


def _write_executable(path: str, text: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(path, 0o755)
    return path


def write_script(case: ReproCase, path: str | None = None) -> str:
    """Write the script (executable); return its path."""
    path = path or default_filename(case)
    return _write_executable(path, render_script(case, os.path.basename(path)))


# ---------------------------------------------------------------------------- batched, paged

@dataclass(frozen=True)
class PagedReproCase:
    variant: str
    dims: Dims
    lengths: tuple
    lengths_spec: str
    s_q: int
    causal: bool
    page_size: int
    cache_dtype: str
    q_dtype: str
    plan: dict            # max_chunks, min_chunk, tile, rows_per_block
    plan_from: str
    seed: int
    scale: float
    negative_control: bool = False
    command: str = ""
    # Who merges a request's chunks, fixed at generation by the step's rule (_merge_form):
    # True, the attention kernel (tickets), then the projection `project_kind` alone;
    # False, the combine's one-kernel form, which also projects (project_kind None).
    attn_merges: bool = False
    project_kind: str | None = None
    # Where `variant` is what "auto" resolved to at generation: "auto -> V on ARCH: why" (the
    # script pins V, so it runs the same kernel on any device); "" where V was asked by name.
    chosen: str = ""

    def instances(self):
        return _paged_instances(registry.variant(self.variant), self.cache_dtype, self.q_dtype,
                                not self.negative_control)

    def attn_writes_single(self) -> bool:
        """The combine's flag, as PagedDecodeStep passes it: the family's attention kernel
        writes the latent of a request of one chunk, which the merge then skips."""
        return registry.variant(self.variant).family in SINGLE_PASS_FAMILIES


def _paged_instances(var, cache: str, q: str, rescale: bool):
    """(paged attention instance, paged combine instance) from the registry."""
    return (registry.paged_attention_instance(var, cache, q),
            registry.paged_combine_instance(cache, rescale))


def _merge_form(var, max_chunks: int, cache: str, q: str, m_rows: int, n_head: int,
                num_sms: int) -> dict:
    """attn_merges and project_kind of a paged case: PagedDecodeStep's rule on the plan's chunk
    slots (registry.attn_merges, as merges_in_attn), and where it holds the projection the step
    then launches alone (registry.project_kind over the m_rows = B * s_q latent rows a head,
    with the plan's SM count)."""
    merges = registry.attn_merges(var.family, max_chunks, q, cache)
    return {"attn_merges": merges,
            "project_kind": registry.project_kind(m_rows, n_head, num_sms) if merges else None}


def make_paged_case(variant: str, *, batch: int, lengths="4096", s_q: int = 1,
                    causal: bool = False, page_size: int = 64, preset: str = "dsv3",
                    heads: int | None = None, cache: str = "f16", q: str = "f32",
                    splits="auto", seed: int = 0, negative_control: bool = False,
                    num_sms: int | None = None, blocks_per_sm="auto", arch: str | None = None,
                    command: str = "") -> PagedReproCase:
    """Resolve a batched paged case (ValueError naming any bad value). The chunk plan is
    fixed now (paged_api.plan_for_lengths with the device's, or the given / modelled, SMs and
    blocks/SM) and pinned in the script: the result does not depend on it, the launch does.
    So is `variant` "auto": resolved for the case on `arch` (else this GPU's, else sm_90),
    the variant it names pinned, what and why in `chosen`."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    dims = PRESETS[preset] if heads is None else PRESETS[preset].with_heads(int(heads))
    lens = tuple(int(n) for n in parse_lengths(lengths, batch, seed))
    s_q = check_s_q(s_q, dims.n_head, len(lens))
    check_page_size(page_size)
    check_inputs_fit(lens, s_q, page_size, dims, PAGED_SPARE_PAGES)  # the script's own draws
    if cache not in ("f16", "bf16"):
        raise ValueError(f"cache dtype must be f16 or bf16, got {cache!r}")
    q = cache if q == "cache" else q
    if q not in ("f32", cache):
        raise ValueError(f"q dtype must be f32 or the cache dtype ({cache}), got {q!r}")
    if arch is not None:
        check_arch(arch, "arch")
    # "auto" as decode_paged would pick it on the target: the given arch, else this GPU's,
    # else the H200 the plan below models
    target = arch or (toolkit.arch_of_device() if toolkit.device_available()[0] else "sm_90")
    chosen = ""
    if isinstance(variant, str) and variant == "auto":
        variant, why = auto_choice(s_q, dims.n_head,
                                   AutoFacts.of_lengths(lens, page_size, q, cache, target))
        chosen = f"auto -> {variant} on {target}: {why}"
    var = paged_variant(variant, s_q, dims.n_head)
    if not var.is_cuda:
        raise ValueError("the paged repro reproduces the CUDA kernels; the cublas engine has "
                         "no paged kernel of its own")
    chunks = None
    if splits not in ("auto", None):
        if isinstance(splits, bool) or int(splits) != splits or splits < 1:
            raise ValueError(f"splits must be 'auto' or an integer >= 1, got {splits!r}")
        if splits > CHUNK_CAP:
            raise ValueError(f"splits (every request's chunk cap in the paged step) must be at "
                             f"most {CHUNK_CAP}, got {splits}")
        chunks = int(splits)
    attn, _ = _paged_instances(var, cache, q, not negative_control)
    need = None if arch is None else instance_needs(arch, attn)
    if need:
        raise ValueError(f"{var.name} needs {need} (arch is {arch})")
    if blocks_per_sm in (None, "auto"):
        sms, bps, how = _auto_blocks_per_sm(var, attn, cache, q, arch, num_sms)
    else:
        sms, bps = num_sms or 132, int(blocks_per_sm)
        how = f"plan_chunks with {sms} SMs and {bps} blocks/SM (given)"
    n_rows = s_q * dims.n_head
    plan = plan_for_lengths(lens, page_size, n_rows, attn, num_sms=sms, blocks_per_sm=bps,
                            splits=chunks)
    n_chunks, _ = plan.for_lengths(lens)
    if negative_control and int(max(n_chunks)) < 2:
        raise ValueError("the negative control needs a request cut into at least 2 chunks, "
                         f"but every request here runs one (max_chunks {plan.max_chunks}, "
                         f"min_chunk {plan.min_chunk}): dropping the rescale would change "
                         "nothing; give a longer length or --splits N >= 2")
    return PagedReproCase(
        variant=var.name, dims=dims, lengths=lens, lengths_spec=str(lengths), s_q=int(s_q),
        causal=bool(causal), page_size=int(page_size), cache_dtype=cache, q_dtype=q,
        plan={"max_chunks": plan.max_chunks, "min_chunk": plan.min_chunk, "tile": plan.tile,
              "rows_per_block": attn.heads, "target": plan.target,
              "programs": plan.programs_per_block},
        plan_from=f"{plan.reason}; {how}", seed=int(seed), scale=dims.default_scale,
        negative_control=bool(negative_control), command=command, chosen=chosen,
        **_merge_form(var, plan.max_chunks, cache, q, len(lens) * int(s_q), dims.n_head, sms))


def default_paged_filename(case: PagedReproCase) -> str:
    neg = "_negctl" if case.negative_control else ""
    causal = "_causal" if case.causal else ""
    return (f"repro_paged_{case.variant}_B{len(case.lengths)}_sq{case.s_q}{causal}_H"
            f"{case.dims.n_head}_p{case.page_size}_{case.cache_dtype}_q{case.q_dtype}{neg}.py")


def _paged_combine(case: PagedReproCase, comb) -> tuple[dict | None, str]:
    """(COMBINE, its source) of a paged script: the combine's one-kernel form (merge, then
    project); (None, "") where the attention kernel merges and the step launches no merge."""
    if case.attn_merges:
        return None, ""
    return (_kernel_spec(comb, col_blocks=registry.COMBINE_COL_BLOCKS,
                         attn_writes_single=int(case.attn_writes_single()),
                         args=PAGED_COMBINE_ARGS),
            _check_embeddable(comb.source, read_source(comb.source)))


def _paged_project(case: PagedReproCase) -> tuple[dict | None, str]:
    """(PROJECT, its source): where the attention kernel merges, the projection the step then
    launches alone (PagedDecodeStep.projects_alone: project_grid, project_args); else
    (None, "")."""
    if not case.attn_merges:
        return None, ""
    inst = registry.project_instance(case.cache_dtype, case.project_kind)
    d = case.dims
    grid = registry.project_grid(d.n_head, d.v_head, len(case.lengths) * case.s_q, inst.kind)
    return (_kernel_spec(inst, grid=grid, args=PAGED_PROJECT_ARGS),
            _check_embeddable(inst.source, read_source(inst.source)))


def _merge_says(case: PagedReproCase) -> str:
    """The header's paragraph on who merges a request's chunks (and so what the negative
    control breaks)."""
    slots = case.plan["max_chunks"]
    if case.attn_merges:
        says = (f"Merge: the attention kernel merges (tickets), as PagedDecodeStep does here "
                f"(registry.attn_merges: mma, q in the cache dtype, {slots} chunk slots a "
                f"request, 2 to {registry.ATTN_MERGE_MAX_CHUNKS}): zeroed attn_tickets [B][row "
                f"blocks] and merge_rescale, no merge kernel, then the projection "
                f"({case.project_kind}) alone.")
        broken = "the attention kernel's merge runs with merge_rescale 0 (no exp(m_i - m) rescale)"
    else:
        says = (f"Merge: the merge kernel merges (the combine's one-kernel form, which also "
                f"projects): registry.attn_merges does not hold for {case.variant}, q "
                f"{case.q_dtype}, cache {case.cache_dtype} and {slots} chunk slots a request.")
        broken = "the combine drops the exp(m_i - m) rescale of the chunk merge"
    says = textwrap.fill(says, 92)
    if case.negative_control:
        says += f"\nThis is the NEGATIVE CONTROL: {broken}, so the comparison must FAIL (exit 1)."
    return says


def render_paged_script(case: PagedReproCase, filename: str | None = None) -> str:
    attn, comb = case.instances()
    # a user kernel (user_kernel.py) brings its own text and -D options
    attn_text = attn.source_text() if hasattr(attn, "source_text") else read_source(attn.source)
    options = NVRTC_OPTIONS + tuple(f"-D{d}" for d in getattr(attn, "defines", ()))
    tolerance, tolerance_says, tolerance_from = _kernel_tolerance(attn, case.cache_dtype)
    attn_args = _paged_attn_args(attn)
    combine, combine_src = _paged_combine(case, comb)
    project, project_src = _paged_project(case)
    d = case.dims
    title = (f"mlasandbox repro: paged {case.variant} ({attn.name} + "
             f"{(combine or project)['name']}), B={len(case.lengths)}, lengths "
             f"{case.lengths_spec}, s_q={case.s_q}{' causal' if case.causal else ''}, "
             f"H={d.n_head}, page {case.page_size}, cache {case.cache_dtype}, q {case.q_dtype}, "
             f"seed {case.seed}" + (" [NEGATIVE CONTROL: must FAIL]" if case.negative_control
                                    else ""))
    stamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    header = (f"Generated on {stamp}" + (f":\n    {case.command}" if case.command else ".")
              + (f"\n{textwrap.fill(case.chosen + '; this script pins it.', 92)}"
                 if case.chosen else "")
              + f"\nChunk plan: {case.plan_from}.\n" + textwrap.fill(tolerance_says, 92)
              + "\n" + _merge_says(case))
    values = {
        "@@TITLE@@": title, "@@HEADER@@": header,
        "@@FILENAME@@": filename or default_paged_filename(case),
        "@@VARIANT@@": repr(case.variant),
        "@@DIMS@@": repr((d.n_head, d.kv_lora, d.rope, d.v_head, d.nope)),
        "@@CACHE@@": repr(case.cache_dtype), "@@Q@@": repr(case.q_dtype),
        "@@LENGTHS@@": repr(tuple(case.lengths)), "@@S_Q@@": repr(case.s_q),
        "@@CAUSAL@@": repr(case.causal), "@@PAGE_SIZE@@": repr(case.page_size),
        "@@SPARE_PAGES@@": repr(PAGED_SPARE_PAGES), "@@SEED@@": repr(case.seed),
        "@@SCALE@@": repr(float(case.scale)), "@@PLAN@@": repr(dict(case.plan)),
        "@@PLAN_FROM@@": repr(case.plan_from), "@@NEGATIVE@@": repr(case.negative_control),
        "@@ATTN_MERGES@@": repr(case.attn_merges),
        "@@TOLERANCE@@": repr(tolerance), "@@TOLERANCE_FROM@@": tolerance_from,
        "@@EXPECT@@": repr("FAIL" if case.negative_control else "PASS"),
        "@@OPTIONS@@": repr(options),
        "@@ATTN@@": repr(_kernel_spec(attn, smem_bytes=attn.smem_bytes,
                                      arch=_arch_target(attn), args=attn_args)),
        "@@TENSOR_MAP@@": (TENSOR_MAP.replace("@@TENSOR_MAP_SOURCE@@", _tensor_map_source())
                           if attn_args == PAGED_WGMMA_ARGS else ""),
        "@@COMBINE@@": repr(combine), "@@PROJECT@@": repr(project),
    }
    return _fill(PAGED_TEMPLATE, values, {"@@ATTN_SOURCE@@": _check_embeddable(attn.source,
                                                                                attn_text),
                                          "@@COMBINE_SOURCE@@": combine_src,
                                          "@@PROJECT_SOURCE@@": project_src})


def paged_runs_on(case: PagedReproCase) -> str:
    """The one device arch the case's attention kernel runs on ('sm_90' for an sm_90a
    kernel), '' where any arch the family compiles for will do."""
    target = _arch_target(case.instances()[0])
    return arch_specific.base_arch(target) if target else ""


def write_paged_script(case: PagedReproCase, path: str | None = None) -> str:
    """Write the paged script (executable); return its path."""
    path = path or default_paged_filename(case)
    return _write_executable(path, render_paged_script(case, os.path.basename(path)))
