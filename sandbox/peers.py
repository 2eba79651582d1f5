"""Other implementations of the same paged decode step, timed beside ours (`bench --peers`).

    peers, skipped = load_peers(("flashmla", "torch"))   # skipped: [{"name", "reason"}]
    run = peers["torch"].prepare(inputs, stream_ptr)       # inputs: PeerInputs on the device
    latent, lse = run()          # torch tensors: [B, s_q, H, 512], [B, s_q, H]

* `flashmla`: FlashMLA's SM90 dense decode from the `sgl-flash-mla` wheel (SGLang's fork),
  `flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
  tile_scheduler_metadata, num_splits=None, softmax_scale=, causal=, use_legacy=True)` with
  `tile_scheduler_metadata` the FlashMLASchedMeta of `get_mla_metadata()` (filled by the first
  call and reused: the lengths do not change within a run). q [B, s_q, H, 576] and the cache
  [num_pages, 64, 1, 576] in bf16 or f16; returns out [B, s_q, H, 512] in q's dtype and lse
  [B, H, s_q] f32 (natural log). Page size 64 only.
* `torch`: the step in torch eager ops, in float32: gather each request's pages through the
  table, q.k, masked softmax (logsumexp), p.v.
* `flashinfer`: `flashinfer.mla.BatchMLAPagedAttentionWrapper` (plan on the CSR form of the
  table, run on q split into its 512 latent and 64 rope columns), where installed.

Every peer runs on the 16-bit q (q rounded to the cache dtype: FlashMLA takes no f32 q), on
the bench's stream (torch.cuda.ExternalStream), and writes latent and lse only: no wv_b
projection. A peer that cannot load is skipped with the reason (its ImportError text).
torch and the peers' packages are an optional extra (`pip install -e '.[peers]'`), so they are
imported when a peer loads, never with this module.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .bf16 import as_f32, to_storage
from .compare import DEFAULT_TOLERANCE, Tolerance
from .paged import PagedResult

__all__ = ["PEER_NAMES", "PeerUnavailable", "PeerInputs", "load_peers", "peer_q",
           "FLASHMLA_TOLERANCE", "tolerance_of", "TorchPeer", "FlashMLAPeer",
           "FlashInferPeer", "to_result"]

PEER_NAMES = ("flashmla", "torch", "flashinfer")
FLASHMLA_PAGE_SIZE = 64

# FlashMLA rounds p (the softmax weights) to the q dtype for its p.v MMA and writes its output
# in that dtype: two roundings, each within half an ulp, 2^-9 relative for bf16 (8 significand
# bits) and 2^-12 for f16 (11). Their sum bounds the relative error of every latent element,
# so the relL2 of latent by 2^-8 (bf16) and 2^-11 (f16). lse is summed from the f32 scores
# (the 16-bit q and cache are exact inputs), so it keeps the f32 limit of the CUDA variants.
FLASHMLA_TOLERANCE = {"bf16": Tolerance(2.0 ** -8, 2.0 ** -8, DEFAULT_TOLERANCE.lse_abs),
                      "f16": Tolerance(2.0 ** -11, 2.0 ** -11, DEFAULT_TOLERANCE.lse_abs)}


class PeerUnavailable(RuntimeError):
    """A peer that cannot run here (not installed, no device, a shape it does not take)."""


@dataclass
class PeerInputs:
    """One step's device arrays (CuPy) and the facts a peer needs on the host."""

    q: Any              # [B, s_q, H, 576], the cache dtype (peer_q)
    kv_cache: Any       # [num_pages, page_size, 576]
    block_table: Any    # [B, max_pages] int32
    cache_seqlens: Any  # [B] int32
    lengths: np.ndarray  # host copy of cache_seqlens
    block_table_host: np.ndarray
    cache_dtype: str
    scale: float
    causal: bool
    kv_lora: int = 512   # the latent columns of a cache row (the rest is rope)


def peer_q(q_host, cache_dtype: str) -> np.ndarray:
    """The q every peer runs on: q rounded to the cache dtype (a no-op when it is one)."""
    return to_storage(as_f32(q_host, np), cache_dtype, np)


