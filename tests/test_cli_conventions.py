"""One convention across the commands: every option documented, `--json [FILE]` everywhere,
`--variants` for lists, the same `--q` values, and tables that fit 100 columns."""
from __future__ import annotations

import re

import click
import pytest
from click.testing import CliRunner
from rich.console import Console

from mlasandbox import registry
from mlasandbox.cli.main import main
from mlasandbox.cli.options import Q_CHOICES, SEED, FiniteFloatRange
from mlasandbox.cli.render import regs_table

COMMANDS = sorted(main.commands)


def _params(name):
    return [p for p in main.commands[name].params if isinstance(p, click.Option)]


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_has_help(name):
    missing = [p.opts[0] for p in _params(name) if not (p.help or "").strip()]
    assert not missing, f"{name}: no help for {', '.join(missing)}"


@pytest.mark.parametrize("name", COMMANDS)
def test_json_takes_an_optional_file_everywhere(name):
    (opt,) = [p for p in _params(name) if "--json" in p.opts]
    assert not opt.is_flag and opt.flag_value == "-" and opt.metavar == "[FILE]"


@pytest.mark.parametrize("name", COMMANDS)
def test_lists_are_variants_and_q_takes_the_same_values(name):
    for p in _params(name):
        assert "--variant" not in p.opts or p.name == "variant_name" or p.name == "variant"
        if "--q" in p.opts and isinstance(p.type, click.Choice):
            assert tuple(p.type.choices) == Q_CHOICES


@pytest.mark.parametrize("name", COMMANDS)
def test_seeds_and_real_numbers_are_checked_one_way(name):
    """Every --seed takes what numpy's generators take (0..2**63-1), and every real-number
    option refuses nan and inf, whichever command parses it."""
    for p in _params(name):
        if p.name == "seed":
            assert p.type is SEED, f"{name} --seed"
        if isinstance(p.type, click.types.FloatParamType):
            assert isinstance(p.type, FiniteFloatRange), f"{name} {p.opts[0]}"


def test_grid_help_names_every_variant_family():
    out = " ".join(CliRunner().invoke(main, ["grid", "--help"]).stdout.split())
    for v in registry.VARIANTS.values():
        if v.is_cuda:
            assert (v.name in out) or (v.family == "batched" and "batched<HPB>" in out), v.name


def _fake_rows():
    """Three compiled rows and one not compiled. Every field of every row holds a value no
    other field or row shows, so a cell that shows the wrong field or row is seen."""
    rows = []
    for i, (name, limiter) in enumerate((("attn_rows<cache=bf16,q=bf16>", "registers"),
                                         ("mma_attn<heads=32,cache=bf16,q=bf16>", "warps"),
                                         ("attn_tiled<hpb=16,cache=bf16,q=bf16>",
                                          "shared memory"))):
        rows.append({"name": name, "registers": 217 + i, "spill_stores": 8 + i,
                     "spill_loads": 20 + i, "code_bytes": (30 + i) * 1024 + 512,
                     "stack_bytes": 40 + i, "static_smem": 700 + i,
                     "dynamic_smem": (61 + i) * 1024, "threads": 96 + 64 * i,
                     "blocks_per_sm": 3 + i, "step": i == 1,
                     "warp_occupancy": 0.11 * (i + 1), "limiter": limiter})
    rows.append({"name": "attn_tiled<hpb=16,cache=f16,q=f32>", "needs": "sm_90"})
    return rows


def _expected_cells(r) -> dict[str, str]:
    """{column header: the text its cell must show} for a row of _fake_rows."""
    if r.get("needs"):
        return dict(zip(("kernel", "regs", "spill st/ld", "code KiB", "stack", "smem",
                         "dyn smem", "threads", "blocks/SM", "warps", "limiter"),
                        (r["name"], *"-" * 7, "needs sm_90", "-", "not compiled")))
    return {"kernel": r["name"], "regs": str(r["registers"]),
            "spill st/ld": f"{r['spill_stores']}/{r['spill_loads']}",
            "code KiB": f"{r['code_bytes'] / 1024:.1f}", "stack": str(r["stack_bytes"]),
            "smem": f"{r['static_smem']} B", "dyn smem": f"{r['dynamic_smem'] / 1024:.1f} KiB",
            "threads": str(r["threads"]),
            "blocks/SM": f"{r['blocks_per_sm']}" + (" <- step" if r["step"] else ""),
            "warps": f"{r['warp_occupancy']:.0%}", "limiter": r["limiter"]}


