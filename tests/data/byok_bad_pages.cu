// mlasandbox: entry=warp_rows threads=32*ROWS tile_rows=32 heads_per_block=ROWS smem=0
// mlasandbox: params ROWS=4
// A planted wrong kernel: byok_warp_rows.cu, which runs each chunk to its full length and so
// follows table entries past the request's pages (a fault the launch guard names).
#define BYOK_BUG_PAST_PAGES
#include "byok_warp_rows.cu"
