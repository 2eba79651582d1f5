'''The text of the script `mlasandbox repro` writes (see repro.py for how it is filled in).

It is a template, not code this package runs: `@@NAME@@` markers are replaced by repr()'d
values or, for the CUDA sources and the cuBLAS engine, by verbatim text. The generated
script imports CuPy and NumPy only.
'''

HELPERS = r'''# ==== bf16 as uint16 bit patterns (round to nearest even; NaN -> quiet NaN) =========
def _xp(a):
    if isinstance(a, (np.ndarray, np.generic)):
        return np  # host arrays never ask CuPy (the reference runs without a GPU)
    import cupy

    return cupy.get_array_module(a)


def f32_to_bf16_bits(x):
    xp = _xp(x)
    bits = xp.ascontiguousarray(xp.asarray(x, dtype=xp.float32)).view(xp.uint32)
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) >> 16).astype(xp.uint16)
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    quiet_nan = (((bits >> 16) & 0x8000) | 0x7FC0).astype(xp.uint16)
    return xp.where(is_nan, quiet_nan, rounded)


def bf16_bits_to_f32(u16):
    xp = _xp(u16)
    return (xp.asarray(u16).astype(xp.uint32) << 16).view(xp.float32)


def to_storage(x, dtype):
    xp = _xp(x)
    if dtype == "f32":
        return xp.asarray(x, dtype=xp.float32)
    if dtype == "f16":
        return xp.asarray(x).astype(xp.float16)
    return f32_to_bf16_bits(xp.asarray(x, dtype=xp.float32))


def as_f64(a):
    a = np.asarray(a)
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def out_of_memory(case, exc):
    """The verdict line of a case that does not fit: CuPy's OutOfMemoryError (a
    MemoryError) is the device's, any other MemoryError the host's."""
    where = "device" if type(exc).__name__ == "OutOfMemoryError" else "host"
    return (f"ERROR: {case} does not fit in this machine's {where} memory "
            f"({type(exc).__name__}: {exc})")


# ==== the phase guard ==========================================================================
class PhaseError(RuntimeError):
    """A CUDA error, located: which phase of which variant, which launch."""


@contextlib.contextmanager
def phase(name, launch=""):
    """Run one phase, then synchronize: a launch error or an asynchronous fault is reported
    here, naming this phase, not at some later call."""
    import cupy

    try:
        yield
        cupy.cuda.get_current_stream().synchronize()
    except PhaseError:
        raise
    except Exception as exc:
        raise PhaseError(f"phase {name!r} of variant {VARIANT!r} failed: {launch}: "
                         f"{type(exc).__name__}: {exc}") from exc


class Guard:
    """What the cuBLAS engine calls: guard.phase(name)."""

    def phase(self, name, launch=None):
        return phase(name, launch or "CuPy/cuBLAS calls")


# ==== compile and launch (the CUDA variants) ===================================================
def include_dirs(extra):
    """Where cuda_fp16.h and cuda_bf16.h are: --include, $MLASANDBOX_CUDA_INCLUDE, $CUDA_PATH,
    $CUDA_HOME, the NVIDIA pip wheels, /usr/local/cuda; the first directory holding both."""
    cands = list(extra)
    cands += [p for p in os.environ.get("MLASANDBOX_CUDA_INCLUDE", "").split(os.pathsep) if p]
    cands += [os.path.join(os.environ[v], "include") for v in ("CUDA_PATH", "CUDA_HOME")
              if os.environ.get(v)]
    for root in sys.path:
        for sub in ("nvidia/cu13/include", "nvidia/cuda_runtime/include",
                    "nvidia/cuda_nvrtc/include"):
            cands.append(os.path.join(root or ".", sub))
    cands.append("/usr/local/cuda/include")
    for d in cands:
        if all(os.path.isfile(os.path.join(d, h)) for h in ("cuda_fp16.h", "cuda_bf16.h")):
            return [d]
    return []  # let CuPy find them, or fail at compile saying which header is missing


def whole_cubin(prog):
    """The cubin of a compiled NVRTC program, every byte: CuPy's nvrtc.getCUBIN drops the
    last one (as it does PTX's NUL), and a file of that is not a whole ELF. Read from the
    libnvrtc CuPy loaded: cuda.pathfinder's (CuPy 14 loads it so), else the one mapped."""
    import ctypes

    try:
        from cuda import pathfinder

        path = pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path
    except Exception:
        with open("/proc/self/maps") as f:
            mapped = {line.split(None, 5)[5].strip() for line in f if len(line.split()) == 6}
        paths = sorted({os.path.realpath(p) for p in mapped
                        if os.path.basename(p).startswith("libnvrtc.so")})
        if len(paths) != 1:
            raise RuntimeError("cannot tell which NVRTC library CuPy loaded: "
                               f"{', '.join(paths) or 'none'} mapped")
        path = paths[0]
    lib = ctypes.CDLL(path)
    size = ctypes.c_size_t()
    handle = ctypes.c_void_p(int(prog))
    if lib.nvrtcGetCUBINSize(handle, ctypes.byref(size)) != 0 or size.value == 0:
        raise RuntimeError("nvrtcGetCUBINSize failed: the program has no cubin")
    buf = ctypes.create_string_buffer(size.value)
    if lib.nvrtcGetCUBIN(handle, buf) != 0:
        raise RuntimeError("nvrtcGetCUBIN failed")
    return buf.raw


def cubin_for_arch(source, expression, arch, options, filename="kernel.cu"):
    """(cubin, lowered name) of one name expression of `source`, compiled by NVRTC for `arch`
    (no GPU needed): --gpu-architecture=ARCH, `options` and CuPy's own -ftz=true, as
    mlasandbox's arch_specific.compile_cubin builds it. A rejected compile raises with
    NVRTC's log."""
    from cupy.cuda import nvrtc

    opts = [f"--gpu-architecture={arch}", *options, "-ftz=true"]
    prog = nvrtc.createProgram(source, filename, [], [])
    try:
        nvrtc.addNameExpression(prog, expression)
        try:
            nvrtc.compileProgram(prog, opts)
        except Exception as exc:
            log = nvrtc.getProgramLog(prog).rstrip("\x00")
            raise RuntimeError(f"NVRTC failed to compile {filename} for {arch} ({exc}):\n"
                               f"{log}\noptions: {' '.join(opts)}") from None
        return whole_cubin(prog), nvrtc.getLoweredName(prog, expression)
    finally:
        nvrtc.destroyProgram(prog)


def compile_for_arch(source, expression, arch, options, filename="kernel.cu"):
    """The cupy.RawKernel of `expression` built for an arch-specific target (sm_90a, which
    wgmma.mma_async needs). cupy.RawModule(code=...) adds the device's own arch (sm_90) to
    the options itself, so NVRTC runs here (cubin_for_arch) and CuPy loads the cubin from a
    temporary file with cupy.RawModule(path=...), by the lowered name."""
    import cupy

    cubin, lowered = cubin_for_arch(source, expression, arch, options, filename)
    with tempfile.TemporaryDirectory(prefix="mlasandbox-repro-") as d:
        path = os.path.join(d, os.path.splitext(os.path.basename(filename))[0] + ".cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        # get_function loads the module onto the device now: the file may go afterwards
        return cupy.RawModule(path=path).get_function(lowered)


def device_arch():
    """sm_XY of the current device (compute capability X.Y)."""
    import cupy

    return "sm_" + cupy.cuda.Device().compute_capability


def arch_refusal(have):
    """The NOT RUN line when the attention kernel is built for an arch-specific target
    (ATTN["arch"], e.g. sm_90a) and this device, `have`, is not that target's arch: sm_90a
    code runs on compute capability 9.0 only, not on a newer GPU. None when it can run."""
    target = ATTN["arch"] if ATTN else None
    if not target or have == target[:-1]:
        return None
    return f"NOT RUN: {VARIANT} needs {target}, this device is {have}; nothing was checked"


def raw_kernel(source, spec, opts):
    """The cupy.RawKernel of spec["expression"] in `source`; None where spec is None (a kernel
    this case does not launch)."""
    import cupy

    if spec is None:
        return None
    return cupy.RawModule(code=source, options=opts, name_expressions=[
        spec["expression"]]).get_function(spec["expression"])


def compile_kernels(inc):
    """(the attention kernel, then one kernel per (spec, source) of LATER_KERNELS: None where
    the case launches none)."""
    opts = tuple(NVRTC_OPTIONS) + tuple(f"-I{d}" for d in inc)
    if ATTN["arch"]:
        attn = compile_for_arch(ATTN_SOURCE, ATTN["expression"], ATTN["arch"], opts,
                                ATTN["source"])
    else:
        attn = raw_kernel(ATTN_SOURCE, ATTN, opts)
    if ATTN["smem_bytes"] > 48 * 1024:  # past the default 48 KB: the kernel must opt in
        attn.max_dynamic_shared_size_bytes = ATTN["smem_bytes"]
        attn.preferred_shared_memory_carveout = 100
    return (attn, *(raw_kernel(source, spec, opts) for spec, source in LATER_KERNELS))


def versions():
    import cupy
    from cupy.cuda import runtime

    dev = cupy.cuda.Device()
    props = runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])

    def v(x):
        return f"{x // 1000}.{(x % 1000) // 10}"

    try:
        nvrtc = "%d.%d" % cupy.cuda.nvrtc.getVersion()
    except Exception as exc:
        nvrtc = f"unknown ({exc})"
    return [("GPU", f"{name} (sm_{props['major']}{props['minor']}, "
                    f"{props['multiProcessorCount']} SMs)"),
            ("driver", v(runtime.driverGetVersion())),
            ("CUDA runtime", v(runtime.runtimeGetVersion())), ("NVRTC", nvrtc),
            ("CuPy", cupy.__version__), ("NumPy", np.__version__),
            ("Python", platform.python_version())]


def device_versions(say):
    """Print the GPU and the versions; False (after the NOT RUN line) without a usable GPU, or
    with one that cannot run the attention kernel's arch-specific target (arch_refusal)."""
    try:
        for k, v in versions():
            say(f"  {k:<13} {v}")
        have = device_arch()
    except Exception as exc:
        print(f"NOT RUN: no usable CUDA device ({type(exc).__name__}: {exc}); nothing was "
              "checked")
        return False
    refusal = arch_refusal(have)
    if refusal:
        print(refusal)
        return False
    return True


def parse_args(argv):
    """(args, say): --include and --quiet; say prints unless --quiet. Prints the title."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--include", action="append", default=[],
                    help="directory holding cuda_fp16.h and cuda_bf16.h (repeatable)")
    ap.add_argument("--quiet", action="store_true", help="print only the verdict line")
    args = ap.parse_args(argv)
    say = (lambda *a: None) if args.quiet else print
    say(__doc__.splitlines()[0])
    return args, say
'''

