// mla_mma.cu: the tensor-core attention variants, mla::mma_attn<HEADS, CacheT, QT, kRoundP>.
//
// Template parameters
//   HEADS    heads per block: 16 (mma16) or 32 (mma32), as HM = HEADS / 16 m-tiles of 16 heads
//   CacheT   cache element: __half or __nv_bfloat16 (also the MMA operand type)
//   QT       query element: float, or CacheT
//   kRoundP  false: p as hi + lo halves, exact to f32 level (mma16, mma32); true: p rounded
//            to CacheT once, one value product (mma16r, mma32r: FlashMLA's exactness)
// Fixed geometry
//   kThreads = 256 (8 warps), kTile = 64 cache rows per step, two stages;
//   MLA_KV_LORA = 512, MLA_ROPE = 64. sandbox/registry.py passes its own values for the
//   block, the tile and the shared memory; the kernel static_asserts them.
//
// Launch: grid = (ceil(H / HEADS), S), block = 256, dynamic smem = MmaSmem<HM>::bytes.
// Same slices and same partial (m, l, acc[512]) in the log2 domain as mla_attn.cu, so the
// same combine merges it.
// mla::mma_attn_paged<HEADS, CacheT, QT, kRoundP>, the paged launch of the same body (mla_walk.cuh):
// grid = (ceil(n_rows / HEADS), P, 1) (P chunk programs, mla_walk.cuh), same block and
// shared memory; a block's HEADS "heads" are HEADS query rows r = i * H + h of its request
// (16 heads x s_q 4 fill two mma32 blocks or four mma16 ones), partials
// [B][max_chunks][n_rows]. Two arguments follow the paged contract's (repro.PAGED_MMA_ARGS):
// attn_tickets, [B][row blocks] zeroed, where the kernel merges each request of several
// chunks itself (its last program, PagedWalk::finish; the host launches no combine; q in the
// cache dtype only), null where the combine merges; merge_rescale, 0 for that merge's
// negative control.
//
// Exact to f32 level although the tensor cores take 16-bit operands: an f32 q and p are
// split into hi + lo parts of the cache dtype (hi = round(x), lo = round(x - hi)) and each
// product is done twice, so q.c = q_hi.c + q_lo.c to ~2^-22 (f16) / 2^-16 (bf16) relative;
// the cache is already 16-bit and exact, and every accumulation is f32. A q in the cache
// dtype (QT = CacheT) is exact as it is: its scores take one product, unscaled, and the
// scale multiplies their f32 sums (a quarter of the tile's MMAs fewer for mma16, and 36 q
// registers instead of 72). With kRoundP the value product takes p's hi half alone: each
// weight off by up to 2^-11 (f16) / 2^-8 (bf16) relative, the error FlashMLA and wgmma64 take
// (registry.ROUND_P_RELL2_BOUND); the running sum l still adds the f32 p.
//
// One tile of 64 rows:
//   scores: S[HEADS x 64 rows] = Q C^T. Warp w serves k-group w % 4 (9 of the 36 k16
//           steps) of one m tile (mma32: m tile w / 4, all 64 rows) or of 32 rows (mma16:
//           rows 32 (w / 4) ..), and keeps that k-group's q fragments, hi and lo, in 72
//           registers for the whole slice: the loop reads only cache fragments from shared
//           memory, each feeding 4 MMAs. The four k-groups meet in `red`, which reuses q's
//           staging buffer once the fragments are in registers.
//   softmax: warp w owns heads w, w+8, ...; each head's 64 rows are spread over 8 (mma32) or
//           16 (mma16) lanes, 8 or 4 adjacent rows a lane: tile max, p = 2^(s - m), written as
//           hi/lo halves [head][row] for ldmatrix, one vector store each; (m, l, alpha).
//           The max is lazy (mla_common.cuh): the accumulators are rescaled only on the tiles
//           where some head's max grew by more than 2^8.
//   values: warp w owns latent columns 64w .. 64w+63 (8 n8 tiles) for all heads,
//           A = p (ldmatrix), B = cache rows (ldmatrix.trans), 4 k16 steps per tile.
// The next tile's copy is issued at the top of each tile, so a whole tile of compute covers it.
//
// Why q lives in registers: a warp that re-read its q fragments, hi and lo, from shared memory
// on every tile would need 720 ldmatrix.x4 (368 KB) per 64-row tile for mma32's 1,152 MMAs
// and 432 for mma16's 576; with q in registers the score loop needs 288 and 144, and the 4
// k-groups' partials cost one float2 store per fragment.
#include "mla_walk.cuh"

