// mlasandbox: entry=warp_rows kind=step threads=32*ROWS tile_rows=32 heads_per_block=ROWS smem=0
// mlasandbox: params ROWS=4
// byok_warp_rows.cu as a whole-step kernel: one chunk per request, latent and lse written
// directly (no partials, no combine; wv_b in an f32 matmul).
#define BYOK_WHOLE_STEP
#include "byok_warp_rows.cu"
