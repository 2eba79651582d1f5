// mla_wgmma.cu: the Hopper tensor-core attention, mla::wgmma_attn_paged<CacheT, QT>.
//
// Template parameters
//   CacheT  cache element: __half or __nv_bfloat16 (also the operand type of both products)
//   QT      query element: CacheT (the registry's only instance)
// Fixed geometry
//   kWgThreads = 256: two warpgroups; kWgRows = 64 query rows per block; kWgTile = 64 cache
//   positions per step, two stages; MLA_KV_LORA = 512, MLA_ROPE = 64. sandbox/registry.py
//   passes its own values for the block, the tile and the shared memory; the kernel
//   static_asserts them.
// Needs sm_90a (wgmma.mma_async); any other target is refused by the #error below.
//
// Launch (the paged contract of mla_walk.cuh, PagedWalk, as mma_attn_paged):
// grid = (ceil(n_rows / 64), chunk programs, 1), block = 256, dynamic smem =
// WgmmaSmem::bytes; program p runs the p-th chunk of the batch (the balanced chunk rule,
// PagedWalk::begin); a block's 64 rows are query rows r = i * H + h of its request (16 heads
// x s_q 4, or 64 of 128 heads), partials (m, l, acc[512]) in the log2 domain
// [B][max_chunks][n_rows]. Where a request runs one chunk (PagedWalk::single(); every request
// under a single-pass plan) the kernel also writes its rows' latent = acc / l and lse, and the
// merge skips them (combine_paged's attn_writes_single).
//
// Shared memory, every operand in the 128-byte-swizzle layout wgmma reads: a matrix of 64
// rows is stored as column blocks of 64 16-bit elements (128 bytes), block after block, each
// block [64 rows][128 B] with 16-byte chunk c of row r at chunk c ^ (r & 7) (sw_offset).
//   q      [9 blocks][64 rows]       A of the scores (K-major)
//   tiles  2 x [9 blocks][64 pos]    B of the scores (K-major: positions are N, the 576
//                                    dims K), and, its first 8 blocks, B of the values
//                                    (MN-major: positions are K, the 512 latent dims N)
//   p      [1 block][64 rows]        A of the values (K-major: positions are K)
//
// One tile of 64 positions, both warpgroups at once:
//   scores  warpgroup w computes the partial S[64 rows x 64 positions] = Q K^T over its
//           half of the dims (256w .. 256w + 255 and rope 512 + 32w ..): 18 wgmma
//           m64n64k16, A and B from shared memory, f32 accumulators; the halves of the
//           positions the other keeps cross through shared memory (the tile's spent rope
//           block and p), so warpgroup w holds the whole S of positions 32w .. 32w + 31.
//           Split by dims, not positions: each warpgroup reads half of q and of the tile per
//           tile (144 KB of shared memory both), not all of q and half the tile (216 KB).
//   softmax in the accumulator registers; the row maxima of the two halves meet through
//           shared memory, so both warpgroups hold the same running max m and rescale
//           factor alpha; p = 2^(s - m) rounded to CacheT into p.
//           The max is lazy (mla_common.cuh): alpha is 1 unless a row's max grew by > 2^8.
//   values  warpgroup w owns latent columns 256w .. 256w + 255: O = O alpha + P V as 4
//           wgmma m64n256k16 (A = p, B = the tile's columns, transposed), 128 f32
//           accumulators a thread.
// Copies: every thread issues cp.async for the next tile at the top of each tile (the walk's
// page lookups, zero-filled past the slice), so a whole tile of products covers it; the
// copied bytes reach the tensor cores' proxy through fence.proxy.async before the barrier.
//
// Exactness: the cache and q are 16-bit and exact (the registry instantiates QT = CacheT
// only; the scale multiplies the f32 scores). p alone is rounded to CacheT, once, before the
// value product (relative error <= 2^-11 for f16, 2^-8 for bf16); every product accumulates
// in f32, and the running sum l adds the f32 p, not the rounded one.
#include "mla_walk.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "mla_wgmma.cu uses wgmma.mma_async: compile it for sm_90a (--gpu-architecture=sm_90a)"
#endif