def _render(width: int) -> str:
    con = Console(width=width, record=True, force_terminal=False, color_system=None)
    con.print(regs_table(_fake_rows(), "sm_90"))
    return con.export_text()


def _in_order(cells) -> re.Pattern:
    """A whole line that shows these cells, in this order, and nothing else."""
    return re.compile(r"^\s*" + r"\s+".join(map(re.escape, cells)) + r"\s*$", re.M)


def _left_out(text: str) -> list[str]:
    m = re.search(r"\(left out to fit the width: ([^)]*)\)", " ".join(text.split()))
    return m.group(1).split(", ") if m else []


@pytest.mark.parametrize("width", [250, 140, 100])
def test_regs_table_cells_show_their_own_field_and_row(width):
    """Each row's line shows its own values, each under its own header, at a width that
    keeps every column and at narrower ones that leave some out (named in the caption)."""
    text = _render(width)
    dropped = _left_out(text)
    headers = [c for c in _expected_cells(_fake_rows()[0]) if c not in dropped]
    assert _in_order(headers).search(text), text
    for r in _fake_rows():
        want = _expected_cells(r)
        assert _in_order(want[h] for h in headers).search(text), (r["name"], text)
    assert (width == 250) == (dropped == [])
    assert {"kernel", "regs", "spill st/ld", "blocks/SM"}.isdisjoint(dropped)


def test_regs_table_fits_100_columns_and_keeps_its_numbers():
    text = _render(100)
    assert max(len(line) for line in text.splitlines()) <= 100
    for name, regs in (("mma_attn<heads=32,cache=bf16,q=bf16>", "218"),
                       ("attn_tiled<hpb=16,cache=bf16,q=bf16>", "219")):
        line = next(ln for ln in text.splitlines() if name in ln)
        assert f" {regs} " in line, line  # the name whole, the register count whole
    assert "needs sm_90" in text and "…" not in text
    wide = _render(200)
    assert "stack" in wide and "code KiB" in wide and "left out" not in wide


def test_regs_command_output_fits_100_columns():
    res = CliRunner(env={"COLUMNS": "100"}).invoke(main, ["regs", "--cache", "bf16"])
    assert res.exit_code == 0, res.output
    assert max(len(line.rstrip()) for line in res.stdout.splitlines()) <= 100
    assert "…" not in res.stdout


def test_bench_and_sweep_tables_fit_100_columns(monkeypatch):
    """The timed tables, from the fake backend: the time columns stay whole."""
    from lab_fakes import FakeBackend
    from mlasandbox import bench_gpu, toolkit

    monkeypatch.setattr(toolkit, "device_available", lambda: (True, "device 0: Fake H200"))
    monkeypatch.setattr(bench_gpu, "CupyBackend", lambda *a, **k: FakeBackend(*a, **k))
    runner = CliRunner(env={"COLUMNS": "100"})
    for args in (["bench", "--ctx", "64,8192", "--variants", "split,mma16,cublas"],
                 ["sweep", "--hpb", "8,12,16", "--ctx", "32768"]):
        res = runner.invoke(main, args)
        assert res.exit_code == 0, res.output
        lines = res.stdout.splitlines()
        assert max(len(line.rstrip()) for line in lines) <= 100, args
        assert "…" not in res.stdout, res.stdout
    out = runner.invoke(main, ["bench", "--ctx", "64,8192", "--variants", "split,mma16"]).stdout
    rows = [ln.split() for ln in out.splitlines() if "[" in ln and ln.split()[:1] in (
        ["split"], ["mma16"])]  # the phase tables' rows: attn as median [p10-p90]
    assert {r[0]: r[-2] for r in rows} == {"split": "FMA", "mma16": "GEMM"}
