// mla_mma.cu: the tensor-core attention variants, mla::mma_attn<HM, CacheT, QT>.
//
// Template parameters
//   HM      head m-tiles per block: the block serves 16*HM heads (mma16: 1, mma32: 2), so one
//           pass over the cache (and one ldmatrix of each cache fragment) serves 16*HM heads
//   CacheT  cache element: __half or __nv_bfloat16 (also the MMA operand type)
//   QT      query element: float, or CacheT
// Fixed geometry (sandbox/registry.py mirrors it)
//   kThreads = 256 (8 warps), kTile = 64 cache rows per step, two stages;
//   MLA_KV_LORA = 512, MLA_ROPE = 64.
//
// Launch: grid = (ceil(H / (16*HM)), S), block = 256, dynamic smem = MmaSmem<HM>::bytes.
// Same slices and same partial (m, l, acc[512]) in the log2 domain as mla_attn.cu, so the
// same combine merges it.
//
// Exact to f32 level although the tensor cores take 16-bit operands: q and p are split into
// hi + lo parts of the cache dtype (hi = round(x), lo = round(x - hi)) and each product is
// done twice, so q.c = q_hi.c + q_lo.c to ~2^-22 (f16) / 2^-16 (bf16) relative; the cache is
// already 16-bit and exact, and every accumulation is f32.
//
// One tile of 64 rows:
//   scores: S[16HM heads x 64 rows] = Q C^T. Warp w computes rows 16*(w%4) .. +15 (two n8
//           tiles) over k16 steps 18*(w/4) .. +17; the two k halves meet in shared memory
//           (mma16: a buffer of their own, the next tile is issued before the scores;
//           mma32: the spare tile buffer, the next tile is issued after the softmax).
//   softmax: warp w owns heads w, w+8, ... (one lane per two rows), all of them at once: tile
//           max, p = 2^(s - m), written as hi/lo halves [head][row] for ldmatrix; (m, l, alpha).
//           The max is lazy (mla_common.cuh): the accumulators are rescaled only on the tiles
//           where some head's max grew by more than 2^8.
//   values: warp w owns latent columns 64w .. 64w+63 (8 n8 tiles) for all heads,
//           A = p (ldmatrix), B = cache rows (ldmatrix.trans), 4 k16 steps per tile.
#include "mla_common.cuh"