namespace mla {

constexpr int kWgThreads = 256;
constexpr int kWgRows = 64;                          // query rows of a block (one M of wgmma)
constexpr int kWgTile = 64;                          // cache positions per step
constexpr int kWgLora = MLA_KV_LORA;
constexpr int kWgKey = MLA_KV_LORA + MLA_ROPE;
constexpr int kColBlock = 64;                        // 16-bit elements of a 128-byte row block
constexpr int kKeyBlocks = kWgKey / kColBlock;       // 9
constexpr int kBlockBytes = 64 * 128;                // one column block of 64 rows
constexpr int kWgTileBytes = kKeyBlocks * kBlockBytes;
constexpr int kScoreSteps = kWgKey / 16;             // 36 k16 steps of the scores
constexpr int kHalfTile = kWgTile / 2;               // positions of one warpgroup's scores
static_assert(kWgKey % kColBlock == 0 && kWgLora == 2 * 256, "two warpgroups of 256 columns");
// The value product's B descriptor (MN-major): lbo between 64-column blocks, sbo between
// groups of 8 positions.
#ifndef MLA_WGMMA_V_LBO
#define MLA_WGMMA_V_LBO kBlockBytes
#define MLA_WGMMA_V_SBO 1024
#endif

struct WgmmaSmem {
    static constexpr int q = 0;
    static constexpr int tiles = q + kWgTileBytes;
    static constexpr int p = tiles + 2 * kWgTileBytes;
    static constexpr int red = p + kBlockBytes;           // [2 tile parities][2 wg][64] f32
    static constexpr int lsum = red + 2 * 2 * kWgRows * 4;  // [2 wg][64] f32
    static constexpr int used = lsum + 2 * kWgRows * 4;
    static constexpr int bytes = used + 1024;             // the base is aligned up to 1024 B
    static_assert(bytes <= 227 * 1024, "one block per SM");
};

// Byte offset of element (row r, column k) of a matrix in the column-block layout above.
__device__ __forceinline__ int sw_offset(int r, int k) {
    return (k >> 6) * kBlockBytes + r * 128 + ((((k >> 3) & 7) ^ (r & 7)) << 4) + ((k & 7) << 1);
}

// A wgmma shared-memory matrix descriptor, 128-byte swizzle: start address, leading and
// stride byte offsets (K-major: lbo unused, sbo = 1024 between 8-row groups; MN-major: lbo
// between 64-element column blocks, sbo between groups of 8 rows of K).
__device__ __forceinline__ unsigned long long sw128_desc(unsigned addr, unsigned lbo,
                                                         unsigned sbo) {
    return static_cast<unsigned long long>((addr & 0x3FFFF) >> 4) |
           (static_cast<unsigned long long>(lbo >> 4) << 16) |
           (static_cast<unsigned long long>(sbo >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving reads of accumulator registers above a wgmma_wait.
template <int N> __device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// The two products: m64n64k16 (scores, B K-major) and m64n256k16 with B MN-major (values),
// f32 accumulators, A and B from shared memory.
#define MLA_WGMMA_OPS(NAME, T)                                                                    \
struct NAME {                                                                                     \
    __device__ static void m64n64(float (&d)[32], unsigned long long a,                           \
                                  unsigned long long b) {                                         \
        asm volatile(                                                                             \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                          \
            "wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " {"                            \
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "                                  \
            "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "                        \
            "%24, %25, %26, %27, %28, %29, %30, %31"                                              \
            "}, %32, %33, p, 1, 1, 0, 0;\n}\n"                                                    \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),             \
              "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),           \
              "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),       \
              "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),       \
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),       \
              "+f"(d[30]), "+f"(d[31])                                                            \
            : "l"(a), "l"(b), "r"(1));                                                            \
    }                                                                                             \
    __device__ static void m64n256_trans_b(float (&d)[128], unsigned long long a,                 \
                                  unsigned long long b) {                                         \
        asm volatile(                                                                             \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                         \
            "wgmma.mma_async.sync.aligned.m64n256k16.f32." T "." T " {"                           \
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "                                  \
            "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "                        \
            "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "                        \
            "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                        \
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "                        \
            "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, "                        \
            "%72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, "                        \
            "%84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                        \
            "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, "                \
            "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, "            \
            "%120, %121, %122, %123, %124, %125, %126, %127"                                      \
            "}, %128, %129, p, 1, 1, 0, 1;\n}\n"                                                  \
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),             \
              "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),           \
              "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),       \
              "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),       \
              "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),       \
              "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),       \
              "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),       \
              "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),       \
              "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),       \
              "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),       \
              "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]),       \
              "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),       \
              "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),       \
              "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),       \
              "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]),       \
              "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),       \
              "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]),     \
              "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), \
              "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), \
              "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
              "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), \
              "+f"(d[126]), "+f"(d[127])                                                          \
            : "l"(a), "l"(b), "r"(1));                                                            \
    }                                                                                             \
}

