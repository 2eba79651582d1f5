"""`check` on a device: every variant against the float64 reference, and the negative control
(the combine without its rescale) shown failing. The verdict logic runs on the CPU with a
stand-in backend; the real run is a GPU test."""
from __future__ import annotations


from gpu_support import fresh_seed, gpu
from mlasandbox import device_check, registry


class Backend:
    """CupyBackend.check's interface: `good` variants match, the control combine fails unless
    `control_passes`, `broken` raises at launch."""

    def __init__(self, control_passes=(), broken=()):
        self.control_passes, self.broken = set(control_passes), set(broken)
        self.calls = []

    def check(self, variants, dims, n_ctx, cache, q, seed, splits, rescale=True):
        self.calls.append((tuple(variants), splits, rescale))
        self.shapes = getattr(self, "shapes", []) + [(n_ctx, dims.n_head, cache, q)]
        out = []
        for v in variants:
            row = {"variant": v, "n_ctx": n_ctx, "heads": dims.n_head, "splits": 16}
            if not rescale and v in self.broken:
                row.update({"ok": False, "detail": "CUDARuntimeError: planted"})
            else:
                wrong = not rescale and v not in self.control_passes
                rel = 0.3 if wrong else 1e-7
                row.update({"ok": not wrong, "latent_relL2": rel, "tolerance": 1e-4,
                            "detail": "planted" if wrong else ""})
            out.append(row)
        return out


def test_variants_then_controls_each_must_fail():
    b = Backend()
    rows = device_check.device_checks(["split", "mma16", "cublas"], backend=b)
    assert b.calls == [(("split", "mma16", "cublas"), "auto", True),
                       (("split", "mma16"), device_check.CONTROL_SPLITS, False)]
    assert [r["name"] for r in rows] == [
        "split vs float64 reference", "mma16 vs float64 reference", "cublas vs float64 reference",
        "split negative control (combine without rescale, must fail)",
        "mma16 negative control (combine without rescale, must fail)"]
    assert all(r["ok"] for r in rows)
    assert "rejected as it must" in rows[-1]["detail"]
    # both at the documented case: past the split gate, a partial head block at 16 and 32
    assert (device_check.CHECK_CTX, device_check.CHECK_HEADS) == (20000, 12)
    assert b.shapes == [(20000, 12, "f16", "f32")] * 2


def test_a_control_that_passes_or_cannot_run_fails_the_check():
    rows = device_check.device_checks(["split", "batched12"],
                                      backend=Backend(control_passes={"split"},
                                                      broken={"batched12"}))
    ctl = {r["variant"]: r for r in rows if "control" in r["name"]}
    assert ctl["split"]["ok"] is False and "has no power" in ctl["split"]["detail"]
    assert ctl["batched12"]["ok"] is False and "planted" in ctl["batched12"]["detail"]


@gpu
def test_on_the_device_every_variant_passes_and_every_control_fails():
    seed = fresh_seed()
    rows = device_check.device_checks(registry.variant_names(), seed=seed)
    bad = [f"{r['name']}: {r['detail']}" for r in rows if not r["ok"]]
    assert not bad, f"seed={seed}\n" + "\n".join(bad)
    controls = [r for r in rows if "control" in r["name"]]
    splitting = [n for n in registry.variant_names()
                 if registry.variant(n).is_cuda and registry.variant(n).splits]
    assert sorted(r["variant"] for r in controls) == sorted(splitting)
    assert all(r["ran"] and r["latent_relL2"] > r["tolerance"] for r in controls), \
        f"seed={seed}"