def tolerance_of(name: str, cache_dtype: str) -> Tolerance:
    if name == "flashmla" or name == "flashinfer":  # both round p and out to 16 bits
        return FLASHMLA_TOLERANCE[cache_dtype]
    return DEFAULT_TOLERANCE  # torch: float32 arithmetic throughout, as the CUDA variants


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _torch():
    try:
        import torch
    except ImportError as exc:
        raise PeerUnavailable(f"torch is not installed ({_reason(exc)}); pip install -e "
                              "'.[peers]'") from None
    if not torch.cuda.is_available():
        raise PeerUnavailable("torch sees no CUDA device")
    return torch


def _tensor(torch, arr, cache_dtype: str | None = None):
    """A zero-copy torch view of a CuPy array; uint16 words are bf16 where the cache is."""
    t = torch.from_dlpack(arr)
    if str(arr.dtype) == "uint16" and cache_dtype == "bf16":
        t = t.view(torch.bfloat16)
    return t


def _on_stream(torch, stream_ptr: int, fn):
    stream = torch.cuda.ExternalStream(int(stream_ptr))

    def run():
        with torch.cuda.stream(stream):
            return fn()
    return run


class TorchPeer:
    """The step in torch eager ops, float32 (TF32 off for its matmuls)."""

    name = "torch"

    def __init__(self):
        self.torch = _torch()

    def prepare(self, inp: PeerInputs, stream_ptr: int):
        torch = self.torch
        q = _tensor(torch, inp.q, inp.cache_dtype)
        cache = _tensor(torch, inp.kv_cache, inp.cache_dtype)
        B, s_q, H, K = q.shape
        num_pages, page = cache.shape[0], cache.shape[1]
        kv_lora = inp.kv_lora
        max_len = int(inp.lengths.max()) if inp.lengths.size else 0
        n_pages = max(1, -(-max_len // page))
        dev = q.device
        table = torch.from_dlpack(inp.block_table)[:, :n_pages].long().clamp(0, num_pages - 1)
        idx = (table[:, :, None] * page + torch.arange(page, device=dev)).reshape(B, -1)
        lens = torch.from_dlpack(inp.cache_seqlens).long()
        pos = torch.arange(idx.shape[1], device=dev)
        keep = pos[None, :] < lens[:, None]                                  # [B, T]
        ahead = torch.arange(s_q - 1, -1, -1, device=dev) if inp.causal else \
            torch.zeros(s_q, dtype=torch.long, device=dev)
        visible = (lens[:, None] - ahead[None, :]).repeat_interleave(H, dim=1)  # [B, s_q*H]
        seen = pos[None, None, :] < visible[:, :, None]                      # [B, rows, T]
        flat = cache.reshape(-1, K)
        scale = float(inp.scale)

        def step():
            tf32 = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = False
            try:
                kv = flat[idx].float()
                kv = torch.where(keep[..., None], kv, torch.zeros((), device=dev))
                s = torch.bmm(q.reshape(B, s_q * H, K).float(), kv.transpose(1, 2)) * scale
                s = s.masked_fill(~seen, -math.inf)
                lse = torch.logsumexp(s, dim=-1)
                p = torch.nan_to_num(torch.exp(s - lse[..., None]), nan=0.0)
                latent = torch.bmm(p, kv[..., :kv_lora])
            finally:
                torch.backends.cuda.matmul.allow_tf32 = tf32
            return latent.reshape(B, s_q, H, kv_lora), lse.reshape(B, s_q, H)
        return _on_stream(torch, stream_ptr, step)


class FlashMLAPeer:
    """FlashMLA's SM90 dense decode (legacy kernels of the sgl-flash-mla wheel)."""

    name = "flashmla"

    def __init__(self):
        self.torch = _torch()
        try:
            from flash_mla import flash_mla_with_kvcache, get_mla_metadata
        except ImportError as exc:
            raise PeerUnavailable(f"{_reason(exc)}; install the sgl-flash-mla wheel "
                                  "(pip install --no-deps sgl_flash_mla-*.whl)") from None
        self.flash_mla_with_kvcache, self.get_mla_metadata = (flash_mla_with_kvcache,
                                                              get_mla_metadata)

    def prepare(self, inp: PeerInputs, stream_ptr: int):
        torch = self.torch
        q = _tensor(torch, inp.q, inp.cache_dtype)
        cache = _tensor(torch, inp.kv_cache, inp.cache_dtype)
        if cache.shape[1] != FLASHMLA_PAGE_SIZE:
            raise PeerUnavailable(f"FlashMLA takes page_size {FLASHMLA_PAGE_SIZE}, the bench "
                                  f"runs {cache.shape[1]}")
        k_cache = cache.reshape(cache.shape[0], cache.shape[1], 1, cache.shape[2])
        table = torch.from_dlpack(inp.block_table)
        seqlens = torch.from_dlpack(inp.cache_seqlens)
        sched, _ = self.get_mla_metadata()
        kv_lora = inp.kv_lora

        def step():
            out, lse = self.flash_mla_with_kvcache(
                q, k_cache, table, seqlens, kv_lora, sched, None,
                softmax_scale=float(inp.scale), causal=bool(inp.causal), use_legacy=True)
            return out, lse.transpose(1, 2)       # lse [B, H, s_q] -> [B, s_q, H]
        return _on_stream(torch, stream_ptr, step)


class FlashInferPeer:
    """FlashInfer's BatchMLAPagedAttentionWrapper (planned once on the table's CSR form)."""

    name = "flashinfer"

    def __init__(self):
        self.torch = _torch()
        try:
            from flashinfer.mla import BatchMLAPagedAttentionWrapper
        except ImportError as exc:
            raise PeerUnavailable(_reason(exc)) from None
        self.wrapper_cls = BatchMLAPagedAttentionWrapper

    def prepare(self, inp: PeerInputs, stream_ptr: int):
        torch = self.torch
        q = _tensor(torch, inp.q, inp.cache_dtype)
        cache = _tensor(torch, inp.kv_cache, inp.cache_dtype)
        B, s_q, H, K = q.shape
        L = inp.kv_lora
        dev = q.device
        need = [-(-int(n) // cache.shape[1]) for n in inp.lengths]
        indices = np.concatenate([inp.block_table_host[b, :need[b]] for b in range(B)]
                                 + [np.zeros(0, np.int32)]).astype(np.int32)
        as_dev = (lambda a: torch.as_tensor(np.asarray(a, np.int32), device=dev))
        qo_indptr = as_dev(np.arange(B + 1) * s_q)
        kv_indptr = as_dev(np.concatenate([[0], np.cumsum(need)]))
        q_nope = q.reshape(B * s_q, H, K)[..., :L].contiguous()
        q_pe = q.reshape(B * s_q, H, K)[..., L:].contiguous()
        ckv, kpe = cache[..., :L].contiguous(), cache[..., L:].contiguous()
        workspace = torch.empty(128 << 20, dtype=torch.int8, device=dev)
        wrapper = self.wrapper_cls(workspace)
        wrapper.plan(qo_indptr, kv_indptr, as_dev(indices), as_dev(inp.lengths), H, L, K - L,
                     cache.shape[1], bool(inp.causal), float(inp.scale), q.dtype, cache.dtype)

        def step():
            out, lse = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True)
            # FlashInfer keeps its lse in base 2; the contract's is natural
            return out.reshape(B, s_q, H, L), (lse * math.log(2.0)).reshape(B, s_q, H)
        return _on_stream(torch, stream_ptr, step)


_PEERS = {"flashmla": FlashMLAPeer, "torch": TorchPeer, "flashinfer": FlashInferPeer}


def load_peers(names) -> tuple[dict, list]:
    """({name: peer} of those that load, [{"name", "reason"}] of those that do not)."""
    loaded, skipped = {}, []
    for name in names:
        if name not in _PEERS:
            raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEER_NAMES)}")
        try:
            loaded[name] = _PEERS[name]()
        except PeerUnavailable as exc:
            skipped.append({"name": name, "reason": str(exc)})
        except Exception as exc:  # a broken install (a missing shared library, an ABI error)
            skipped.append({"name": name, "reason": _reason(exc)})
    return loaded, skipped


def to_result(latent, lse) -> PagedResult:
    """A peer's torch outputs as a host PagedResult (no out: the peers do no wv_b)."""
    return PagedResult(latent=latent.float().cpu().numpy(), lse=lse.float().cpu().numpy())
