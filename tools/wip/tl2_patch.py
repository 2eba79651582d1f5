"""Patch cuda_src/mla_mma.cu and mla_combine.cu in place with globaltimer records (tl2.py)."""
import re, pathlib
pre = r'''
__device__ unsigned long long mla_atl[4096];
__device__ unsigned long long mla_ctl[3 * 8192];
__device__ __forceinline__ unsigned long long tl_gt() { unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
#define TL_CBID (blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z))
struct TlA { __device__ TlA() { if (threadIdx.x == 0) mla_atl[2 * blockIdx.y] = tl_gt(); }
  __device__ ~TlA() { if (threadIdx.x == 0) mla_atl[2 * blockIdx.y + 1] = tl_gt(); } };
struct TlC { __device__ TlC() { if (threadIdx.x == 0) mla_ctl[3 * TL_CBID] = tl_gt(); }
  __device__ ~TlC() { if (threadIdx.x == 0) mla_ctl[3 * TL_CBID + 2] = tl_gt(); } };
'''
for name, pat, ins in [
    ("mla_mma.cu", r"(mma_attn_paged\([^{]*\{\n\s*pdl_launch_dependents\(\);[^\n]*\n)",
     "    TlA _tl;\n"),
    ("mla_combine.cu", r"(combine_paged\([^{]*\{\n)", "    TlC _tl;\n"),
]:
    p = pathlib.Path("cuda_src") / name
    s = p.read_text()
    s, n = re.subn(pat, lambda m: m.group(1) + ins, s, count=1)
    assert n == 1, name
    if name == "mla_combine.cu":
        s, n = re.subn(r"(\n    pdl_wait\(\);[^\n]*\n)", r"\1    if (threadIdx.x == 0) mla_ctl[3 * TL_CBID + 1] = tl_gt();\n", s, count=1)
        assert n == 1
    # the prelude before the first include
    i = s.index("#include")
    s = s[:i] + pre + s[i:]
    p.write_text(s)
print("patched")
