"""The correctness battery a kernel of the paged contract must pass (a user kernel under
`mlasandbox try`, or any variant name).

Each case runs one PagedDecodeStep (the variant's attention, the built-in combine and wv_b)
under the synchronizing launch guard, so a fault is reported by the phase and kernel that
made it. The inputs are make_paged_inputs' (a permuted block table; NaN in every unused page
and past each length in its last page; INVALID_PAGE in every table entry past a request's
pages) from a fresh seed per run, printed so a failure can be rerun. Before the launch the
partials and the outputs are poisoned with NaN: a partial the combine reads but the kernel
never wrote, or an output row never written, fails; the chunk counts with -1, so counts the
kernel never published fail every row that sees a position. out, latent and lse are compared
with the float64 reference (reference.decode_paged) by compare_paged: relL2 1e-4 for out and
latent, 1e-4 absolute for lse (compare.py derives them: a correct f32 kernel errs by 1e-6 .. 5e-6 at
these depths, one skipped 32-row tile by 1e-3 or more), rows that see nothing exactly latent 0
and lse -inf, NaN never passing.

The cases: contexts 1, 4095, 4096, 4097, 12289, 20000 (around the split gate and the 4096
tile and page edges); every chunk count 1..8 of one request and more chunks than a short
request can take; head counts that leave a partial last group of rows for any rows per
block; batched paged cases with empty requests, page sizes 1, 16, 64, s_q 1, 2, 4, causal;
bf16 and a 16-bit query.
"""
from __future__ import annotations

import os
import re
import secrets
import time
from dataclasses import dataclass

import numpy as np

from .compare_paged import compare_paged
from .dims import preset
from .paged_inputs import make_paged_inputs
from .reference import decode_paged as reference_decode_paged

__all__ = ["Case", "CaseResult", "battery_cases", "fast_cases", "run_case", "run_battery",
           "BOUNDARY_CONTEXTS"]

BOUNDARY_CONTEXTS = (1, 4095, 4096, 4097, 12289, 20000)


@dataclass(frozen=True)
class Case:
    what: str                 # why the case is there
    heads: int
    lengths: tuple
    s_q: int = 1
    causal: bool = False
    page_size: int = 64
    splits: object = None     # None: the chunk rule; N: every request's chunk cap
    cache: str = "f16"
    q: str = "f32"
    wv_b: bool = True

    def label(self) -> str:
        lens = ",".join(map(str, self.lengths))
        return (f"H={self.heads} s_q={self.s_q}{' causal' if self.causal else ''} "
                f"page={self.page_size} splits={self.splits or 'auto'} {self.cache}/q {self.q} "
                f"lengths={lens}")


@dataclass
class CaseResult:
    case: Case
    ok: bool
    reason: str               # "" when ok
    worst: str                # the worst position (request, query token, head, column)
    seed: int
    seconds: float
    errors: dict              # field -> error (relL2 or max abs)
    failed: tuple = ()        # the fields that failed (out, latent, lse, empty rows)

    def as_dict(self) -> dict:
        return {"what": self.case.what, "case": self.case.label(), "ok": self.ok,
                "reason": self.reason, "failed": list(self.failed), "worst": self.worst,
                "seed": self.seed, "seconds": round(self.seconds, 3), "errors": self.errors}


def battery_cases(heads=(16,), contexts=BOUNDARY_CONTEXTS, rows_per_block: int = 1,
                  batch: int | None = None, lengths=None) -> list[Case]:
    """The battery: `heads` for the context cases, `rows_per_block` to pick head counts that
    leave a partial last group; `batch` and `lengths` (a list) add one batched case."""
    h0 = heads[0]
    out = [Case(f"context {n}", h, (n,)) for h in heads for n in contexts]
    out += [Case(f"{k} chunks of one request", h0, (3000,), splits=k) for k in range(1, 9)]
    out.append(Case("more chunks than a short request can take", h0, (20, 1, 0), splits=16,
                    page_size=16))
    partial = sorted({1, 3, rows_per_block + 1, 2 * rows_per_block - 1} - {0})
    out += [Case(f"partial head group (H={h})", h, (140, 4097), page_size=16)
            for h in partial if h % max(rows_per_block, 1) or h == 1]
    out += [
        Case("batch with empty requests, page 64", h0, (0, 1, 20, 140, 4097, 0)),
        Case("batch, page 16, s_q 2 causal", 3, (0, 20, 140, 4096), s_q=2, causal=True,
             page_size=16),
        Case("batch, page 1, s_q 4 causal", 9, (1, 2, 5, 300), s_q=4, causal=True,
             page_size=1),
        Case("bf16 cache and query, no wv_b", h0, (4095, 0, 700), cache="bf16", q="bf16",
             wv_b=False),
        Case("f16 query", h0, (2000,), q="f16", page_size=16),
    ]
    if batch is not None and lengths is not None:
        out.append(Case(f"batch {batch} (--batch/--lengths)", h0,
                        tuple(int(x) for x in np.resize(np.asarray(lengths), batch))))
    return out


