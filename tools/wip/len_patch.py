"""Measurement-only patches of cuda_src/mla_walk.cuh (never committed): `len` makes the
batch-1 rule and begin() take the length 131072 as a constant (no load before the rule);
`table` also makes a tile-in-page lookup the identity (page = row >> page_shift, right only
for a table 0, 1, 2, ...)."""
import sys
p = "cuda_src/mla_walk.cuh"
s = open(p).read()
modes = sys.argv[1:]
def sub(a, b):
    global s
    assert s.count(a) == 1, a
    s = s.replace(a, b)
if "len" in modes:
    sub("const int len = __ldg(lengths);", "const int len = 131072;")
    sub("len = __ldg(cache_seqlens + req);", "len = batch == 1 ? 131072 : __ldg(cache_seqlens + req);")
if "table" in modes:
    sub("page[0] = row < row_end ? __ldg(pages + (row >> page_shift)) : 0;",
        "page[0] = row < row_end ? (row >> page_shift) : 0;")
open(p, "w").write(s)
print("patched", modes)
