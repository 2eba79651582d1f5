"""The memory ablation: what the cache loads cost a kernel (`mlasandbox ablate`).

A variant's attention kernel is built a second time with -DMLA_ABLATE_CACHE_LOADS
(mla_common.cuh): it copies only the first tile into each stage buffer and computes every
later tile on those rows. It issues the real kernel's instructions minus the cache copies, so
its time is what the design costs with free memory (its compute floor), and

    loads share = 1 - t(ablated) / t(real)

is the part of the real time that the loads add. A share near 0 says a faster memory system
(or fewer bytes, or multicast) would not help: the instructions are the limit. A share near
1 - (compute floor / one-read time) says the kernel is bound by what it reads. The ablated
results are wrong by design; the run checks only that they differ from the real ones, which
shows the ablated build really is another kernel.

Noise (noise.py, the A/A test): the real kernel is timed as two arms of the same code
(A and A') interleaved with the ablated one (B), round by round; the A/A pairs give the
floor, and a B-vs-A difference under it is "no measurable difference", not a number.

`ablate` runs the batch-1 step (one contiguous cache), `ablate_paged` a paged serving step:
the paged launch of the variant's kernel (wgmma64 has no other), over requests of given
lengths in a paged cache.

Needs a CUDA device.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .api import DecodeStep
from .compare import rel_l2
from .inputs import make_inputs
from .kernels import device_info, get_kernel
from .noise import NoiseFloor, Verdict, noise_floor, verdict
from .timing import L2Flush, percentile, time_gpu

__all__ = ["ABLATE_DEFINE", "Ablation", "ablate", "ablate_paged", "loads_share"]

ABLATE_DEFINE = "MLA_ABLATE_CACHE_LOADS"


def loads_share(real_us: float, ablated_us: float) -> float:
    """The share of the real time that the cache loads add: 1 - ablated / real (>= 0)."""
    if not (real_us > 0 and ablated_us > 0):
        raise ValueError(f"times must be positive, got real {real_us}, ablated {ablated_us}")
    return max(0.0, 1.0 - ablated_us / real_us)


@dataclass(frozen=True)
class Ablation:
    variant: str
    kernel: str
    n_head: int
    n_ctx: int
    cache: str
    q: str
    splits: int
    head_blocks: int
    real_us: float            # median of the A and A' round medians
    ablated_us: float         # median of the B round medians
    share: float              # loads_share(real_us, ablated_us); 0 when not measurable
    floor: NoiseFloor         # from the A/A pairs
    verdict: Verdict          # ablated vs real, against the floor
    output_change: float      # relL2 of the ablated latent against the real one (> 0;
                              # inf where the ablated one is not finite)
    paged: dict | None = None  # the paged step (batch, lengths, page_size, s_q, causal);
                               # then n_ctx is the longest request, splits the chunk slots

    def as_dict(self) -> dict:
        d = asdict(self)
        d["floor"], d["verdict"] = self.floor.as_dict(), self.verdict.as_dict()
        return d


def _interleaved(step, rounds: int, timing_kw, nothing_to_ablate):
    """(real_us, ablated_us, floor, verdict, output change) of `step`'s attention kernel
    against its load-ablated build, timed A A' B, B A' A, ... `nothing_to_ablate()` is the
    message of the ValueError raised when the ablated build computes what the real one does."""
    import cupy

    real_kernel = step.attn_kernel
    ablated_kernel = get_kernel(step.attn_inst, (ABLATE_DEFINE,))

    def latent_with(kernel):
        step.attn_kernel = kernel
        step.run()
        return cupy.array(step.latent, copy=True)

    real_latent = latent_with(real_kernel)
    ablated_latent = latent_with(ablated_kernel)
    step.attn_kernel = real_kernel
    if bool(cupy.array_equal(ablated_latent, real_latent)):  # every slice fit the buffers
        raise ValueError(nothing_to_ablate())
    # Kernels whose score partials borrow the spare tile buffer (batched) compute the
    # later tiles on those partials' bits, often NaN: a relL2 of inf. Float pipes take NaN at
    # full speed, so the timing is unaffected.
    change = rel_l2(ablated_latent, real_latent)
    change = change if math.isfinite(change) else math.inf

    flush = L2Flush(device_info().l2_bytes)
    kw = {"warmup": 3, "min_repeats": 10, "max_repeats": 100, "target_s": 0.1,
          **(timing_kw or {})}

    def median_of(kernel) -> float:
        step.attn_kernel = kernel
        return time_gpu(step.run_attn, flush=flush, **kw).median_us

    arms = {"a": [], "a2": [], "b": []}
    kernels = {"a": real_kernel, "a2": real_kernel, "b": ablated_kernel}
    for i in range(rounds):  # A A' B, B A' A, ...: drift through the run hits every arm alike
        order = ("a", "a2", "b") if i % 2 == 0 else ("b", "a2", "a")
        for arm in order:
            arms[arm].append(median_of(kernels[arm]))
    step.attn_kernel = real_kernel
    floor = noise_floor(arms["a"], arms["a2"])
    real_us = percentile(sorted(arms["a"] + arms["a2"]), 0.5)
    ablated_us = percentile(sorted(arms["b"]), 0.5)
    return real_us, ablated_us, floor, verdict(ablated_us, real_us, floor.floor), change


def _result(step, n_head, n_ctx, cache, q, splits, head_blocks, measured, paged=None):
    real_us, ablated_us, floor, v, change = measured
    return Ablation(variant=step.variant.name, kernel=step.attn_inst.name, n_head=n_head,
                    n_ctx=n_ctx, cache=cache, q=q, splits=splits, head_blocks=head_blocks,
                    real_us=real_us, ablated_us=ablated_us,
                    share=loads_share(real_us, ablated_us) if v.measurable else 0.0,
                    floor=floor, verdict=v, output_change=change, paged=paged)


def ablate(variant: str, dims, n_ctx: int, cache: str = "f16", q: str = "f32", splits=None,
           rounds: int = 5, seed: int = 0, timing_kw: dict | None = None) -> Ablation:
    """Time `variant`'s attention phase at (dims, n_ctx) real and load-ablated, interleaved.

    `dims` is a Dims or a preset name; `q` is "f32" or the cache dtype. Raises ValueError for
    a variant without a CUDA kernel, and for a context so short that every slice fits the
    kernel's stage buffers (then the ablated build loads everything the real one does).
    """
    import cupy

    if rounds < 2:
        raise ValueError(f"rounds must be >= 2 (the A/A floor needs pairs), got {rounds}")
    inp = make_inputs(dims, n_ctx, n_ctx, cache_dtype=cache, q_dtype=q, seed=seed, xp=cupy)
    step = DecodeStep(**inp.decode_args(), variant=variant, splits=splits)
    if step.plan is None:
        raise ValueError(f"variant {variant!r} has no CUDA kernel to ablate (the cuBLAS engine "
                         f"reads the cache inside cuBLAS)")

    def nothing():
        slice_rows = -(-n_ctx // step.plan.splits)
        return (f"-D{ABLATE_DEFINE} changed nothing for {step.attn_inst.name} at n_ctx "
                f"{n_ctx}: each of its {step.plan.splits} slices holds at most {slice_rows} "
                f"rows, which its stage buffers take whole (tiles of "
                f"{step.attn_inst.tile_rows} rows); ablate a longer context")

    measured = _interleaved(step, rounds, timing_kw, nothing)
    return _result(step, step.dims.n_head, n_ctx, cache, q, step.plan.splits,
                   step.plan.head_blocks, measured)


def ablate_paged(variant: str, dims, lengths, *, page_size: int = 64, s_q: int = 1,
                 causal: bool = False, cache: str = "f16", q: str = "f16", splits=None,
                 rounds: int = 5, seed: int = 0, timing_kw: dict | None = None) -> Ablation:
    """The same for a paged serving step: requests of `lengths` in pages of `page_size`,
    s_q query tokens each (causal as the paged contract says). Raises ValueError for a
    variant without a paged CUDA kernel, and for a batch whose chunks all fit the kernel's
    stage buffers."""
    import cupy

    from .paged_api import PagedDecodeStep
    from .paged_inputs import make_paged_inputs

    if rounds < 2:
        raise ValueError(f"rounds must be >= 2 (the A/A floor needs pairs), got {rounds}")
    lengths = [int(n) for n in lengths]
    inp = make_paged_inputs(dims, lengths, s_q=s_q, page_size=page_size, cache_dtype=cache,
                            q_dtype=q, causal=causal, seed=seed, xp=cupy)
    step = PagedDecodeStep(**inp.decode_args(), variant=variant, splits=splits)
    if not step.variant.is_cuda:
        raise ValueError(f"variant {variant!r} has no CUDA kernel to ablate (the cuBLAS engine "
                         f"reads the cache inside cuBLAS)")

    def nothing():
        return (f"-D{ABLATE_DEFINE} changed nothing for {step.attn_inst.name}: every chunk of "
                f"this batch (longest request {max(lengths)} positions, up to "
                f"{step.plan.max_chunks} chunks a request) fits its stage buffers (tiles of "
                f"{step.attn_inst.tile_rows} rows); ablate longer requests")

    measured = _interleaved(step, rounds, timing_kw, nothing)
    paged = {"batch": len(lengths), "lengths": lengths, "page_size": page_size, "s_q": s_q,
             "causal": bool(causal)}
    return _result(step, step.shape.n_head, max(lengths), cache, q, step.plan.max_chunks,
                   step.plan.head_blocks, measured, paged)
