"""`bench --plot FILE.png`: the depth curves of every variant, log-log.

Step time (q_absorb + attn + combine) against n_ctx, one line per variant, the p10-p90 band
shaded, the split gate marked. A curve that slopes while the reference engine's stays flat is
the problem this sandbox studies: work per block that grows with n_ctx. Needs matplotlib
(`pip install 'mlasandbox[plot]'`); `PlotUnavailable` says so when it is missing.
"""
from __future__ import annotations

__all__ = ["PlotUnavailable", "plot_depth"]


class PlotUnavailable(RuntimeError):
    pass


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable(
            f"--plot needs matplotlib ({exc}); install the plot extra: "
            "pip install 'mlasandbox[plot]'") from None
    return plt


def plot_depth(result: dict, path, phase: str = "step") -> str:
    """Draw `phase` medians against n_ctx for every variant (and cache dtype) into `path`."""
    plt = _pyplot()
    series: dict = {}
    for r in result["rows"]:
        if r["phase"] != phase or r["variant"] == "-":
            continue
        label = r["variant"] + ("" if len(result["config"]["cache_dtypes"]) == 1
                                else f" ({r['cache']})")
        if r.get("check_ok") is False:
            label += " [FAILED CHECK]"
        series.setdefault(label, []).append((r["n_ctx"], r["median_us"], r["p10_us"],
                                             r["p90_us"]))
    if not series:
        raise ValueError(f"no {phase} rows to plot")
    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    for label, pts in series.items():
        pts.sort()
        x = [p[0] for p in pts]
        style = "--" if label.startswith("cublas") else "-"
        (line,) = ax.plot(x, [p[1] for p in pts], style, marker="o", ms=4, label=label)
        ax.fill_between(x, [p[2] for p in pts], [p[3] for p in pts], alpha=0.15,
                        color=line.get_color(), linewidth=0)
    gate = result["config"].get("min_ctx")
    if gate:
        ax.axvline(gate, color="grey", linestyle=":", linewidth=1)
        ax.annotate(f"split gate {gate}", (gate, 1), xycoords=("data", "axes fraction"),
                    xytext=(4, -14), textcoords="offset points", fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context n_ctx (tokens)")
    ax.set_ylabel(f"{phase} time, median (us)")
    meta, cfg = result.get("meta", {}), result["config"]
    dims = cfg.get("dims", {})
    ax.set_title(f"MLA decode depth curve: {meta.get('device', '?')}, H={dims.get('n_head')}, "
                 f"cache {'/'.join(cfg['cache_dtypes'])}, q {cfg.get('q_dtype')}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)
