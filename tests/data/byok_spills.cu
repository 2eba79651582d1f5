// mlasandbox: entry=warp_rows threads=32*ROWS tile_rows=32 heads_per_block=ROWS smem=0
// mlasandbox: params ROWS=4
// byok_warp_rows.cu (a correct kernel) under a cap of 32 registers a thread: its state
// (16 latent columns of q, of the cache row and of acc a lane, m, l, the chunk) does not fit,
// so ptxas spills to local memory and reports nonzero spill stores and loads, different
// from each other, for the compile report of `try` to show (tests/test_byok.py). The cap is
// __launch_bounds__(MLA_THREADS, 65536 / (MLA_THREADS x 32)): 16 blocks of 128 threads must
// fit sm_90's 65536 registers.
#define BYOK_REGISTER_CAP 32
#include "byok_warp_rows.cu"
