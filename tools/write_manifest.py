#!/usr/bin/env python3
"""Write (or extend) the manifest.json of one results run.

A run is one folder under results/, named <device>-<UTC date>-<commit>, holding the files one
session on one device wrote and a manifest.json that says what produced them: device, driver,
CUDA, CuPy, commit, date and the exact commands. Run on the machine that measured:

    python tools/write_manifest.py --name                  # prints the folder name for now
    python tools/write_manifest.py RUN_DIR --command "mlasandbox bench --json bench.json" ...

A second call on the same folder keeps the recorded facts and appends its commands, so
.ci/gpu-lab and .ci/gpu-sanitize can both record into one run. A fact that cannot be read
(no GPU, no nvidia-smi, no git) is written as null, never guessed.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

SCHEMA = "mlasandbox.manifest/1"
FIELDS = ("device", "arch", "num_sms", "driver", "cuda_driver_api", "cuda_runtime", "nvrtc",
          "cupy", "numpy", "python", "mlasandbox", "commit", "sources", "date", "host")
ROOT = Path(__file__).resolve().parent.parent


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def _commit() -> str | None:
    # A tree copied to a GPU machine carries a stale .git (or none): the caller names the
    # commit in $MLASANDBOX_COMMIT, as the bench's own metadata reads it.
    if os.environ.get("MLASANDBOX_COMMIT"):
        return os.environ["MLASANDBOX_COMMIT"]
    head = _run(["git", "rev-parse", "--short=7", "HEAD"])
    if head is None:
        return None
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    return head + ("-dirty" if dirty else "")


def _device_facts() -> dict:
    """What the device and its software stack say about themselves; None where unreadable."""
    facts: dict = dict.fromkeys(FIELDS)
    facts.update(python=platform.python_version(), host=platform.node(), commit=_commit(),
                 date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    facts["driver"] = _run(["nvidia-smi", "--query-gpu=driver_version",
                            "--format=csv,noheader"])
    if facts["driver"]:
        facts["driver"] = facts["driver"].splitlines()[0].strip()
    try:  # the code this process imports, whatever the commit field says (provenance.py)
        from mlasandbox.provenance import sources_digest

        facts["sources"] = sources_digest()
    except Exception:
        pass
    try:
        from mlasandbox.bench_gpu import run_meta

        meta = run_meta()
    except Exception as exc:  # no CuPy, no driver, no device: the facts stay null
        facts["device_error"] = f"{type(exc).__name__}: {exc}"
        return facts
    for key in ("device", "arch", "num_sms", "cuda_runtime", "nvrtc", "cupy", "numpy",
                "mlasandbox"):
        facts[key] = meta.get(key)
    facts["cuda_driver_api"] = meta.get("driver")
    return facts


def run_name(facts: dict) -> str:
    """<device>-<UTC date>-<commit>, e.g. h200-2026-11-30-a8a2e02; 'unknown' for a null part."""
    dev = facts.get("device") or "unknown"
    slug = re.sub(r"[^a-z0-9]+", "-", dev.lower().replace("nvidia", "")).strip("-")
    date = (facts.get("date") or "unknown")[:10]
    commit = (facts.get("commit") or "unknown").replace("-dirty", "")
    return f"{slug or 'unknown'}-{date}-{commit}"


def merge(old: dict | None, facts: dict, commands: list[str], notes: str | None) -> dict:
    """The manifest after this call: old facts kept (they describe the run's first session),
    commands appended in order, files listed from disk by the caller."""
    man = {"schema": SCHEMA, **facts, "commands": [], "notes": None, "files": []}
    if old:
        man.update({k: v for k, v in old.items() if k not in ("commands", "files")})
        man["commands"] = list(old.get("commands") or [])
    man["commands"] += [c for c in commands if c not in man["commands"]]
    if notes:
        man["notes"] = notes
    return man


def write(run_dir: Path, commands: list[str], notes: str | None = None,
          facts: dict | None = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "manifest.json"
    old = json.loads(path.read_text()) if path.exists() else None
    man = merge(old, facts if facts is not None else _device_facts(), commands, notes)
    man["files"] = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")
                          if p.is_file() and p.name != "manifest.json")
    path.write_text(json.dumps(man, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", nargs="?", type=Path, help="the run's folder under results/")
    ap.add_argument("--command", action="append", default=[], help="a command the run ran "
                    "(repeat; in the order they ran)")
    ap.add_argument("--notes", help="one line on what the run is for")
    ap.add_argument("--name", action="store_true", help="print the run folder name and exit")
    args = ap.parse_args(argv)
    if args.name:
        print(run_name(_device_facts()))
        return 0
    if args.run_dir is None:
        ap.error("RUN_DIR is required unless --name is given")
    print(write(args.run_dir, args.command, args.notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
