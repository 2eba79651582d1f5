// mla_wgmma.cu: the Hopper tensor-core attention, mla::wgmma_attn_paged<CacheT, QT, kPartials>.
//
// Template parameters
//   CacheT     cache element: __half or __nv_bfloat16 (also the operand type of both products)
//   QT         query element: CacheT (the registry's only instance)
//   kPartials  true: the partials of every chunk; false (a single-pass plan's instance, no
//              merge launched): only the latent and lse of each request, unless the plan has
//              several chunk slots (max_chunks > 1), where it writes the partials as well
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
//   p      [1 block][64 rows]        warpgroup 0's p, A of warpgroup 1's product with it
//                                    (K-major: positions are K); warpgroup 1's p goes into
//                                    its stage's rope block once its scores are done
//
// The seesaw (FlashMLA's deep-dive names it): a pair of tiles a step, tile 2k in stage 0 and
// 2k + 1 in stage 1. Warpgroup w computes the whole S[64 rows x 64 positions] = Q K^T of
// tile 2k + w (36 wgmma m64n64k16 over the 9 blocks) and owns latent columns 256w ..
// 256w + 255 of O (128 f32 accumulators a thread). Warpgroup 0's softmax goes first (from the
// running max m to m0), then warpgroup 1's (from m0 to m1) while warpgroup 0 runs its own
// value product p0 V0_L (A from registers) and warpgroup 1 its p0 V0_R (A = p from shared
// memory); then each runs p1 V1: the tensor cores have a product queued through warpgroup
// 1's softmax. The row maxima cross in shared memory; the max is lazy (mla_common.cuh), so
// the rescale of O is skipped unless a row's max grew by more than 2^8. Each handoff from
// one warpgroup to the other is an mbarrier (kBarP0 .. kBarK1Free below).
// Copies: each warpgroup copies its own stage (the pages looked up during the scores before):
// a whole tile in one page by bulk tensor copy (TMA, a group's four latent blocks in one box,
// the rope block in another, from one thread, through the cache's tensor maps, the kernel's
// last argument) where the host passes them (pages of 64 or more; sandbox/tensor_map.py),
// else by cp.async from every thread; in two
// groups: the blocks its own products free first go out as soon as
// they are free, the rest once the other warpgroup is done with them; the scores start on
// the first group and wait for the second after 20 (warpgroup 0) or 16 (1) of their 36
// steps. A reader waits on its group's mbarrier (the bulk copy's bytes, or the copying
// threads' cp.async arrivals), then fence.proxy.async: cp.async's bytes reach the tensor
// cores' proxy.
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
constexpr int kGroupBlocks = 4;                      // latent column blocks of a copy group
constexpr int kMapBytes = 128;                       // sizeof(CUtensorMap)
static_assert(kWgKey % kColBlock == 0 && kWgLora == 2 * 256, "two warpgroups of 256 columns");
static_assert(2 * kGroupBlocks * kColBlock == kWgLora, "two copy groups of latent blocks a tile");
// Rows the bulk copy's boxes are moved by: 0, but for a negative control's planted defect
// (tests/test_gpu_wgmma.py), which shows the reference check sees the TMA path.
#ifndef MLA_WGMMA_TMA_ROW_SHIFT
#define MLA_WGMMA_TMA_ROW_SHIFT 0
#endif
// The value product's B descriptor (MN-major): lbo between 64-column blocks, sbo between
// groups of 8 positions.
#ifndef MLA_WGMMA_V_LBO
#define MLA_WGMMA_V_LBO kBlockBytes
#define MLA_WGMMA_V_SBO 1024
#endif

// The mbarriers, each of 128 arrivals (a warpgroup's threads) a phase but kBarQ (256) and,
// on the TMA path, the four copy groups' (one arrival and the expected bytes), phase
// k & 1 in pair k: full[w][g], warpgroup w's copy group g (0 early, 1 late) of its stage has
// landed (cp.async arrivals); kBarP0 / kBarP1, warpgroup 0's / 1's p and row maxima are
// written; kBarK0Free, warpgroup 1 is done with p_s and stage 0; kBarK1Free, warpgroup 0 is
// done with stage 1's blocks 0-3 and 8. mbarriers rather than named barriers: racecheck
// models an mbarrier's arrive -> wait (docs/tiled16-deep-dive.md).
enum : int { kBarFull = 0, kBarP0 = 4, kBarP1, kBarK0Free, kBarK1Free, kBarQ, kWgBars };

