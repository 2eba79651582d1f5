
// ---- the entry mlasandbox launches ------------------------------------------------------
// The paged launch of mma_attn_body<HEADS> above as one non-template kernel: MLA_CACHE_T,
// MLA_Q_T, MLA_PARAM_HEADS and the header's values are the sandbox's -D options
// (mla_user.cuh).
// The walk's begin() places program (blockIdx.x, blockIdx.y) of the grid (head_blocks, P, 1):
// the p-th chunk of the batch in request order (request p in a single pass), and publishes the
// chunk counts the combine reads (mla_walk.cuh: locate_chunk). A kernel of your own that does
// not use the walk gets the same from mla_user::program_chunk (mla_user.cuh, docs/byok.md).
static_assert(mla::kMmaThreads == MLA_THREADS, "header threads= differs from kMmaThreads");
static_assert(mla::kMmaTile == MLA_TILE_ROWS, "header tile_rows= differs from kMmaTile");
static_assert(MLA_HEADS_PER_BLOCK == MLA_PARAM_HEADS,
              "header heads_per_block= differs from HEADS");
__global__ void __launch_bounds__(mla::kMmaThreads, 1)
@NAME@(@PARAMS@) {
    mla::PagedWalk<MLA_CACHE_T, mla::kMmaTile> walk{
        kv_cache, block_table, cache_seqlens, n_rows, n_head, s_q, causal, max_pages,
        page_shift, max_chunks, min_chunk, target, batch, chunk_counts, latent, lse};
    // false: p as hi + lo halves (mma16, mma32); true rounds p once (mma16r, mma32r)
    mla::mma_attn_body<MLA_PARAM_HEADS, MLA_CACHE_T, MLA_Q_T, false>(q, walk, scale_log2,
                                                                     part_acc, part_m, part_l);
}