MLA_WGMMA_OPS(WgmmaF16, "f16");
MLA_WGMMA_OPS(WgmmaBf16, "bf16");
#undef MLA_WGMMA_OPS
template <typename T> struct WgmmaOps;
template <> struct WgmmaOps<__half> : WgmmaF16 {};
template <> struct WgmmaOps<__nv_bfloat16> : WgmmaBf16 {};

template <typename T> __device__ __forceinline__ unsigned pack2(float a, float b);
template <> __device__ __forceinline__ unsigned pack2<__half>(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const unsigned*>(&h);
}

// 64 rows of 576 16-bit elements into `dst` in the column-block layout, one cp.async group:
// row r (copied in pass r / 32) from src(pass, r), zero-filled where that is null (never read;
// `any` is a valid address for the zero-size copy). Thread t copies row t / 8 (+ 32), chunks
// t % 8 + 8i of the row's 72: chunk 8i + c of row r lands in column block i at chunk
// c ^ (r & 7).
template <typename T, typename Src>
__device__ __forceinline__ void copy_rows_sw128(unsigned char* dst, const T* any, Src src) {
    constexpr int kRowsPerPass = kWgThreads / 8;
    const int crow = threadIdx.x >> 3, clane = threadIdx.x & 7;
#pragma unroll
    for (int pass = 0; pass < kWgTile / kRowsPerPass; ++pass) {
        const int row = pass * kRowsPerPass + crow;
        const T* row_src = src(pass, row);
        const bool valid = row_src != nullptr;
        const T* from = (valid ? row_src : any) + clane * 8;
        unsigned char* to = dst + row * 128 + ((clane ^ (row & 7)) << 4);
#pragma unroll
        for (int i = 0; i < kKeyBlocks; ++i)
            cp_async_16(to + i * kBlockBytes, from + 64 * i, valid);
    }
    cp_async_commit();
}

// Tile `tile_index` of the slice into `tile` (one stage): position t of the request through
// its page; positions >= row_end are zero-filled and their table entries are not looked up.
// The pages come from the walk's fetch of one copy before (PagedWalk::fetch, the rows of this
// thread's passes, or the tile's one page), and the copy then fetches the next tile's: a
// table read per row here made every copy wait for it.
template <typename W>
__device__ __forceinline__ void wgmma_copy_tile(unsigned char* tile, W& walk, int tile_index,
                                                int row_start, int row_end) {
    if (kAblateCacheLoads && tile_index >= 2) return;
    const int in_page = (1 << walk.page_shift) - 1;
    const int pos0 = row_start + tile_index * kWgTile;
    const bool one_page = walk.template tile_in_page<kWgTile>(row_start);
    copy_rows_sw128(tile, walk.cache, [&](int pass, int row) -> decltype(walk.cache) {
        const int pos = pos0 + row;
        if (pos >= row_end) return nullptr;
        const int pg = one_page ? walk.page[0] : walk.page[pass];
        const size_t cache_row = (static_cast<size_t>(pg) << walk.page_shift) + (pos & in_page);
        return walk.cache + cache_row * kWgKey;
    });
    walk.template fetch<kWgTile, kWgThreads>(tile_index + 1, row_start, row_end);
}

template <typename A, typename B> struct SameType { static constexpr bool value = false; };
template <typename A> struct SameType<A, A> { static constexpr bool value = true; };