def fast_cases(rows_per_block: int = 1) -> list[Case]:
    """A few seconds' subset for --watch: a boundary context, a partial group, a batch."""
    h = rows_per_block + 1 if rows_per_block > 1 else 3
    return [Case("context 4097", 16, (4097,)),
            Case(f"partial head group (H={h})", h, (140, 1000), page_size=16),
            Case("batch with empty requests", 3, (0, 20, 140, 0), s_q=2, causal=True,
                 page_size=16)]


def _worst_position(got_lat, want_lat, got_lse, want_lse) -> str:
    """The (request, query token, head) row with the largest latent error, and its column."""
    with np.errstate(invalid="ignore"):   # NaN and inf entries are what is looked for
        d = np.abs(got_lat - want_lat)
        lse_bad = ~(np.abs(got_lse - want_lse) <= 1e-4)
    d[~np.isfinite(d)] = np.inf
    live = ~np.isneginf(want_lse)
    lse_bad &= live
    empty_bad = ~live & ~(np.isneginf(got_lse) & np.all(got_lat == 0, axis=-1))
    if empty_bad.any():
        b, i, h = np.argwhere(empty_bad)[0]
        return (f"request {b}, query {i}, head {h}: sees no position but got lse "
                f"{got_lse[b, i, h]:.4g} (want -inf)")
    b, i, h, col = np.unravel_index(int(np.argmax(d)), d.shape)
    where = (f"request {b}, query {i}, head {h}, latent column {col}: got "
             f"{got_lat[b, i, h, col]:.6g}, want {want_lat[b, i, h, col]:.6g}")
    if lse_bad.any():
        b2, i2, h2 = np.argwhere(lse_bad)[0]
        where += (f"; lse at request {b2}, query {i2}, head {h2}: got {got_lse[b2, i2, h2]:.6g}"
                  f", want {want_lse[b2, i2, h2]:.6g}")
    return where


def run_case(variant, case: Case, seed: int) -> CaseResult:
    """One case on the current device: poisoned outputs and partials, the sync guard."""
    import cupy as cp

    from .paged_api import PagedDecodeStep

    t0 = time.perf_counter()
    dims = preset("dsv3").with_heads(case.heads)
    host = make_paged_inputs(dims, case.lengths, s_q=case.s_q, page_size=case.page_size,
                             cache_dtype=case.cache, q_dtype=case.q, causal=case.causal,
                             seed=seed, with_wv_b=case.wv_b)
    dev = {k: (cp.asarray(v) if isinstance(v, np.ndarray) else v)
           for k, v in host.decode_args().items()}
    try:
        step = PagedDecodeStep(**dev, variant=variant, splits=case.splits, sync_check=True)
        step.check_indices()
        for buf in (step.latent, step.lse, step.out, *(getattr(step, n, None) for n in (
                "part_acc", "part_m", "part_l", "out_part"))):
            if buf is not None:
                buf.fill(cp.nan)
        # the chunk counts the attention kernel must publish: -1 merges no chunk, so a count
        # left unwritten (or one from an earlier step's scratch) fails every live row
        if getattr(step, "chunk_counts", None) is not None:
            step.chunk_counts.fill(-1)
        res = step.run()
        cp.cuda.Device().synchronize()
    except Exception as exc:   # a fault, named by the guard (phase, kernel, launch)
        return CaseResult(case, False, f"{type(exc).__name__}: {exc}", "-", seed,
                          time.perf_counter() - t0, {})
    ref = reference_decode_paged(**host.decode_args())
    cmp = compare_paged(res, ref)
    errors = {}
    if cmp.live is not None:
        errors = {f.name: f.value for f in cmp.live.fields}
    reason = "" if cmp.ok else "; ".join(
        ln for ln in cmp.summary().splitlines() if ln.startswith("FAIL"))
    fields = [f.name for f in cmp.live.fields if not f.ok] if cmp.live is not None else []
    if cmp.empty_wrong:
        fields.append("empty rows")
    worst = "-"
    if not cmp.ok:
        got_lat = np.asarray(cp.asnumpy(res.latent), np.float64)
        got_lse = np.asarray(cp.asnumpy(res.lse), np.float64)
        worst = _worst_position(got_lat, np.asarray(ref.latent), got_lse, np.asarray(ref.lse))
    return CaseResult(case, cmp.ok, reason, worst, seed, time.perf_counter() - t0, errors,
                      tuple(fields))


