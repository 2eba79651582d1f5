"""Find and read the CUDA sources shipped in `mlasandbox.cuda_src`.

The sources are package data, found through importlib.resources, so the same lookup
works from a checkout with an editable install and from a wheel. Local includes
(`#include "x.cuh"`) are expanded inline: the text handed to NVRTC is then one
self-contained string, which is also what `mlasandbox repro` embeds in a script.
"""
from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources

__all__ = ["read_source", "source_names"]

_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def _raw(name: str) -> str:
    node = resources.files("mlasandbox.cuda_src").joinpath(name)
    if not node.is_file():
        raise FileNotFoundError(
            f"CUDA source {name!r} is not in mlasandbox.cuda_src; have: {', '.join(source_names())}"
        )
    return node.read_text(encoding="utf-8")


def source_names() -> list[str]:
    root = resources.files("mlasandbox.cuda_src")
    return sorted(p.name for p in root.iterdir() if p.name.endswith((".cu", ".cuh")))


@lru_cache(maxsize=None)
def read_source(name: str) -> str:
    """The text of `name` with its local includes expanded (each header once)."""
    seen: set[str] = set()

    def expand(fname: str) -> str:
        def include(match: re.Match) -> str:
            header = match.group(1)
            if header in seen:
                return f"// (already included: {header})"
            seen.add(header)
            return f"// ---- begin {header} ----\n{expand(header)}\n// ---- end {header} ----"

        return _LOCAL_INCLUDE.sub(include, _raw(fname))

    return expand(name)
