"""The memory ablation's CPU side: the arithmetic, every tile-copying kernel honouring the
define (and compiling with it through NVRTC), and `mlasandbox ablate` without a GPU and with
a fake one."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mlasandbox import ablate as ablate_mod
from mlasandbox import ptxas, registry, sources, toolkit
from mlasandbox.ablate import ABLATE_DEFINE, Ablation, loads_share
from mlasandbox.cli import ablate_cmd
from mlasandbox.cli.lab_render import fmt_us
from mlasandbox.cli.main import main
from mlasandbox.noise import noise_floor, verdict

HAVE_GPU, GPU_REASON = toolkit.device_available()


def test_loads_share_is_the_part_of_the_time_the_loads_add():
    assert loads_share(100.0, 60.0) == pytest.approx(0.4)
    assert loads_share(100.0, 100.0) == 0.0
    # an ablated kernel measured slower than the real one (noise) is not a negative share
    assert loads_share(100.0, 101.0) == 0.0
    with pytest.raises(ValueError, match="positive"):
        loads_share(0.0, 1.0)


# Files whose cp.async copies are not of the cache: the projection stages the latent and wv_b
NOT_CACHE_COPIES = {"mla_project.cu"}


def test_every_kernel_that_copies_cache_tiles_honours_the_ablation():
    # a new family that copies tiles but forgets the hook would be timed "ablated" with all
    # its loads still in place: a memory share of zero that is a lie. Each file's own text,
    # not with its includes expanded (mla_common.cuh names the hook, so every file that
    # includes it would pass): a file that issues cp.async itself checks the hook; an
    # attention file that does not copies through the helpers that check it.
    own = {s: sources._raw(s) for s in sources.source_names()}
    issuing = {s for s, text in own.items() if "cp_async_16(" in text} - NOT_CACHE_COPIES
    assert {"mla_common.cuh", "mla_walk.cuh", "mla_wgmma.cu"} <= issuing, issuing
    for name in issuing:
        assert "kAblateCacheLoads" in own[name], name
    helpers = ("copy_tile<", "cp_async_tile<")
    for name in ("mla_attn.cu", "mla_attn_rows.cu", "mla_attn_tiled.cu", "mla_mma.cu"):
        assert name in issuing or any(h in own[name] for h in helpers), name
    assert "cp_async_16(" in own["mla_project.cu"]  # the exemption is still needed


def test_the_ablated_builds_compile_through_nvrtc():
    insts = [registry.attention_instance(registry.variant(v))
             for v in ("split", "batched16", "tiled16", "mma16", "mma32")]
    rep = ptxas.ptxas_report(insts, arch="sm_90", extra_options=(f"-D{ABLATE_DEFINE}",))
    assert list(rep) == [i.name for i in insts]
    assert all(0 < r.registers <= 255 for r in rep.values())


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.skipif(HAVE_GPU, reason="this machine has a GPU")
def test_ablate_without_a_gpu_says_so_and_exits_2():
    res = run("ablate", "--variants", "split")
    assert res.exit_code == 2
    assert "ablate times kernels on a GPU" in res.output


def test_ablate_rejects_the_cublas_engine_and_unknown_variants():
    for bad in ("cublas", "nope"):
        res = run("ablate", "--variants", bad)
        assert res.exit_code == 2 and "--variants" in res.output, res.output


def fake_ablation(variant, real_us, ablated_us, jitter=0.001):
    a = [real_us * (1 + jitter * i) for i in range(4)]
    a2 = [real_us * (1 - jitter * i) for i in range(4)]
    floor = noise_floor(a, a2)
    v = verdict(ablated_us, real_us, floor.floor)
    return Ablation(variant=variant, kernel=f"k<{variant}>", n_head=96, n_ctx=131072,
                    cache="f16", q="f32", splits=27, head_blocks=96, real_us=real_us,
                    ablated_us=ablated_us,
                    share=loads_share(real_us, ablated_us) if v.measurable else 0.0,
                    floor=floor, verdict=v, output_change=0.5)


def test_ablate_table_and_json_with_a_fake_gpu(monkeypatch):
    monkeypatch.setattr(toolkit, "device_available", lambda: (True, "device 0: Fake H200"))
    canned = {"split": fake_ablation("split", 2134.0, 1841.0),
              "mma16": fake_ablation("mma16", 270.0, 270.1)}   # under the floor
    calls = []

    def fake_run(**opts):
        calls.append(opts)
        return canned[opts["variant"]]

    monkeypatch.setattr(ablate_cmd, "_run_ablation", fake_run)
    monkeypatch.setattr(ablate_cmd, "_run_meta", lambda: {"device": "Fake H200", "commit": "abc"})
    res = run("ablate", "--variants", "split,mma16", "--heads", 96, "--rounds", 3)
    assert res.exit_code == 0, res.output
    assert [c["variant"] for c in calls] == ["split", "mma16"]
    assert calls[0]["dims"].n_head == 96 and calls[0]["rounds"] == 3
    assert calls[0]["splits"] is None
    out = res.output
    assert "14%" in out                                   # 1 - 1841 / 2134
    # the split row, cell by cell in the header's order (real before ablated)
    cells = next(ln.split() for ln in out.splitlines() if ln.split()[:1] == ["split"])
    assert cells[:6] == ["split", "27", "96", fmt_us(2134.0), fmt_us(1841.0), "14%"], cells
    if len(cells) > 6:                                    # the floor column, where it fits
        assert cells[6] == f"{100 * canned['split'].floor.floor:.2f}%", cells
    assert "no measurable difference" in out              # mma16's 0.04% is under the floor
    res = run("ablate", "--variants", "split", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["ok"] and doc["rows"][0]["share"] == pytest.approx(1 - 1841 / 2134)
    assert doc["meta"]["commit"] == "abc"      # a results file says where it came from
    assert doc["rows"][0]["verdict"]["kind"] == "faster"


def test_ablate_needs_rounds_to_pair():
    with pytest.raises(ValueError, match="rounds"):
        ablate_mod.ablate("split", "h96", 8192, rounds=1)


def test_ablate_runs_a_paged_step_with_a_presets_shape_or_the_options(monkeypatch):
    """--serving / --batch ablate the paged step: the run gets the requests' lengths, page
    size, query tokens and causality, the preset's heads, q in the cache dtype unless --q
    says, and the paged default variants (not the batch-1-only per_head and tiled16)."""
    monkeypatch.setattr(toolkit, "device_available", lambda: (True, "device 0: Fake H200"))
    monkeypatch.setattr(ablate_cmd, "_run_meta", lambda: {"device": "Fake H200"})
    monkeypatch.setattr(ablate_cmd, "_run_ablation", lambda **o: pytest.fail("batch-1 run"))
    calls = []

    def fake_paged(**opts):
        calls.append(opts)
        return fake_ablation(opts["variant"], 400.0, 300.0)

    monkeypatch.setattr(ablate_cmd, "_run_paged_ablation", fake_paged)
    res = run("ablate", "--serving", "b128-4k-h128", "--variants", "wgmma64", "--json")
    assert res.exit_code == 0, res.output
    (c,) = calls
    assert (c["variant"], c["dims"].n_head, c["q"], c["page_size"]) == ("wgmma64", 128,
                                                                          "f16", 64)
    assert tuple(c["lengths"]) == (4096,) * 128 and (c["s_q"], c["causal"]) == (1, False)
    doc = json.loads(res.stdout)
    assert doc["config"]["paged"]["batch"] == 128 and "n_ctx" not in doc["config"]
    calls.clear()
    res = run("ablate", "--batch", "3", "--lengths", "5,0,9000", "--page-size", "16",
              "--s-q", "2", "--causal", "--heads", "9", "--q", "f32")
    assert res.exit_code == 0, res.output
    assert [c["variant"] for c in calls] == list(ablate_cmd.DEFAULT_PAGED_VARIANTS)
    assert tuple(calls[0]["lengths"]) == (5, 0, 9000) and calls[0]["q"] == "f32"
    assert (calls[0]["dims"].n_head, calls[0]["page_size"], calls[0]["s_q"],
            calls[0]["causal"]) == (9, 16, 2, True)
    assert "25%" in res.output and "paged step B=3" in res.output   # 1 - 300 / 400


@pytest.mark.parametrize("args, message", [
    (("--variants", "wgmma64"), "wgmma64 serves the paged step only: give --batch"),
    (("--batch", "2", "--variants", "tiled16"), "tiled16 serves batch 1"),
    (("--batch", "2", "--ctx", "100"), "--ctx is the batch-1 step's context"),
    (("--s-q", "2"), "--s-q needs --batch B or --serving PRESET"),
])
def test_ablate_refuses_a_paged_run_it_cannot_do_before_looking_for_a_gpu(monkeypatch, args,
                                                                         message):
    monkeypatch.setattr(toolkit, "device_available", lambda: pytest.fail("looked for a GPU"))
    res = run("ablate", *args)
    assert res.exit_code == 2 and message in res.output, res.output
