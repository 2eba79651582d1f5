"""Bad input to a user kernel is a HeaderError naming the field and its limit (`try` and `new`
exit 2), never a traceback, a hang or a compile that fails later: the header's values and
parameters have upper bounds derived from how the kernels use them, the expression evaluator
stays within bounded length, depth and magnitude, entry and `new`'s NAME are identifiers a
compile takes, and the file is a regular UTF-8 file (a byte-order mark is ignored).
"""
from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlasandbox import limits, registry
from mlasandbox import user_kernel as uk
from mlasandbox.cli.main import main
from mlasandbox.user_new import MAX_NAME, new_kernel_source

DATA = Path(__file__).parent / "data"
CORRECT = DATA / "byok_warp_rows.cu"


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def header(**fields) -> str:
    f = {"entry": "k", "threads": "128", "tile_rows": "32", "heads_per_block": "4", "smem": "0",
         **fields}
    return "// mlasandbox: " + " ".join(f"{k}={v}" for k, v in f.items()) + "\n"


def refused(text: str, *words):
    with pytest.raises(uk.HeaderError) as e:
        uk.parse_header(text, "my.cu")
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    return str(e.value)


# ---- the fields' limits -------------------------------------------------------------------

def test_the_limits_follow_from_the_kernels_int32_arithmetic():
    # tiles_of: len + tile_rows - 1 in int32 with len up to MAX_CTX
    assert limits.MAX_CTX + uk.MAX_TILE_ROWS - 1 == 2**31 - 1
    # the head block of headroom limits.MAX_HEADS keeps is the largest built-in block's
    variants = {**registry.VARIANTS, **registry.PAGED_ONLY_VARIANTS}.values()
    largest = max(v.hpb for v in variants if v.hpb)
    assert limits.MAX_HEADS + uk.MAX_HEADS_PER_BLOCK == 2**31 - 1
    assert uk.MAX_HEADS_PER_BLOCK == largest == 64


@pytest.mark.parametrize("field, high", [("tile_rows", uk.MAX_TILE_ROWS),
                                         ("heads_per_block", uk.MAX_HEADS_PER_BLOCK)])
def test_tile_rows_and_heads_per_block_have_upper_bounds(field, high):
    assert uk.parse_header(header(**{field: high})).evaluate({})[field] == high
    for bad in (high + 1, 100000, 2**31):
        refused(header(**{field: bad}), f"{field}={bad}", f"1..{high}", "int32")


def test_parameter_values_fit_an_int():
    ok = uk.parse_header(header() + "// mlasandbox: params Z=2147483647,-2147483647\n")
    assert ok.params == {"Z": (2**31 - 1, -(2**31 - 1))}
    refused(header() + "// mlasandbox: params Z=99999999999999999999999\n",
            "my.cu:2", "Z=99999999999999999999999", "-2147483647..2147483647")
    with pytest.raises(uk.HeaderError, match=r"--params Z=2147483648: .*2147483647"):
        ok.param_sets({"Z": (1, 2**31)})
    with pytest.raises(uk.HeaderError, match="ROWS=4294967296"):
        uk.load_kernel(str(CORRECT), ROWS=2**32)
    with pytest.raises(uk.HeaderError, match="ROWS must be an integer"):
        uk.load_kernel(str(CORRECT), ROWS=4.5)       # not silently 4
    assert uk.load_kernel(str(CORRECT), ROWS=8.0).params == {"ROWS": 8}


def test_try_refuses_a_huge_value_as_a_usage_error(tmp_path):
    p = tmp_path / "big.cu"
    p.write_text(CORRECT.read_text().replace("tile_rows=32", "tile_rows=2147483648", 1))
    res = cli("try", p, "--no-time")
    assert res.exit_code == 2 and "tile_rows must be in 1..65535" in res.output, res.output
    res = cli("try", CORRECT, "--no-time", "--params", "ROWS=99999999999")
    assert res.exit_code == 2 and "--params ROWS=99999999999" in res.output, res.output


# ---- the expression evaluator -------------------------------------------------------------

