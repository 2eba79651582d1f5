"""Where a kernel's warps wait, from Nsight Compute's per-SASS stall samples.

`ncu --section SourceCounters --section WarpStateStats --page source --print-source sass --csv`
prints one row per SASS instruction: how many times a warp executed it, and how many of the
periodic warp-state samples found a warp at it, by reason (`selected`: the warp issued).
This module turns those rows into the table that says why a kernel is slow:

* **blocks**: instructions grouped by how many times they ran. Code that runs equally often
  (one loop body, or the straight line around it) lands in one group, so a kernel's hot loops
  are the groups that hold most of the samples. In attn_tiled at 16 heads and 131072 context
  every score-loop instruction runs 147,456 times (512 score warps x 32 tiles x 9 units) and
  every value-loop instruction 65,536 times.
* **opcodes per block**: each opcode's share of the block's instructions against its share of
  the block's samples. Where the second is far above the first, that is where the warps
  wait: attn_tiled's f16 -> f32 conversions (HADD2.F32) are 5% of each loop's instructions
  and 17-19% of its samples, mostly math-pipe throttle (an ncu profile on an H200 at 16
  heads, 131072 context).

* **code footprint**: how many of the kernel's 128-byte lines of code the launch ran. Each
  line's first run fetches it, from DRAM where the L2 was flushed (as the bench flushes it):
  wgmma64 at 1 x 64 x 128 runs 389 of its 883 lines, and a replay of the same module just
  before takes 2-5 us off a launch (docs/wgmma-deep-dive.md, "The cold start").

Also the kernel-wide figures of ncu's raw page (issue active, warp instructions, stalls per
issue). Reads text only: no GPU, no ncu (mlasandbox.ncu runs ncu); `read_saved` reads the
files of `stalls --from`.
"""
from __future__ import annotations

import csv
import gzip
import io
import math
import os
import re
import zlib
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass

from .limits import (MAX_INPUT_FILE_BYTES, input_text, read_input_bytes, read_input_text,
                     size_text)

__all__ = ["SassLine", "OpcodeShare", "Block", "CodeFootprint", "StallReport", "NcuFormatError",
           "read_source_csv", "summarize", "read_raw_csv", "KERNEL_METRICS", "STALL_REASONS",
           "stall_metric", "saved_files", "read_saved", "MAX_PAGE_BYTES"]

# The reasons of ncu's warp-state sampling, as the source page names its columns
# ("stall_<reason>"; the "(Not Issued)" copies are skipped).
_REASON_COLUMN = re.compile(r"^stall_([a-z_]+)$")
_PREDICATE = re.compile(r"^@!?U?P[T0-9]+\s+")


class NcuFormatError(ValueError):
    """Text that is not the ncu CSV page this module reads."""


@dataclass(frozen=True)
class SassLine:
    address: str
    source: str           # the SASS text, predicate included
    opcode: str           # the mnemonic with its modifiers, predicate dropped (FFMA.FTZ)
    executed: int         # warp-level executions
    samples: dict         # reason -> samples


@dataclass(frozen=True)
class OpcodeShare:
    opcode: str
    instructions: int     # how many SASS instructions of the block have this opcode
    instr_share: float    # of the block's instructions
    samples: float
    sample_share: float   # of the block's samples
    reasons: tuple        # ((reason, samples), ...), most first


@dataclass(frozen=True)
class Block:
    executed: int         # times each of its instructions ran
    instructions: int
    samples: float
    sample_share: float   # of the kernel's samples
    reasons: tuple        # ((reason, samples), ...), most first
    opcodes: tuple        # OpcodeShare, most samples first


@dataclass(frozen=True)
class CodeFootprint:
    code_bytes: int       # first to last instruction of the listing, 16 bytes each
    lines: int            # the 128-byte lines it covers
    lines_run: int        # those holding an instruction the launch ran


@dataclass(frozen=True)
class StallReport:
    kernel: str
    instructions: int     # SASS instructions in the listing
    samples: float
    reasons: tuple        # ((reason, samples), ...) over the whole kernel, most first
    blocks: tuple         # Block, most samples first
    code: CodeFootprint | None = None  # None where the addresses are not numbers

    def as_dict(self) -> dict:
        return asdict(self)


# The per-SASS table's cells are counts (instructions executed, stall samples): whole
# numbers >= 0, exact in a float below 2**53. ncu leaves a zero cell empty or "-".
MAX_COUNT = 2**53