struct WgmmaSmem {
    static constexpr int q = 0;
    static constexpr int tiles = q + kWgTileBytes;
    static constexpr int p = tiles + 2 * kWgTileBytes;
    static constexpr int mx = p + kBlockBytes;            // [2 wg][64] f32: m0, m1 of a pair
    static constexpr int lsum = mx + 2 * kWgRows * 4;     // [2 wg][64] f32
    static constexpr int bars = lsum + 2 * kWgRows * 4;   // kWgBars mbarriers
    static constexpr int used = bars + kWgBars * 8;
    static constexpr int bytes = used + 1024;             // the base is aligned up to 1024 B
    static_assert(bytes <= 227 * 1024, "one block per SM");
};

// Byte offset of element (row r, column k) of a matrix in the column-block layout above.
__device__ __forceinline__ int sw_offset(int r, int k) {
    return (k >> 6) * kBlockBytes + r * 128 + ((((k >> 3) & 7) ^ (r & 7)) << 4) + ((k & 7) << 1);
}

// A wgmma shared-memory matrix descriptor, 128-byte swizzle: start address, leading and
// stride byte offsets (K-major: lbo unused, sbo = 1024 between 8-row groups; MN-major: lbo
// between 64-element column blocks, sbo between groups of 8 rows of K), and at(off) the
// descriptor of the matrix `off` bytes on (a k step). The low word holds the start address
// (addr & 0x3FFFF) >> 4 in bits 0-13 and lbo >> 4 above it; the high word sbo >> 4 and the
// swizzle mode (bit 62 of the descriptor). A shared-memory address plus offset stays below
// 2^18 (an SM has 228 KB), so adding off >> 4 to the low word never carries out of the
// start field: one add a product. Building each descriptor from its address instead is four
// dependent uniform-datapath instructions on the products' issue path (ncu, H200, 128 x 4096
// x 128 heads: ULOP3, USHF and UIADD3 then hold a quarter of the tile loop's stall samples).
struct Sw128Desc {
    unsigned lo, hi;
    __device__ __forceinline__ Sw128Desc(unsigned addr, unsigned lbo, unsigned sbo)
        : lo(((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16)), hi((sbo >> 4) | (1u << 30)) {}
    __device__ __forceinline__ unsigned long long at(unsigned off) const {
        unsigned long long d;
        asm("mov.b64 %0, {%1, %2};" : "=l"(d) : "r"(lo + (off >> 4)), "r"(hi));
        return d;
    }
};

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

// ---- the bulk tensor copy (TMA) of whole tiles, through the cache's tensor maps ----
// Two maps, kMapBytes apart (sandbox/tensor_map.py): the 3-D map of the latent column blocks
// (a box: kGroupBlocks blocks of 64 rows, one copy group's four blocks in one instruction,
// where four 2-D boxes cost about 350 issue cycles of the issuing thread against 90), then
// the 2-D map whose box is one block (the rope block). They lie in global memory, written by
// a host copy: acquired once by each issuing thread before its first box.
__device__ __forceinline__ void tma_acquire(const void* maps) {
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n"
                 ::"l"(maps) : "memory");
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n"
                 ::"l"(static_cast<const char*>(maps) + kMapBytes) : "memory");
}
// One arrival that also expects `bytes` of bulk copies to complete on the barrier's phase.
__device__ __forceinline__ void mbar_arrive_expect_bytes(unsigned long long* bar, unsigned bytes) {
    asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n"
                 ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// Box (col, row) of the 2-D map, 64 elements of 64 rows, into `dst` in the 128-byte swizzle;
// its bytes count against `bar`'s expected transactions.
__device__ __forceinline__ void tma_box(void* dst, const void* map, int col, int row,
                                        unsigned long long* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];\n"
        ::"r"(smem_u32(dst)), "l"(map), "r"(col), "r"(row), "r"(smem_u32(bar)) : "memory");
}
// Box (0, row, block) of the 3-D map: 64 rows of column blocks block .. block + 3, each 64 x
// 128 bytes in the 128-byte swizzle, one after the other from `dst` (a stage's layout).
__device__ __forceinline__ void tma_blocks(void* dst, const void* map, int block, int row,
                                           unsigned long long* bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];\n"
        ::"r"(smem_u32(dst)), "l"(map), "r"(0), "r"(row), "r"(block), "r"(smem_u32(bar))
        : "memory");
}
// The 128 threads of warpgroup wg (named barriers 1 and 2; 0 is __syncthreads').
// Immediate ids: a register id makes ptxas reserve all 16 barriers.
__device__ __forceinline__ void warpgroup_sync(int wg) {
    if (wg == 0) asm volatile("bar.sync 1, 128;\n" ::: "memory");
    else asm volatile("bar.sync 2, 128;\n" ::: "memory");
}