TEMPLATE = r'''#!/usr/bin/env python3
"""@@TITLE@@

@@HEADER@@

Self-contained: CuPy and NumPy only (no mlasandbox). Run:

    python @@FILENAME@@            [--include DIR_WITH_cuda_fp16.h] [--quiet]

It prints the GPU, driver, CUDA, NVRTC, CuPy and NumPy versions; draws the inputs from the
seed on the host (the same arrays as mlasandbox.inputs.make_inputs(..., xp=cupy): rows
past n_ctx are NaN, so a kernel that reads past the context fails); compiles the embedded
CUDA source with NVRTC (cupy.RawModule, name_expressions) and launches attn, then combine,
with exactly the arguments of mlasandbox.api.DecodeStep, each phase synchronized and checked
so that an error names its phase; compares out, latent and lse with a float64 NumPy
reference (two-pass softmax); prints the error figures and one PASS / FAIL / ERROR / NOT
RUN line.

Exit status: 0 PASS; 1 FAIL (wrong numbers); 2 ERROR (the kernels did not compile, or a launch
or a fault stopped them); 3 NOT RUN (no usable CUDA device here: nothing was checked, which
says nothing about the kernels, and a negative control that is NOT RUN has not failed).
"""
import argparse
import contextlib
import os
import platform
import sys
import tempfile

import numpy as np

# ==== the case: every value that decides what runs ============================================
VARIANT = @@VARIANT@@
N_HEAD, KV_LORA, ROPE, V_HEAD, NOPE = @@DIMS@@
KEY_DIM = KV_LORA + ROPE
CACHE_DTYPE = @@CACHE@@            # bf16 travels as uint16 words holding bf16 bit patterns
Q_DTYPE = @@Q@@
CONTEXTS = @@CONTEXTS@@
SPLITS = @@SPLITS@@                # n_ctx -> split count S, exact (None: the cuBLAS engine)
SPLITS_FROM = @@SPLITS_FROM@@
SEED = @@SEED@@
EXTRA_ROWS = 7                     # NaN-filled cache rows past n_ctx
SCALE = @@SCALE@@
NEGATIVE_CONTROL = @@NEGATIVE@@
TOLERANCE = @@TOLERANCE@@          # relL2 for out and latent, max |error| for lse
EXPECT = @@EXPECT@@
REFERENCE_CHUNK = 8192             # cache rows widened to float64 at once

# ==== the kernels ==============================================================================
NVRTC_OPTIONS = @@OPTIONS@@
ATTN = @@ATTN@@
COMBINE = @@COMBINE@@
LOG2E = 1.4426950408889634
# (file, source, name expressions): what NVRTC compiles. Empty for the cuBLAS engine.
ATTN_SOURCE = r"""@@ATTN_SOURCE@@"""
COMBINE_SOURCE = r"""@@COMBINE_SOURCE@@"""
CUDA_PROGRAMS = (
    [(ATTN["source"], ATTN_SOURCE, [ATTN["expression"]]),
     ("mla_combine.cu", COMBINE_SOURCE, [COMBINE["expression"]])] if ATTN else [])
LATER_KERNELS = ((COMBINE, COMBINE_SOURCE),)   # compiled after the attention kernel


@@HELPERS@@


# ==== inputs ===================================================================================
def host_inputs(n_ctx):
    """q [H, 576], cache [n_ctx + EXTRA_ROWS, 576] (NaN past n_ctx), wv_b [H, 128, 512] on the
    host: the draws of mlasandbox.inputs.make_inputs(dims, n_ctx + 7, n_ctx, CACHE_DTYPE,
    Q_DTYPE, seed=SEED, nan_fill=True), in the same order (NumPy's default_rng, float32,
    rounded to the storage dtype on the host; no cuRAND)."""
    rng = np.random.default_rng(SEED)

    def normal(shape, std=1.0):
        out = rng.standard_normal(shape, dtype=np.float32)
        if std != 1.0:
            out *= np.float32(std)
        return out

    n_alloc = n_ctx + EXTRA_ROWS
    q_nope = to_storage(normal((N_HEAD, NOPE)), CACHE_DTYPE)
    q_rope = to_storage(normal((N_HEAD, ROPE)), CACHE_DTYPE)
    wk_b = to_storage(normal((N_HEAD, NOPE, KV_LORA), NOPE ** -0.5), CACHE_DTYPE)
    wv_b = to_storage(normal((N_HEAD, V_HEAD, KV_LORA), KV_LORA ** -0.5), CACHE_DTYPE)
    cache = to_storage(normal((n_alloc, KEY_DIM)), CACHE_DTYPE)
    cache[n_ctx:] = 0x7FC0 if CACHE_DTYPE == "bf16" else np.nan
    # q = q_nope @ wk_b || q_rope, in float64, rounded once to the q dtype
    qn, qr, wk = (as_f64(a) for a in (q_nope, q_rope, wk_b))
    q = to_storage(np.concatenate([np.einsum("hn,hnk->hk", qn, wk), qr], axis=1), Q_DTYPE)
    return q, cache, wv_b


def make_inputs(n_ctx):
    """host_inputs(n_ctx), copied to the device: the arrays of make_inputs(..., xp=cupy)."""
    import cupy

    return tuple(cupy.asarray(a) for a in host_inputs(n_ctx))


# ==== the float64 reference: two passes over the rows t < n_ctx ===============================
def reference(q, cache, wv_b, n_ctx):
    import cupy

    q64, wv64 = as_f64(cupy.asnumpy(q)), as_f64(cupy.asnumpy(wv_b))
    live = cupy.asnumpy(cache[:n_ctx])  # rows past n_ctx are NaN on purpose: never read
    chunks = [(t0, min(n_ctx, t0 + REFERENCE_CHUNK)) for t0 in range(0, n_ctx, REFERENCE_CHUNK)]
    scores = np.empty((N_HEAD, n_ctx))
    for t0, t1 in chunks:
        scores[:, t0:t1] = q64 @ as_f64(live[t0:t1]).T
    scores *= SCALE
    m = scores.max(axis=1)
    np.exp(scores - m[:, None], out=scores)
    l = scores.sum(axis=1)
    acc = np.zeros((N_HEAD, KV_LORA))
    for t0, t1 in chunks:
        acc += scores[:, t0:t1] @ as_f64(live[t0:t1])[:, :KV_LORA]
    latent = acc / l[:, None]
    return {"out": np.einsum("hvk,hk->hv", wv64, latent), "latent": latent,
            "lse": m + np.log(l)}


# ==== launch (the CUDA variants) =============================================================
def run_cuda(kernels, q, cache, wv_b, n_ctx, splits):
    """attn over grid (head blocks, S), then combine over grid (H, col blocks): the launches
    of mlasandbox.api.DecodeStep, arguments in the order ATTN["args"] / COMBINE["args"].
    Outputs and partials start as NaN, so an element a kernel fails to write shows up; the
    combine's per-head tickets start at 0, as the kernel requires."""
    import cupy

    attn, combine = kernels
    H = N_HEAD
    head_blocks = -(-H // ATTN["heads_per_block"])
    nan = np.float32(np.nan)
    values = {
        "q": q, "cache": cache, "wv_b": wv_b,
        "n_head": np.int32(H), "n_ctx": np.int32(n_ctx), "splits": np.int32(splits),
        "v_head": np.int32(V_HEAD), "scale": np.float32(SCALE * LOG2E),
        "part_acc": cupy.full(splits * H * KV_LORA, nan, cupy.float32),
        "part_m": cupy.full(splits * H, nan, cupy.float32),
        "part_l": cupy.full(splits * H, nan, cupy.float32),
        "out": cupy.full((H, V_HEAD), nan, cupy.float32),
        "latent": cupy.full((H, KV_LORA), nan, cupy.float32),
        "lse": cupy.full((H,), nan, cupy.float32),
        "out_part": cupy.full(H * COMBINE["col_blocks"] * V_HEAD, nan, cupy.float32),
        "tickets": cupy.zeros(H, cupy.uint32),
    }
    grid, block, smem = (head_blocks, splits, 1), (ATTN["threads"], 1, 1), ATTN["smem_bytes"]
    with phase("attn", f"kernel {ATTN['name']}, grid {grid}, block {block}, dynamic shared "
                       f"memory {smem} B"):
        attn(grid, block, tuple(values[a] for a in ATTN["args"]), shared_mem=smem)
    grid, block = (H, COMBINE["col_blocks"], 1), (COMBINE["threads"], 1, 1)
    with phase("combine", f"kernel {COMBINE['name']}, grid {grid}, block {block}, dynamic "
                          f"shared memory 0 B"):
        combine(grid, block, tuple(values[a] for a in COMBINE["args"]), shared_mem=0)
    return {k: cupy.asnumpy(values[k]) for k in ("out", "latent", "lse")}


@@ENGINE@@


# ==== comparison ===============================================================================
def compare(got, want):
    """(ok, lines): relL2 for out and latent, max |error| for lse; any NaN/inf fails."""
    ok, lines = True, []
    for name, metric in (("out", "relL2"), ("latent", "relL2"), ("lse", "max abs")):
        g, w = np.asarray(got[name], np.float64), np.asarray(want[name], np.float64)
        nonfinite = int(np.count_nonzero(~np.isfinite(g)))
        err = np.abs(g - w)
        if metric == "relL2":
            value = float(np.linalg.norm((g - w).ravel()) / np.linalg.norm(w.ravel()))
        else:
            value = float(err.max())
        if nonfinite:
            value = float("nan")
        limit = TOLERANCE[name]
        good = nonfinite == 0 and value <= limit
        ok &= good
        text = (f"  {'ok  ' if good else 'FAIL'} {name:<6} {metric} {value:.3e} "
                f"(limit {limit:.1e})" + (f", {nonfinite} NaN/inf" if nonfinite else ""))
        if not good:
            rank = np.where(np.isfinite(err), err, np.inf).ravel()
            worst = np.argsort(-rank, kind="stable")[:3]
            text += "; worst at " + "; ".join(
                f"{tuple(int(i) for i in np.unravel_index(k, g.shape))}: "
                f"{g.ravel()[k]:.6g} vs {w.ravel()[k]:.6g}" for k in worst)
        lines.append(text)
    return ok, lines


def main(argv=None):
    args, say = parse_args(argv)
    say(f"  variant {VARIANT}: H={N_HEAD}, kv_lora={KV_LORA}, rope={ROPE}, v_head={V_HEAD}, "
        f"cache {CACHE_DTYPE}, q {Q_DTYPE}, seed {SEED}")
    say(f"  contexts and splits: {SPLITS}  ({SPLITS_FROM})")
    if ATTN:
        say(f"  kernels: {ATTN['name']} (block {ATTN['threads']}, dynamic smem "
            f"{ATTN['smem_bytes']} B), {COMBINE['name']} (block {COMBINE['threads']})")
    if NEGATIVE_CONTROL:
        say("  NEGATIVE CONTROL: the combine drops its exp(m_i - m) rescale; the check must FAIL")
    if not device_versions(say):
        return 3
    kernels = None
    if ATTN:
        inc = include_dirs(args.include)
        say(f"  CUDA headers  {inc[0] if inc else '(not found here; leaving it to CuPy)'}")
        try:
            kernels = compile_kernels(inc)
        except Exception as exc:
            print(f"ERROR: compile error ({type(exc).__name__}): {exc}")
            return 2
    all_ok = True
    for n_ctx in CONTEXTS:
        splits = SPLITS[n_ctx]
        say(f"n_ctx {n_ctx}, splits {splits}:")
        try:
            q, cache, wv_b = make_inputs(n_ctx)
            if ATTN:
                got = run_cuda(kernels, q, cache, wv_b, n_ctx, splits)
            else:
                got = run_engine(q, cache, wv_b, n_ctx)
            want = reference(q, cache, wv_b, n_ctx)
        except PhaseError as exc:
            print(f"  error: {exc}")
            print(f"ERROR: {VARIANT} raised a CUDA error at n_ctx={n_ctx} (see above)")
            return 2
        except MemoryError as exc:
            print(out_of_memory(f"n_ctx={n_ctx}", exc))
            return 2
        ok, lines = compare(got, want)
        for line in lines:
            say(line)
        all_ok &= ok
    what = f"{VARIANT} H={N_HEAD} cache={CACHE_DTYPE} q={Q_DTYPE} n_ctx={list(CONTEXTS)}"
    note = ("  (negative control: FAIL is the expected outcome; a PASS would mean the check "
            "has no power)") if NEGATIVE_CONTROL else ""
    print(("PASS: " if all_ok else "FAIL: ") + what + " against the float64 reference" + note)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
'''

