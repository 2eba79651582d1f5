// mlasandbox: entry=warp_rows threads=32*ROWS tile_rows=32 heads_per_block=ROWS smem=0
// mlasandbox: params ROWS=4
// A planted wrong kernel: byok_warp_rows.cu, which serves full groups of rows only: a partial last
// group gets no partials.
#define BYOK_BUG_PARTIAL_GROUP
#include "byok_warp_rows.cu"