template <typename CacheT, typename QT, typename W>
__device__ __forceinline__ void wgmma_attn_body(const QT* __restrict__ q, W& walk, float scale_log2,
                                                float* __restrict__ part_acc,
                                                float* __restrict__ part_m,
                                                float* __restrict__ part_l) {
    using Op = WgmmaOps<CacheT>;
    using Smem = WgmmaSmem;
#ifdef MLA_REGISTRY_FACTS
    static_assert(MLA_WGMMA_THREADS == kWgThreads,
                  "registry.WGMMA_THREADS differs from kWgThreads");
    static_assert(MLA_WGMMA_TILE == kWgTile, "registry.WGMMA_TILE differs from kWgTile");
    static_assert(registry_fact(kWgRows, MLA_WGMMA_SMEM) == Smem::bytes,
                  "registry.wgmma_smem_bytes(64) differs from WgmmaSmem::bytes");
#endif
    require_dynamic_smem(Smem::bytes);
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // The swizzle is a function of address bits 4-9: every operand starts 1024-aligned.
    unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
    BlockSlice work;  // a chunk none of whose rows sees a position writes neutral partials
    if (!walk.begin(kWgRows, kWgLora, part_acc, part_m, part_l, work)) return;
    const int head0 = work.head0, row_start = work.row_start, row_end = work.row_end;
    const size_t part_base = work.part_base;
    const int n_rows = walk.rows();
    unsigned char* q_s = smem + Smem::q;
    unsigned char* tiles = smem + Smem::tiles;
    unsigned char* p_s = smem + Smem::p;
    float* red = reinterpret_cast<float*>(smem + Smem::red);
    float* lsum = reinterpret_cast<float*>(smem + Smem::lsum);

    // q copied as given (exact 16-bit; the scale goes on the f32 scores), in the group of
    // tile 0; rows past n_rows are zeros
    static_assert(SameType<QT, CacheT>::value, "q in the cache dtype: copied, not converted");
    const CacheT* q_rows = walk.q(q);
    copy_rows_sw128(q_s, q_rows, [&](int, int j) -> const CacheT* {
        return head0 + j < n_rows ? q_rows + static_cast<size_t>(head0 + j) * kWgKey : nullptr;
    });
    walk.template fetch<kWgTile, kWgThreads>(0, row_start, row_end);
    wgmma_copy_tile(tiles, walk, 0, row_start, row_end);

    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31;
    const int g = lane >> 2, c = lane & 3;
    const int r0 = 16 * ((tid >> 5) & 3) + g;  // this thread's rows r0 and r0 + 8 of the block
    // the end of each row's visible positions in the slice (causal rows see fewer)
    const int re0 = walk.row_end(head0 + r0, row_end), re1 = walk.row_end(head0 + r0 + 8, row_end);
    const unsigned q_addr = smem_u32(q_s), p_addr = smem_u32(p_s);
    const unsigned tiles_addr = smem_u32(tiles);

    float o[128];  // O[64 rows][256w + 8j + 2c + {0,1}]: o[4j + {0,1}] row r0, o[4j + {2,3}] + 8
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // l: this thread's columns
    const int n_tiles = (row_end - row_start + kWgTile - 1) / kWgTile;

    for (int it = 0; it < n_tiles; ++it) {
        const int buf = it & 1;
        cp_async_wait<0>();
        fence_proxy_async();  // this thread's copies -> wgmma
        __syncthreads();      // tile `it` and q visible; the other stage and p are free
        if (it + 1 < n_tiles)
            wgmma_copy_tile(tiles + (buf ^ 1) * kWgTileBytes, walk, it + 1, row_start, row_end);
        const unsigned kt = tiles_addr + buf * kWgTileBytes;

        // ---- scores: warpgroup w sums dims 256w .. 256w + 255 and rope dims 512 + 32w ..
        // 512 + 32w + 31 (18 k16 steps each, the same code with its own offsets) over all 64
        // positions; each keeps the f32 sum of its own 32 positions ----
        float sp[32];  // this warpgroup's partial S[64 x 64]: sp[4j + e] (r0, 8j + 2c + e)
#pragma unroll
        for (int i = 0; i < 32; ++i) sp[i] = 0.f;
        wgmma_fence();
#pragma unroll
        for (int i = 0; i < kScoreSteps / 2; ++i) {
            // k16 step 16w + i (i < 16) or 32 + 2w + (i - 16): 8 KB per block, 32 B per step
            const unsigned koff = i < 16
                ? (i >> 2) * kBlockBytes + (i & 3) * 32 + wg * 4 * kBlockBytes
                : 8 * kBlockBytes + (i - 16) * 32 + wg * 64;
            Op::m64n64(sp, sw128_desc(q_addr + koff, 16, 1024), sw128_desc(kt + koff, 16, 1024));
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(sp);
        __syncthreads();  // both warpgroups' score products are done with the rope block
        // The halves the other warpgroup keeps cross in shared memory: warpgroup 0's through
        // the tile's rope block, warpgroup 1's through p (free since the top barrier).
        // [4 float4][128 threads] each, conflict-free.
        float4* x_rope = reinterpret_cast<float4*>(tiles + buf * kWgTileBytes + 8 * kBlockBytes);
        float4* x_p = reinterpret_cast<float4*>(p_s);
        const int wt = tid & 127;
        float s[16];  // the sum over all 576 dims of this warpgroup's positions 32 wg ..
        if (wg == 0) {
#pragma unroll
            for (int i = 0; i < 4; ++i)
                x_rope[i * 128 + wt] = make_float4(sp[16 + 4 * i], sp[17 + 4 * i], sp[18 + 4 * i],
                                                   sp[19 + 4 * i]);
        } else {
#pragma unroll
            for (int i = 0; i < 4; ++i)
                x_p[i * 128 + wt] = make_float4(sp[4 * i], sp[1 + 4 * i], sp[2 + 4 * i],
                                                sp[3 + 4 * i]);
        }
        __syncthreads();
        {
            const float4* x_in = wg == 0 ? x_p : x_rope;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float4 v = x_in[i * 128 + wt];
                s[4 * i] = (wg == 0 ? sp[4 * i] : sp[16 + 4 * i]) + v.x;
                s[4 * i + 1] = (wg == 0 ? sp[4 * i + 1] : sp[17 + 4 * i]) + v.y;
                s[4 * i + 2] = (wg == 0 ? sp[4 * i + 2] : sp[18 + 4 * i]) + v.z;
                s[4 * i + 3] = (wg == 0 ? sp[4 * i + 3] : sp[19 + 4 * i]) + v.w;
            }
        }

        // ---- softmax: s[4j + e] is (row r0, column 8j + 2c + e), s[4j + 2 + e] row r0 + 8 ----
        const int base = row_start + it * kWgTile + wg * kHalfTile;
        const int lim0 = re0 - base, lim1 = re1 - base;
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = 8 * j + 2 * c + e;
                s[4 * j + e] = col < lim0 ? s[4 * j + e] * scale_log2 : -INFINITY;
                s[4 * j + 2 + e] = col < lim1 ? s[4 * j + 2 + e] * scale_log2 : -INFINITY;
                mx0 = fmaxf(mx0, s[4 * j + e]);
                mx1 = fmaxf(mx1, s[4 * j + 2 + e]);
            }
#pragma unroll
        for (int o2 = 1; o2 < 4; o2 <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o2));
        }
        float* red_t = red + buf * 2 * kWgRows;  // by tile parity: no reader of the last is left
        if (c == 0) { red_t[wg * kWgRows + r0] = mx0; red_t[wg * kWgRows + r0 + 8] = mx1; }
        __syncthreads();
        mx0 = fmaxf(mx0, red_t[(wg ^ 1) * kWgRows + r0]);
        mx1 = fmaxf(mx1, red_t[(wg ^ 1) * kWgRows + r0 + 8]);
        // both warpgroups now hold the same tile max, hence the same m and alpha
        float alpha[2], m_exp[2];
        const float mx[2] = {mx0, mx1};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float m_new = mx[h] > m_run[h] + kLazyLog2 ? mx[h] : m_run[h];
            alpha[h] = m_new == -INFINITY ? 1.f : exp2f(m_run[h] - m_new);
            m_exp[h] = W::exp_offset(m_new);
            m_run[h] = m_new;
        }
        float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float p0 = exp2f(s[4 * j] - m_exp[0]), p1 = exp2f(s[4 * j + 1] - m_exp[0]);
            const float p2 = exp2f(s[4 * j + 2] - m_exp[1]), p3 = exp2f(s[4 * j + 3] - m_exp[1]);
            sum0 += p0 + p1;
            sum1 += p2 + p3;
            const int col = wg * kHalfTile + 8 * j + 2 * c;
            *reinterpret_cast<unsigned*>(p_s + sw_offset(r0, col)) = pack2<CacheT>(p0, p1);
            *reinterpret_cast<unsigned*>(p_s + sw_offset(r0 + 8, col)) = pack2<CacheT>(p2, p3);
        }
        l_run[0] = l_run[0] * alpha[0] + sum0;
        l_run[1] = l_run[1] * alpha[1] + sum1;
        fence_proxy_async();  // p -> wgmma
        __syncthreads();      // both halves of p are written

        // ---- values: O = O alpha + P V[:, 256 wg ..] ----
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
            for (int j = 0; j < 32; ++j) {
                o[4 * j] *= alpha[0]; o[4 * j + 1] *= alpha[0];
                o[4 * j + 2] *= alpha[1]; o[4 * j + 3] *= alpha[1];
            }
        }
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kWgTile / 16; ++kk)
            Op::m64n256_trans_b(o, sw128_desc(p_addr + kk * 32, 16, 1024),
                                sw128_desc(kt + 4 * wg * kBlockBytes + kk * 16 * 128,
                                           MLA_WGMMA_V_LBO, MLA_WGMMA_V_SBO));
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(o);
    }

    // ---- partials: (m, l) from warpgroup 0, each warpgroup its 256 columns ----