namespace mla {

constexpr int kMmaThreads = 256;
constexpr int kMmaWarps = kMmaThreads / 32;
constexpr int kMmaTile = 64;
constexpr int kMmaLora = MLA_KV_LORA;
constexpr int kMmaKey = MLA_KV_LORA + MLA_ROPE;
constexpr int kMmaChunks = kMmaKey / 8;                   // 16-byte chunks per cache row (72)
constexpr int kKSteps = kMmaKey / 16;                     // 36
constexpr int kPChunks = kMmaTile / 8;                    // 16-byte chunks per p row (8)
static_assert(kKSteps % 2 == 0 && kMmaChunks % 8 == 0, "two k halves and the 8-chunk swizzle");
static_assert(kMmaTile == 16 * (kMmaWarps / 2), "score phase: 4 row pairs x 2 k halves");
static_assert(kMmaLora == 64 * kMmaWarps, "value phase: 64 columns per warp");

// The score halves (`red`) get their own buffer when it fits the 227 KB a Hopper block may
// opt into (mma16). Then the next tile's copy is issued at the top of the tile, so a whole
// tile of compute covers it: at 16 heads the kernel is bound by how many bytes are in flight,
// and issuing after the softmax left the load a third less time. mma32's q halves leave no
// room: its scores borrow the spare tile buffer, and the copy waits until the softmax has
// consumed them.
constexpr int kMmaSmemMax = 227 * 1024;

template <int HM> struct MmaSmem {
    static constexpr int heads = 16 * HM;
    static constexpr int tile_bytes = kMmaTile * kMmaKey * 2;
    static constexpr int red_bytes = 2 * heads * kMmaTile * 4;        // [k half][heads][64] f32
    static constexpr int tiles = 0;                                   // 2 x [64][72 chunks]
    static constexpr int q = tiles + 2 * tile_bytes;                  // hi, lo: [heads][72 chunks]
    static constexpr int p = q + 2 * heads * kMmaKey * 2;             // hi, lo: [heads][8 chunks]
    static constexpr int m = p + 2 * heads * kMmaTile * 2;            // [heads] f32 each
    static constexpr int l = m + heads * 4;
    static constexpr int alpha = l + heads * 4;
    static constexpr int red = alpha + heads * 4;                     // when red_own
    static constexpr bool red_own = red + red_bytes <= kMmaSmemMax;
    static constexpr int bytes = red + (red_own ? red_bytes : 0);
    static_assert(red_own || red_bytes <= tile_bytes, "the score halves live in the spare tile");
};

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

template <int HM, typename CacheT, typename QT>
__global__ void __launch_bounds__(kMmaThreads, 1)
mma_attn(const QT* __restrict__ q, const CacheT* __restrict__ cache, int n_head, int n_ctx,
         int splits, float scale_log2, float* __restrict__ part_acc, float* __restrict__ part_m,
         float* __restrict__ part_l) {
    using M = MmaType<CacheT>;
    using Smem = MmaSmem<HM>;
    constexpr int kHeads = Smem::heads;
    require_dynamic_smem(Smem::bytes);
    extern __shared__ __align__(128) unsigned char smem[];
    uint4* tiles = reinterpret_cast<uint4*>(smem + Smem::tiles);
    CacheT* q_hl = reinterpret_cast<CacheT*>(smem + Smem::q);      // [2][heads][576], swizzled
    CacheT* p_hl = reinterpret_cast<CacheT*>(smem + Smem::p);      // [2][heads][64], swizzled
    float* m_s = reinterpret_cast<float*>(smem + Smem::m);
    float* l_s = reinterpret_cast<float*>(smem + Smem::l);
    float* alpha_s = reinterpret_cast<float*>(smem + Smem::alpha);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, c4 = lane & 3;  // fragment row group and column pair
    BlockSlice work;  // an empty slice (S > n_ctx) writes its neutral partial and is done
    if (!begin_slice(kHeads, n_head, n_ctx, splits, kMmaLora, part_acc, part_m, part_l, work)) return;
    const int head0 = work.head0, row_start = work.row_start, row_end = work.row_end;
    const size_t part_base = work.part_base;

    auto load_tile = [&](int tile_index, int buf) {  // two stage buffers
        cp_async_tile<kMmaTile, kMmaChunks, 2, kMmaThreads>(tiles, buf, tile_index, cache, row_start, row_end);
    };
    load_tile(0, 0);

    // q, pre-scaled into the log2 domain, as hi/lo halves in the swizzled [head][k] layout.
    stage_q<kHeads, kMmaKey, kMmaThreads>(q, head0, n_head, scale_log2, [&](int j, int k, float x) {
        CacheT hi, lo;
        split_hi_lo(x, hi, lo);
        const int off = swizzled_chunk(j, k >> 3, kMmaChunks) * 8 + (k & 7);
        q_hl[off] = hi;
        q_hl[kHeads * kMmaKey + off] = lo;
    });
    for (int j = tid; j < kHeads; j += kMmaThreads) { m_s[j] = -INFINITY; l_s[j] = 0.f; }

    // Value accumulators: [m tile][n8 tile][{row g: cols 2c4, 2c4+1; row g+8: same}]
    float acc[HM][8][4];
#pragma unroll
    for (int mt = 0; mt < HM; ++mt)
#pragma unroll
        for (int t = 0; t < 8; ++t) acc[mt][t][0] = acc[mt][t][1] = acc[mt][t][2] = acc[mt][t][3] = 0.f;

    const unsigned q_base = smem_u32(q_hl);
    const unsigned p_base = smem_u32(p_hl);
    const int n_tiles = (row_end - row_start + kMmaTile - 1) / kMmaTile;
    // ldmatrix row addresses: lane l feeds row (l & 7) of matrix (l >> 3).
    const int lm_mat = lane >> 3, lm_row = lane & 7;
    const int row_pair = warp & 3, k_half = warp >> 2;

    for (int it = 0; it < n_tiles; ++it) {
        const int buf = it & 1;
        cp_async_wait<0>();
        __syncthreads();  // tile `it` visible; everyone is done with the other buffer
        if (Smem::red_own && it + 1 < n_tiles) load_tile(it + 1, buf ^ 1);
        const unsigned tile_base = smem_u32(tiles + buf * kMmaTile * kMmaChunks);
        float* red = Smem::red_own ? reinterpret_cast<float*>(smem + Smem::red)
                                   : reinterpret_cast<float*>(tiles + (buf ^ 1) * kMmaTile * kMmaChunks);

        // ---- scores: rows 16*row_pair .. +15 (two n8 tiles), k16 steps of this k half ----
        {
            float sp[HM][2][2][4];  // [m tile][n tile][q hi, q lo][fragment]
#pragma unroll
            for (int mt = 0; mt < HM; ++mt)
#pragma unroll
                for (int n = 0; n < 2; ++n)
#pragma unroll
                    for (int v = 0; v < 2; ++v) sp[mt][n][v][0] = sp[mt][n][v][1] = sp[mt][n][v][2] = sp[mt][n][v][3] = 0.f;
            // A (q): matrices (heads 0-7 | 8-15 of the m tile) x (k lo | k hi)
            const int a_head = (lm_mat & 1) * 8 + lm_row, a_khalf = lm_mat >> 1;
            // B (cache rows): matrices (n tile 0 | 1) x (k lo | k hi)
            const int b_row = row_pair * 16 + (lm_mat >> 1) * 8 + lm_row, b_khalf = lm_mat & 1;
            // Every row this lane addresses has row & 7 == lm_row, and the swizzle flips only
            // the low three bits of a chunk index, so chunk 2ks + khalf of k-step ks0 + 4i + j
            // sits 8i chunks (128 bytes) after that of k-step ks0 + j: four addresses per
            // operand, once per tile, and the fully unrolled k loop adds immediates. (Swizzling
            // every step's address cost mma32 a third of its score-loop instructions; unrolled
            // by 6, the XOR's period of 4 steps did not line up with the loop's. Measured at
            // 131072 context: mma32 210.3 -> 199.2 us at 96 heads, 277.9 -> 264.6 at 128;
            // mma16 unchanged, with 123 registers instead of 163. results/h200-2026-11-29/
            // mma_addr_e84cb41.txt.)
            const int ks0 = k_half * (kKSteps / 2);
            unsigned b_addr[4], q_addr[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                b_addr[j] = tile_base + swizzled_chunk(b_row, 2 * (ks0 + j) + b_khalf, kMmaChunks) * 16;
                q_addr[j] = q_base + swizzled_chunk(a_head, 2 * (ks0 + j) + a_khalf, kMmaChunks) * 16;
            }
            auto k_step = [&](int j, unsigned skip) {  // k-step ks0 + j + 4 * (skip / 128)
                unsigned b[4];
                ldsm_x4(b_addr[j] + skip, b);
#pragma unroll
                for (int mt = 0; mt < HM; ++mt) {
                    unsigned a_hi[4], a_lo[4];
                    const unsigned qa = q_addr[j] + skip + mt * 16 * kMmaChunks * 16;
                    ldsm_x4(qa, a_hi);
                    ldsm_x4(qa + kHeads * kMmaKey * 2, a_lo);
                    M::mma(sp[mt][0][0], a_hi, b[0], b[1]);
                    M::mma(sp[mt][1][0], a_hi, b[2], b[3]);
                    M::mma(sp[mt][0][1], a_lo, b[0], b[1]);
                    M::mma(sp[mt][1][1], a_lo, b[2], b[3]);
                }
            };
            static_assert(kKSteps / 2 == 4 * 4 + 2, "a k half is 4 x 4 k-steps and 2 more");
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) k_step(j, 128u * i);
            k_step(0, 512u);
            k_step(1, 512u);
            // red[k_half][head][row]; fragment e: head 16mt + g + 8*(e >> 1), row 8n + 2c4 + (e & 1)
#pragma unroll
            for (int mt = 0; mt < HM; ++mt)
#pragma unroll
                for (int n = 0; n < 2; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int head = 16 * mt + g + 8 * (e >> 1);
                        const int row = row_pair * 16 + 8 * n + 2 * c4 + (e & 1);
                        red[(k_half * kHeads + head) * kMmaTile + row] = sp[mt][n][0][e] + sp[mt][n][1][e];
                    }
        }
        __syncthreads();

        // ---- softmax: warp w owns heads w, w+8, ...; lane owns rows lane and lane+32 ----
        // A warp's heads go through each step together, so their shuffle reductions overlap
        // instead of queueing one head's latency behind the other's.
        bool moved = false;  // some head of this warp moved its max (lazy max, mla_common.cuh)
        {
            constexpr int kWarpHeads = kHeads / kMmaWarps;  // 2 (mma16) or 4 (mma32)
            const int row_a = row_start + it * kMmaTile + lane;
            float s0[kWarpHeads], s1[kWarpHeads], m_old[kWarpHeads], t_max[kWarpHeads],
                p_sum[kWarpHeads];
#pragma unroll
            for (int i = 0; i < kWarpHeads; ++i) {
                const int h = warp + i * kMmaWarps;
                s0[i] = red[h * kMmaTile + lane] + red[(kHeads + h) * kMmaTile + lane];
                s1[i] = red[h * kMmaTile + lane + 32] + red[(kHeads + h) * kMmaTile + lane + 32];
                s0[i] = (row_a < row_end) ? s0[i] : -INFINITY;
                s1[i] = (row_a + 32 < row_end) ? s1[i] : -INFINITY;
                m_old[i] = m_s[h];
                t_max[i] = fmaxf(s0[i], s1[i]);
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
#pragma unroll
                for (int i = 0; i < kWarpHeads; ++i)
                    t_max[i] = fmaxf(t_max[i], __shfl_xor_sync(0xffffffffu, t_max[i], o));
#pragma unroll
            for (int i = 0; i < kWarpHeads; ++i) {
                const int h = warp + i * kMmaWarps;
                // m_new (lazy, kLazyLog2): t_max is finite (the first row is valid), and
                // m_old = -inf on the first tile always moves
                const bool move = t_max[i] > m_old[i] + kLazyLog2;
                t_max[i] = move ? t_max[i] : m_old[i];
                moved |= move;
                const float p0 = exp2f(s0[i] - t_max[i]), p1 = exp2f(s1[i] - t_max[i]);
                p_sum[i] = p0 + p1;
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int col = lane + 32 * half;
                    CacheT hi, lo;
                    split_hi_lo(half ? p1 : p0, hi, lo);
                    const int off = swizzled_chunk(h, col >> 3, kPChunks) * 8 + (col & 7);
                    p_hl[off] = hi;
                    p_hl[kHeads * kMmaTile + off] = lo;
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
#pragma unroll
                for (int i = 0; i < kWarpHeads; ++i)
                    p_sum[i] += __shfl_xor_sync(0xffffffffu, p_sum[i], o);
            // Every lane has read m_s[] above; lane 0 overwrites it. The shuffles order the
            // two in practice, the barrier makes it formal (racecheck flags it otherwise).
            __syncwarp();
            if (lane == 0) {
#pragma unroll
                for (int i = 0; i < kWarpHeads; ++i)
                    online_softmax_step(m_s, l_s, alpha_s, warp + i * kMmaWarps, m_old[i], t_max[i], p_sum[i]);
            }
        }
        // p and (m, l, alpha) are visible; rescale only if some head's max moved
        const int rescale = __syncthreads_or(moved);
        // The score halves are consumed: the spare buffer takes the next tile, which lands
        // while this tile's value phase runs.
        if (!Smem::red_own && it + 1 < n_tiles) load_tile(it + 1, buf ^ 1);

        // ---- values: acc = acc * alpha + p @ cache[:, 64w .. 64w+63] ----
        if (rescale) {
#pragma unroll
            for (int mt = 0; mt < HM; ++mt) {
                const float a0 = alpha_s[16 * mt + g], a1 = alpha_s[16 * mt + g + 8];
#pragma unroll
                for (int t = 0; t < 8; ++t) {
                    acc[mt][t][0] *= a0; acc[mt][t][1] *= a0;
                    acc[mt][t][2] *= a1; acc[mt][t][3] *= a1;
                }
            }
        }
#pragma unroll
        for (int ks = 0; ks < kMmaTile / 16; ++ks) {
            unsigned pa_hi[HM][4], pa_lo[HM][4];
#pragma unroll
            for (int mt = 0; mt < HM; ++mt) {
                const int pa = swizzled_chunk(16 * mt + (lm_mat & 1) * 8 + lm_row, 2 * ks + (lm_mat >> 1), kPChunks) * 16;
                ldsm_x4(p_base + pa, pa_hi[mt]);
                ldsm_x4(p_base + kHeads * kMmaTile * 2 + pa, pa_lo[mt]);
            }
            // B: matrices (rows 16ks + 0-7 | 8-15) x (column tile 2j | 2j+1), transposed
            const int b_row = 16 * ks + (lm_mat & 1) * 8 + lm_row;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                unsigned b[4];
                const int col_chunk = warp * 8 + 2 * j + (lm_mat >> 1);
                ldsm_x4_trans(tile_base + swizzled_chunk(b_row, col_chunk, kMmaChunks) * 16, b);
#pragma unroll
                for (int mt = 0; mt < HM; ++mt) {
                    M::mma(acc[mt][2 * j], pa_hi[mt], b[0], b[1]);
                    M::mma(acc[mt][2 * j + 1], pa_hi[mt], b[2], b[3]);
                    M::mma(acc[mt][2 * j], pa_lo[mt], b[0], b[1]);
                    M::mma(acc[mt][2 * j + 1], pa_lo[mt], b[2], b[3]);
                }
            }
        }
    }

    // acc[mt][t][0..1]: head 16mt + g, columns 64w + 8t + 2c4 + {0,1}; [2..3]: head + 8.
#pragma unroll
    for (int mt = 0; mt < HM; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int h = head0 + 16 * mt + g + 8 * hh;
            if (h >= n_head) continue;
            float* dst = part_acc + (part_base + h) * kMmaLora + warp * 64 + 2 * c4;
#pragma unroll
            for (int t = 0; t < 8; ++t)
                *reinterpret_cast<float2*>(dst + 8 * t) = make_float2(acc[mt][t][2 * hh], acc[mt][t][2 * hh + 1]);
        }
    // (m, l) of the last softmax step are visible since the barrier before the value phase.
    if (tid < kHeads && head0 + tid < n_head) {
        part_m[part_base + head0 + tid] = m_s[tid];
        part_l[part_base + head0 + tid] = l_s[tid];
    }
}

}  // namespace mla
