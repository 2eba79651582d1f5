// mla_common.cuh: helpers shared by the mlasandbox kernel families.
//
// Conversions from the cache element types to f32, 16-byte cp.async with zero fill, the PDL
// wait and trigger, warp reductions, the online-softmax step and the lazy max, the tiles'
// swizzle, the memory ablation's switch and the tile copy that honours it, the context slice
// every attention family walks (with the neutral partial of an empty one), and the q
// prologue. Nothing here depends on the MLA dims.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// NVRTC compiles without the C library headers that define INFINITY.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

namespace mla {

// ---- element conversions -------------------------------------------------------------
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// Two packed 16-bit elements (one 32-bit word) to two floats.
template <typename T> __device__ __forceinline__ float2 pair_to_f32(unsigned int w);
template <> __device__ __forceinline__ float2 pair_to_f32<__half>(unsigned int w) {
    __half2 h = *reinterpret_cast<__half2*>(&w);
    return __half22float2(h);
}
template <> __device__ __forceinline__ float2 pair_to_f32<__nv_bfloat16>(unsigned int w) {
    // bf16 is the top half of an f32: two integer ops, no float pipe.
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

// The 2, 4 or 8 cache elements packed in a 4-, 8- or 16-byte word read from a tile, as f32
// in order, into x[0..).
template <typename CacheT> __device__ __forceinline__ void unpack_f32(unsigned int w, float* x) {
    const float2 a = pair_to_f32<CacheT>(w);
    x[0] = a.x; x[1] = a.y;
}
template <typename CacheT> __device__ __forceinline__ void unpack_f32(uint2 w, float* x) {
    unpack_f32<CacheT>(w.x, x); unpack_f32<CacheT>(w.y, x + 2);
}
template <typename CacheT> __device__ __forceinline__ void unpack_f32(uint4 w, float* x) {
    unpack_f32<CacheT>(w.x, x); unpack_f32<CacheT>(w.y, x + 2);
    unpack_f32<CacheT>(w.z, x + 4); unpack_f32<CacheT>(w.w, x + 6);
}

// ---- mma.sync (sm_80+) -------------------------------------------------------------------
// D += A B for one m16n8k16 tile, A row-major and B column-major 16-bit operands of type T,
// f32 accumulators; and the split of an f32 into two 16-bit parts that keep it to ~2^-22
// (f16) or ~2^-16 (bf16) relative, so a product on 16-bit tensor cores stays near f32.
template <typename T> struct MmaType;
template <> struct MmaType<__half> {
    __device__ static void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
template <> struct MmaType<__nv_bfloat16> {
    __device__ static void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

// Whether two types are one (NVRTC has no <type_traits> here).
template <typename A, typename B> struct SameType { static constexpr bool value = false; };
template <typename A> struct SameType<A, A> { static constexpr bool value = true; };

// x = hi + lo in the 16-bit type T, each part rounded to nearest.
template <typename T>
__device__ __forceinline__ void split_hi_lo(float x, T& hi, T& lo) {
    hi = from_f32<T>(x);
    lo = from_f32<T>(x - to_f32(hi));
}
// The 16 bits of a half or bfloat16, in the low half of a word.
template <typename T>
__device__ __forceinline__ unsigned bits16(T x) {
    unsigned short u;
    memcpy(&u, &x, sizeof u);
    return u;
}

// ---- cp.async (sm_80+) -----------------------------------------------------------------
// The 32-bit shared-state-space address of a generic pointer into shared memory, the operand
// form of cp.async, ldmatrix and mbarrier.
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Copies 16 bytes, or zero-fills the destination when `valid` is false (src-size 0): rows
// past the end of a slice become zeros in shared memory and are never read from global,
// so a NaN-filled cache past n_ctx cannot leak into a product.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
    const unsigned dst = smem_u32(smem_dst);
    int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// ---- mbarriers: arrive -> wait orderings compute-sanitizer's racecheck models (try_wait:
// sm_90 and later; the kernels that use them are built for sm_90 or sm_90a) ----
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(arrivals) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            " selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    } while (!done);
}
// Arrives on `bar` now, releasing this thread's earlier shared-memory writes to its waiters.
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(smem_u32(bar)) : "memory");
}
// Arrives on `bar` once every cp.async this thread issued before has landed (at once if none).
__device__ __forceinline__ void mbar_arrive_after_copies(unsigned long long* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// ---- programmatic dependent launch (sm_90+) ---------------------------------------------
// A kernel launched with programmatic stream serialization (sandbox/pdl.py) may start while
// the kernel before it still runs. pdl_wait() blocks until that kernel has completed and its
// writes are visible: nothing before it may read what that kernel writes.
// pdl_launch_dependents() lets the next kernel's blocks be scheduled once every block of this
// one has called it (or exited); it orders nothing, the dependent's wait does. Both compile
// to nothing below sm_90, and the wait is a no-op for a kernel launched without the attribute.
// -DMLA_NO_PDL_WAIT builds a kernel that does not wait: a negative control only
// (tests/test_gpu_phases.py: behind a kernel that writes q late, that build must fail).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(MLA_NO_PDL_WAIT)
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// ---- warp reductions -------------------------------------------------------------------
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One online-softmax step of head h for one tile (one lane calls it): rescale the running sum
// to the new max and add the tile's sum. alpha = 2^(m_old - m_new) also rescales the value
// accumulators; m_old = -inf on the first tile gives alpha = 0, never NaN (m_new is finite:
// every tile holds at least one valid row).
__device__ __forceinline__ void online_softmax_step(float* m_s, float* l_s, float* alpha_s, int h,
                                                    float m_old, float m_new, float p_sum) {
    const float alpha = exp2f(m_old - m_new);
    alpha_s[h] = alpha;
    l_s[h] = l_s[h] * alpha + p_sum;
    m_s[h] = m_new;
}

// 2^x as one MUFU.EX2, flushing results below 2^-126 to zero (exp2f adds a range fix-up of
// three instructions for them). Used for the p = 2^(s - m) of attn_rows, where such a p is
// nothing next to the running sum (>= 2^-8 with the lazy max below).
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The lazy running max (mla_attn_rows.cu, mla_attn_tiled.cu, mla_mma.cu): a head's reference
// max moves only when a tile's (attn_rows: a step's) max exceeds it by more than this many
// log2 units, so p = 2^(s - m) <= 2^8 and the value accumulators are rescaled only where some
// head's max moved (alpha is exactly 1 for the others). A huge value (-DMLA_LAZY_LOG2=1e30f) never moves the max after
// the first tile: the GPU tests' negative control, which rising scores overflow.
#ifndef MLA_LAZY_LOG2
#define MLA_LAZY_LOG2 8.f
#endif
[[maybe_unused]] constexpr float kLazyLog2 = MLA_LAZY_LOG2;

// ---- the shared-memory swizzle ---------------------------------------------------------
// Chunk c (16 bytes) of tile row r lives at chunk (c ^ (r & 7)) of that row, for rows of
// `chunks_per_row` chunks (a multiple of 8): 8 consecutive rows read at one column land in 8
// different bank groups, and one row read across its columns stays conflict-free too, with no
// padding. Every attention family lays its cache tiles out this way.
__device__ __forceinline__ int swizzled_chunk(int r, int c, int chunks_per_row) {
    return r * chunks_per_row + (c ^ (r & 7));
}

// ---- the memory ablation (mlasandbox ablate) ---------------------------------------------
// Built with -DMLA_ABLATE_CACHE_LOADS, a kernel copies only the first tile into each of its
// stage buffers and then computes every later tile on those same rows: the instructions it
// issues are its own minus the cache copies, so its time is the design's compute floor and
// the gap to the real kernel is what the loads cost. Its results are wrong by design (where
// score partials borrow the spare tile buffer, later tiles compute on their bits, often NaN,
// which the float pipes take at full speed).
#ifdef MLA_ABLATE_CACHE_LOADS
[[maybe_unused]] constexpr bool kAblateCacheLoads = true;
#else
[[maybe_unused]] constexpr bool kAblateCacheLoads = false;
#endif

// ---- the tile copy ------------------------------------------------------------------------
// Copies tile `tile_index` of the slice that starts at row_start (cache rows [row0, row0 +
// kRows), row0 = row_start + tile_index * kRows) into stage buffer `buf` of `tiles` (kStages
// buffers of kRows rows of kChunks 16-byte chunks) with kThreadsT threads, one cp.async group;
// rows >= row_end are zero-filled (cp_async_16). Under the memory ablation only the first
// kStages tiles are copied, one per buffer.
// kSwizzle: lay the rows out with swizzled_chunk() (families that read a column of chunks down
// many rows), or plainly, row after row (attn_rows, whose warps read whole rows: a row's 16
// chunks of 8 lanes are conflict-free either way).
// Eight threads copy a row, kThreadsT / 8 rows per pass: thread t copies rows t/8 + pass *
// kThreadsT/8, chunks (t%8) + 8i, where t is threadIdx.x, or `thread` when only some of the
// block's threads copy (attn_tiled's value warps, threads 128..255, pass 0..127). Rows a
// multiple of 8 apart share a swizzle, and the swizzle flips only the low three bits of the
// chunk index, so a thread's destinations are one base plus immediates and its sources one
// row pointer plus immediates: no per-chunk index arithmetic.
template <int kRows, int kChunks, int kStages, int kThreadsT, bool kSwizzle = true, typename CacheT>
__device__ __forceinline__ void cp_async_tile(uint4* tiles, int buf, int tile_index,
                                              const CacheT* __restrict__ cache, int row_start,
                                              int row_end, int thread = -1) {
    constexpr int kRowsPerPass = kThreadsT / 8;
    static_assert(kThreadsT % 64 == 0 && kRows % kRowsPerPass == 0,
                  "8 threads per row, and a pass of rows a multiple of 8 (one swizzle per thread)");
    static_assert(kChunks % 8 == 0, "the XOR swizzle permutes chunks within groups of 8");
    if (kAblateCacheLoads && tile_index >= kStages) return;
    const int row0 = row_start + tile_index * kRows;
    const unsigned t = thread < 0 ? threadIdx.x : static_cast<unsigned>(thread);
    const int copy_row = t >> 3, copy_lane = t & 7;
    uint4* dst = tiles + buf * kRows * kChunks + copy_row * kChunks +
                 (kSwizzle ? (copy_lane ^ (copy_row & 7)) : copy_lane);
#pragma unroll
    for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
        const int row = row0 + pass * kRowsPerPass + copy_row;
        const bool valid = row < row_end;
        const CacheT* src = cache + static_cast<size_t>(valid ? row : 0) * (kChunks * 8) + copy_lane * 8;
#pragma unroll
        for (int i = 0; i < kChunks / 8; ++i)
            cp_async_16(dst + (pass * kRowsPerPass * kChunks + 8 * i), src + 64 * i, valid);
    }
    cp_async_commit();
}

// ---- context slices and their partials ------------------------------------------------
// Block (g, split) of a launch with grid (head groups, splits) serves heads
// [head0, head0 + heads) over the contiguous rows [row_start, row_end) of [0, n_ctx), with
// ceil(n_ctx / splits) rows per slice: contiguous so that each block's walk stays sequential
// for the prefetcher. With splits > n_ctx the last slices are empty (row_start == row_end).
// Its partial for head h is entry part_base + h of the partials (split * n_head + h).
struct BlockSlice {
    int head0, row_start, row_end;
    size_t part_base;
};

// part_base of this block's slice: one value the kernels may recompute at their end rather
// than hold in a register across the walk (attn_rows, at its 80-register limit, does).
__device__ __forceinline__ size_t slice_part_base(int n_head) {
    return static_cast<size_t>(static_cast<int>(blockIdx.y)) * n_head;
}

// The slice of this block. An empty one writes, for the heads that exist (< n_head),
// m = -inf, l = 0, acc = 0 and returns false: the combine weighs it by 2^(m - m_max) = 0,
// so it is neutral, never NaN, and the kernel has nothing else to do.
__device__ __forceinline__ bool begin_slice(int heads, int n_head, int n_ctx, int splits, int latent,
                                            float* part_acc, float* part_m, float* part_l,
                                            BlockSlice& out) {
    const int split = blockIdx.y;
    const int len = (n_ctx + splits - 1) / splits;
    const int begin = min(split * len, n_ctx);
    out = {static_cast<int>(blockIdx.x) * heads, begin, min(n_ctx, begin + len),
           slice_part_base(n_head)};
    if (out.row_start < out.row_end) return true;
    for (int j = 0; j < heads && out.head0 + j < n_head; ++j) {
        const size_t partial = out.part_base + out.head0 + j;
        for (int c = threadIdx.x; c < latent; c += blockDim.x) part_acc[partial * latent + c] = 0.f;
        if (threadIdx.x == 0) { part_m[partial] = -INFINITY; part_l[partial] = 0.f; }
    }
    return false;
}

// ---- the query ---------------------------------------------------------------------------
// q is read through L2 only (ld.global.cg), never the read-only path: behind q_absorb the
// attention kernel starts before q is written (api.DecodeStep.run_attn(after_q_absorb)), so q
// is not read-only for the kernel's lifetime, as __ldg and const __restrict__ loads assume.
// Reads q[head0 + j, k] for the block's kHeadsT heads and kKey key columns as f32 times
// `scale` (0 for heads >= n_head, which are masked) and hands each value to
// store(j, k, value), which writes it in the family's shared-memory layout. A thread issues
// up to 16 global loads before it stores the first value, so the prologue waits for one
// memory latency per 16 values, not one per loop trip (a strided loop unrolled by 4 waited
// 9 times at 16 heads); 16 keeps the loads' addresses and values out of the register peak.
template <int kHeadsT, int kKey, int kThreadsT, typename QT, typename Store>
__device__ __forceinline__ void stage_q(const QT* __restrict__ q, int head0, int n_head, float scale,
                                        Store store) {
    constexpr int kTotal = kHeadsT * kKey;
    constexpr int kPerThread = (kTotal + kThreadsT - 1) / kThreadsT;
    constexpr int kBatch = kPerThread < 16 ? kPerThread : 16;
#pragma unroll 1
    for (int first = 0; first < kPerThread; first += kBatch) {
        float v[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
            const int idx = threadIdx.x + (first + i) * kThreadsT;
            const int j = idx / kKey, k = idx - j * kKey;
            v[i] = (idx < kTotal && head0 + j < n_head) ? to_f32(__ldcg(q + static_cast<size_t>(head0 + j) * kKey + k)) : 0.f;
        }
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
            const int idx = threadIdx.x + (first + i) * kThreadsT;
            const int j = idx / kKey, k = idx - j * kKey;
            if (idx < kTotal) store(j, k, v[i] * scale);
        }
    }
}