NO_ENGINE = '''def run_engine(q, cache, wv_b, n_ctx):
    raise RuntimeError("this script reproduces a CUDA variant; the cuBLAS engine is not embedded")
'''

ENGINE_WRAPPER = '''# ==== the cuBLAS engine: cublas_engine.py, verbatim except its imports
@@ENGINE_SOURCE@@


def run_engine(q, cache, wv_b, n_ctx):
    import cupy

    n_head, v_head, kv_lora = wv_b.shape
    latent = cupy.empty((n_head, kv_lora), cupy.float32)
    lse = cupy.empty((n_head,), cupy.float32)
    out = cupy.empty((n_head, v_head), cupy.float32)
    guard = Guard()
    with guard.phase("attn"):
        cublas_attention(q, cache, n_ctx, SCALE, CACHE_DTYPE, latent, lse)
    with guard.phase("combine"):
        cublas_projection(wv_b, latent, CACHE_DTYPE, out)
    return {"out": cupy.asnumpy(out), "latent": cupy.asnumpy(latent), "lse": cupy.asnumpy(lse)}
'''

PAGED_TEMPLATE = r'''#!/usr/bin/env python3
"""@@TITLE@@

@@HEADER@@

Self-contained: CuPy and NumPy only (no mlasandbox). Run:

    python @@FILENAME@@            [--include DIR_WITH_cuda_fp16.h] [--quiet]

It prints the GPU and versions; draws the batch's inputs from the seed on the host (the arrays
of mlasandbox.paged_inputs.make_paged_inputs: a permuted block table, NaN in every unused page
and past each request's length, INVALID_PAGE in every table entry past a request's pages);
compiles the embedded CUDA source with NVRTC (an attention kernel with ATTN["arch"], such as
wgmma64's sm_90a: for that target, by compile_for_arch) and launches the paged attention over
grid (row blocks, chunk programs, 1), then, as the step it reproduces, one of two forms
(ATTN_MERGES, decided when the script was generated):
  - the merge kernel merges: the paged combine over (n_rows, col blocks, B), which merges
    each request's chunks and projects (with COMBINE["attn_writes_single"] it does not merge
    a request of one chunk, whose latent and lse the attention kernel wrote, and projects
    that latent);
  - the attention kernel merges (tickets): the mma kernel's last program of a request merges
    its chunks (zeroed attn_tickets, a ticket a request and row block), no merge kernel is
    launched, and the projection PROJECT runs alone over PROJECT["grid"];
each phase synchronized so that an error names it; compares latent, lse and out with an
embedded float64 paged reference (rows that see no position must be exactly latent 0, lse
-inf, out 0); prints one PASS / FAIL / ERROR / NOT RUN line.

Importing this file runs nothing: host_inputs() and reference() need NumPy alone.

Exit status: 0 PASS; 1 FAIL (wrong numbers); 2 ERROR (the kernels did not compile, or a launch
or a fault stopped them); 3 NOT RUN (no usable CUDA device here, or, for an arch-specific
kernel, a device of another arch: "NOT RUN: wgmma64 needs sm_90a, this device is sm_XY", since
sm_90a code runs on sm_90 only; nothing was checked, and a negative control that is NOT RUN
has not failed).
"""
import argparse
import contextlib
import os
import platform
import sys
import tempfile

import numpy as np

# ==== the case: every value that decides what runs ============================================
VARIANT = @@VARIANT@@
N_HEAD, KV_LORA, ROPE, V_HEAD, NOPE = @@DIMS@@
KEY_DIM = KV_LORA + ROPE
CACHE_DTYPE = @@CACHE@@            # bf16 travels as uint16 words holding bf16 bit patterns
Q_DTYPE = @@Q@@
LENGTHS = @@LENGTHS@@              # one per request
S_Q = @@S_Q@@
CAUSAL = @@CAUSAL@@
PAGE_SIZE = @@PAGE_SIZE@@
SPARE_PAGES = @@SPARE_PAGES@@      # unused (NaN) pages besides the requests' own
SEED = @@SEED@@                    # draws q, wv_b, the cache and the table permutation
SCALE = @@SCALE@@
PLAN = @@PLAN@@                    # the chunk plan: max_chunks, min_chunk, tile, rows per block,
                                   # target (chunk programs of one wave per row block),
                                   # programs (the grid's chunk programs a row block: 2 target
                                   # where it offers a second wave, the kernel's choice)
PLAN_FROM = @@PLAN_FROM@@
NEGATIVE_CONTROL = @@NEGATIVE@@
ATTN_MERGES = @@ATTN_MERGES@@      # who merges the chunks, as the step decided at generation:
                                   # the attention kernel (tickets), else the merge kernel
MERGE_FORM = ("the attention kernel merges (tickets)" if ATTN_MERGES
              else "the merge kernel merges")
@@TOLERANCE_FROM@@
TOLERANCE = @@TOLERANCE@@          # relL2 for out and latent, max |error| for lse (live rows)
EXPECT = @@EXPECT@@
INVALID_PAGE = 2 ** 31 - 1         # table entries past a request's pages

# ==== the kernels ==============================================================================
NVRTC_OPTIONS = @@OPTIONS@@
ATTN = @@ATTN@@
COMBINE = @@COMBINE@@              # None where the attention kernel merges
PROJECT = @@PROJECT@@              # None where the combine projects
LOG2E = 1.4426950408889634
ATTN_SOURCE = r"""@@ATTN_SOURCE@@"""
COMBINE_SOURCE = r"""@@COMBINE_SOURCE@@"""
PROJECT_SOURCE = r"""@@PROJECT_SOURCE@@"""
LATER_KERNELS = ((COMBINE, COMBINE_SOURCE), (PROJECT, PROJECT_SOURCE))


@@HELPERS@@


@@TENSOR_MAP@@


# ==== inputs ===================================================================================
def host_inputs():
    """(q, kv_cache, block_table, cache_seqlens, wv_b) as NumPy arrays: the draws of
    make_paged_inputs(dims, LENGTHS, s_q=S_Q, page_size=PAGE_SIZE, cache_dtype=CACHE_DTYPE,
    q_dtype=Q_DTYPE, seed=SEED, spare_pages=SPARE_PAGES), in the same order."""
    lengths = np.asarray(LENGTHS, dtype=np.int64)
    batch = lengths.size
    need = -(-lengths // PAGE_SIZE)
    max_pages = max(1, int(need.max()))
    num_pages = int(need.sum()) + SPARE_PAGES + 1
    rng = np.random.default_rng(SEED)

    def normal(shape, std=1.0):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    nan = 0x7FC0 if CACHE_DTYPE == "bf16" else np.nan
    q = to_storage(normal((batch, S_Q, N_HEAD, KEY_DIM)), Q_DTYPE)
    wv_b = to_storage(normal((N_HEAD, V_HEAD, KV_LORA), KV_LORA ** -0.5), CACHE_DTYPE)
    cache = to_storage(normal((num_pages, PAGE_SIZE, KEY_DIM)), CACHE_DTYPE)
    order = rng.permutation(num_pages)
    table = np.full((batch, max_pages), INVALID_PAGE, dtype=np.int32)
    used = np.zeros(num_pages, dtype=bool)
    first = 0
    for b in range(batch):
        ids = order[first:first + need[b]]
        first += need[b]
        table[b, :need[b]] = ids
        used[ids] = True
        tail = int(lengths[b]) - (int(need[b]) - 1) * PAGE_SIZE
        if need[b] and tail < PAGE_SIZE:
            cache[ids[-1], tail:] = nan
    cache[~used] = nan
    return q, cache, table, lengths.astype(np.int32), wv_b


def visible(lengths):
    """[B, S_Q]: the leading positions query i of request b sees."""
    lengths = np.asarray(lengths, dtype=np.int64)[:, None]
    behind = (S_Q - 1 - np.arange(S_Q))[None, :] if CAUSAL else np.zeros((1, S_Q), np.int64)
    return np.maximum(lengths - behind, 0)


# ==== the float64 paged reference ==============================================================
def reference(q, cache, table, lengths, wv_b):
    """latent [B, S_Q, H, 512], lse [B, S_Q, H], out [B, S_Q, H, 128] in float64: per request
    its first ceil(len / PAGE_SIZE) pages gathered through the table, cut at its length (the
    tail is NaN on purpose), then softmax(scale q.k) over the positions each query sees."""
    q64, wv64 = as_f64(q), as_f64(wv_b)
    vis = visible(lengths)
    batch = q64.shape[0]
    latent = np.zeros((batch, S_Q, N_HEAD, KV_LORA))
    lse = np.full((batch, S_Q, N_HEAD), -np.inf)
    for b in range(batch):
        n = int(lengths[b])
        if n == 0:
            continue
        ids = np.asarray(table[b, :-(-n // PAGE_SIZE)], dtype=np.int64)
        rows = as_f64(cache[ids].reshape(-1, KEY_DIM)[:n])
        s = np.einsum("ihk,tk->iht", q64[b], rows) * SCALE
        seen = np.arange(n)[None, :] < vis[b][:, None]
        s = np.where(seen[:, None, :], s, -np.inf)
        live = vis[b] > 0
        m = np.where(live[:, None], s.max(axis=2, initial=-np.inf), 0.0)
        w = np.exp(s - m[:, :, None])
        l = w.sum(axis=2)
        acc = np.einsum("iht,tk->ihk", w, rows[:, :KV_LORA])
        with np.errstate(divide="ignore", invalid="ignore"):
            latent[b] = np.where(live[:, None, None], acc / l[:, :, None], 0.0)
            lse[b] = np.where(live[:, None], m + np.log(l), -np.inf)
    out = np.einsum("hvk,bihk->bihv", wv64, latent)
    return {"out": out, "latent": latent, "lse": lse}


# ==== launch (the CUDA kernels) ================================================================
def launch_values(q, cache, table, lengths, wv_b):
    """Every kernel argument by name. Outputs and partials start as NaN (an element a kernel
    fails to write shows up); tickets start at 0."""
    import cupy

    batch, n_rows = len(LENGTHS), S_Q * N_HEAD
    mc = PLAN["max_chunks"]
    nan = np.float32(np.nan)
    n_part = batch * mc * n_rows
    values = {
        "q": q, "kv_cache": cache, "block_table": table, "cache_seqlens": lengths,
        "wv_b": wv_b, "n_rows": np.int32(n_rows), "n_head": np.int32(N_HEAD),
        "s_q": np.int32(S_Q), "causal": np.int32(CAUSAL),
        "max_pages": np.int32(table.shape[1]), "page_shift": np.int32(PAGE_SIZE.bit_length() - 1),
        "max_chunks": np.int32(mc), "min_chunk": np.int32(PLAN["min_chunk"]),
        "target": np.int32(PLAN["target"]),
        "batch": np.int32(batch), "chunk_counts": cupy.full(batch, -1, cupy.int32),
        "scale_log2": np.float32(SCALE * LOG2E),
        "v_head": np.int32(V_HEAD), "m_rows": np.int32(batch * S_Q),
        "part_acc": cupy.full(n_part * KV_LORA, nan, cupy.float32),
        "part_m": cupy.full(n_part, nan, cupy.float32),
        "part_l": cupy.full(n_part, nan, cupy.float32),
        "out": cupy.full((batch, S_Q, N_HEAD, V_HEAD), nan, cupy.float32),
        "latent": cupy.full((batch, S_Q, N_HEAD, KV_LORA), nan, cupy.float32),
        "lse": cupy.full((batch, S_Q, N_HEAD), nan, cupy.float32),
    }
    if COMBINE:   # the one-kernel form: each row's column parts, and a ticket a row
        values["attn_writes_single"] = np.int32(COMBINE["attn_writes_single"])
        values["out_part"] = cupy.full(batch * n_rows * COMBINE["col_blocks"] * V_HEAD, nan,
                                       cupy.float32)
        values["tickets"] = cupy.zeros(batch * n_rows, cupy.uint32)
    if "kv_map" in ATTN["args"]:   # wgmma64: whole tiles by bulk tensor copy, else cp.async
        values["kv_map"] = cache_map(cache)
    if "attn_tickets" in ATTN["args"]:
        values.update(attn_merge_args(batch, n_rows))
    return values


def attn_merge_args(batch, n_rows):
    """The mma kernel's attn_tickets and merge_rescale. Where it merges (ATTN_MERGES): a zeroed
    ticket a request and row block, [B][row blocks] as the step sizes them, and the rescale,
    off in the negative control; else a null pointer, and the combine merges."""
    import cupy

    if not ATTN_MERGES:
        return {"attn_tickets": np.uint64(0), "merge_rescale": np.int32(1)}
    row_blocks = -(-n_rows // PLAN["rows_per_block"])
    return {"attn_tickets": cupy.zeros((batch, row_blocks), cupy.uint32),
            "merge_rescale": np.int32(not NEGATIVE_CONTROL)}


def launch(name, kernel, spec, grid, values, smem=0):
    """One kernel as phase `name`: spec's block and argument names, synchronized after."""
    block = (spec["threads"], 1, 1)
    with phase(name, f"kernel {spec['name']}, grid {grid}, block {block}, dynamic shared "
                     f"memory {smem} B"):
        kernel(grid, block, tuple(values[a] for a in spec["args"]), shared_mem=smem)


def run_cuda(kernels, q, cache, table, lengths, wv_b):
    """attn over (row blocks, chunk programs, 1), then the combine over (n_rows, col blocks,
    B), or where the attention kernel merges the projection alone over PROJECT["grid"]: the
    launches of mlasandbox.PagedDecodeStep (its run_combine)."""
    import cupy

    attn, combine, project = kernels
    values = launch_values(q, cache, table, lengths, wv_b)
    batch, n_rows = len(LENGTHS), S_Q * N_HEAD
    programs = PLAN["programs"]                                   # chunk programs a row block
    launch("attn", attn, ATTN, (-(-n_rows // PLAN["rows_per_block"]), programs, 1), values,
           ATTN["smem_bytes"])
    if COMBINE:
        launch("combine", combine, COMBINE, (n_rows, COMBINE["col_blocks"], batch), values)
    if PROJECT:
        launch("project", project, PROJECT, tuple(PROJECT["grid"]), values)
    return {k: cupy.asnumpy(values[k]) for k in ("out", "latent", "lse")}


# ==== comparison ===============================================================================
def compare(got, want):
    """(ok, lines): on rows that see a position, relL2 of out and latent and max |error| of
    lse; rows that see nothing must be exactly latent 0, out 0, lse -inf. NaN never passes."""
    empty = np.isneginf(want["lse"])
    live = ~empty
    ok, lines = True, []
    for name, metric in (("out", "relL2"), ("latent", "relL2"), ("lse", "max abs")):
        g = np.asarray(got[name], np.float64)[live]
        w = np.asarray(want[name], np.float64)[live]
        if not live.any():
            continue
        nonfinite = int(np.count_nonzero(~np.isfinite(g)))
        if metric == "relL2":
            value = float(np.linalg.norm((g - w).ravel()) / np.linalg.norm(w.ravel()))
        else:
            value = float(np.abs(g - w).max())
        if nonfinite:
            value = float("nan")
        good = nonfinite == 0 and value <= TOLERANCE[name]
        ok &= good
        lines.append(f"  {'ok  ' if good else 'FAIL'} {name:<6} {metric} {value:.3e} (limit "
                     f"{TOLERANCE[name]:.1e}, {int(live.sum())} live rows)"
                     + (f", {nonfinite} NaN/inf" if nonfinite else ""))
    lat, out, lse = (np.asarray(got[k], np.float64) for k in ("latent", "out", "lse"))
    wrong = empty & ~(np.isneginf(lse) & np.all(lat == 0, axis=-1) & np.all(out == 0, axis=-1))
    n_wrong = int(wrong.sum())
    ok &= n_wrong == 0
    lines.append(f"  {'ok  ' if n_wrong == 0 else 'FAIL'} empty  {n_wrong} of "
                 f"{int(empty.sum())} rows that see nothing are not latent 0 / out 0 / lse -inf")
    return ok, lines


def main(argv=None):
    args, say = parse_args(argv)
    say(f"  {VARIANT}: B={len(LENGTHS)}, s_q={S_Q}{' causal' if CAUSAL else ''}, H={N_HEAD}, "
        f"page {PAGE_SIZE}, cache {CACHE_DTYPE}, q {Q_DTYPE}, seed {SEED}")
    say(f"  chunk plan {PLAN} ({PLAN_FROM})")
    say(f"  merge: {MERGE_FORM}")
    if NEGATIVE_CONTROL:
        say(f"  NEGATIVE CONTROL: {'the attention kernel' if ATTN_MERGES else 'the combine'} "
            "drops its exp(m_i - m) rescale; the check must FAIL")
    if not device_versions(say):
        return 3
    inc = include_dirs(args.include)
    try:
        kernels = compile_kernels(inc)
    except Exception as exc:
        print(f"ERROR: compile error ({type(exc).__name__}): {exc}")
        return 2
    import cupy

    try:
        host = host_inputs()
        got = run_cuda(kernels, *(cupy.asarray(a) for a in host))
        want = reference(*host)
    except PhaseError as exc:
        print(f"  error: {exc}")
        print(f"ERROR: {VARIANT} raised a CUDA error (see above)")
        return 2
    except MemoryError as exc:
        print(out_of_memory(f"B={len(LENGTHS)}, lengths up to {max(LENGTHS)}", exc))
        return 2
    ok, lines = compare(got, want)
    for line in lines:
        say(line)
    what = (f"{VARIANT} B={len(LENGTHS)} s_q={S_Q} causal={CAUSAL} H={N_HEAD} page={PAGE_SIZE} "
            f"cache={CACHE_DTYPE} q={Q_DTYPE}")
    note = ("  (negative control: FAIL is the expected outcome; a PASS would mean the check "
            "has no power)") if NEGATIVE_CONTROL else ""
    print(("PASS: " if ok else "FAIL: ") + what + " against the float64 paged reference" + note)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
'''

# The wgmma family's tensor maps: sandbox/tensor_map.py verbatim but its __future__ import
# (step_map: PagedDecodeStep's maps), and a null pointer where it gives none (cp.async).
TENSOR_MAP = '''# ==== the cache's tensor maps (sandbox/tensor_map.py, verbatim but its __future__ import)
@@TENSOR_MAP_SOURCE@@


def cache_map(cache):
    """The maps argument of the attention kernel for the device cache `cache`."""
    kv_map = step_map(cache)
    return np.uint64(0) if kv_map is None else kv_map
'''