namespace mla {

constexpr int kMmaThreads = 256;
constexpr int kMmaWarps = kMmaThreads / 32;
constexpr int kMmaTile = 64;
// Tiles a block asks into L2 at its start, past the two its ring holds: the first tiles
// run cold (the code fetched from memory after the bench's L2 flush) with only the ring in
// flight.
#ifndef MLA_MMA_L2_AHEAD
#define MLA_MMA_L2_AHEAD 0
#endif
enum : int { kMmaL2Ahead = MLA_MMA_L2_AHEAD };  // an enum: NVRTC emits namespace constants
constexpr int kMmaLora = MLA_KV_LORA;
constexpr int kMmaKey = MLA_KV_LORA + MLA_ROPE;
constexpr int kMmaChunks = kMmaKey / 8;                   // 16-byte chunks per cache row (72)
constexpr int kKSteps = kMmaKey / 16;                     // 36
constexpr int kPChunks = kMmaTile / 8;                    // 16-byte chunks per p row (8)
static_assert(kMmaChunks % 8 == 0, "the 8-chunk swizzle");
static_assert(kMmaLora == 64 * kMmaWarps, "value phase: 64 columns per warp");

constexpr int kScoreKGroups = 4;                          // k-groups of the score phase
constexpr int kGroupKSteps = kKSteps / kScoreKGroups;     // 9 k16 steps, 72 q registers
constexpr int kRedStride = kMmaTile + 8;                  // floats per [k-group][head] row of
                                                          // red: a fragment's 8 row groups
                                                          // land on distinct bank pairs
static_assert(kKSteps % kScoreKGroups == 0, "whole k-steps per k-group");
constexpr int kMmaSmemMax = 227 * 1024;                   // what a Hopper block may opt into

template <int HM> struct MmaSmem {
    static constexpr int heads = 16 * HM;
    static constexpr int tile_bytes = kMmaTile * kMmaKey * 2;
    static constexpr int q_bytes = 2 * heads * kMmaKey * 2;           // hi, lo: [heads][72 chunks]
    static constexpr int red_bytes = kScoreKGroups * heads * kRedStride * 4;  // [k-group][heads][72] f32
    static constexpr int tiles = 0;                                   // 2 x [64][72 chunks]
    static constexpr int q = tiles + 2 * tile_bytes;                  // q's staging, then red
    static constexpr int red = q;
    static constexpr int p = q + (q_bytes > red_bytes ? q_bytes : red_bytes);  // hi, lo: [heads][8 chunks]
    static constexpr int m = p + 2 * heads * kMmaTile * 2;            // [heads] f32 each
    static constexpr int l = m + heads * 4;
    static constexpr int alpha = l + heads * 4;
    static constexpr int bytes = alpha + heads * 4;
    static_assert(bytes <= kMmaSmemMax, "one block per SM");
};

__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(unsigned addr, unsigned (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// The kernel body, on the walk W of its launch (mla_walk.cuh).
template <int HEADS, typename CacheT, typename QT, bool kRoundP, typename W>
__device__ __forceinline__ void mma_attn_body(const QT* __restrict__ q, W& walk, float scale_log2,
                                              float* __restrict__ part_acc,
                                              float* __restrict__ part_m,
                                              float* __restrict__ part_l,
                                              unsigned int* attn_tickets = nullptr,
                                              int merge_rescale = 1) {
    static_assert(HEADS == 16 || HEADS == 32, "mma_attn serves 16 or 32 heads per block");
    constexpr int HM = HEADS / 16;  // m tiles of 16 heads
    using M = MmaType<CacheT>;
    using Smem = MmaSmem<HM>;
#ifdef MLA_REGISTRY_FACTS
    static_assert(MLA_MMA_THREADS == kMmaThreads, "registry.MMA_THREADS differs from kMmaThreads");
    static_assert(MLA_MMA_TILE == kMmaTile, "registry.MMA_TILE differs from kMmaTile");
    static_assert(registry_fact(HEADS, MLA_MMA_SMEM) == Smem::bytes,
                  "registry.mma_smem_bytes(HEADS) differs from MmaSmem<HEADS / 16>::bytes");
#endif
    constexpr int kHeads = Smem::heads;
    constexpr bool kQ16 = SameType<QT, CacheT>::value;  // q exact in 16 bits: no lo product
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
    // The kernel's own merge (PagedWalk::finish) is built for a 16-bit q only: the f32-q
    // kernels hold q's hi and lo halves and sit at their register budget, which the merge's
    // code raised by 13 (paged mma16, NVRTC 13.0); the host asks it of a 16-bit q alone.
    if (!walk.begin(kHeads, kMmaLora, part_acc, part_m, part_l, work)) {
        if constexpr (kQ16)
            walk.template finish<kHeads, kMmaThreads>(attn_tickets, merge_rescale, part_acc,
                                                      part_m, part_l);
        return;
    }
    const int head0 = work.head0, row_start = work.row_start, row_end = work.row_end;
    const size_t part_base = work.part_base;
    const int n_head = walk.rows();  // rows of q (heads; paged: s_q x heads of a request)

    auto load_tile = [&](int tile_index, int buf) {  // two stage buffers
        walk.template copy_tile<kMmaTile, kMmaChunks, 2, kMmaThreads>(tiles, buf, tile_index,
                                                                      row_start, row_end);
    };
    walk.template fetch<kMmaTile, kMmaThreads>(0, row_start, row_end);
    load_tile(0, 0);
    if (kMmaL2Ahead > 0 && tid == 0)
        walk.template l2_ahead<kMmaTile>(2, kMmaL2Ahead, row_start, row_end);

    pdl_wait();  // q is the kernel before's (q_absorb, api.DecodeStep): nothing above reads it
    // q, as hi/lo halves in the swizzled [head][k] layout: an f32 q pre-scaled into the log2
    // domain; a 16-bit q as it is (lo = 0, never read), its scores scaled in the softmax.
    const QT* q_rows = walk.q(q);
    stage_q8<kHeads, kMmaKey, kMmaThreads>(q_rows, head0, n_head, kQ16 ? 1.f : scale_log2,
                                           [&](int j, int c, const float (&x)[8]) {
        unsigned hi_w[4], lo_w[4];  // pairs of 16-bit halves
#pragma unroll
        for (int e = 0; e < 8; e += 2) {
            CacheT hi0, lo0, hi1, lo1;
            split_hi_lo(x[e], hi0, lo0);
            split_hi_lo(x[e + 1], hi1, lo1);
            hi_w[e / 2] = bits16(hi0) | (bits16(hi1) << 16);
            lo_w[e / 2] = bits16(lo0) | (bits16(lo1) << 16);
        }
        const int off = swizzled_chunk(j, c, kMmaChunks) * 8;
        *reinterpret_cast<uint4*>(q_hl + off) = make_uint4(hi_w[0], hi_w[1], hi_w[2], hi_w[3]);
        if (!kQ16)
            *reinterpret_cast<uint4*>(q_hl + kHeads * kMmaKey + off) =
                make_uint4(lo_w[0], lo_w[1], lo_w[2], lo_w[3]);
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
    float* red = reinterpret_cast<float*>(smem + Smem::red);
    const int n_tiles = (row_end - row_start + kMmaTile - 1) / kMmaTile;
    // ldmatrix row addresses: lane l feeds row (l & 7) of matrix (l >> 3).
    const int lm_mat = lane >> 3, lm_row = lane & 7;

    // Score identity: k-group kg (k16 steps ks0 .. ks0 + 8) of m tile s_mt over rows
    // s_row0 .. s_row0 + 8 kNTiles - 1.
    constexpr int kRowGroups = 2 / HM;                   // mma16: 2 x 32 rows, mma32: 1 x 64
    constexpr int kNTiles = kMmaTile / 8 / kRowGroups;   // n8 tiles of a warp: 4 HM
    static_assert(kScoreKGroups * HM * kRowGroups == kMmaWarps, "a warp per (k-group, m tile, rows)");
    const int kg = warp % kScoreKGroups, s_rest = warp / kScoreKGroups;
    const int s_mt = HM == 1 ? 0 : s_rest, s_row0 = HM == 1 ? 32 * s_rest : 0;
    const int ks0 = kg * kGroupKSteps;

    // This warp's q fragments, hi and lo, for the whole slice. A: matrices (heads 0-7 | 8-15
    // of the m tile) x (k lo | k hi).
    unsigned qf_hi[kGroupKSteps][4], qf_lo[kGroupKSteps][4];
    {
        const int a_head = 16 * s_mt + (lm_mat & 1) * 8 + lm_row, a_khalf = lm_mat >> 1;
        __syncthreads();  // q_hl is staged
#pragma unroll
        for (int j = 0; j < kGroupKSteps; ++j) {
            const unsigned qa = q_base + swizzled_chunk(a_head, 2 * (ks0 + j) + a_khalf, kMmaChunks) * 16;
            ldsm_x4(qa, qf_hi[j]);
            if (!kQ16) ldsm_x4(qa + kHeads * kMmaKey * 2, qf_lo[j]);
        }
    }
    // (red overwrites q_hl: the barrier at the top of the first tile orders every warp's
    // fragment loads above before any warp's first partials.)

    // B (cache rows): matrices (n tile 2np | 2np + 1) x (k lo | k hi). Every row this lane
    // addresses has row & 7 == lm_row, and the swizzle flips only the low three bits of a
    // chunk index, so chunk 2ks + khalf of k-step ks0 + 4i + j sits 8i chunks (128 bytes)
    // after that of k-step ks0 + j, and n-tile pair np 16 rows after pair 0: four addresses
    // per tile, and the fully unrolled loop adds immediates, where swizzling every step's
    // address would cost a third of mma32's score-loop instructions.
    const int b_row = s_row0 + (lm_mat >> 1) * 8 + lm_row, b_khalf = lm_mat & 1;
    unsigned b_off[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) b_off[j] = swizzled_chunk(b_row, 2 * (ks0 + j) + b_khalf, kMmaChunks) * 16;

    for (int it = 0; it < n_tiles; ++it) {
        const int buf = it & 1;
        cp_async_wait<0>();
        __syncthreads();  // tile `it` visible; everyone is done with the other buffer and red
        if (it + 1 < n_tiles) load_tile(it + 1, buf ^ 1);
        const unsigned tile_base = smem_u32(tiles + buf * kMmaTile * kMmaChunks);

        // ---- scores: this warp's k-group, hi (and an f32 q's lo) products into one f32
        // accumulator ----
        {
            float sp[kNTiles][4];
#pragma unroll
            for (int n = 0; n < kNTiles; ++n) sp[n][0] = sp[n][1] = sp[n][2] = sp[n][3] = 0.f;
#pragma unroll
            for (int j = 0; j < kGroupKSteps; ++j) {
                const unsigned b_addr = tile_base + b_off[j % 4] + 128u * (j / 4);
#pragma unroll
                for (int np = 0; np < kNTiles / 2; ++np) {
                    unsigned b[4];
                    ldsm_x4(b_addr + np * 16 * kMmaChunks * 16, b);
                    M::mma(sp[2 * np], qf_hi[j], b[0], b[1]);
                    M::mma(sp[2 * np + 1], qf_hi[j], b[2], b[3]);
                    if (!kQ16) {
                        M::mma(sp[2 * np], qf_lo[j], b[0], b[1]);
                        M::mma(sp[2 * np + 1], qf_lo[j], b[2], b[3]);
                    }
                }
            }
            // red[kg][head][row]; fragment e: head 16 s_mt + g + 8 (e >> 1), row
            // s_row0 + 8n + 2c4 + (e & 1)
#pragma unroll
            for (int n = 0; n < kNTiles; ++n)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int head = 16 * s_mt + g + 8 * hh;
                    const int row = s_row0 + 8 * n + 2 * c4;
                    *reinterpret_cast<float2*>(red + (kg * kHeads + head) * kRedStride + row) =
                        make_float2(sp[n][2 * hh], sp[n][2 * hh + 1]);
                }
        }
        __syncthreads();

        // ---- softmax: warp w owns heads w + 8i; a head's kLanesPerHead lanes hold
        // kRowsPerLane adjacent rows each (vector loads of the partials, one vector store of
        // p's hi and lo halves, log2(kLanesPerHead) shuffle steps per reduction) ----
        bool moved = false;  // this lane's head moved its max (lazy max, mla_common.cuh)
        {
            constexpr int kWarpHeads = kHeads / kMmaWarps;            // 2 (mma16) or 4 (mma32)
            constexpr int kLanesPerHead = 32 / kWarpHeads;            // 16 or 8
            constexpr int kRowsPerLane = kMmaTile / kLanesPerHead;    // 4 or 8
            static_assert(kRowsPerLane % 4 == 0 && 8 % kRowsPerLane == 0, "float4 loads within one p chunk");
            const int h = warp + (lane / kLanesPerHead) * kMmaWarps;
            const int r0 = (lane % kLanesPerHead) * kRowsPerLane;
            // >= 1 for lane 0 of every head but a paged one that sees nothing yet
            const int rows_valid =
                walk.row_end(head0 + h, row_end) - (row_start + it * kMmaTile + r0);
            float sc[kRowsPerLane];
#pragma unroll
            for (int r = 0; r < kRowsPerLane; ++r) sc[r] = 0.f;
#pragma unroll
            for (int k = 0; k < kScoreKGroups; ++k)
#pragma unroll
                for (int r4 = 0; r4 < kRowsPerLane; r4 += 4) {
                    const float4 v = *reinterpret_cast<const float4*>(red + (k * kHeads + h) * kRedStride + r0 + r4);
                    sc[r4] += v.x; sc[r4 + 1] += v.y; sc[r4 + 2] += v.z; sc[r4 + 3] += v.w;
                }
            float t_max = -INFINITY;
#pragma unroll
            for (int r = 0; r < kRowsPerLane; ++r) {
                if (kQ16) sc[r] *= scale_log2;
                sc[r] = r < rows_valid ? sc[r] : -INFINITY;
                t_max = fmaxf(t_max, sc[r]);
            }
#pragma unroll
            for (int o = kLanesPerHead / 2; o > 0; o >>= 1) t_max = fmaxf(t_max, __shfl_xor_sync(0xffffffffu, t_max, o));
            // m_new (lazy, kLazyLog2): t_max is finite (the first row is valid), and
            // m_old = -inf on the first tile always moves; a paged row that sees nothing yet
            // keeps m = -inf, and W::exp_offset / W::softmax_step keep it from NaN
            const float m_old = m_s[h];
            moved = t_max > m_old + kLazyLog2;
            const float m_new = moved ? t_max : m_old;
            const float m_exp = W::exp_offset(m_new);
            float p_sum = 0.f;
            unsigned hi_w[kRowsPerLane / 2], lo_w[kRowsPerLane / 2];  // pairs of 16-bit halves
#pragma unroll
            for (int r = 0; r < kRowsPerLane; r += 2) {
                const float p0 = exp2f(sc[r] - m_exp), p1 = exp2f(sc[r + 1] - m_exp);
                p_sum += p0 + p1;
                CacheT hi0, lo0, hi1, lo1;
                split_hi_lo(p0, hi0, lo0);
                split_hi_lo(p1, hi1, lo1);
                hi_w[r / 2] = bits16(hi0) | (bits16(hi1) << 16);
                lo_w[r / 2] = bits16(lo0) | (bits16(lo1) << 16);
            }
            const int off = swizzled_chunk(h, r0 >> 3, kPChunks) * 8 + (r0 & 7);
            if constexpr (kRowsPerLane == 8) {
                *reinterpret_cast<uint4*>(p_hl + off) = make_uint4(hi_w[0], hi_w[1], hi_w[2], hi_w[3]);
                if (!kRoundP)
                    *reinterpret_cast<uint4*>(p_hl + kHeads * kMmaTile + off) = make_uint4(lo_w[0], lo_w[1], lo_w[2], lo_w[3]);
            } else {
                *reinterpret_cast<uint2*>(p_hl + off) = make_uint2(hi_w[0], hi_w[1]);
                if (!kRoundP)
                    *reinterpret_cast<uint2*>(p_hl + kHeads * kMmaTile + off) = make_uint2(lo_w[0], lo_w[1]);
            }
#pragma unroll
            for (int o = kLanesPerHead / 2; o > 0; o >>= 1) p_sum += __shfl_xor_sync(0xffffffffu, p_sum, o);
            // Every lane of the head has read m_s[h] above; its first lane overwrites it. The
            // shuffles order the two in practice, the barrier makes it formal (racecheck flags
            // it otherwise).
            __syncwarp();
            if (lane % kLanesPerHead == 0) W::softmax_step(m_s, l_s, alpha_s, h, m_old, m_new, p_sum);
        }
        // p and (m, l, alpha) are visible; rescale only if some head's max moved
        const int rescale = __syncthreads_or(moved);

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
                if (!kRoundP) ldsm_x4(p_base + kHeads * kMmaTile * 2 + pa, pa_lo[mt]);
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
                    if (!kRoundP) {
                        M::mma(acc[mt][2 * j], pa_lo[mt], b[0], b[1]);
                        M::mma(acc[mt][2 * j + 1], pa_lo[mt], b[2], b[3]);
                    }
                }
            }
        }
    }

    // acc[mt][t][0..1]: head 16mt + g, columns 64w + 8t + 2c4 + {0,1}; [2..3]: head + 8.
    // (m, l) of the last softmax step are visible since the barrier before the value phase.
    const bool single = walk.single();  // also latent = acc / l and lse (mla_walk.cuh)
#pragma unroll
    for (int mt = 0; mt < HM; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int h = head0 + 16 * mt + g + 8 * hh;
            if (h >= n_head) continue;
            const size_t col0 = (part_base + h) * kMmaLora + warp * 64 + 2 * c4;
            float* dst = part_acc + col0;
#pragma unroll
            for (int t = 0; t < 8; ++t)
                *reinterpret_cast<float2*>(dst + 8 * t) = make_float2(acc[mt][t][2 * hh], acc[mt][t][2 * hh + 1]);
            if (single) {
                const float inv_l = single_pass_inv_l(l_s[16 * mt + g + 8 * hh]);
                // batch 1: col0 itself, so the batch-1 kernels' machine code stays as it is
                const size_t lat0 =
                    W::latent_is_partial()
                        ? col0
                        : walk.latent_row(part_base + h) * kMmaLora + warp * 64 + 2 * c4;
#pragma unroll
                for (int t = 0; t < 8; ++t)
                    *reinterpret_cast<float2*>(walk.latent + lat0 + 8 * t) =
                        make_float2(acc[mt][t][2 * hh] * inv_l, acc[mt][t][2 * hh + 1] * inv_l);
            }
        }
    if (tid < kHeads && head0 + tid < n_head) {
        part_m[part_base + head0 + tid] = m_s[tid];
        part_l[part_base + head0 + tid] = l_s[tid];
        if (single)
            walk.lse[walk.latent_row(part_base + head0 + tid)] =
                single_pass_lse(m_s[tid], l_s[tid]);
    }
    if constexpr (kQ16)
        walk.template finish<kHeads, kMmaThreads>(attn_tickets, merge_rescale, part_acc, part_m,
                                                  part_l);
}

template <int HEADS, typename CacheT, typename QT, bool kRoundP>
__global__ void __launch_bounds__(kMmaThreads, 1)
mma_attn(const QT* __restrict__ q, const CacheT* __restrict__ cache, int n_head, int n_ctx,
         int splits, float scale_log2, float* __restrict__ part_acc, float* __restrict__ part_m,
         float* __restrict__ part_l, float* __restrict__ latent, float* __restrict__ lse) {
    pdl_launch_dependents();  // the combine may launch now; it waits for this grid
    ContiguousWalk<CacheT> walk{cache, n_head, n_ctx, splits, latent, lse};
    mma_attn_body<HEADS, CacheT, QT, kRoundP>(q, walk, scale_log2, part_acc, part_m, part_l);
}

// The paged launch (mla_walk.cuh, PagedWalk): grid (ceil(n_rows / HEADS), P, 1).
template <int HEADS, typename CacheT, typename QT, bool kRoundP>
__global__ void __launch_bounds__(kMmaThreads, 1)
mma_attn_paged(const QT* __restrict__ q, const CacheT* __restrict__ kv_cache,
               const int* __restrict__ block_table, const int* __restrict__ cache_seqlens,
               int n_rows, int n_head, int s_q, int causal, int max_pages, int page_shift,
               int max_chunks, int min_chunk, float scale_log2, float* __restrict__ part_acc,
               float* __restrict__ part_m, float* __restrict__ part_l, int target,
               int batch, int* __restrict__ chunk_counts,
               float* __restrict__ latent, float* __restrict__ lse,
               unsigned int* __restrict__ attn_tickets, int merge_rescale) {
    // The combine may launch now; it waits for this grid. Where this kernel merges (tickets),
    // the projection is its dependent and launches as its blocks exit: launched at its entry,
    // the projection made B = 32 x N(8192, 4096) x 16 heads' step slower (docs/schedule.md).
    if (attn_tickets == nullptr) pdl_launch_dependents();
    PagedWalk<CacheT, kMmaTile> walk{kv_cache, block_table, cache_seqlens, n_rows, n_head, s_q,
                                     causal, max_pages, page_shift, max_chunks, min_chunk,
                                     target, batch, chunk_counts, latent, lse};
    mma_attn_body<HEADS, CacheT, QT, kRoundP>(q, walk, scale_log2, part_acc, part_m, part_l,
                                              attn_tickets, merge_rescale);
}

}  // namespace mla
