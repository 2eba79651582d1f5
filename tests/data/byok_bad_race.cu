// mlasandbox: entry=warp_rows threads=32*ROWS tile_rows=32 heads_per_block=ROWS smem=0
// mlasandbox: params ROWS=4
// A planted wrong kernel: byok_warp_rows.cu, which stages q through shared memory and reads it
// back without a barrier.
#define BYOK_BUG_RACE
#include "byok_warp_rows.cu"
