// mla_paged_check.cu: the index validator of a paged decode step, mla::check_paged.
//
// Parameters
//   block_table [batch, max_pages] int32, cache_seqlens [batch] int32 (device), num_pages
//   the pages of the cache, page_size its rows per page; error[4] int32, zeroed by the caller.
// Launch: grid = (batch), block = kCheckThreads (128), no dynamic shared memory.
//
// Block b checks request b: its length must lie in 0 .. max_pages * page_size (else flag 1,
// entry -1, value = the length), and every table entry the attention kernels read for it,
// entries 0 .. ceil(len / page_size) - 1, must lie in 0 .. num_pages - 1 (else flag 2, the
// entry and its value). Entries past those are never read, by this kernel or the attention
// kernels, so they may hold anything. The first error to claim `error` (atomicCAS on its
// flag) writes {flag, request, entry, value}; later ones leave it.
#include "mla_common.cuh"

namespace mla {

constexpr int kCheckThreads = 128;

__device__ __forceinline__ void report_paged_error(int* error, int flag, int request, int entry,
                                                   int value) {
    if (atomicCAS(error, 0, flag) == 0) {
        error[1] = request;
        error[2] = entry;
        error[3] = value;
    }
}

__global__ void __launch_bounds__(kCheckThreads)
check_paged(const int* __restrict__ block_table, const int* __restrict__ cache_seqlens, int batch,
            int max_pages, int page_size, int num_pages, int* __restrict__ error) {
#ifdef MLA_REGISTRY_FACTS
    static_assert(MLA_CHECK_THREADS == kCheckThreads,
                  "registry.CHECK_THREADS differs from kCheckThreads");
#endif
    const int b = blockIdx.x;
    if (b >= batch) return;
    const int len = cache_seqlens[b];
    if (len < 0 || static_cast<long long>(len) > static_cast<long long>(max_pages) * page_size) {
        if (threadIdx.x == 0) report_paged_error(error, 1, b, -1, len);
        return;
    }
    const int pages = (len + page_size - 1) / page_size;
    const int* row = block_table + static_cast<size_t>(b) * max_pages;
    for (int e = threadIdx.x; e < pages; e += kCheckThreads) {
        const int page = row[e];
        if (page < 0 || page >= num_pages) report_paged_error(error, 2, b, e, page);
    }
}

}  // namespace mla
