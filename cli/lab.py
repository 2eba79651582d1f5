"""Register the lab commands (issue 4) on the `mlasandbox` group.

* `bench`: the timed bench (cli/bench_cmd.py) replaces the group's no-GPU `bench` under the
  same name, and hands the no-GPU case back to it, so that behaviour is unchanged;
* `sweep` (cli/sweep_cmd.py), `repro` (cli/repro_cmd.py), `ablate` (cli/ablate_cmd.py) and
  `stalls` (cli/stalls_cmd.py) are new.
"""
from __future__ import annotations

__all__ = ["register"]


def register(group) -> None:
    from .ablate_cmd import ablate
    from .bench_cmd import bench, set_no_gpu_fallback
    from .repro_cmd import repro
    from .stalls_cmd import stalls
    from .sweep_cmd import sweep

    previous = group.commands.get("bench")
    if previous is not None and previous is not bench:
        set_no_gpu_fallback(previous)
    group.add_command(bench)
    group.add_command(sweep)
    group.add_command(repro)
    group.add_command(ablate)
    group.add_command(stalls)
