
// ---- the entry mlasandbox launches ------------------------------------------------------
// The paged launch of attn_rows_body above as one non-template kernel: MLA_CACHE_T, MLA_Q_T
// and the header's values are the sandbox's -D options (mla_user.cuh lists them).
// The walk's begin() places program (blockIdx.x, blockIdx.y) of the grid (head_blocks, P, 1):
// the p-th chunk of the batch in request order (request p in a single pass), and publishes the
// chunk counts the combine reads (mla_walk.cuh: locate_chunk). A kernel of your own that does
// not use the walk gets the same from mla_user::program_chunk (mla_user.cuh, docs/byok.md).
static_assert(mla::rows::kThreads == MLA_THREADS, "header threads= differs from rows::kThreads");
static_assert(mla::rows::kTile == MLA_TILE_ROWS, "header tile_rows= differs from rows::kTile");
static_assert(MLA_HEADS_PER_BLOCK == 1, "attn_rows serves one query row per block");
__global__ void __launch_bounds__(mla::rows::kThreads, mla::kPagedMinBlocks)
@NAME@(@PARAMS@) {
    mla::PagedWalk<MLA_CACHE_T, mla::rows::kTile> walk{
        kv_cache, block_table, cache_seqlens, n_rows, n_head, s_q, causal, max_pages,
        page_shift, max_chunks, min_chunk, target, batch, chunk_counts, latent, lse};
    mla::attn_rows_body<MLA_CACHE_T>(q, walk, scale_log2, part_acc, part_m, part_l);
}
