"""Power of the behind-q_absorb check: the attention built without its pdl_wait
(-DMLA_NO_PDL_WAIT, the combine as built), launched behind q_absorb with q NaN-filled first,
eager, N runs per variant: how many fail the compare (and how many with the wait)."""
import cupy, numpy as np, sys
sys.path.insert(0, "tests")
from gpu_support import device_inputs, poison, compile_with
from mlasandbox import reference, registry
from mlasandbox.api import DecodeStep, QAbsorb
from mlasandbox.compare import compare
from mlasandbox.dims import Dims
N = 10
for ctx in (2000, 32768):
    inp, seed = device_inputs(Dims(n_head=16), ctx, "f16", "f32")
    ref = reference.decode(**inp.decode_args())
    for variant in [n for n, v in registry.VARIANTS.items() if v.is_cuda]:
        out = []
        for broken in (False, True):
            with cupy.cuda.Stream(non_blocking=True) as stream:
                qa = QAbsorb(inp.q_nope, inp.q_rope, inp.wk_b)
                step = DecodeStep(**dict(inp.decode_args(), q=qa.q), variant=variant)
                if broken:
                    step.attn_kernel = compile_with(step.attn_inst, "MLA_NO_PDL_WAIT")
                fails = 0
                for _ in range(N):
                    poison(step); qa.q.fill(cupy.nan); qa.run()
                    step.run_attn(after_q_absorb=True); step.run_combine(); stream.synchronize()
                    fails += not compare(reference.DecodeResult(step.out, step.latent, step.lse), ref).ok
                out.append(fails)
        print(f"{variant:10s} ctx {ctx:6d}: with the wait {out[0]}/{N} fail, without {out[1]}/{N} fail", flush=True)