// Four 8 x 8 matrices of 16-bit pairs from the m64 accumulator fragments of a warp into shared
// memory (stmatrix): register i of a thread is row lane / 4, columns 2 (lane % 4), + 1 of matrix i,
// and lane l gives the address of row l % 8 of matrix l / 8. One instruction where four 32-bit
// stores a thread and their addresses would be sixteen.
__device__ __forceinline__ void stmatrix_x4(unsigned addr, const unsigned (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 ::"r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// The three products, f32 accumulators: m64n64k16 (scores: A = q, B = the tile, K-major, both
// in shared memory) and m64n256k16 with B MN-major (values: the tile's latent columns), its A
// (p) from shared memory (_ss) or from this thread's registers (_rs: the four 16-bit pairs of
// the m64k16 A fragment, the layout of the score accumulator a thread already holds). `acc`
// is the instruction's scale-d: D += A B, or D = A B where it is 0.
#define MLA_WGMMA_D128                                                         \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "                       \
    "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "             \
    "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "             \
    "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "             \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "             \
    "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, "             \
    "%72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, "             \
    "%84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "             \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, "     \
    "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, " \
    "%120, %121, %122, %123, %124, %125, %126, %127"
#define MLA_WGMMA_D128_OUT                                                              \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),             \
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
    "+f"(d[126]), "+f"(d[127])
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
    __device__ static void m64n256_ss(float (&d)[128], unsigned long long a,                      \
                                      unsigned long long b, int acc = 1) {                        \
        asm volatile(                                                                             \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                         \
            "wgmma.mma_async.sync.aligned.m64n256k16.f32." T "." T " {" MLA_WGMMA_D128            \
            "}, %128, %129, p, 1, 1, 0, 1;\n}\n"                                                  \
            : MLA_WGMMA_D128_OUT                                                                  \
            : "l"(a), "l"(b), "r"(acc));                                                          \
    }                                                                                             \
    __device__ static void m64n256_rs(float (&d)[128], const unsigned (&a)[4],                    \
                                      unsigned long long b, int acc = 1) {                        \
        asm volatile(                                                                             \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                                         \
            "wgmma.mma_async.sync.aligned.m64n256k16.f32." T "." T " {" MLA_WGMMA_D128            \
            "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"                                 \
            : MLA_WGMMA_D128_OUT                                                                  \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));                      \
    }                                                                                             \
}

MLA_WGMMA_OPS(WgmmaF16, "f16");
MLA_WGMMA_OPS(WgmmaBf16, "bf16");
#undef MLA_WGMMA_OPS
#undef MLA_WGMMA_D128
#undef MLA_WGMMA_D128_OUT
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

// The pages of this thread's rows of tile t, for a warpgroup's copy: thread wt of the
// warpgroup copies rows wt / 8 + 16 pass (pass 0..3). Rows at or past row_end get page 0
// and their table entries are not looked up. Looked up a few products before the copy that
// needs them, so no copy waits on the table.
template <typename W>
__device__ __forceinline__ void seesaw_pages(const W& walk, int t, int row_start, int row_end,
                                             int wt, int (&pg)[4]) {
    const int* pages = walk.request_pages();
    if (walk.template tile_in_page<kWgTile>(row_start)) {  // one page: one entry, in pg[0]
        const int pos = row_start + t * kWgTile;
        pg[0] = pos < row_end ? __ldg(pages + (pos >> walk.page_shift)) : 0;
        return;
    }
#pragma unroll
    for (int pass = 0; pass < 4; ++pass) {
        const int pos = row_start + t * kWgTile + (wt >> 3) + 16 * pass;
        pg[pass] = pos < row_end ? __ldg(pages + (pos >> walk.page_shift)) : 0;
    }
}

// The cp.async copy of tile t's column blocks four .. four + 3 (and the rope block 8 where
// `rope`) into `stage`, rows at or past row_end zero-filled: their zero-size copies read
// nothing. `one_page`: the tile is rows (row0 & in_page) .. + 63 of page pg0 (page 0 past the
// slice), one base address and fixed offsets (pg1 .. pg3 unread); else row crow + 16 pass lies
// in page pg<pass>. Out of line (__noinline__): under a tensor map it runs for a slice's
// partial last tile alone, and inline its code would sit between the instructions every
// pair runs, which a launch fetches cold from memory after an L2 flush (measured in
// docs/wgmma-deep-dive.md).
template <typename CacheT>
__device__ __noinline__ void seesaw_copy_async(unsigned char* stage, const CacheT* cache,
                                               int page_shift, bool one_page, int row0,
                                               int row_end, int wt, int pg0, int pg1, int pg2,
                                               int pg3, int four, bool rope) {
    const int crow = wt >> 3, clane = wt & 7, in_page = (1 << page_shift) - 1;
    const int pg[4] = {pg0, one_page ? pg0 : pg1, one_page ? pg0 : pg2, one_page ? pg0 : pg3};
#pragma unroll
    for (int pass = 0; pass < 4; ++pass) {
        const int row = crow + 16 * pass, pos = row0 + row;
        const bool valid = pos < row_end;
        const size_t cache_row = one_page
            ? (static_cast<size_t>(pg0) << page_shift) + (row0 & in_page) + row
            : (static_cast<size_t>(pg[pass]) << page_shift) + (pos & in_page);
        const CacheT* from = cache + (valid ? cache_row * kWgKey : 0) + clane * 8;
        unsigned char* to = stage + row * 128 + ((clane ^ (row & 7)) << 4);
#pragma unroll
        for (int i = 0; i < 4; ++i)
            cp_async_16(to + (four + i) * kBlockBytes, from + 64 * (four + i), valid);
        if (rope) cp_async_16(to + 8 * kBlockBytes, from + 64 * 8, valid);
    }
}

