"""A fake bench backend: the interface of mlasandbox.bench_gpu.CupyBackend, with timings from a
small deterministic model instead of a GPU. It drives run_bench, run_sweep and the CLI on the
CPU; `jitter`, `drift`, `fail_check` and `aa_kernels` plant the situations the report must
handle (noise, an unstable harness, a wrong kernel, an A/A that is not A/A)."""
from __future__ import annotations

import random

from mlasandbox import registry
from mlasandbox.splits import plan_splits
from mlasandbox.timing import Timing, summarize

# What a timing's clocks look like where the power cap held the SM clock in most reads.
FAKE_CLOCKS = {"clock_samples": 12, "sm_mhz": 1905.0, "sm_mhz_min": 1890.0, "power_w": 681.0,
               "power_capped": 0.75, "thermal": 0.0}


class FakeBackend:
    arch = "sm_90"
    num_sms = 132

    def __init__(self, jitter=0.005, drift=0.0, fail_check=(), aa_kernels=None, seed=1,
                 scale=1.0):
        self.rng = random.Random(seed)
        self.jitter, self.drift, self.fail_check = jitter, drift, set(fail_check)
        self.aa_kernels = aa_kernels
        self.scale = scale
        self.calls: list = []
        self.controls = 0
        self.dims = None

    # ---- run-level
    def meta(self):
        return {"device": "Fake H200", "arch": "sm_90", "num_sms": 132, "l2_bytes": 50 << 20,
                "driver": "13.0", "cuda_runtime": "13.0", "cupy": "14.2.0", "commit": "abc123",
                "date": "2026-01-01T00:00:00+00:00", "clocks": "NVML every 5 ms (fake)"}

    def ceilings(self, copy_bytes, gemm_n, timing_kw):
        self.calls.append(("ceilings",))
        return {"copy_GBps": 4000.0, "gemm_TFLOPs": 700.0, "fma_TFLOPs": 65.0,
                "copy_bytes": copy_bytes,
                "gemm_n": gemm_n}

    def prepare(self, dims, n_alloc, cache, q, seed):
        self.calls.append(("prepare", dims.n_head, n_alloc, cache, q))
        self.dims = dims

    def release_steps(self):
        self.calls.append(("release_steps",))

    def release(self):
        self.calls.append(("release",))

    # ---- plans and times
    def plan(self, variant, n_ctx, splits):
        v = registry.variant(variant)
        if not v.is_cuda:
            return {"splits": None, "head_blocks": None, "heads_per_block": None,
                    "attn_kernel": "cuBLAS engine (CuPy)"}
        inst = registry.attention_instance(v)
        p = plan_splits(n_ctx, self.dims.n_head, v.hpb, num_sms=132, blocks_per_sm=2,
                        splits=None if splits == "auto" or not v.splits else splits,
                        split=v.splits, tile=inst.tile_rows)
        kernel = inst.name
        if self.aa_kernels and variant in self.aa_kernels:
            kernel = self.aa_kernels[variant]
        return {"splits": p.splits, "head_blocks": p.head_blocks,
                "heads_per_block": p.heads_per_block, "waves": p.waves,
                "attn_kernel": kernel, "attn_num_regs": 100, "driver_blocks_per_sm": 2,
                "reason": p.reason}

    def _attn_us(self, variant, n_ctx, splits):
        v = registry.variant(variant)
        if not v.is_cuda:
            return 40.0 + 0.002 * n_ctx
        p = self.plan(variant, n_ctx, splits)
        serial = n_ctx / p["splits"]          # rows each block walks
        passes = p["head_blocks"] / 264       # waves of blocks
        return 3.0 + 0.045 * serial * max(1.0, passes)

    def _timing(self, us, mode="events"):
        us *= self.scale
        samples = [us * (1 + self.jitter * self.rng.uniform(-1, 1)) for _ in range(15)]
        return Timing(summarize(samples), mode, "", samples, clocks=FAKE_CLOCKS)

    def time(self, variant, n_ctx, phase, splits, use_graph, timing_kw):
        self.calls.append(("time", variant, n_ctx, phase, use_graph))
        mode = "graph" if use_graph else "events"
        attn = self._attn_us(variant, n_ctx, splits)
        s = self.plan(variant, n_ctx, splits)["splits"] or 1
        combine = 2.0 + 0.05 * s if registry.variant(variant).is_cuda else 9.0  # engine: wv_b
        us = {"attn": attn, "combine": combine, "step": 5.0 + attn + combine}[phase]
        return self._timing(us, mode)

    def time_floor(self, variant, n_ctx, splits, timing_kw):
        """The launch floor: a graph of the step's empty kernels (None for the engine)."""
        self.calls.append(("floor", variant, n_ctx))
        if not registry.variant(variant).is_cuda:
            return None
        return self._timing(4.0, "graph")

    def time_control(self, use_graph, timing_kw):
        self.calls.append(("control", use_graph))
        self.controls += 1
        return self._timing(5.0 * (1 + self.drift * (self.controls - 1)),
                            "graph" if use_graph else "events")

    def check(self, variants, dims, n_ctx, cache, q, seed, splits):
        self.calls.append(("check", tuple(variants), dims.n_head, n_ctx))
        out = []
        for v in variants:
            bad = v in self.fail_check
            out.append({"variant": v, "n_ctx": n_ctx, "heads": dims.n_head, "splits": 1,
                        "ok": not bad, "out_relL2": 0.5 if bad else 1e-7,
                        "latent_relL2": 0.5 if bad else 1e-7, "lse_abs": 1e-6,
                        "tolerance": 1e-4, "detail": "planted failure" if bad else ""})
        return out
