// mla_user.cuh: what a user kernel of mlasandbox (docs/byok.md) may include besides the
// built-in headers (mla_common.cuh, mla_walk.cuh).
//
// The sandbox compiles a user kernel with these -D options, from its header line:
//   MLA_CACHE_T, MLA_Q_T      the cache element (__half, __nv_bfloat16) and the query element
//                             (float, or the cache element)
//   MLA_THREADS, MLA_TILE_ROWS, MLA_HEADS_PER_BLOCK, MLA_SMEM_BYTES
//                             threads=, tile_rows=, heads_per_block=, smem= evaluated
//   MLA_PARAM_<NAME>          each declared parameter: MLA_PARAM_HPB=12 for
//                             `// mlasandbox: params HPB=8,12,16`
//   MLA_KV_LORA, MLA_ROPE     512 and 64
//
// mla_user::program_chunk(...): what program (blockIdx.x, blockIdx.y) of the paged attention
// grid serves (the request, its chunk, the chunk's positions and its first partial), and the
// chunk counts the combine reads, published by the one program that owes them. The chunk rule
// is mla_walk.cuh's (locate_chunk, request_span: sandbox/chunks.py's arithmetic).
#pragma once
#include "mla_walk.cuh"

namespace mla_user {

// What one program of the paged attention grid (head_blocks, P, 1) serves. request < 0: no
// chunk (p past the batch's last chunk, or, in a single pass, an empty request): the program
// writes nothing. Else rows [blockIdx.x * heads_per_block, ...) below n_rows over positions
// [start, end) of `request` (end <= its length; clip a causal row to what it sees), and
// row r's partial is entry part_base + r of part_m, part_l (part_acc: times 512).
struct Chunk {
    int request, chunk;  // the request and which of its chunks
    int start, end;      // the chunk's positions of the request
    int chunk_len;       // the request's chunk length, whole tiles (end <= start + chunk_len)
    size_t part_base;    // (request * max_chunks + chunk) * n_rows
};

// The chunk of program p = blockIdx.y: the p-th chunk of the batch in request order (on one
// wave of target programs, or two where the grid offers them and the lengths take them), or
// request p with max_chunks == 1 (a single pass: the grid has one program per request).
// Publishes every request's chunk count to chunk_counts[B] from row block 0's program 0
// (a single pass: request p's count from row block 0's program p), which the combine reads.
// Call it from every warp of the block with the kernel's own arguments, each warp whole
// (its lanes converged: the rule runs on warp shuffles; no shared memory, no barrier).
__device__ __forceinline__ Chunk program_chunk(const int* __restrict__ cache_seqlens, int batch,
                                               int n_rows, int max_chunks, int min_chunk,
                                               int target, int* __restrict__ chunk_counts,
                                               int tile = MLA_TILE_ROWS) {
    const int p = static_cast<int>(blockIdx.y);
    Chunk ch{-1, 0, 0, 0, tile, 0};
    if (max_chunks == 1) {
        const int len = __ldg(cache_seqlens + p);
        if (blockIdx.x == 0 && threadIdx.x == 0) chunk_counts[p] = len > 0;
        if (len == 0) return ch;
        return {p, 0, 0, len, (len + tile - 1) / tile * tile, static_cast<size_t>(p) * n_rows};
    }
    const bool publish = blockIdx.x == 0 && p == 0 && threadIdx.x < 32;
    // the guarded form of the rule's search (mla_walk.cuh, batch_chunk_unit): the same answer
    const mla::ChunkSlot slot = mla::locate_chunk<true>(cache_seqlens, batch, p, max_chunks,
                                                        tile, min_chunk, target,
                                                        publish ? chunk_counts : nullptr);
    if (slot.b < 0) return ch;
    const int len = __ldg(cache_seqlens + slot.b), start = slot.c * slot.len;
    return {slot.b, slot.c, start, min(len, start + slot.len), slot.len,
            (static_cast<size_t>(slot.b) * max_chunks + slot.c) * n_rows};
}

// The dynamic shared memory the launch gave this block (%dynamic_smem_size).
__device__ __forceinline__ unsigned int dynamic_smem_bytes() {
    unsigned int have;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    return have;
}

}  // namespace mla_user

// MLA_SMEM_NEEDS(bytes), inside the kernel: the kernel's own statement of the dynamic shared
// memory it uses. At compile time it fails when the header's smem= declares less; at launch it
// traps when the block got less (a launch by hand with a smaller size).
#define MLA_SMEM_NEEDS(bytes)                                                                 \
    static_assert((bytes) <= MLA_SMEM_BYTES,                                               \
                  "mlasandbox: the kernel needs more dynamic shared memory than the "        \
                  "header's smem= declares");                                               \
    if (::mla_user::dynamic_smem_bytes() < static_cast<unsigned int>(bytes)) __trap()