// One copy group of a warpgroup: column blocks four .. four + 3, and the rope block 8 where
// `rope`, of tile t's 64 positions into `stage` (positions >= row_end zero-filled, so a tile
// past the slice is all zeros: its scores are masked and its p is 0); `landed` completes its
// phase once the group is in.
// With the tensor maps (`map`, every tile of the slice in one page), a whole tile goes by bulk
// tensor copy: once every warp of the warpgroup is past the products that read the blocks,
// thread 0 expects the bytes and issues one 3-D box of the four blocks (and a 2-D box of the
// rope block); `landed` counts that one arrival. A tile with rows past row_end goes by
// cp.async (the copy engine would read those rows, which the cache need not hold valid):
// each thread waits for its own copies, then thread 0 makes the phase's one counted arrival.
// Not cp.async.mbarrier.arrive without .noinc (each thread adding its own arrival to the
// count as its copies land): right by the PTX manual, but compute-sanitizer's synccheck
// reports it as a barrier overflow and stops the kernel. Only a chunk's last pair holds such
// tiles, so a warpgroup waits at most once a chunk (docs/wgmma-deep-dive.md, measured).
// Without a map, cp.async by every thread, `landed` counting the 128 threads' arrivals.
template <typename W>
__device__ __forceinline__ void seesaw_copy(unsigned char* stage, const W& walk, const void* map,
                                            int t, int row_start, int row_end, int wt,
                                            const int (&pg)[4], int four, bool rope,
                                            unsigned long long* landed) {
    const int in_page = (1 << walk.page_shift) - 1;
    const bool copies = !(kAblateCacheLoads && t >= 2);
    const int row0 = row_start + t * kWgTile;
    if (map != nullptr) {
        const int wg = threadIdx.x >> 7;
        if (copies && row0 + kWgTile <= row_end) {
            warpgroup_sync(wg);
            if (wt == 0) {
                const int y =
                    (pg[0] << walk.page_shift) + (row0 & in_page) + MLA_WGMMA_TMA_ROW_SHIFT;
                mbar_arrive_expect_bytes(landed,
                                         (rope ? kGroupBlocks + 1 : kGroupBlocks) * kBlockBytes);
                tma_blocks(stage + four * kBlockBytes, map, four, y, landed);
                if (rope)
                    tma_box(stage + 8 * kBlockBytes, static_cast<const char*>(map) + kMapBytes,
                            kWgLora, y, landed);
            }
            return;
        }
        if (copies)
            seesaw_copy_async(stage, walk.cache, walk.page_shift, true, row0, row_end, wt, pg[0],
                              pg[0], pg[0], pg[0], four, rope);
        cp_async_wait_all();  // this thread's copies have landed
        warpgroup_sync(wg);   // and every thread's of the warpgroup
        if (wt == 0) mbar_arrive(landed);
        return;
    }
    if (copies)
        seesaw_copy_async(stage, walk.cache, walk.page_shift,
                          walk.template tile_in_page<kWgTile>(row_start), row0, row_end, wt,
                          pg[0], pg[1], pg[2], pg[3], four, rope);
    mbar_arrive_after_copies(landed);  // once this thread's copies have landed
}

