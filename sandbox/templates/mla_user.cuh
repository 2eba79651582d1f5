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
#pragma once

namespace mla_user {

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