@pytest.mark.parametrize("expr, words", [
    ("+".join(["1"] * 5000), ["at most 512 characters"]),
    ("-" * 3000 + "32", ["at most 512 characters"]),
    ("+".join(["1"] * 150), ["deeper than 100 levels"]),
    ("-" * 200 + "32", ["deeper than 100 levels"]),
    ("1" + "0" * 400 + "/1", ["exceeds", "2**63 - 1"]),
    ("4294967296*4294967296", ["exceeds"]),
    ("1\x002", ["not an integer expression"]),
])
def test_the_evaluator_bounds_length_depth_and_magnitude(expr, words):
    msg = refused(header(threads=expr), "threads=", *words)
    assert len(msg) < 400     # the expression is shown shortened


@pytest.mark.parametrize("expr, refused_with", [
    ("0" * 512, None), ("0" * 513, "the expression has 513 characters, at most 512"),
    # 98 unary minuses and the literal: 100 levels with the expression's own node
    ("-" * 98 + "0", None), ("-" * 99 + "0", "nests deeper than 100 levels"),
    ("9223372036854775807-9223372036854775807", None),
    ("9223372036854775808-9223372036854775808", "a value exceeds 9223372036854775807"),
])
def test_the_evaluators_limits_sit_exactly_at_their_edges(expr, refused_with):
    if refused_with is None:
        assert uk.parse_header(header(smem=expr)).evaluate({})["smem"] == 0
    else:
        with pytest.raises(uk.HeaderError, match=re.escape(refused_with)):
            uk.parse_header(header(smem=expr)).evaluate({})


def test_division_and_remainder_are_cs_and_exact():
    h = uk.parse_header(header(smem="9007199254740993/1-9007199254740992+((0-7)%4+3)*8"
                               "+(0-7)/4+1"))
    # 2**53 + 1 survives (no float), C's -7 % 4 is -3 and -7 / 4 is -1
    assert h.evaluate({})["smem"] == 1 + 0 * 8 + (-1) + 1
    assert uk.parse_header(header(smem="100-(0-7)//4")).evaluate({})["smem"] == 102


# ---- names --------------------------------------------------------------------------------

# what a compile would reject, refused as `entry` and as `new`'s NAME alike
@pytest.mark.parametrize("name, why", [
    ("wärp", "ASCII letters, digits and _"),
    ("int", "is a C/C++ keyword"),
    ("__global__", "is reserved to the compiler"),
    ("_Kernel", "is reserved to the compiler"),
    ("threadIdx", "is a name CUDA declares"),
    ("main", "is the program's entry point"),
    ("MLA_SMEM_NEEDS", "the sandbox's -D macros start with MLA_"),
])
def test_entry_and_name_refuse_what_a_compile_would_reject(tmp_path, name, why):
    refused(header(entry=name), f"entry={name}", why)
    new_refuses(tmp_path, name, f"NAME {name!r}", why)


def new_refuses(tmp_path, name, *words):
    res = cli("new", tmp_path / name)
    assert res.exit_code == 2, res.output
    assert "NAME" in res.output and "Traceback" not in res.output
    for w in words:
        assert w in " ".join(res.output.split()), (w, res.output)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("entry, words", [("ns::attn<ä>", "ASCII"),
                                          ("ns::__global__", "__global__ is reserved"),
                                          ("int::attn", "int is a C/C++ keyword"),
                                          ("__x::attn", "__x is reserved to the compiler"),
                                          ("ns::int::attn", "int is a C/C++ keyword")])
def test_every_part_of_a_qualified_entry_is_checked(entry, words):
    refused(header(entry=entry), words)


@pytest.mark.parametrize("name, words", [
    ("a" * (MAX_NAME + 1), [f"{MAX_NAME + 1} characters", f"at most {MAX_NAME}"]),
    ("mla", ["'mla'", "namespace or a macro"]),
    ("mla_user", ["namespace or a macro"]),
    ("mlasandbox_contract", ["namespace or a macro"]),
])
def test_new_refuses_a_long_name_or_one_the_copy_declares(tmp_path, name, words):
    new_refuses(tmp_path, name, *words)


def test_entry_may_name_types_in_its_template_arguments():
    h = uk.parse_header(header(entry="::ns::attn<HPB, int, MLA_Q_T>"))
    assert h.fields["entry"] == "::ns::attn<HPB, int, MLA_Q_T>"


def test_a_parameter_name_is_no_keyword():
    refused(header() + "// mlasandbox: params int=1\n", "params: int is a C/C++ keyword")


def test_try_refuses_a_non_ascii_entry_before_compiling(tmp_path):
    p = tmp_path / "uni.cu"
    p.write_text(CORRECT.read_text().replace("entry=warp_rows", "entry=wärp", 1))
    res = cli("try", p, "--no-time")
    assert res.exit_code == 2 and "entry=wärp" in res.output, res.output