def _count(text: str, column: str) -> float:
    """A cell of the per-SASS table; NcuFormatError naming the column for a cell ncu would
    not write (text, a negative or fractional count, nan, inf, a count past MAX_COUNT)."""
    text = text.strip().replace(",", "")
    if not text or text == "-":
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 <= value < MAX_COUNT and value == int(value)):
        raise NcuFormatError(f"a {column!r} cell of {text[:40]!r} in the per-SASS table, "
                             f"where ncu writes a whole count from 0 to 2**53")
    return value


def _metric(text: str) -> float | None:
    """A value of the raw page, or None where it is not a finite number: the page holds
    text attributes too (the device's name), and ncu writes "n/a" for what it did not
    collect."""
    try:
        value = float(text.strip().replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _opcode(source: str) -> str:
    text = _PREDICATE.sub("", source.strip())
    return text.split()[0] if text else ""


def read_source_csv(text: str) -> tuple[str, list[SassLine]]:
    """(kernel name, one SassLine per instruction) of ncu's `--page source --print-source sass
    --csv` output. Lines ncu prints around it (==PROF==, the program's own) are skipped."""
    lines = text.splitlines()
    kernel = ""
    header_at = None
    for i, line in enumerate(lines):
        if line.startswith('"Kernel Name"'):
            row = next(csv.reader([line]))
            kernel = row[1] if len(row) > 1 else ""
        elif line.startswith('"Address"'):
            header_at = i
            break
    if header_at is None:
        raise NcuFormatError("no per-SASS table: expected ncu's `--page source --print-source "
                             "sass --csv` output, with a header row starting \"Address\"")
    header = next(csv.reader([lines[header_at]]))
    for needed in ("Source", "Instructions Executed"):
        if needed not in header:
            raise NcuFormatError(f"the per-SASS table has no {needed!r} column (ncu needs "
                                 "--section SourceCounters --section WarpStateStats)")
    reasons = {col: m.group(1) for col in header if (m := _REASON_COLUMN.match(col))}
    if not reasons:
        raise NcuFormatError("the per-SASS table has no stall_<reason> columns (ncu needs "
                             "--section WarpStateStats)")
    out = []
    for row in csv.reader(line for line in lines[header_at + 1:] if line.startswith('"0x')):
        if len(row) != len(header):  # a row cut short (or run over) would read as zeros
            raise NcuFormatError(f"a per-SASS row at {row[0][:20]!r} has {len(row)} cells "
                                 f"where the header has {len(header)}")
        cells = dict(zip(header, row))
        samples = {reason: _count(cells.get(col, ""), col) for col, reason in reasons.items()}
        out.append(SassLine(cells.get("Address", ""), cells.get("Source", "").strip(),
                            _opcode(cells.get("Source", "")),
                            int(_count(cells.get("Instructions Executed", ""),
                                       "Instructions Executed")), samples))
    if not out:
        raise NcuFormatError("the per-SASS table has a header and no instruction rows")
    return kernel, out


CODE_LINE = 128      # bytes an instruction cache line holds (8 SASS instructions)
_INSTRUCTION = 16    # bytes of one SASS instruction (sm_70 and later)


def code_footprint(lines: list[SassLine]) -> CodeFootprint | None:
    """The listing's size and the 128-byte lines the launch ran, from the instructions'
    addresses (ncu prints where the code was loaded); None if an address is not hex."""
    try:
        addrs = [int(line.address, 16) for line in lines]
    except ValueError:
        return None
    if not addrs:
        return None
    covered = {a // CODE_LINE for a in addrs}
    run = {a // CODE_LINE for a, line in zip(addrs, lines) if line.executed > 0}
    return CodeFootprint(max(addrs) - min(addrs) + _INSTRUCTION, len(covered), len(run))


def _ranked(counter: Counter) -> tuple:
    return tuple((k, v) for k, v in counter.most_common() if v > 0)


def summarize(kernel: str, lines: list[SassLine], top_blocks: int = 6,
              min_share: float = 0.01) -> StallReport:
    """The kernel's samples by reason, and its `top_blocks` blocks of equally-often-run
    instructions that hold at least `min_share` of the samples, each with its opcode mix."""
    total = Counter()
    groups = defaultdict(list)
    for line in lines:
        total.update(line.samples)
        if line.executed > 0:
            groups[line.executed].append(line)
    all_samples = sum(total.values())
    blocks = []
    for executed, members in groups.items():
        reasons = Counter()
        by_op = defaultdict(Counter)
        count = Counter()
        for line in members:
            reasons.update(line.samples)
            by_op[line.opcode].update(line.samples)
            count[line.opcode] += 1
        samples = sum(reasons.values())
        if not all_samples or samples / all_samples < min_share:
            continue
        opcodes = sorted(
            (OpcodeShare(op, count[op], count[op] / len(members), sum(c.values()),
                         sum(c.values()) / samples if samples else 0.0, _ranked(c))
             for op, c in by_op.items()),
            key=lambda o: (-o.samples, o.opcode))
        blocks.append(Block(executed, len(members), samples, samples / all_samples,
                            _ranked(reasons), tuple(opcodes)))
    blocks.sort(key=lambda b: (-b.samples, -b.executed))
    return StallReport(kernel, len(lines), all_samples, _ranked(total), tuple(blocks[:top_blocks]),
                       code_footprint(lines))


# The kernel-wide metrics `mlasandbox stalls` asks ncu for, with their labels.
STALL_REASONS = ("selected", "not_selected", "dispatch_stall", "wait", "long_scoreboard",
                 "short_scoreboard", "math_pipe_throttle", "mio_throttle", "barrier",
                 "no_instruction", "branch_resolving", "membar", "lg_throttle")


def stall_metric(reason: str) -> str:
    return f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"


KERNEL_METRICS = {
    "gpu__time_duration.sum": "duration (us, at ncu's locked clock)",
    "sm__cycles_elapsed.avg.per_second": "SM clock (GHz)",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue active (% of cycles)",
    "smsp__inst_executed.sum": "warp instructions",
    "smsp__inst_executed_pipe_fma.sum": "on the FMA pipe",
    "smsp__inst_executed_pipe_alu.sum": "on the ALU pipe",
    "smsp__inst_executed_pipe_lsu.sum": "on the LSU pipe",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum": "shared-memory bank conflicts",
    **{stall_metric(r): f"stalled {r} (per issue)" for r in STALL_REASONS},
}


def read_raw_csv(text: str) -> dict:
    """{metric: value} of the first kernel in ncu's `--page raw --csv` output (a header row,
    a units row, then one row per profiled kernel)."""
    rows = [r for r in csv.reader(line for line in text.splitlines() if line.startswith('"'))]
    at = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if at is None or len(rows) < at + 3:
        raise NcuFormatError("no kernel row: expected ncu's `--page raw --csv` output (a "
                             "header with \"Kernel Name\", a units row, a row per kernel)")
    header, values = rows[at], rows[at + 2]
    out = {}
    for name, value in zip(header, values):
        if name == "Kernel Name":
            out[name] = value
        elif "__" in name and (number := _metric(value)) is not None:
            if number < 0 and name in KERNEL_METRICS:  # rates, counts and ratios, all >= 0
                raise NcuFormatError(f"the raw page's {name} is {value[:40]!r}, below 0")
            out[name] = number
    return out


# A kernel's per-SASS page is a few MB (tiled16's: 0.7 MB, 2,160 instructions); this
# bounds the text read, a gzipped page's after decompression.
MAX_PAGE_BYTES = MAX_INPUT_FILE_BYTES


def saved_files(path: str) -> tuple[str, str | None]:
    """(source page CSV, raw page CSV or None) that `stalls --from PATH` reads: a --save
    directory's (its source.csv may be gzipped), or PATH itself, a source page CSV."""
    if os.path.isdir(path):
        source, raw = os.path.join(path, "source.csv"), os.path.join(path, "raw.csv")
        if not os.path.exists(source) and os.path.exists(source + ".gz"):
            source += ".gz"
        return source, raw
    return path, None


def read_saved(path: str) -> tuple[str, str | None]:
    """(source page CSV, raw page CSV or None) of a --save directory or a source page CSV
    file (gzipped if its name ends in .gz), each a regular file read up to MAX_PAGE_BYTES.
    ValueError naming the file and what is wrong."""
    source, raw = saved_files(path)
    if not os.path.exists(source):
        raise ValueError(f"{source} does not exist (--from takes a directory written by "
                         "--save, or ncu's per-SASS CSV)")
    data = read_input_bytes(source, "ncu CSV", MAX_PAGE_BYTES)
    if source.endswith(".gz"):
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(data)) as gz:
                data = gz.read(MAX_PAGE_BYTES + 1)
        except (OSError, EOFError, zlib.error) as exc:
            # gzip.BadGzipFile is an OSError; a truncated stream is an EOFError
            raise ValueError(f"{source} is not a gzip-compressed ncu CSV ({exc})") from None
        if len(data) > MAX_PAGE_BYTES:
            raise ValueError(f"ncu CSV {source!r} is larger than {size_text(MAX_PAGE_BYTES)} "
                             "uncompressed")
    source_text = input_text(data, source, "ncu CSV")
    if raw is None or not os.path.lexists(raw):
        return source_text, None
    return source_text, read_input_text(raw, "ncu raw page", MAX_PAGE_BYTES)