// The byte offset in q and in a tile of k16 step i of warpgroup WG's scores: its early four
// blocks first (and the rope block 8 on warpgroup 0's early side), then the rest.
__device__ __forceinline__ unsigned seesaw_koff(int wg, int i) {
    const int blk = wg == 0 ? (i < 16 ? i >> 2 : i < 20 ? 8 : 4 + ((i - 20) >> 2))
                            : (i < 16 ? 4 + (i >> 2) : i < 20 ? 8 : (i - 20) >> 2);
    return blk * kBlockBytes + (i & 3) * 32;
}
template <typename CacheT, typename QT, bool kPartials, typename W>
__device__ __forceinline__ void wgmma_attn_body(const QT* __restrict__ q, W& walk, float scale_log2,
                                                float* __restrict__ part_acc,
                                                float* __restrict__ part_m,
                                                float* __restrict__ part_l,
                                                const void* __restrict__ kv_map) {
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
    float* mx_s = reinterpret_cast<float*>(smem + Smem::mx);
    float* lsum = reinterpret_cast<float*>(smem + Smem::lsum);

    // Warp-uniform by construction (a broadcast), so that ptxas sees the warpgroup branches
    // below as uniform and keeps the wgmma in them asynchronous.
    const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    const int wt = tid & 127, lane = tid & 31, g = lane >> 2, c = lane & 3;
    const int r0 = 16 * ((tid >> 5) & 3) + g;  // this thread's rows r0 and r0 + 8 of the block
    const int n_tiles = (row_end - row_start + kWgTile - 1) / kWgTile;
    const int n_pairs = (n_tiles + 1) / 2;
    // warpgroup w's tiles 2k + w live in stage w; the first four blocks of its latent
    // columns (256 w ..) are its half of every value product
    unsigned char* own_stage = tiles + wg * kWgTileBytes;
    const int early = 4 * wg, late = 4 * (1 - wg);

    unsigned long long* bars = reinterpret_cast<unsigned long long*>(smem + Smem::bars);
    unsigned long long* full = bars + kBarFull + 2 * wg;  // this warpgroup's two groups
    // The bulk tensor copy where the host passed the cache's maps; it sends whole tiles of
    // one page (the host passes none under pages of 64 positions, and checked here too).
    const void* map = kv_map != nullptr && walk.template tile_in_page<kWgTile>(row_start)
                          ? kv_map : nullptr;
    if (tid < kWgBars)
        mbar_init(bars + tid, tid == kBarQ ? kWgThreads : tid < kBarP0 && map ? 1 : 128);
    if (map != nullptr && wt == 0) tma_acquire(map);
    // the initialized barriers, to the copy engine's proxy too (it completes the TMA phases)
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    __syncthreads();

    pdl_wait();  // q is the kernel before's (q_absorb, api.DecodeStep): nothing above reads it
    // q copied as given (exact 16-bit; the scale goes on the f32 scores) by every thread;
    // rows past n_rows are zeros. Then each warpgroup its first tile, in its two groups (the
    // blocks its own products free first, then the rest).
    static_assert(SameType<QT, CacheT>::value, "q in the cache dtype: copied, not converted");
    const CacheT* q_rows = walk.q(q);
    copy_rows_sw128(q_s, q_rows, [&](int, int j) -> const CacheT* {
        return head0 + j < n_rows ? q_rows + static_cast<size_t>(head0 + j) * kWgKey : nullptr;
    });
    mbar_arrive_after_copies(bars + kBarQ);
    int pg[4];
    seesaw_pages(walk, wg, row_start, row_end, wt, pg);
    seesaw_copy(own_stage, walk, map, wg, row_start, row_end, wt, pg, early, wg == 0, full);
    seesaw_copy(own_stage, walk, map, wg, row_start, row_end, wt, pg, late, wg == 1, full + 1);
    mbar_wait(bars + kBarQ, 0);  // q has landed, every thread's rows of it

    // the end of each row's visible positions in the slice (causal rows see fewer)
    const int re0 = walk.row_end(head0 + r0, row_end), re1 = walk.row_end(head0 + r0 + 8, row_end);
    // every row of the block sees at least this far: a row's end grows with its query token, so
    // the block's first row has the least (block-uniform, so the branch on it below is too)
    const int re_all = walk.row_end(head0, row_end);
    // the row of p whose 16 bytes lane l gives to stmatrix (matrix l / 8, its row l % 8):
    // 16 (warp) + 8 ((l / 8) & 1) + l % 8, at columns 16 kk + 8 (l / 16)
    const int st_row = 16 * ((tid >> 5) & 3) + 8 * ((lane >> 3) & 1) + (lane & 7);
    const int st_col = 8 * (lane >> 4);
    const unsigned q_addr = smem_u32(q_s), p_addr = smem_u32(p_s);
    const unsigned stage0 = smem_u32(tiles), stage1 = stage0 + kWgTileBytes;
    const unsigned own_addr = wg == 0 ? stage0 : stage1;
    const Sw128Desc q_desc(q_addr, 16, 1024), own_desc(own_addr, 16, 1024);  // the scores' A, B

    // O[64 rows][256w + 8j + 2c + {0,1}]: o[4j + {0,1}] row r0, o[4j + {2,3}] + 8. Not zeroed:
    // the first pair's first value product writes it (scale-d 0), so that the 128 moves are
    // not code a launch runs once, cold (docs/wgmma-deep-dive.md, the cold start).
    float o[128];
    // the running max (the same in both warpgroups after every pair) and this warpgroup's
    // share of the row sum: the f32 p of its own tiles, on the scale of m_run
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

    // The scores of this warpgroup's tile t_own over all 576 dims, its early group's blocks
    // first (warpgroup 0: 0-3 and the rope block 8; 1: 4-7), the rest once they have landed;
    // the next own tile's pages are looked up meanwhile. WG: the warpgroup, a literal at
    // each call (the lambda is inlined), so that each branch unrolls its own step list.
    auto scores = [&](const int WG, int t_own, bool next, float (&sp)[32]) {
        const int kFirst = WG == 0 ? 20 : 16;
#pragma unroll
        for (int i = 0; i < 32; ++i) sp[i] = 0.f;
        const unsigned phase = (t_own >> 1) & 1;  // the stage's fill of this pair
        mbar_wait(full, phase);  // the warpgroup's early group has landed
        __syncwarp();
        fence_proxy_async();     // the copied bytes -> the tensor cores' proxy
        wgmma_fence();
#pragma unroll
        for (int i = 0; i < kFirst; ++i)
            Op::m64n64(sp, q_desc.at(seesaw_koff(WG, i)), own_desc.at(seesaw_koff(WG, i)));
        wgmma_commit();
        mbar_wait(full + 1, phase);  // and the late group
        __syncwarp();
        fence_proxy_async();
        wgmma_fence();  // ours, after the wait's branch: else ptxas inserts one and serializes
#pragma unroll
        for (int i = kFirst; i < 36; ++i)
            Op::m64n64(sp, q_desc.at(seesaw_koff(WG, i)), own_desc.at(seesaw_koff(WG, i)));
        wgmma_commit();
        if (next) seesaw_pages(walk, t_own + 2, row_start, row_end, wt, pg);
        wgmma_wait<0>();
        fence_regs(sp);
    };
    // The softmax of the own tile from the running max m_base (the lazy max of
    // mla_common.cuh): m_run becomes the new max, own_scale = 2^(m_base - m_run), pa the
    // A fragments of p rounded to CacheT, also written for the other warpgroup into p_out
    // (warpgroup 0: p_s; 1: its stage's spent rope block) with the new max into mx_s[wg];
    // then the barrier `ready` tells the other warpgroup. Returns the f32 sums of p.
    auto softmax = [&](float (&sp)[32], int t_own, const float (&m_base)[2],
                       float (&own_scale)[2], unsigned (&pa)[4][4], float (&sums)[2],
                       unsigned char* p_out, unsigned long long* ready) {
        const int base = row_start + t_own * kWgTile;
        float mx0 = -INFINITY, mx1 = -INFINITY;
        if (base + kWgTile <= re_all) {  // every row sees the whole tile: no mask
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    sp[4 * j + e] *= scale_log2;
                    sp[4 * j + 2 + e] *= scale_log2;
                    mx0 = fmaxf(mx0, sp[4 * j + e]);
                    mx1 = fmaxf(mx1, sp[4 * j + 2 + e]);
                }
        } else {
            const int lim0 = re0 - base - 2 * c, lim1 = re1 - base - 2 * c;
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = 8 * j + e;  // the column less 2 c, as lim0 and lim1 are
                    sp[4 * j + e] = col < lim0 ? sp[4 * j + e] * scale_log2 : -INFINITY;
                    sp[4 * j + 2 + e] = col < lim1 ? sp[4 * j + 2 + e] * scale_log2 : -INFINITY;
                    mx0 = fmaxf(mx0, sp[4 * j + e]);
                    mx1 = fmaxf(mx1, sp[4 * j + 2 + e]);
                }
        }