def run_battery(variant, cases, *, seed: int | None = None, progress=None,
                stop_on_fault: bool = True) -> list[CaseResult]:
    """Every case, each on a seed of its own (seed + index; a fresh seed when None). After a
    fault the CUDA context is unusable: the remaining cases are reported as not run."""
    base = secrets.randbits(31) if seed is None else int(seed)
    out: list[CaseResult] = []
    faulted = None
    for i, case in enumerate(cases):
        if faulted is not None and stop_on_fault:
            out.append(CaseResult(case, False, f"not run: an earlier case faulted ({faulted})",
                                  "-", base + i, 0.0, {}))
            continue
        r = run_case(variant, case, base + i)
        if not r.ok and r.reason.startswith(("PhaseError", "CUDA")) and "illegal" in r.reason:
            faulted = case.what
        out.append(r)
        if progress:
            progress(r)
    return out


# ---------------------------------------------------------------------------- the sanitizer

SANITIZER_TOOLS = ("memcheck", "racecheck")


def sanitizer_path() -> str | None:
    import shutil

    found = shutil.which("compute-sanitizer")
    for cand in (found, "/usr/local/cuda/bin/compute-sanitizer"):
        if cand and os.path.isfile(cand):
            return cand
    return None


def sanitize(kernel, tool: str = "racecheck", timeout_s: float = 300.0) -> dict:
    """compute-sanitizer `tool` over the first fast case of `kernel` (a user kernel file),
    in a child process: {ok, summary, errors, output}. Where compute-sanitizer is missing,
    ok is None and the summary says so."""
    import subprocess
    import sys

    if tool not in SANITIZER_TOOLS:
        raise ValueError(f"tool must be one of {', '.join(SANITIZER_TOOLS)}, got {tool!r}")
    exe = sanitizer_path()
    if exe is None:
        return {"ok": None, "summary": "skipped: compute-sanitizer is not installed here",
                "errors": None, "output": ""}
    spec = kernel.name if hasattr(kernel, "name") else str(kernel)
    cmd = [exe, "--tool", tool, "--error-exitcode", "99", sys.executable, "-m",
           "mlasandbox.battery", spec]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"ok": False, "summary": f"timed out after {timeout_s:.0f} s", "errors": None,
                "output": ""}
    text = proc.stdout + proc.stderr
    # memcheck: "ERROR SUMMARY: 0 errors"; racecheck: "RACECHECK SUMMARY: 2 hazards
    # displayed (2 errors, 0 warnings)": every hazard counts, warnings included
    m = (re.search(r"RACECHECK SUMMARY: (\d+) hazards? displayed", text)
         or re.search(r"ERROR SUMMARY: (\d+) errors?", text))
    errors = int(m.group(1)) if m else None
    first = next((ln.strip() for ln in text.splitlines()
                  if re.search(r"Error|Race reported|hazard", ln) and "SUMMARY" not in ln), "")
    ok = proc.returncode == 0 and errors == 0
    summary = (f"{errors} {'hazard' if tool == 'racecheck' else 'error'}(s)"
               if errors is not None else f"no summary in its output (exit {proc.returncode})")
    if not ok and first:
        summary += f"; first: {first[:200]}"
    return {"ok": ok, "summary": summary, "errors": errors, "output": text[-4000:]}


def _main(argv=None) -> int:
    """`python -m mlasandbox.battery SPEC`: the first fast case of a variant (what
    `sanitize` runs under compute-sanitizer); exit 0 when it passes."""
    import sys

    spec = (argv or sys.argv[1:])[0]
    from .paged_api import paged_variant

    var = paged_variant(spec, 1, 16)
    rows = getattr(var, "hpb", 1) or 1
    r = run_case(var, fast_cases(rows)[1], seed=1)
    print(f"{'ok' if r.ok else 'FAIL'} {r.case.label()} {r.reason}")
    return 0 if r.ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())
