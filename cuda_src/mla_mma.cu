// mla_mma.cu: the tensor-core attention variant, mla::mma_attn<CacheT, QT>.
//
// Template parameters
//   CacheT  cache element: __half or __nv_bfloat16 (also the MMA operand type)
//   QT      query element: float, or CacheT
// Fixed geometry
//   kHeads = 16 heads per block (the M dimension of mma.m16n8k16), kThreads = 128 (4 warps),
//   kTile = 64 cache rows per step, two stages; MLA_KV_LORA = 512, MLA_ROPE = 64.
//
// Launch: grid = (ceil(H / 16), S), block = 128, dynamic smem = mma_smem_bytes().
// Same slices and same partial (m, l, acc[512]) in the log2 domain as mla_attn.cu, so the
// same combine merges it.
//
// Why it is exact to f32 level although the tensor cores take 16-bit operands: q and p are
// split into hi + lo parts of the cache dtype (hi = round(x), lo = round(x - hi)) and each
// product is done twice, so q.c = q_hi.c + q_lo.c to ~2^-22 (f16) / 2^-16 (bf16) relative;
// the cache itself is already 16-bit and exact. Accumulation is f32.
//
// One tile of 64 rows:
//   scores: S[16 heads x 64 rows] = Q[16 x 576] C[64 x 576]^T; warp w computes rows
//           16w .. 16w+15 (two n8 tiles) over all 36 k16 steps, q and cache fragments from
//           swizzled shared memory through ldmatrix.
//   softmax: per head, the tile max and row sums are reduced over the 4 warps through
//           shared memory; p = 2^(s - m_new) is written as hi/lo halves [head][row].
//   values: warp w owns latent columns 128w .. 128w+127 (16 n8 tiles, 64 f32 registers);
//           A = p (ldmatrix), B = cache rows (ldmatrix.trans), 4 k16 steps per tile.
#include "mla_common.cuh"

