// mlasandbox: entry=warp_rows threads=32*ROWS tile_rows=32 heads_per_block=ROWS smem=0
// mlasandbox: params ROWS=4,8
// byok_warp_rows.cu: a user kernel of the paged attention contract written unlike every
// built-in one: one warp per query row, straight from global memory (no shared memory, no
// cp.async), one cache position at a time, an exact (not lazy) online softmax in the log2
// domain. Lane l owns latent columns 16l..16l+15 and rope columns 2l, 2l+1.
// The planted wrong kernels of tests/data/byok_bad_*.cu include this file with one BYOK_BUG_*;
// byok_step.cu with BYOK_WHOLE_STEP, as a whole-step kernel (kind=step); byok_spills.cu with
// BYOK_REGISTER_CAP, a register cap that makes ptxas spill.
#include "mla_user.cuh"   // mla_user::program_chunk; mla_walk.cuh (mla::to_f32)

namespace {

constexpr int kLatent = MLA_KV_LORA, kKey = MLA_KV_LORA + MLA_ROPE;
static_assert(kLatent == 32 * 16 && MLA_ROPE == 32 * 2, "a lane holds 16 + 2 columns");

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int bit = 16; bit >= 1; bit >>= 1) x += __shfl_xor_sync(0xffffffffu, x, bit);
    return x;
}

}  // namespace

#ifdef BYOK_REGISTER_CAP
// at most BYOK_REGISTER_CAP registers a thread (sm_90's 65536 registers over
// MLA_THREADS x minBlocksPerSM): ptxas spills what does not fit (byok_spills.cu)
__global__ void __launch_bounds__(MLA_THREADS, 65536 / (MLA_THREADS * BYOK_REGISTER_CAP))
#else
__global__ void __launch_bounds__(MLA_THREADS)
#endif
warp_rows(const MLA_Q_T* q, const MLA_CACHE_T* kv_cache, const int* block_table,
          const int* cache_seqlens, int n_rows, int n_head, int s_q, int causal, int max_pages,
          int page_shift, int max_chunks, int min_chunk, float scale_log2, float* part_acc,
          float* part_m, float* part_l, int target, int batch, int* chunk_counts,
          float* latent, float* lse) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row = blockIdx.x * MLA_HEADS_PER_BLOCK + warp;
#ifdef BYOK_WHOLE_STEP
    // a single pass (kind=step): program p is request p, its one chunk the whole request
    const int b = blockIdx.y, len = cache_seqlens[b];
    const mla_user::Chunk ch{b, 0, 0, len, len, static_cast<size_t>(b) * n_rows};
#else
    // every warp, before any returns: the rule runs on warp shuffles, and row block 0's
    // program 0 publishes the chunk counts here
    const mla_user::Chunk ch = mla_user::program_chunk(cache_seqlens, batch, n_rows, max_chunks,
                                                       min_chunk, target, chunk_counts);
    if (ch.request < 0) return;                    // no chunk: the combine reads nothing here
    const int b = ch.request, len = cache_seqlens[b];
#endif
#ifdef BYOK_BUG_RACE
    // q staged through shared memory by the whole block, read without a barrier
    __shared__ float q_stage[MLA_HEADS_PER_BLOCK][kKey];
    for (int i = threadIdx.x; i < MLA_HEADS_PER_BLOCK * kKey; i += MLA_THREADS) {
        const int r = blockIdx.x * MLA_HEADS_PER_BLOCK + i / kKey;
        q_stage[i / kKey][i % kKey] =
            r < n_rows ? mla::to_f32(q[(static_cast<size_t>(b) * n_rows + r) * kKey + i % kKey])
                       : 0.f;
    }
#endif
#ifdef BYOK_BUG_PARTIAL_GROUP
    if ((blockIdx.x + 1) * MLA_HEADS_PER_BLOCK > n_rows) return;  // serves full groups only
#endif
    if (row >= n_rows) return;
    const int visible = causal ? len - (s_q - 1 - row / n_head) : len;
    const int start = ch.start;
#if defined(BYOK_BUG_PAST_PAGES)
    // runs every chunk to its full length, past the request's pages into invalid entries
    const int end = start + ch.chunk_len;
#elif defined(BYOK_BUG_PAST_LENGTH)
    // runs to the end of the request's last page, not to its length
    const int page = 1 << page_shift;
    const int end = min(start + ch.chunk_len, (len + page - 1) / page * page);
#else
    const int end = min(ch.end, visible);
#endif

    const size_t q_row = (static_cast<size_t>(b) * n_rows + row) * kKey;
    float ql[16], qr[2];
#pragma unroll
    for (int e = 0; e < 16; ++e) {
#ifdef BYOK_BUG_RACE
        ql[e] = q_stage[warp][16 * lane + e] * scale_log2;
#else
        ql[e] = mla::to_f32(q[q_row + 16 * lane + e]) * scale_log2;
#endif
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) qr[e] = mla::to_f32(q[q_row + kLatent + 2 * lane + e]) * scale_log2;

    float m = -INFINITY, l = 0.f, acc[16];
#pragma unroll
    for (int e = 0; e < 16; ++e) acc[e] = 0.f;
    const int* pages = block_table + static_cast<size_t>(b) * max_pages;
    for (int t = start; t < end; ++t) {
        const size_t cache_row = (static_cast<size_t>(pages[t >> page_shift]) << page_shift) +
                                 (t & ((1 << page_shift) - 1));
        const MLA_CACHE_T* k = kv_cache + cache_row * kKey;
        float x[16], s = 0.f;
#pragma unroll
        for (int e = 0; e < 16; ++e) {
            x[e] = mla::to_f32(k[16 * lane + e]);
            s = fmaf(x[e], ql[e], s);
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) s = fmaf(mla::to_f32(k[kLatent + 2 * lane + e]), qr[e], s);
        s = warp_sum(s);
        const float m_new = fmaxf(m, s);
        const float alpha = exp2f(m - m_new);      // 0 at the first position (m = -inf)
        const float p = exp2f(s - m_new);
        l = l * alpha + p;
#pragma unroll
        for (int e = 0; e < 16; ++e) {
#ifdef BYOK_BUG_NO_RESCALE
            acc[e] = acc[e] + p * x[e];
#else
            acc[e] = fmaf(acc[e], alpha, p * x[e]);
#endif
        }
        m = m_new;
    }
#ifdef BYOK_WHOLE_STEP
    // latent = acc / l and lse in the natural log; a row that sees nothing: 0 and -inf
    const size_t out_row = ch.part_base + row;
    const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int e = 0; e < 16; ++e) latent[out_row * kLatent + 16 * lane + e] = acc[e] * inv;
    if (lane == 0) lse[out_row] = l > 0.f ? (m + log2f(l)) * 0.6931471805599453f : -INFINITY;
    return;
#endif
    // a row that sees nothing of its chunk writes the neutral partial (m -inf, l 0, acc 0)
    const size_t partial = ch.part_base + row;
#pragma unroll
    for (int e = 0; e < 16; ++e) part_acc[partial * kLatent + 16 * lane + e] = acc[e];
    if (lane == 0) {
        part_m[partial] = m;
        part_l[partial] = l;
    }
}