def test_new_takes_the_longest_name():
    assert new_kernel_source("a" * MAX_NAME).count("a" * MAX_NAME) >= 3


def test_an_entry_named_like_a_contract_helper_compiles(tmp_path):
    """The contract's checks refer to the entry from the global scope, so a kernel named
    like one of their helpers (same, sig, arg) is the user's."""
    path = tmp_path / "same.cu"
    assert cli("new", path).exit_code == 0
    res = cli("try", path, "--no-time")
    assert res.exit_code == 0, res.output


def test_an_entry_named_like_a_cuda_function_gets_a_hint(tmp_path):
    p = tmp_path / "pf.cu"
    p.write_text(CORRECT.read_text().replace("warp_rows", "printf"))
    with pytest.raises(uk.UserCompileError, match="rename the entry"):
        uk.compile_report(uk.load_kernel(str(p)))


# ---- the file -----------------------------------------------------------------------------

def test_a_byte_order_mark_is_ignored(tmp_path):
    p = tmp_path / "bom.cu"
    p.write_bytes(b"\xef\xbb\xbf" + CORRECT.read_bytes())
    k = uk.load_kernel(str(p))
    assert k.params == {"ROWS": 4} and not k.text.startswith("\ufeff")
    assert uk.parse_header("\ufeff" + header()).fields["entry"] == "k"
    res = cli("try", p, "--no-time")
    assert res.exit_code == 0, res.output


def test_an_include_with_a_byte_order_mark_or_not_utf8(tmp_path):
    (tmp_path / "inc.cuh").write_bytes(b"\xef\xbb\xbfint x;\n")
    src = uk.expanded_source('#include "inc.cuh"\n', "k.cu", tmp_path)
    assert "\ufeff" not in src and "int x;" in src
    (tmp_path / "inc.cuh").write_bytes(b"int \xff;\n")
    with pytest.raises(ValueError, match="included file .*inc.cuh.* not UTF-8 text"):
        uk.expanded_source('#include "inc.cuh"\n', "k.cu", tmp_path)


def _unblock(fifo, wait_s: float = 3.0):
    time.sleep(wait_s)
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:      # no reader: nothing blocks
        pass


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this OS")
def test_a_fifo_or_device_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "k.cu"
    os.mkfifo(fifo)
    # refused before a read that would block; should it read, a writer ends the wait
    threading.Thread(target=_unblock, args=(fifo,), daemon=True).start()
    with pytest.raises(ValueError, match=r"k\.cu' is a FIFO \(named pipe\), not a regular file"):
        uk.load_kernel(str(fifo))
    with pytest.raises(ValueError, match=r"is a character device, not a regular file"):
        uk.UserKernel(os.devnull)
    with pytest.raises(ValueError, match="no such file"):
        uk.load_kernel(str(tmp_path / "missing.cu"))
    assert cli("try", fifo).exit_code == 2


def test_docs_state_the_limits():
    doc = " ".join((Path(__file__).parents[1] / "docs" / "byok.md").read_text().split())
    for text in (f"1..{uk.MAX_TILE_ROWS}", f"1..{uk.MAX_HEADS_PER_BLOCK}",
                 f"{limits.MAX_CTX:,}", f"-{uk.MAX_PARAM}..{uk.MAX_PARAM}",
                 f"at most {uk.MAX_EXPR_CHARS} characters", f"{uk.MAX_EXPR_DEPTH} levels",
                 f"at most {MAX_NAME} characters", "byte-order mark"):
        assert text in doc, text
    assert re.search(r"`/` and `%` being C's", doc)



def test_a_header_declaring_more_parameter_sets_than_one_run_compiles_is_refused():
    eight = ",".join(str(v) for v in range(1, 9))
    ok = uk.parse_header(header() + f"// mlasandbox: params A={eight} B={eight}\n")
    assert len(ok.param_sets()) == 64 == uk.MAX_PARAM_SETS
    big = uk.parse_header(header() + f"// mlasandbox: params A={eight} B={eight},9\n")
    with pytest.raises(uk.HeaderError, match=r"params: A 8 x B 9 = 72 parameter sets, at most 64"):
        big.param_sets()
    assert len(big.param_sets({"B": (1,)})) == 8   # narrowed by --params