namespace mla {

constexpr int kMmaHeads = 16;
constexpr int kMmaThreads = 128;
constexpr int kMmaWarps = kMmaThreads / 32;
constexpr int kMmaTile = 64;
constexpr int kMmaLora = MLA_KV_LORA;
constexpr int kMmaKey = MLA_KV_LORA + MLA_ROPE;
constexpr int kMmaChunks = kMmaKey / 8;                   // 16-byte chunks per cache row (72)
constexpr int kPChunks = kMmaTile / 8;                    // 16-byte chunks per p row (8)
static_assert(kMmaKey % 32 == 0 && kMmaChunks % 8 == 0, "k16 steps and the 8-chunk swizzle");
static_assert(kMmaTile == 16 * kMmaWarps, "score phase: 16 rows per warp");
static_assert(kMmaLora == 128 * kMmaWarps, "value phase: 128 columns per warp");

struct MmaSmem {
    static constexpr int tile_bytes = kMmaTile * kMmaKey * 2;
    static constexpr int tiles = 0;                                   // 2 x [64][72 chunks]
    static constexpr int q = tiles + 2 * tile_bytes;                  // hi, lo: [16][72 chunks]
    static constexpr int p = q + 2 * kMmaHeads * kMmaKey * 2;         // hi, lo: [16][8 chunks]
    static constexpr int red = p + 2 * kMmaHeads * kMmaTile * 2;      // max, sum: [4 warps][16]
    static constexpr int bytes = red + 2 * kMmaWarps * kMmaHeads * 4;
};

// Chunk c of row r at chunk (c ^ (r & 7)): the 8 rows an ldmatrix reads at one column land
// in 8 different bank groups.
__device__ __forceinline__ int mma_swz(int r, int c, int chunks_per_row) {
    return r * chunks_per_row + (c ^ (r & 7));
}

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(unsigned addr, unsigned (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

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

// x = hi + lo in the 16-bit type T, each part rounded to nearest.
template <typename T>
__device__ __forceinline__ void split_hi_lo(float x, T& hi, T& lo) {
    hi = from_f32<T>(x);
    lo = from_f32<T>(x - to_f32(hi));
}

template <typename CacheT, typename QT>
__global__ void __launch_bounds__(kMmaThreads, 1)
mma_attn(const QT* __restrict__ q, const CacheT* __restrict__ cache, int n_head, int n_ctx,
         int splits, float scale_log2, float* __restrict__ part_acc, float* __restrict__ part_m,
         float* __restrict__ part_l) {
    using M = MmaType<CacheT>;
    require_dynamic_smem(MmaSmem::bytes);
    extern __shared__ __align__(128) unsigned char smem[];
    uint4* tiles = reinterpret_cast<uint4*>(smem + MmaSmem::tiles);
    CacheT* q_hl = reinterpret_cast<CacheT*>(smem + MmaSmem::q);      // [2][16][576], swizzled
    CacheT* p_hl = reinterpret_cast<CacheT*>(smem + MmaSmem::p);      // [2][16][64], swizzled
    float* red_max = reinterpret_cast<float*>(smem + MmaSmem::red);   // [4][16]
    float* red_sum = red_max + kMmaWarps * kMmaHeads;                 // [4][16]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, c4 = lane & 3;  // fragment row group and column pair
    const int head0 = blockIdx.x * kMmaHeads;
    const int split = blockIdx.y;
    const int slice_len = (n_ctx + splits - 1) / splits;
    const int row_start = min(split * slice_len, n_ctx);
    const int row_end = min(n_ctx, row_start + slice_len);
    const size_t part_base = static_cast<size_t>(split) * n_head;

    if (row_start >= row_end) {  // empty slice: a neutral partial
        for (int j = 0; j < kMmaHeads && head0 + j < n_head; ++j) {
            float4* dst = reinterpret_cast<float4*>(part_acc + (part_base + head0 + j) * kMmaLora);
            dst[tid] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (tid == 0) { part_m[part_base + head0 + j] = -INFINITY; part_l[part_base + head0 + j] = 0.f; }
        }
        return;
    }

    // Tile copy: 128 threads, 64 rows x 72 chunks = 36 chunks each.
    auto load_tile = [&](int tile_index, int buf) {
        const int row0 = row_start + tile_index * kMmaTile;
        uint4* dst = tiles + buf * kMmaTile * kMmaChunks;
        for (int idx = tid; idx < kMmaTile * kMmaChunks; idx += kMmaThreads) {
            const int r = idx / kMmaChunks, c = idx - r * kMmaChunks;
            const bool valid = row0 + r < row_end;
            const CacheT* src = cache + static_cast<size_t>(valid ? row0 + r : 0) * kMmaKey + c * 8;
            cp_async_16(dst + mma_swz(r, c, kMmaChunks), src, valid);
        }
        cp_async_commit();
    };
    load_tile(0, 0);

    // q, pre-scaled into the log2 domain, as hi/lo halves in the swizzled [head][k] layout.
    for (int idx = tid; idx < kMmaHeads * kMmaKey; idx += kMmaThreads) {
        const int j = idx / kMmaKey, k = idx - j * kMmaKey;
        const int h = head0 + j;
        const float x = (h < n_head) ? to_f32(q[static_cast<size_t>(h) * kMmaKey + k]) * scale_log2 : 0.f;
        CacheT hi, lo;
        split_hi_lo(x, hi, lo);
        const int off = mma_swz(j, k >> 3, kMmaChunks) * 8 + (k & 7);
        q_hl[off] = hi;
        q_hl[kMmaHeads * kMmaKey + off] = lo;
    }

    // Per-thread state: running max and sum for heads g and g+8 (identical in every warp),
    // and the value accumulators: 16 n8 tiles x {row g: cols 2c4, 2c4+1; row g+8: same}.
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
    float acc[16][4];
#pragma unroll
    for (int t = 0; t < 16; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;

    const unsigned q_base = smem_u32(q_hl);
    const unsigned p_base = smem_u32(p_hl);
    const int n_tiles = (row_end - row_start + kMmaTile - 1) / kMmaTile;
    // ldmatrix row addresses: lane l feeds row (l & 7) of matrix (l >> 3).
    const int lm_mat = lane >> 3, lm_row = lane & 7;

    for (int it = 0; it < n_tiles; ++it) {
        const int buf = it & 1;
        cp_async_wait<0>();
        __syncthreads();  // tile `it` visible; everyone is done with the other buffer
        if (it + 1 < n_tiles) load_tile(it + 1, buf ^ 1);
        const unsigned tile_base = smem_u32(tiles + buf * kMmaTile * kMmaChunks);

        // ---- scores for rows 16*warp .. +15: two n8 tiles ----
        // Four independent accumulator sets (q_hi / q_lo x even / odd k steps) per n tile, so
        // consecutive MMAs do not wait on each other: a chain of 72 dependent MMAs would
        // leave the tensor pipe idle with only 4 warps per SM.
        float s[2][4];
        {
            float sp[2][4][4];
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int v = 0; v < 4; ++v) sp[n][v][0] = sp[n][v][1] = sp[n][v][2] = sp[n][v][3] = 0.f;
            // A (q): matrices (heads 0-7 | 8-15) x (k lo | k hi) -> head (lm_mat & 1)*8 + lm_row
            const int a_head = (lm_mat & 1) * 8 + lm_row, a_khalf = lm_mat >> 1;
            // B (cache rows): matrices (n tile 0 | 1) x (k lo | k hi)
            const int b_row = warp * 16 + (lm_mat >> 1) * 8 + lm_row, b_khalf = lm_mat & 1;
#pragma unroll 4
            for (int ks = 0; ks < kMmaKey / 16; ks += 2) {
#pragma unroll
                for (int par = 0; par < 2; ++par) {
                    unsigned a_hi[4], a_lo[4], b[4];
                    const int qa = mma_swz(a_head, 2 * (ks + par) + a_khalf, kMmaChunks) * 16;
                    ldsm_x4(q_base + qa, a_hi);
                    ldsm_x4(q_base + kMmaHeads * kMmaKey * 2 + qa, a_lo);
                    ldsm_x4(tile_base + mma_swz(b_row, 2 * (ks + par) + b_khalf, kMmaChunks) * 16, b);
                    M::mma(sp[0][par], a_hi, b[0], b[1]);
                    M::mma(sp[1][par], a_hi, b[2], b[3]);
                    M::mma(sp[0][2 + par], a_lo, b[0], b[1]);
                    M::mma(sp[1][2 + par], a_lo, b[2], b[3]);
                }
            }
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    s[n][e] = (sp[n][0][e] + sp[n][1][e]) + (sp[n][2][e] + sp[n][3][e]);
        }
        // s[n][0..1]: head g, rows 16w + 8n + 2c4 + {0,1}; s[n][2..3]: head g+8, same rows.
        const int row0 = row_start + it * kMmaTile + warp * 16 + 2 * c4;
        float wmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = row0 + 8 * n + (e & 1);
                if (row >= row_end) s[n][e] = -INFINITY;
                wmax[e >> 1] = fmaxf(wmax[e >> 1], s[n][e]);
            }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            wmax[hh] = fmaxf(wmax[hh], __shfl_xor_sync(0xffffffffu, wmax[hh], 1));
            wmax[hh] = fmaxf(wmax[hh], __shfl_xor_sync(0xffffffffu, wmax[hh], 2));
        }
        if (c4 == 0) { red_max[warp * kMmaHeads + g] = wmax[0]; red_max[warp * kMmaHeads + g + 8] = wmax[1]; }
        __syncthreads();
        float m_new[2], alpha[2], wsum[2] = {0.f, 0.f};
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float t = red_max[g + 8 * hh];
#pragma unroll
            for (int w = 1; w < kMmaWarps; ++w) t = fmaxf(t, red_max[w * kMmaHeads + g + 8 * hh]);
            m_new[hh] = fmaxf(m_run[hh], t);  // finite: the tile's first row is valid
            alpha[hh] = exp2f(m_run[hh] - m_new[hh]);
        }
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
                const int hh = e >> 1, head = g + 8 * hh;
                const float p0 = exp2f(s[n][e] - m_new[hh]), p1 = exp2f(s[n][e + 1] - m_new[hh]);
                wsum[hh] += p0 + p1;
                CacheT h0, l0, h1, l1;
                split_hi_lo(p0, h0, l0);
                split_hi_lo(p1, h1, l1);
                const int col = warp * 16 + 8 * n + 2 * c4;  // row within the tile = column of p
                const int off = mma_swz(head, col >> 3, kPChunks) * 8 + (col & 7);
                p_hl[off] = h0; p_hl[off + 1] = h1;
                p_hl[kMmaHeads * kMmaTile + off] = l0; p_hl[kMmaHeads * kMmaTile + off + 1] = l1;
            }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            wsum[hh] += __shfl_xor_sync(0xffffffffu, wsum[hh], 1);
            wsum[hh] += __shfl_xor_sync(0xffffffffu, wsum[hh], 2);
        }
        if (c4 == 0) { red_sum[warp * kMmaHeads + g] = wsum[0]; red_sum[warp * kMmaHeads + g + 8] = wsum[1]; }
        __syncthreads();
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float t = 0.f;
#pragma unroll
            for (int w = 0; w < kMmaWarps; ++w) t += red_sum[w * kMmaHeads + g + 8 * hh];
            l_run[hh] = l_run[hh] * alpha[hh] + t;
            m_run[hh] = m_new[hh];
        }

        // ---- values: acc = acc * alpha + p @ cache[:, 128w .. 128w+127] ----