#pragma unroll
        for (int o2 = 1; o2 < 4; o2 <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o2));
        }
        const float mx[2] = {mx0, mx1};
        float m_exp[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float m_new = mx[h] > m_base[h] + kLazyLog2 ? mx[h] : m_base[h];
            own_scale[h] = m_new == -INFINITY ? 1.f : exp2f(m_base[h] - m_new);
            m_exp[h] = W::exp_offset(m_new);
            m_run[h] = m_new;
        }
        sums[0] = sums[1] = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float p0 = exp2f(sp[4 * j] - m_exp[0]), p1 = exp2f(sp[4 * j + 1] - m_exp[0]);
            const float p2 = exp2f(sp[4 * j + 2] - m_exp[1]), p3 = exp2f(sp[4 * j + 3] - m_exp[1]);
            sums[0] += p0 + p1;
            sums[1] += p2 + p3;
            pa[j >> 1][2 * (j & 1)] = pack2<CacheT>(p0, p1);
            pa[j >> 1][2 * (j & 1) + 1] = pack2<CacheT>(p2, p3);
        }
        // pa[kk] holds the four 8 x 8 matrices of columns 16 kk .. 16 kk + 15: rows r0 and
        // r0 + 8 of the first eight columns, then of the next eight
        const unsigned st_base = smem_u32(p_out);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            stmatrix_x4(st_base + sw_offset(st_row, 16 * kk + st_col), pa[kk]);
        if (c == 0) { mx_s[wg * kWgRows + r0] = m_run[0]; mx_s[wg * kWgRows + r0 + 8] = m_run[1]; }
        fence_proxy_async();  // p -> the other warpgroup's wgmma
        mbar_arrive(ready);
    };
    auto rescale = [&](const float (&sc)[2]) {  // O *= sc by row, skipped where every sc is 1
        if (__any_sync(0xffffffffu, sc[0] != 1.f || sc[1] != 1.f)) {
#pragma unroll
            for (int j = 0; j < 32; ++j) {
                o[4 * j] *= sc[0]; o[4 * j + 1] *= sc[0];
                o[4 * j + 2] *= sc[1]; o[4 * j + 3] *= sc[1];
            }
        }
    };
    // The value product O += P V[:, 256 wg ..] of a tile in stage `stage_addr`, P from
    // registers (the own tile) or from shared memory at p_src (the other warpgroup's);
    // O = P V where acc is 0 (its first k16 step ignores O: the first pair's).
    auto values_rs = [&](unsigned stage_addr, const unsigned (&pa)[4][4], int acc = 1) {
        const Sw128Desc v(stage_addr + early * kBlockBytes, MLA_WGMMA_V_LBO, MLA_WGMMA_V_SBO);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            Op::m64n256_rs(o, pa[kk], v.at(kk * 16 * 128), kk > 0 || acc);
        wgmma_commit();
    };
    auto values_ss = [&](unsigned stage_addr, unsigned p_src, int acc = 1) {
        const Sw128Desc p(p_src, 16, 1024);
        const Sw128Desc v(stage_addr + early * kBlockBytes, MLA_WGMMA_V_LBO, MLA_WGMMA_V_SBO);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            Op::m64n256_ss(o, p.at(kk * 32), v.at(kk * 16 * 128), kk > 0 || acc);
        wgmma_commit();
    };

    // The seesaw, a pair of tiles (2k in stage 0, 2k + 1 in stage 1) a step. Warpgroup 0
    // owns latent columns 0-255 and the even tiles' scores, warpgroup 1 columns 256-511 and
    // the odd tiles'. With m the running max before the pair, m0 after tile 2k, m1 after
    // 2k + 1, scale0 = 2^(m - m0), scale1 = 2^(m0 - m1):
    //   O_L = (O_L scale0 + p0 V0_L) scale1 + p1 V1_L      (warpgroup 0)
    //   O_R = (O_R scale0 + p0 V0_R) scale1 + p1 V1_R      (warpgroup 1)
    // p0 = 2^(s0 - m0), p1 = 2^(s1 - m1), each rounded once, the same words in both products.
    // Warpgroup 1's softmax runs while its p0 product does and warpgroup 0's p0 product;
    // each frees the blocks of a stage as its products finish, and the next pair's copies go
    // out then, in two groups. A tile past the slice is copied as zeros (p 0).
    if (wg == 0) {
        for (int k = 0; k < n_pairs; ++k) {
            const int t_own = 2 * k;
            const bool next = k + 1 < n_pairs;
            float sp[32], scale0[2], scale1[2], sums[2];
            unsigned pa[4][4];
            scores(0, t_own, next, sp);
            const float m_base[2] = {m_run[0], m_run[1]};
            softmax(sp, t_own, m_base, scale0, pa, sums, p_s, bars + kBarP0);
            l_run[0] = l_run[0] * scale0[0] + sums[0];
            l_run[1] = l_run[1] * scale0[1] + sums[1];
            if (k > 0) rescale(scale0);  // O is still zero in the first pair
            values_rs(stage0, pa, k > 0);
            wgmma_wait<0>();
            fence_regs(o);
            // stage 0's blocks 0-3 and 8 are spent: the next tile's early group
            if (next) seesaw_copy(own_stage, walk, map, t_own + 2, row_start, row_end, wt, pg, early, true, full);
            mbar_wait(bars + kBarP1, k & 1);  // p1 and m1
            __syncwarp();
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float m1 = mx_s[kWgRows + r0 + 8 * h];
                scale1[h] = m1 == -INFINITY ? 1.f : exp2f(m_run[h] - m1);
                m_run[h] = m1;
                l_run[h] *= scale1[h];
            }
            rescale(scale1);
            values_ss(stage1, stage1 + 8 * kBlockBytes);
            mbar_wait(bars + kBarK0Free, k & 1);  // warpgroup 1 is done with p_s and stage 0
            if (next) seesaw_copy(own_stage, walk, map, t_own + 2, row_start, row_end, wt, pg, late, false, full + 1);
            wgmma_wait<0>();
            fence_regs(o);
            mbar_arrive(bars + kBarK1Free);
        }
    } else {
        for (int k = 0; k < n_pairs; ++k) {
            const int t_own = 2 * k + 1;
            const bool next = k + 1 < n_pairs;
            float sp[32], scale0[2], scale1[2], sums[2], m0[2];
            unsigned pa[4][4];
            scores(1, t_own, next, sp);
            mbar_wait(bars + kBarP0, k & 1);  // p0 and m0
            __syncwarp();
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                m0[h] = mx_s[r0 + 8 * h];
                scale0[h] = m0[h] == -INFINITY ? 1.f : exp2f(m_run[h] - m0[h]);
            }
            if (k > 0) rescale(scale0);  // O is still zero in the first pair
            values_ss(stage0, p_addr, k > 0);
            softmax(sp, t_own, m0, scale1, pa, sums, own_stage + 8 * kBlockBytes, bars + kBarP1);
            l_run[0] = l_run[0] * scale0[0] * scale1[0] + sums[0];
            l_run[1] = l_run[1] * scale0[1] * scale1[1] + sums[1];
            wgmma_wait<0>();  // p0's product
            fence_regs(o);
            mbar_arrive(bars + kBarK0Free);
            rescale(scale1);
            values_rs(stage1, pa);
            wgmma_wait<0>();
            fence_regs(o);
            // stage 1's blocks 4-7 are spent: the next tile's early group; the rest once
            // warpgroup 0 is done with p1 and blocks 0-3
            if (next) seesaw_copy(own_stage, walk, map, t_own + 2, row_start, row_end, wt, pg, early, false, full);
            mbar_wait(bars + kBarK1Free, k & 1);
            if (next) seesaw_copy(own_stage, walk, map, t_own + 2, row_start, row_end, wt, pg, late, true, full + 1);
        }
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
    // Without kPartials (the instance of a single-pass plan: no merge reads them) the
    // partials are skipped, but for a launch under a plan of several chunk slots.
    const bool single = walk.single();
    const bool partials = kPartials || !walk.single_plan();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = r0 + 8 * h;
        if (head0 + r >= n_rows) continue;
        const size_t partial = part_base + head0 + r;
        const float l = lsum[r] + lsum[kWgRows + r];  // both warpgroups hold the same m_run
        if (wg == 0 && c == 0) {
            if (partials) {
                part_m[partial] = m_run[h];
                part_l[partial] = l;
            }
            if (single) walk.lse[walk.latent_row(partial)] = single_pass_lse(m_run[h], l);
        }
        if (partials) {
            float* dst = part_acc + partial * kWgLora + wg * 256 + 2 * c;
#pragma unroll
            for (int j = 0; j < 32; ++j)
                *reinterpret_cast<float2*>(dst + 8 * j) =
                    make_float2(o[4 * j + 2 * h], o[4 * j + 2 * h + 1]);
        }
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
template <typename CacheT, typename QT, bool kPartials>
__global__ void __launch_bounds__(kWgThreads, 1)
wgmma_attn_paged(const QT* __restrict__ q, const CacheT* __restrict__ kv_cache,
                 const int* __restrict__ block_table, const int* __restrict__ cache_seqlens,
                 int n_rows, int n_head, int s_q, int causal, int max_pages, int page_shift,
                 int max_chunks, int min_chunk, float scale_log2, float* __restrict__ part_acc,
                 float* __restrict__ part_m, float* __restrict__ part_l, int target,
                 int batch, int* __restrict__ chunk_counts, float* __restrict__ latent,
                 float* __restrict__ lse, const void* __restrict__ kv_map) {
    pdl_launch_dependents();  // the combine may launch now; it waits for this grid
    PagedWalk<CacheT, kWgTile> walk{kv_cache, block_table, cache_seqlens, n_rows, n_head, s_q,
                                    causal, max_pages, page_shift, max_chunks, min_chunk,
                                    target, batch, chunk_counts, latent, lse};
    wgmma_attn_body<CacheT, QT, kPartials>(q, walk, scale_log2, part_acc, part_m, part_l,
                                           kv_map);
}

}  // namespace mla
