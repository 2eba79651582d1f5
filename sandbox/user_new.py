"""`mlasandbox new`: a user kernel to start from, a copy of a built-in paged kernel.

The copy keeps the family's whole file from cuda_src/ (its batch-1 launch stays, never
instantiated), states its shared memory with MLA_SMEM_NEEDS, and ends with a non-template
entry (templates/*.entry.cu) that runs the paged body with the contract's arguments
(user_kernel.contract_signature). Its header is the registry's facts for that family, as
expressions: `try` checks them against the kernel's own constants.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .user_kernel import (CONTRACT_NAMESPACE, HEADER_TAG, contract_signature, expanded_source,
                          identifier_problem)

__all__ = ["Template", "TEMPLATES", "new_kernel_source", "MAX_NAME"]

MAX_NAME = 255 - len(".cu")   # NAME.cu is one file name: 255 bytes on common file systems
# What the copy declares outside its own namespaces, which the entry's name would clash with.
_GLOBAL_NAME = re.compile(r"^\s*(?:#\s*define|namespace)\s+([A-Za-z_]\w*)", re.M | re.ASCII)


@dataclass(frozen=True)
class Template:
    source: str          # the built-in family's file in cuda_src/
    entry: str           # the wrapper in templates/
    header: str          # the header's fields
    params: str = ""     # the header's params line, if any


TEMPLATES = {
    "split": Template("mla_attn_rows.cu", "split.entry.cu",
                      "threads=128 tile_rows=32 heads_per_block=1 smem=TILE_ROWS*KEY_DIM*2"),
    "batched": Template("mla_attn.cu", "batched.entry.cu",
                        "threads=256 tile_rows=32 heads_per_block=HPB "
                        "smem=2*TILE_ROWS*KEY_DIM*2+KEY_DIM*HPB*4+HPB*TILE_ROWS*4"
                        "+3*((HPB+3)/4*4)*4", "HPB=8,12,16"),
    "mma16": Template("mla_mma.cu", "mma.entry.cu",
                      "threads=256 tile_rows=64 heads_per_block=HEADS "
                      "smem=2*TILE_ROWS*KEY_DIM*2+max(2*HEADS*KEY_DIM*2,4*HEADS*(TILE_ROWS+8)*4)"
                      "+2*HEADS*TILE_ROWS*2+3*HEADS*4", "HEADS=16"),
    "mma32": Template("mla_mma.cu", "mma.entry.cu",
                      "threads=256 tile_rows=64 heads_per_block=HEADS "
                      "smem=2*TILE_ROWS*KEY_DIM*2+max(2*HEADS*KEY_DIM*2,4*HEADS*(TILE_ROWS+8)*4)"
                      "+2*HEADS*TILE_ROWS*2+3*HEADS*4", "HEADS=32"),
}


def new_kernel_source(name: str, template: str = "split") -> str:
    """The text of NAME.cu: the header, then a copy of the built-in family's source (the
    batch-1 launch stays, uninstantiated), its smem check as MLA_SMEM_NEEDS, and the entry."""
    if len(name) > MAX_NAME:
        raise ValueError(f"NAME has {len(name)} characters; at most {MAX_NAME}, as NAME.cu is "
                         "a file name")
    problem = identifier_problem(name)
    if problem:
        raise ValueError(f"NAME {name!r} {problem}; NAME names the kernel's entry, a C++ "
                         "function")
    if template not in TEMPLATES:
        raise ValueError(f"--from {template}: known templates: {', '.join(TEMPLATES)}")
    t = TEMPLATES[template]
    src = resources.files("mlasandbox.cuda_src").joinpath(t.source).read_text(encoding="utf-8")
    if "require_dynamic_smem(" not in src:
        raise RuntimeError(f"{t.source} no longer calls require_dynamic_smem: update "
                           "user_kernel.new_kernel_source")
    src = src.replace("require_dynamic_smem(", "MLA_SMEM_NEEDS(")
    entry = resources.files("mlasandbox.templates").joinpath(t.entry).read_text(encoding="utf-8")
    entry = entry.replace("@NAME@", name).replace(
        "@PARAMS@", contract_signature("attn", " " * (len(name) + 1)))
    head = [f"{HEADER_TAG} entry={name} {t.header}"]
    if t.params:
        head.append(f"{HEADER_TAG} params {t.params}")
    head += [
        f"// {name}.cu: a copy of the built-in {template} kernel (cuda_src/{t.source}), made by",
        f"// `mlasandbox new {name} --from {template}`. Edit it; `mlasandbox try {name}.cu`",
        "// checks, times and sweeps it (docs/byok.md). The registry's facts are the built-in",
        "// kernels'; this copy states its own in the header above, checked at the entry below.",
        '#include "mla_user.cuh"',
        "#undef MLA_REGISTRY_FACTS",
        "",
    ]
    text = "\n".join(head) + src + entry
    templates = Path(str(resources.files("mlasandbox.templates")))
    taken = set(_GLOBAL_NAME.findall(expanded_source(text, f"{name}.cu", templates)))
    if name in taken or name == CONTRACT_NAMESPACE:
        raise ValueError(f"NAME {name!r}: the copied kernel (cuda_src/{t.source} and the "
                         "headers it includes) or the sandbox's checks already declare it, a "
                         "namespace or a macro; choose another name")
    return text