#pragma unroll
        for (int t = 0; t < 16; ++t) {
            acc[t][0] *= alpha[0]; acc[t][1] *= alpha[0];
            acc[t][2] *= alpha[1]; acc[t][3] *= alpha[1];
        }
#pragma unroll
        for (int ks = 0; ks < kMmaTile / 16; ++ks) {
            unsigned pa_hi[4], pa_lo[4];
            const int pa = mma_swz((lm_mat & 1) * 8 + lm_row, 2 * ks + (lm_mat >> 1), kPChunks) * 16;
            ldsm_x4(p_base + pa, pa_hi);
            ldsm_x4(p_base + kMmaHeads * kMmaTile * 2 + pa, pa_lo);
            // B: matrices (rows 16ks + 0-7 | 8-15) x (column tile 2j | 2j+1), transposed
            const int b_row = 16 * ks + (lm_mat & 1) * 8 + lm_row;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                unsigned b[4];
                const int col_chunk = warp * 16 + 2 * j + (lm_mat >> 1);
                ldsm_x4_trans(tile_base + mma_swz(b_row, col_chunk, kMmaChunks) * 16, b);
                M::mma(acc[2 * j], pa_hi, b[0], b[1]);
                M::mma(acc[2 * j + 1], pa_hi, b[2], b[3]);
                M::mma(acc[2 * j], pa_lo, b[0], b[1]);
                M::mma(acc[2 * j + 1], pa_lo, b[2], b[3]);
            }
        }
    }

    // acc[t][0..1]: head g, columns 128w + 8t + 2c4 + {0,1}; acc[t][2..3]: head g+8.
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int h = head0 + g + 8 * hh;
        if (h >= n_head) continue;
        float* dst = part_acc + (part_base + h) * kMmaLora + warp * 128 + 2 * c4;
#pragma unroll
        for (int t = 0; t < 16; ++t)
            *reinterpret_cast<float2*>(dst + 8 * t) = make_float2(acc[t][2 * hh], acc[t][2 * hh + 1]);
        if (warp == 0 && c4 == 0) { part_m[part_base + h] = m_run[hh]; part_l[part_base + h] = l_run[hh]; }
    }
}

}  // namespace mla