#pragma unroll
    for (int o2 = 1; o2 < 4; o2 <<= 1) {
        l_run[0] += __shfl_xor_sync(0xffffffffu, l_run[0], o2);
        l_run[1] += __shfl_xor_sync(0xffffffffu, l_run[1], o2);
    }
    if (c == 0) { lsum[wg * kWgRows + r0] = l_run[0]; lsum[wg * kWgRows + r0 + 8] = l_run[1]; }
    __syncthreads();
    // Where the request runs one chunk (walk.single()), also latent = acc / l and lse, as the
    // merge of that one partial would write them (mla_walk.cuh, single pass).
    const bool single = walk.single();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = r0 + 8 * h;
        if (head0 + r >= n_rows) continue;
        const size_t partial = part_base + head0 + r;
        const float l = lsum[r] + lsum[kWgRows + r];  // both warpgroups hold the same m_run
        if (wg == 0 && c == 0) {
            part_m[partial] = m_run[h];
            part_l[partial] = l;
            if (single) walk.lse[walk.latent_row(partial)] = single_pass_lse(m_run[h], l);
        }
        float* dst = part_acc + partial * kWgLora + wg * 256 + 2 * c;
#pragma unroll
        for (int j = 0; j < 32; ++j)
            *reinterpret_cast<float2*>(dst + 8 * j) =
                make_float2(o[4 * j + 2 * h], o[4 * j + 2 * h + 1]);
        if (single) {
            const float inv_l = single_pass_inv_l(l);
            float* lat = walk.latent + walk.latent_row(partial) * kWgLora + wg * 256 + 2 * c;
#pragma unroll
            for (int j = 0; j < 32; ++j)
                *reinterpret_cast<float2*>(lat + 8 * j) =
                    make_float2(o[4 * j + 2 * h] * inv_l, o[4 * j + 2 * h + 1] * inv_l);
        }
    }
}

// The paged launch (mla_walk.cuh, PagedWalk): the grid and the arguments of mma_attn_paged.
template <typename CacheT, typename QT>
__global__ void __launch_bounds__(kWgThreads, 1)
wgmma_attn_paged(const QT* __restrict__ q, const CacheT* __restrict__ kv_cache,
                 const int* __restrict__ block_table, const int* __restrict__ cache_seqlens,
                 int n_rows, int n_head, int s_q, int causal, int max_pages, int page_shift,
                 int max_chunks, int min_chunk, float scale_log2, float* __restrict__ part_acc,
                 float* __restrict__ part_m, float* __restrict__ part_l, int target,
                 int batch, int* __restrict__ chunk_counts, float* __restrict__ latent,
                 float* __restrict__ lse) {
    pdl_launch_dependents();  // the combine may launch now; it waits for this grid
    PagedWalk<CacheT, kWgTile> walk{kv_cache, block_table, cache_seqlens, n_rows, n_head, s_q,
                                    causal, max_pages, page_shift, max_chunks, min_chunk,
                                    target, batch, chunk_counts, latent, lse};
    wgmma_attn_body<CacheT>(q, walk, scale_log2, part_acc, part_m, part_l);
}

}  // namespace mla
