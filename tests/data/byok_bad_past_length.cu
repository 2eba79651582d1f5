// mlasandbox: entry=warp_rows threads=32*ROWS tile_rows=32 heads_per_block=ROWS smem=0
// mlasandbox: params ROWS=4
// A planted wrong kernel: byok_warp_rows.cu, which reads each request's last page to its end, past
// the length (the NaN tail).
#define BYOK_BUG_PAST_LENGTH
#include "byok_warp_rows.cu"
