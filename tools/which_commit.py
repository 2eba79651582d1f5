#!/usr/bin/env python3
"""Name the commits whose sources have a digest, e.g. a results file's "sources" field.

    python tools/which_commit.py 3f2a9c81d0e4             # searches HEAD's history
    python tools/which_commit.py 3f2a9c81d0e4 --rev main --max 500

The digest is sandbox/provenance.py's: the package's Python modules, CUDA sources and
templates, as the running package saw them. Prints each matching commit (newest first) and
exits 0, or says none of the commits searched matches and exits 1; exit 2 for a malformed
digest or a repository git cannot read.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sandbox.provenance import DIGEST_CHARS, commit_sources, digest  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("digest", help=f"{DIGEST_CHARS} hex digits")
    ap.add_argument("--rev", default="HEAD", help="where the search starts (default HEAD)")
    ap.add_argument("--max", type=int, default=200, help="commits searched (default 200)")
    ap.add_argument("--repo", default=".", help="the repository (default: here)")
    args = ap.parse_args(argv)
    want = args.digest.strip().lower()
    if not re.fullmatch(f"[0-9a-f]{{{DIGEST_CHARS}}}", want):
        print(f"DIGEST must be {DIGEST_CHARS} hex digits, got {args.digest!r}", file=sys.stderr)
        return 2
    if args.max < 1:
        print(f"--max must be at least 1, got {args.max}", file=sys.stderr)
        return 2
    try:
        revs = subprocess.run(["git", "-C", args.repo, "rev-list", f"--max-count={args.max}",
                               args.rev], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        err = getattr(exc, "stderr", "") or exc
        print(f"cannot list the commits of {args.rev!r} in {args.repo}: {err}".strip(),
              file=sys.stderr)
        return 2
    found = []
    for rev in revs.split():
        try:
            if digest(commit_sources(rev, args.repo)) == want:
                found.append(rev)
        except subprocess.CalledProcessError:
            continue  # a commit from before the package's layout: it has none of the folders
    for rev in found:
        print(rev)
    if not found:
        print(f"no commit of the {len(revs.split())} searched from {args.rev} has sources "
              f"{want}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
