
// ---- the entry mlasandbox launches ------------------------------------------------------
// The paged launch of attn_rows_body above as one non-template kernel: MLA_CACHE_T, MLA_Q_T
// and the header's values are the sandbox's -D options (mla_user.cuh lists them).
static_assert(mla::rows::kThreads == MLA_THREADS, "header threads= differs from rows::kThreads");
static_assert(mla::rows::kTile == MLA_TILE_ROWS, "header tile_rows= differs from rows::kTile");
static_assert(MLA_HEADS_PER_BLOCK == 1, "attn_rows serves one query row per block");
__global__ void __launch_bounds__(mla::rows::kThreads, mla::kPagedMinBlocks)
@NAME@(@PARAMS@) {
    mla::PagedWalk<MLA_CACHE_T, mla::rows::kTile> walk{kv_cache, block_table, cache_seqlens,
                                                     n_rows, n_head, s_q, causal, max_pages,
                                                     page_shift, max_chunks, min_chunk};
    mla::attn_rows_body<MLA_CACHE_T>(q, walk, scale_log2, part_acc, part_m, part_l);
}
