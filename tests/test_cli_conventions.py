"""One convention across the commands: every option documented, `--json [FILE]` everywhere,
`--variants` for lists, the same `--q` values, and tables that fit 100 columns."""
from __future__ import annotations

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
    rows = []
    for i, (name, regs) in enumerate((("attn_rows<cache=bf16,q=bf16>", 80),
                                      ("mma_attn<heads=32,cache=bf16,q=bf16>", 219),
                                      ("attn_tiled<hpb=16,cache=bf16,q=bf16>", 127))):
        rows.append({"name": name, "registers": regs, "spill_stores": 0, "spill_loads": 0,
                     "stack_bytes": 0, "static_smem": 0, "dynamic_smem": 123456 + i,
                     "threads": 256, "blocks_per_sm": 1, "step": i == 1,
                     "warp_occupancy": 0.125, "limiter": "shared memory"})
    rows.append({"name": "attn_tiled<hpb=16,cache=f16,q=f32>", "needs": "sm_90"})
    return rows


def test_regs_table_fits_100_columns_and_keeps_its_numbers():
    con = Console(width=100, record=True, force_terminal=False, color_system=None)
    con.print(regs_table(_fake_rows(), "sm_90"))
    text = con.export_text()
    assert max(len(line) for line in text.splitlines()) <= 100
    for name, regs in (("mma_attn<heads=32,cache=bf16,q=bf16>", "219"),
                       ("attn_tiled<hpb=16,cache=bf16,q=bf16>", "127")):
        line = next(ln for ln in text.splitlines() if name in ln)
        assert f" {regs} " in line, line  # the name whole, the register count whole
    assert "needs sm_90" in text and "…" not in text
    wide = Console(width=200, record=True, color_system=None)
    wide.print(regs_table(_fake_rows(), "sm_90"))
    assert "stack" in wide.export_text() and "left out" not in wide.export_text()


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