// The same, 8 key columns at a time, for families whose layout keeps 8 consecutive columns
// of a head in one 16-byte chunk: store8(j, c, v) gets q[head0 + j, 8c .. 8c + 7] times
// `scale` (0 for heads >= n_head). One vector load per chunk (two float4s of an f32 q, one
// 16-byte word of a 16-bit one) where stage_q issues one load, one index division and one
// store per value: the prologue of a one-tile block was half its instructions.
// kQ8Batch chunks (40 floats) a thread are in flight per memory round trip.
[[maybe_unused]] constexpr int kQ8Batch = 5;
__device__ __forceinline__ void load8_f32(const float* p, float (&v)[8]) {
    const float4 a = __ldcg(reinterpret_cast<const float4*>(p));
    const float4 b = __ldcg(reinterpret_cast<const float4*>(p) + 1);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
template <typename T>
__device__ __forceinline__ void load8_f32(const T* p, float (&v)[8]) {
    unpack_f32<T>(__ldcg(reinterpret_cast<const uint4*>(p)), v);
}
template <int kHeadsT, int kKey, int kThreadsT, typename QT, typename Store8>
__device__ __forceinline__ void stage_q8(const QT* __restrict__ q, int head0, int n_head,
                                         float scale, Store8 store8) {
    static_assert(kKey % 8 == 0, "whole 8-column chunks");
    constexpr int kChunks = kKey / 8;
    constexpr int kTotal = kHeadsT * kChunks;
    constexpr int kPerThread = (kTotal + kThreadsT - 1) / kThreadsT;
    constexpr int kBatch = kPerThread < kQ8Batch ? kPerThread : kQ8Batch;
#pragma unroll 1
    for (int first = 0; first < kPerThread; first += kBatch) {
        float v[kBatch][8];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
            const int idx = threadIdx.x + (first + i) * kThreadsT;
            const int j = idx / kChunks, c = idx - j * kChunks;
            if (idx < kTotal && head0 + j < n_head) {
                load8_f32(q + static_cast<size_t>(head0 + j) * kKey + 8 * c, v[i]);
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) v[i][e] = 0.f;
            }
        }
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
            const int idx = threadIdx.x + (first + i) * kThreadsT;
            const int j = idx / kChunks, c = idx - j * kChunks;
#pragma unroll
            for (int e = 0; e < 8; ++e) v[i][e] *= scale;
            if (idx < kTotal) store8(j, c, v[i]);
        }
    }
}

// ---- the registry's launch values ---------------------------------------------------------
// sandbox/registry.py launches each kernel with a block size, a tile and an amount of dynamic
// shared memory it computes itself, and passes those values to every compile it makes, with
// -DMLA_REGISTRY_FACTS: MLA_<FAMILY>_THREADS and MLA_<FAMILY>_TILE as numbers, and
// MLA_<FAMILY>_SMEM as a list of (heads per block, bytes) pairs, e.g. "2,78640,4,83504".
// Each kernel static_asserts them against its own constants and its layout struct, so a
// formula that drifts from the kernel fails the NVRTC compile of that instance, with no GPU.
// registry_fact(key, list...) is the value paired with `key` in such a list, or -1.
__host__ __device__ constexpr int registry_fact(int) { return -1; }
template <typename... Rest>
__host__ __device__ constexpr int registry_fact(int key, int k, int v, Rest... rest) {
    return key == k ? v : registry_fact(key, rest...);
}

// A kernel that needs `need` bytes of dynamic shared memory traps when launched with less,
// so a launcher whose smem formula drifted from the kernel fails loudly, not wrongly.
__device__ __forceinline__ void require_dynamic_smem(unsigned int need) {
    unsigned int have;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < need) __trap();
}

}  // namespace mla
