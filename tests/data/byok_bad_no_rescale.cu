// mlasandbox: entry=warp_rows threads=32*ROWS tile_rows=32 heads_per_block=ROWS smem=0
// mlasandbox: params ROWS=4
// A planted wrong kernel: byok_warp_rows.cu, which forgets to rescale acc when the running max
// moves (l is rescaled).
#define BYOK_BUG_NO_RESCALE
#include "byok_warp_rows.cu"
