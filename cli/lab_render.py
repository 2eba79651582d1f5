"""Tables for `bench`, `sweep` and `bench --vs` (the lab commands). Rendering only: every
number comes from the result dicts of mlasandbox.bench / sweep / baseline."""
from __future__ import annotations

from rich import box
from rich.markup import escape
from rich.table import Table

from mlasandbox.clocks import clock_cell
from mlasandbox.metrics import explain_lines

from .render import Column, FitTable, fmt_bytes, kv_table

__all__ = ["fmt_us", "depth_table", "phase_table", "summary_table", "checks_table",
           "vs_table", "sweep_table", "paged_sweep_table", "explain_text"]


def fmt_us(x) -> str:
    if x is None:
        return "-"
    if x < 10:
        return f"{x:.2f}"
    if x < 1000:
        return f"{x:.1f}"
    return f"{x:,.0f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}" if x >= 0.1 else f"{x:.1%}"


def _num(x, fmt="{:,.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def _roof(row) -> str:
    """The fraction of the phase's own roof, named ('12% GEMM'); '-' where it was not
    measured."""
    frac = row.get("frac_roof")
    return "-" if frac is None else f"{_pct(frac)} {row.get('roof', '')}".strip()


def _rows(result, phase, cache):
    return [r for r in result["rows"] if r["phase"] == phase and r["cache"] == cache]


def depth_table(result: dict, cache: str) -> Table:
    """Step time per variant and context, the depth term and its share (Lab steps 1-2)."""
    ctxs = result["config"]["contexts"]
    floor = result["noise_floor"]["floor"]
    steps = {(r["variant"], r["n_ctx"]): r for r in _rows(result, "step", cache)}
    fastest = {f["n_ctx"]: f for f in result["fastest"] if f["cache"] == cache}
    depth = {d["variant"]: d for d in result["depth"] if d["cache"] == cache}
    checks = {c["variant"]: c for c in result["checks"] if c["cache"] == cache}
    modes = {}
    for (v, n), r in steps.items():
        modes.setdefault(n, set()).add(r["mode"])
    fl = "no floor" if floor is None else f"{floor:.1%}"
    t = Table(title=f"step time (us, median): q_absorb + attn + combine, cache {cache}; "
                    f"* fastest, = no measurable difference from the fastest (floor {fl})",
              caption="(g): CUDA-graph replay at that context (never for the cuBLAS engine: it "
                      "allocates per call); depth term: t(longest) - t(shortest); share: of the "
                      "step at the longest context",
              title_justify="left", caption_justify="left", box=box.SIMPLE_HEAD)
    t.add_column("variant", no_wrap=True)
    for n in ctxs:
        t.add_column(f"{n}" + (" (g)" if "graph" in modes.get(n, ()) else ""), justify="right")
    t.add_column("depth term", justify="right")
    t.add_column("share", justify="right")
    t.add_column("check", justify="left")
    for v in result["config"]["variants"]:
        cells = []
        for n in ctxs:
            r = steps.get((v, n))
            if r is None:
                cells.append("-")
                continue
            s = fmt_us(r["median_us"])
            f = fastest.get(n)
            if f and f["variant"] == v:
                s = f"[bold green]{s} *[/bold green]"
            elif f and v in f["ties"]:
                s = f"[green]{s} =[/green]"
            cells.append(s)
        d = depth.get(v)
        if d is None:
            dcell, share = "-", "-"
        elif d["measurable"] is False:
            dcell, share = "no measurable difference", "-"
        else:
            dcell, share = fmt_us(d["depth_us"]), _pct(d["share"])
        c = checks.get(v)
        ccell = ("-" if c is None else "[green]ok[/green]" if c["ok"] else
                 "[bold red]WRONG: not a result[/bold red]")
        name = v if c is None or c["ok"] else f"[red]{v}[/red]"
        t.add_row(name, *cells, dcell, share, ccell)
    return t


PHASE_COLUMNS = (
    Column("variant"), Column("S", "right", drop=4), Column("head blocks", "right", drop=3),
    Column("q_absorb", "right", drop=2), Column("attn", "right"),
    Column("combine", "right", drop=6), Column("step", "right"),
    Column("GB/s ideal", "right", drop=5), Column("GB/s issued", "right", drop=1),
    Column("% copy", "right"), Column("TFLOP/s", "right", drop=7),
    Column("SM MHz", "right", drop=9), Column("% roof", "right"), Column("mode", "left", drop=8),
)


def phase_table(result: dict, n_ctx: int, cache: str) -> FitTable:
    """Every phase of every variant at one context, with rates against the ceilings."""
    ceil = result["ceilings"]
    by = {}
    for r in result["rows"]:
        if r["cache"] == cache and r["n_ctx"] == n_ctx:
            by[(r["variant"], r["phase"])] = r
    qa = {r.get("control_label"): r for r in result["rows"]
          if r["phase"] == "q_absorb" and r["cache"] == cache}
    cells = []
    for v in result["config"]["variants"]:
        a = by.get((v, "attn"))
        if a is None:
            continue
        c, s = by.get((v, "combine")), by.get((v, "step"))
        q = qa.get(f"before {v}")
        cells.append([v, _num(a.get("splits"), "{}"), _num(a.get("head_blocks"), "{}"),
                      fmt_us(q["median_us"]) if q else "-",
                      f"{fmt_us(a['median_us'])} "
                      f"\\[{fmt_us(a['p10_us'])}-{fmt_us(a['p90_us'])}]",
                      fmt_us(c["median_us"]) if c else "(in attn)",
                      fmt_us(s["median_us"]) if s else "-",
                      _num(a["GBps_ideal"]), _num(a["GBps_issued"]),
                      _pct(a["frac_copy_ideal"]), _num(a["TFLOPs"], "{:.2f}"), clock_cell(a),
                      _roof(a), a["mode"]])
    return FitTable(
        PHASE_COLUMNS, cells,
        title=f"phases at n_ctx {n_ctx}, cache {cache} (us, median \\[p10-p90]); rates of "
              f"attn: GB/s ideal / as issued, % of copy {ceil['copy_GBps']:,.0f} GB/s; "
              f"TFLOP/s and % of the kernel's own roof: GEMM {ceil['gemm_TFLOPs']:,.0f} "
              f"for the tensor cores (mma, cuBLAS), f32 FMA "
              f"{_num(ceil.get('fma_TFLOPs'), '{:.1f}')} for the CUDA cores; SM MHz: attn's "
              f"SM clock",
        title_justify="left", caption_justify="left", box=box.SIMPLE_HEAD)


def checks_table(result: dict) -> Table:
    t = Table(title="correctness spot check against the float64 reference",
              title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("variant", "cache", "n_ctx", "heads", "S", "out relL2", "latent relL2",
                "lse |err|", "limit", "verdict"):
        t.add_column(col, justify="left" if col in ("variant", "verdict") else "right")
    for c in result["checks"]:
        def f(x):
            return "-" if x is None else f"{x:.2e}"
        t.add_row(c["variant"], c["cache"], str(c["n_ctx"]), str(c["heads"]),
                  _num(c.get("splits"), "{}"), f(c.get("out_relL2")), f(c.get("latent_relL2")),
                  f(c.get("lse_abs")), f(c.get("tolerance")),
                  "[green]ok[/green]" if c["ok"] else
                  f"[red]FAIL[/red] {escape(c.get('detail', ''))}")
    return t


def summary_table(result: dict) -> Table:
    m, ceil, nf, ctl = result["meta"], result["ceilings"], result["noise_floor"], result["control"]
    items = [("device", f"{m.get('device')} ({m.get('arch')}, {m.get('num_sms')} SMs, L2 "
                        f"{fmt_bytes(m.get('l2_bytes'))}); driver {m.get('driver')}, CUDA "
                        f"{m.get('cuda_runtime')}, CuPy {m.get('cupy')}"),
             ("commit / sources / date",
              f"{m.get('commit')} / {m.get('sources', 'not recorded')} / {m.get('date')}"),
             ("copy ceiling", f"{ceil['copy_GBps']:,.0f} GB/s (D2D copy of "
                              f"{fmt_bytes(ceil.get('copy_bytes'))}, read + written)"),
             ("GEMM ceiling", f"{ceil['gemm_TFLOPs']:,.0f} TFLOP/s (f16 {ceil.get('gemm_n')}^3, "
                              "cupy.matmul)")]
    if ceil.get("fma_TFLOPs"):
        items.append(("f32 FMA ceiling", f"{ceil['fma_TFLOPs']:.1f} TFLOP/s (ceiling_fma.cu, "
                                         "2 FLOPs per FMA: the CUDA-core variants' roof)"))
    for run in nf["runs"]:
        items.append((f"A/A noise floor ({run['cache']})",
                      f"{run['floor']:.2%}: per_head vs split at n_ctx {run['n_ctx']} "
                      f"({run['kernel']}, same code: {run['same_code']}), {run['rounds']} "
                      f"interleaved rounds, p90 |a-b|/b {run['p90']:.2%}, max {run['max_rel']:.2%}"
                      f", timer resolution term {run['resolution_term']:.2%}, mode {run['mode']}"))
    series = ctl["series"]
    verdict = ("[green]stable[/green]" if ctl["stable"] else
               "[bold red]UNSTABLE[/bold red]" if ctl["stable"] is False else "not judged")
    items.append(("control q_absorb", f"start {fmt_us(ctl['start_us'])} us, end "
                                      f"{fmt_us(ctl['end_us'])} us, max move "
                                      f"{ctl['max_move']:.2%} over {len(series)} measurements: "
                                      f"{verdict}"))
    est = result["estimate"]
    items.append(("time", f"{result['elapsed_s']:.0f} s (estimated {est['seconds']:.0f} s of "
                          f"GPU work, {est['measurements']} measurements, target "
                          f"{est['target_ms']:.0f} ms each)"))
    return kv_table("bench", items)


def vs_table(cmp: dict) -> Table:
    fl = "none" if cmp["floor"] is None else f"{cmp['floor']:.1%}"
    t = Table(title=f"against the baseline, phase by phase (noise floor {fl})",
              title_justify="left", box=box.SIMPLE_HEAD)
    # both runs' SM clocks where either read them ("*": moved beyond baseline.CLOCK_TOLERANCE)
    clocked = any(r.get("clock_differs") is not None for r in cmp["rows"])
    for col, j in (("variant", "left"), ("cache", "left"), ("n_ctx", "right"),
                   ("phase", "left"), ("baseline us", "right"), ("now us", "right"),
                   *((("SM MHz then/now", "right"),) if clocked else ()), ("verdict", "left")):
        t.add_column(col, justify=j, no_wrap=True)
    c = cmp["control"]
    ctext = c.get("text") or "-"
    style = "red" if c.get("moved") else "green" if c.get("moved") is False else ""
    t.add_row("[bold]control[/bold]", "", "", "q_absorb", fmt_us(c["baseline_us"]),
              fmt_us(c["current_us"]), *(("",) if clocked else ()),
              f"[{style}]{ctext}[/{style}]" if style else ctext)
    for r in cmp["rows"]:
        kind = r["verdict"]
        text = (f"[green]{r['text']}[/green]" if kind == "faster" else
                f"[red]{r['text']}[/red]" if kind in ("slower", "invalid") else r["text"])
        clock = ()
        if clocked:
            clock = ("-" if r.get("clock_differs") is None else
                     f"{r['baseline_mhz']:,.0f}/{r['current_mhz']:,.0f}"
                     + (" [yellow]*[/yellow]" if r["clock_differs"] else ""),)
        t.add_row(r["variant"], r["cache"], str(r["n_ctx"]), r["phase"],
                  fmt_us(r["baseline_us"]), fmt_us(r["current_us"]), *clock, text)
    return t


SWEEP_COLUMNS = (
    Column("HPB", "right"), Column("variant", "left", drop=1), Column("attn us", "right"),
    Column("regs", "right"), Column("spill st/ld", "right"),
    Column("smem st+dyn", "right", drop=3), Column("blocks/SM model", "left"),
    Column("driver", "right", drop=5), Column("limiter", "left", drop=2),
    Column("S", "right", drop=4), Column("head blocks", "right", drop=6),
    Column("waves", "right", drop=7),
)


def _sweep_cells(r: dict) -> tuple[str, str, str]:
    """(time, spills, modelled blocks/SM) of a sweep row, marked: fastest, spills, step."""
    spills = f"{r['spill_stores']}/{r['spill_loads']}"
    if r["spill_stores"] or r["spill_loads"]:
        spills = f"[red]{spills}[/red]"
    tm = "-" if r["median_us"] is None else (
        f"{fmt_us(r['median_us'])} \\[{fmt_us(r['p10_us'])}-{fmt_us(r['p90_us'])}]")
    if r["fastest"]:
        tm = f"[bold green]{tm} *[/bold green]"
    bps = str(r["blocks_per_sm_model"]) + (" <- step" if r["step"] else "")
    if r["step"]:
        bps = f"[yellow]{bps}[/yellow]"
    return tm, spills, bps


def sweep_table(result: dict) -> FitTable:
    cfg = result["config"]
    cells = []
    for r in result["rows"]:
        tm, spills, bps = _sweep_cells(r)
        drv = "-" if r["blocks_per_sm_driver"] is None else (
            str(r["blocks_per_sm_driver"]) + (" <-" if r["driver_step"] else ""))
        cells.append([str(r["hpb"]), r["variant"], tm, str(r["registers"]), spills,
                      f"{fmt_bytes(r['static_smem'])} + {fmt_bytes(r['dynamic_smem'])}", bps,
                      drv, r["limiter"], str(r["splits"]), str(r["head_blocks"]),
                      f"{r['waves']:.2f}"])
    return _sweep_fit(
        SWEEP_COLUMNS, cells, result,
        f"heads-per-block sweep at n_ctx {cfg['n_ctx']}, H={cfg['n_head']}, cache "
        f"{cfg['cache']}, q {cfg['q']} ({cfg['arch']}, {cfg['num_sms']} SMs)",
        "attn: attention phase, median \\[p10-p90]; blocks/SM model: occupancy "
        "calculator on the ptxas report; driver: cudaOccupancy API; <- step: fewer "
        "blocks/SM than the previous HPB (the register wall); * fastest")


def _sweep_fit(columns, cells, result: dict, title: str, caption: str) -> FitTable:
    return FitTable(columns, cells,
                    title=title + ("" if result["timed"] else ": NO GPU, compile-side columns "
                                                              "only"),
                    caption=caption, title_justify="left", caption_justify="left",
                    box=box.SIMPLE_HEAD)


PAGED_SWEEP_COLUMNS = (
    Column("variant", "left"), Column("rows", "right"), Column("attn us", "right"),
    Column("regs", "right"), Column("spill st/ld", "right"),
    Column("smem st+dyn", "right", drop=3), Column("blocks/SM model", "left"),
    Column("driver", "right", drop=5), Column("limiter", "left", drop=2),
    Column("head blocks", "right", drop=6), Column("programs", "right", drop=4),
    Column("longest chunk", "right", drop=7),
)


def paged_sweep_table(result: dict) -> FitTable:
    """The rows-per-block sweep of one paged step (mlasandbox.sweep_paged)."""
    cfg = result["config"]
    cells = []
    for r in result["rows"]:
        tm, spills, bps = _sweep_cells(r)
        drv = "-" if r["blocks_per_sm_driver"] is None else str(r["blocks_per_sm_driver"])
        cells.append([r["variant"], str(r["rows_per_block"]), tm, str(r["registers"]), spills,
                      f"{fmt_bytes(r['static_smem'])} + {fmt_bytes(r['dynamic_smem'])}", bps,
                      drv, r["limiter"], str(r["head_blocks"]), f"{r['programs_run']:,}",
                      f"{r['chunk_len_max']:,}"])
    shape = (f"B={cfg['batch']} x {cfg['lengths_spec']}, H={cfg['dims']['n_head']}"
             + (f", s_q {cfg['s_q']}" if cfg["s_q"] > 1 else "")
             + (" causal" if cfg["causal"] else "") + f", page {cfg['page_size']}")
    return _sweep_fit(
        PAGED_SWEEP_COLUMNS, cells, result,
        f"rows-per-block sweep of the paged step {shape}, cache {cfg['cache_dtype']}, "
        f"q {cfg['q']} ({cfg['arch']}, {cfg['num_sms']} SMs)",
        "rows: query rows (heads x s_q) a block serves; attn: the attention phase, "
        "median \\[p10-p90]; blocks/SM model: occupancy calculator on the ptxas report; "
        "driver: cudaOccupancy API; programs: chunk programs that run; longest chunk: "
        "positions; <- step: fewer blocks/SM than the HPB before (the register wall); "
        "* fastest")


def explain_text(costs) -> str:
    """The formulas behind the rates: one block per phase (metrics.explain_lines)."""

    out = ["Byte and FLOP formulas (ideal: one read of every input, one write of every "
           "output; as issued: what the kernels request, e.g. the cache once per head block):"]
    for c in costs:
        out += explain_lines(c)
    return "\n".join(out)
