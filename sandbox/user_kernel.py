"""A kernel the user wrote in one .cu file, checked and launched as a variant of the paged step.

    // mlasandbox: entry=my_attn threads=128 tile_rows=32 heads_per_block=HPB smem=0
    // mlasandbox: params HPB=4,8

The header (any `// mlasandbox:` line of the file itself, not of what it includes) declares
what the sandbox needs to plan, launch and check the kernel; docs/byok.md is the contract.

* `entry`: the __global__ function launched, a C++ name expression (`my_attn`,
  `ns::attn<HPB, MLA_CACHE_T, MLA_Q_T>`); parameter names and MLA_CACHE_T / MLA_Q_T in it
  are replaced by their values.
* `kind`: `attn` (default): the attention phase of the paged step, writing the partials
  (m, l, acc) the built-in combine merges, one program per chunk of the batch
  (mla_user::program_chunk places it and publishes the chunk counts); `step`: the whole step,
  a single pass (program p is request p) writing latent and lse itself (wv_b in an f32
  matmul).
* `threads`, `tile_rows` (the chunk rule's unit: chunks are whole tiles), `heads_per_block`
  (query rows per block) and `smem` (dynamic shared memory, bytes): integer expressions of
  the parameters and KV_LORA, ROPE, KEY_DIM (and, for smem, THREADS, TILE_ROWS,
  HEADS_PER_BLOCK); `/` and `%` are C's (truncated toward zero). Each has a limit derived
  from the kernels' int32 arithmetic and launch (MAX_TILE_ROWS, MAX_HEADS_PER_BLOCK below).
* `params NAME=v1,v2 ...`: compile-time parameters, passed as -D MLA_PARAM_NAME=v (and
  substituted in `entry`); the sweep runs their product, the first value of each is the
  default.

The arguments are those of PagedDecodeStep.attn_args() (contract_args() reads its source),
checked against the entry's signature by a static_assert appended to the source. The
sandbox passes every header value as a -D option (MLA_THREADS, MLA_TILE_ROWS,
MLA_HEADS_PER_BLOCK, MLA_SMEM_BYTES, MLA_CACHE_T, MLA_Q_T, MLA_PARAM_<NAME>); a kernel that uses
dynamic shared memory states its need with MLA_SMEM_NEEDS(bytes) (mla_user.cuh), a
static_assert against MLA_SMEM_BYTES and a trap at launch. Local includes resolve from the
file's folder, then this package's templates, then cuda_src/; they are inlined behind #line
directives, so NVRTC names the user's file and line in its errors.
"""
from __future__ import annotations

import ast
import itertools
import math
import os
import re
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from importlib import resources
from pathlib import Path

from . import limits, registry, toolkit
from .occupancy import arch_limits, occupancy
from .ptxas import (NvrtcCompileError, PtxasParseError, code_sizes, compile_program,
                    parse_ptxas_log)

__all__ = ["HeaderError", "UserCompileError", "Header", "parse_header", "contract_args",
           "UserKernel", "UserInstance", "load_kernel", "is_user_kernel_spec",
           "expanded_source", "compile_report", "contract_signature", "HEADER_TAG",
           "identifier_problem"]

HEADER_TAG = "// mlasandbox:"
_BOM = "\ufeff"   # a UTF-8 byte-order mark some editors write: not part of the text
FIELDS = ("entry", "kind", "threads", "tile_rows", "heads_per_block", "smem")
REQUIRED = ("entry", "threads", "tile_rows", "heads_per_block", "smem")
KINDS = ("attn", "step")
CONSTANTS = {"KV_LORA": registry.KV_LORA, "ROPE": registry.ROPE,
             "KEY_DIM": registry.KV_LORA + registry.ROPE}
RESERVED = set(CONSTANTS) | {"THREADS", "TILE_ROWS", "HEADS_PER_BLOCK", "MLA_CACHE_T",
                             "MLA_Q_T"}
CONTRACT_FILE = "<mlasandbox contract>"
CONTRACT_NAMESPACE = "mlasandbox_contract"   # the namespace of the appended checks
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ENTRY = re.compile(r"(::)?[A-Za-z_]\w*(::[A-Za-z_]\w*)*(<[^;{}()]*>)?", re.ASCII)
_FIELD = re.compile(r"(?:^|\s)([A-Za-z_]\w*)\s*=(?!=)")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*(//.*|/\*.*\*/\s*)?$')

# The largest header values, from how the kernels use them:
# tiles_of (mla_walk.cuh, mla_user.cuh) computes (len + tile_rows - 1) / tile_rows in int32
# with len up to limits.MAX_CTX, which stays below 2**31 for tile_rows up to 2**31 - MAX_CTX.
MAX_TILE_ROWS = 2**31 - limits.MAX_CTX
# A block's rows are blockIdx.x * heads_per_block + r in int32, and limits.MAX_HEADS keeps
# one head block of headroom below 2**31: that of the largest built-in block (wgmma64).
MAX_HEADS_PER_BLOCK = 2**31 - 1 - limits.MAX_HEADS
# A parameter is a -D value and a C++ int template argument.
MAX_PARAM = 2**31 - 1
# Parameter sets one command compiles (each an NVRTC compile of seconds): a product of the
# declared values past it is a typo or a sweep that should be split.
MAX_PARAM_SETS = 64

# C and C++ keywords, and the built-in variables CUDA declares in every kernel: none can name
# an entry or a parameter (which is substituted into the entry).
_KEYWORDS = frozenset("""
    alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t
    char16_t char32_t class compl concept const consteval constexpr constinit const_cast
    continue co_await co_return co_yield decltype default delete do double dynamic_cast else
    enum explicit export extern false float for friend goto if inline int long mutable
    namespace new noexcept not not_eq nullptr operator or or_eq private protected public
    register reinterpret_cast requires restrict return short signed sizeof static
    static_assert static_cast struct switch template this thread_local throw true try typedef
    typeid typename union unsigned using virtual void volatile wchar_t while xor xor_eq
""".split())
_CUDA_NAMES = frozenset(("threadIdx", "blockIdx", "blockDim", "gridDim", "warpSize"))


def identifier_problem(name: str) -> str | None:
    """Why `name` cannot be a name of the user's C++ (an entry, a parameter, `new`'s NAME),
    as a phrase to follow it; None when it can."""
    if not _IDENT.fullmatch(name):
        return ("is not a C identifier (ASCII letters, digits and _, not starting with a "
                "digit)")
    if name in _KEYWORDS:
        return "is a C/C++ keyword"
    if name in _CUDA_NAMES:
        return "is a name CUDA declares in every kernel"
    if name == "main":
        return "is the program's entry point, which cannot be a kernel"
    if name.startswith("__") or re.match(r"_[A-Z]", name):
        return "is reserved to the compiler (names starting with __, or _ and a capital)"
    if name.startswith("MLA_"):
        return "is reserved: the sandbox's -D macros start with MLA_"
    return None


class HeaderError(ValueError):
    """The header of a user kernel is missing, malformed or inconsistent (names the field)."""


class UserCompileError(RuntimeError):
    """NVRTC rejected a user kernel: `where` is (file, line) of the first error, `log` NVRTC's."""

    def __init__(self, summary: str, where=None, log: str = ""):
        super().__init__(f"{summary}\n(the whole NVRTC log follows)\n{log}")
        self.summary, self.where, self.log = summary, where, log


# ---------------------------------------------------------------------------- the header

# Header expressions are short: these bounds keep Python's parser and the evaluator's
# recursion far from their limits (a RecursionError is not a header error).
MAX_EXPR_CHARS = 512
MAX_EXPR_DEPTH = 100
# Every constant and intermediate value of an expression fits int64, so / and % stay exact
# integer arithmetic (no float) and nothing grows without bound.
MAX_EXPR_VALUE = 2**63 - 1


def _c_div(a: int, b: int) -> int:
    """C's integer division: the quotient truncated toward zero."""
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
           ast.Mult: lambda a, b: a * b, ast.Div: _c_div,
           ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a - b * _c_div(a, b)}


def _depth(tree) -> int:
    deepest, todo = 0, [(tree, 1)]
    while todo:
        node, d = todo.pop()
        deepest = max(deepest, d)
        todo.extend((child, d + 1) for child in ast.iter_child_nodes(node))
    return deepest


def _eval_int(expr: str, env: dict, field_name: str) -> int:
    """An integer expression of `env`'s names: + - * / % (C's: truncated toward zero) //
    min max, every value within +-MAX_EXPR_VALUE."""
    text = expr.strip()
    shown = text if len(text) <= 40 else f"{text[:32]}..."
    if len(text) > MAX_EXPR_CHARS:
        raise HeaderError(f"{field_name}={shown}: the expression has {len(text)} "
                          f"characters, at most {MAX_EXPR_CHARS} characters are allowed")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):   # ValueError: a NUL character
        raise HeaderError(f"{field_name}={shown}: not an integer expression") from None
    except (RecursionError, MemoryError):
        raise HeaderError(f"{field_name}={shown}: the expression nests too deeply (at most "
                          f"{MAX_EXPR_DEPTH} levels)") from None
    if _depth(tree) > MAX_EXPR_DEPTH:
        raise HeaderError(f"{field_name}={shown}: the expression nests deeper than "
                          f"{MAX_EXPR_DEPTH} levels (operators and parentheses)")

    def bounded(v: int) -> int:
        if abs(v) > MAX_EXPR_VALUE:
            raise HeaderError(f"{field_name}={shown}: a value exceeds {MAX_EXPR_VALUE} (2**63 "
                              "- 1) in magnitude")
        return v

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return bounded(node.value)
        if isinstance(node, ast.Name):
            if node.id not in env:
                known = ", ".join(sorted(env)) or "none"
                raise HeaderError(f"{field_name}={shown}: unknown name {node.id!r} (known: "
                                  f"{known})")
            return bounded(env[node.id])
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
                raise HeaderError(f"{field_name}={shown}: division by zero")
            return bounded(_BINOPS[type(node.op)](a, b))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("min", "max") and node.args and not node.keywords):
            vals = [ev(a) for a in node.args]
            return min(vals) if node.func.id == "min" else max(vals)
        raise HeaderError(f"{field_name}={shown}: only integers, names, + - * / % ( ) and "
                          "min/max are allowed")

    return ev(tree)


@dataclass(frozen=True)
class Header:
    fields: dict          # field -> its text
    params: dict          # name -> tuple of int values (declared order)
    line: int             # the first header line (1-based)

    @property
    def kind(self) -> str:
        return self.fields.get("kind", "attn")

    def param_sets(self, override: dict | None = None) -> list[dict]:
        """Every combination of the parameters' values (override: name -> values)."""
        values = dict(self.params)
        for name, vals in (override or {}).items():
            if name not in values:
                known = ", ".join(values) or "none"
                raise HeaderError(f"--params {name}: the header declares no parameter {name} "
                                  f"(declared: {known})")
            values[name] = tuple(_param_value(f"--params {name}", v) for v in vals)
        names = list(values)
        n_sets = math.prod(len(v) for v in values.values())
        if n_sets > MAX_PARAM_SETS:
            counts = " x ".join(f"{n} {len(v)}" for n, v in values.items())
            raise HeaderError(f"params: {counts} = {n_sets:,} parameter sets, at most "
                              f"{MAX_PARAM_SETS} in one run (each is a compile): narrow them "
                              f"with --params NAME=V,...")
        return [dict(zip(names, combo)) for combo in itertools.product(*values.values())]

    def default_params(self) -> dict:
        return {k: v[0] for k, v in self.params.items()}

    def evaluate(self, params: dict) -> dict:
        """threads, tile_rows, heads_per_block, smem as integers at `params`, each checked."""
        env = {**CONSTANTS, **params}
        out = {}
        for name in ("threads", "tile_rows", "heads_per_block"):
            out[name] = _eval_int(self.fields[name], env, name)
        t = out["threads"]
        if not (32 <= t <= 1024 and t % 32 == 0):
            raise HeaderError(f"threads={self.fields['threads']} is {t} at {_spell(params)}: "
                              "threads must be a multiple of 32 in 32..1024")
        for name, high, why in (
                ("tile_rows", MAX_TILE_ROWS, "the kernels count a request's tiles as (len + "
                 "tile_rows - 1) / tile_rows in int32, len up to "
                 f"{limits.MAX_CTX:,}"),
                ("heads_per_block", MAX_HEADS_PER_BLOCK, "the kernels index rows as int32 "
                 "with one head block of headroom, as large as the built-in wgmma64's")):
            if not 1 <= out[name] <= high:
                raise HeaderError(f"{name}={self.fields[name]} is {out[name]} at "
                                  f"{_spell(params)}: {name} must be in 1..{high} ({why})")
        env.update(THREADS=t, TILE_ROWS=out["tile_rows"],
                   HEADS_PER_BLOCK=out["heads_per_block"])
        out["smem"] = _eval_int(self.fields["smem"], env, "smem")
        limit = arch_limits("sm_90").smem_per_block_max
        if not 0 <= out["smem"] <= limit:
            raise HeaderError(f"smem={self.fields['smem']} is {out['smem']} B at "
                              f"{_spell(params)}: smem must be in 0..{limit} B (sm_90's "
                              "opt-in maximum per block)")
        return out


def _param_value(what: str, value) -> int:
    """A parameter's value as an int in -MAX_PARAM..MAX_PARAM (an integer or a whole float,
    never a bool, text or a fraction); HeaderError naming `what`."""
    try:
        v = limits.check_int(what, value, -MAX_PARAM)
    except ValueError as exc:
        raise HeaderError(str(exc)) from None
    if v > MAX_PARAM:
        raise HeaderError(f"{what}={value}: a parameter's value must be in -{MAX_PARAM}.."
                          f"{MAX_PARAM} (it is a -D value and a C++ int template argument)")
    return v


def _spell(params: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in params.items()) or "(no parameters)"


def _check_entry(entry: str, filename: str) -> None:
    """HeaderError unless `entry` is a C++ function name expression of ASCII identifiers, none
    of them a keyword or reserved (NVRTC would reject it only at compile)."""
    spelled = entry.replace(" ", "")
    if not spelled.isascii() or not _ENTRY.fullmatch(spelled):
        raise HeaderError(f"{filename}: entry={entry}: not a C++ function name of ASCII "
                          "letters, digits and _ (e.g. my_attn or ns::attn<HPB, MLA_CACHE_T, "
                          "MLA_Q_T>)")
    for name in spelled.split("<", 1)[0].lstrip(":").split("::"):
        problem = identifier_problem(name)
        if problem:
            raise HeaderError(f"{filename}: entry={entry}: {name} {problem}")


def parse_header(text: str, filename: str = "kernel.cu") -> Header:
    """The header of a user kernel's text; HeaderError naming the field and the line."""
    fields: dict = {}
    params: dict = {}
    first = None
    for no, raw in enumerate(text.removeprefix(_BOM).splitlines(), 1):
        line = raw.strip()
        if not line.startswith(HEADER_TAG):
            continue
        first = first or no
        body = line[len(HEADER_TAG):].strip()
        where = f"{filename}:{no}"
        if body.startswith("params"):
            for item in body[len("params"):].split():
                name, eq, vals = item.partition("=")
                if not eq or not _IDENT.fullmatch(name):
                    raise HeaderError(f"{where}: params: expected NAME=v1,v2,..., got {item!r}")
                if name in RESERVED:
                    raise HeaderError(f"{where}: params: {name} is reserved (the sandbox "
                                      "defines it); choose another name")
                problem = identifier_problem(name)   # MLA_ names included
                if problem:
                    raise HeaderError(f"{where}: params: {name} {problem}; choose another name")
                if name in params:
                    raise HeaderError(f"{where}: params: {name} is declared twice")
                try:
                    ints = [int(v) for v in vals.split(",")]
                except ValueError:
                    raise HeaderError(f"{where}: params: {name}={vals}: the values must be "
                                      "integers, comma-separated") from None
                values = tuple(_param_value(f"{where}: params: {name}", v) for v in ints)
                if len(set(values)) != len(values):
                    raise HeaderError(f"{where}: params: {name}={vals} repeats a value")
                params[name] = values
            continue
        matches = list(_FIELD.finditer(body))
        if not matches or body[:matches[0].start()].strip():
            raise HeaderError(f"{where}: expected key=value fields ({', '.join(FIELDS)}) or "
                              f"`params NAME=v1,v2`, got {body!r}")
        for i, m in enumerate(matches):
            key = m.group(1)
            end = matches[i + 1].start() if i + 1 < len(matches) else len(body)
            value = body[m.end():end].strip()
            if key not in FIELDS:
                raise HeaderError(f"{where}: unknown field {key!r}; the fields are "
                                  f"{', '.join(FIELDS)} (and a `params` line)")
            if key in fields:
                raise HeaderError(f"{where}: field {key} is given twice")
            if not value:
                raise HeaderError(f"{where}: field {key} has no value")
            fields[key] = value
    if first is None:
        raise HeaderError(f"{filename}: no `{HEADER_TAG}` header line; a user kernel starts "
                          f"with e.g. `{HEADER_TAG} entry=my_attn threads=128 tile_rows=32 "
                          "heads_per_block=4 smem=0` (docs/byok.md)")
    missing = [f for f in REQUIRED if f not in fields]
    if missing:
        raise HeaderError(f"{filename}: the header lacks {', '.join(missing)} (required: "
                          f"{', '.join(REQUIRED)})")
    if fields.get("kind", "attn") not in KINDS:
        raise HeaderError(f"{filename}: kind={fields['kind']}: kind must be one of "
                          f"{', '.join(KINDS)}")
    _check_entry(fields["entry"], filename)
    header = Header(fields, params, first)
    header.evaluate(header.default_params())   # every field is checked once here
    return header


# ---------------------------------------------------------------------------- the contract

@dataclass(frozen=True)
class Arg:
    name: str
    ctype: str


# The C types of the contract's pointer arguments, by the name attn_args() reads them from.
_POINTER_TYPES = {"q": "const MLA_Q_T*", "kv_cache": "const MLA_CACHE_T*",
                  "block_table": "const int*", "cache_seqlens": "const int*",
                  "part_acc": "float*", "part_m": "float*", "part_l": "float*",
                  "chunk_counts": "int*", "latent": "float*", "lse": "float*"}
_SCALAR_NAMES = {"scale": "scale_log2"}   # attn_args passes scale * log2(e)


def _leaf(node) -> str | None:
    """The attribute a contract argument is read from: `self.q` -> q, `sh.n_head` -> n_head,
    `self.scale * _LOG2E` -> scale."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name):
            return sub.attr
    return None


@lru_cache(maxsize=None)
def contract_args(kind: str = "attn") -> tuple:
    """The entry's arguments, (name, C type) in order: the tuple PagedDecodeStep.attn_args()
    returns, read from paged_api.py's source (parsed, not imported: paged_api loads user
    kernels). The same list for both kinds: it ends with latent and lse, which a whole-step
    kernel writes."""
    tree = ast.parse(Path(__file__).with_name("paged_api.py").read_text(encoding="utf-8"))
    fn = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
               and n.name == "attn_args"), None)
    ret = next((n.value for n in ast.walk(fn) if isinstance(n, ast.Return)), None) if fn else None
    if not isinstance(ret, ast.Tuple):
        raise RuntimeError("paged_api.PagedDecodeStep.attn_args no longer returns a tuple "
                           "literal: update user_kernel.contract_args")
    out = []
    for elt in ret.elts:
        if (isinstance(elt, ast.Call) and isinstance(elt.func, ast.Attribute)
                and elt.func.attr in ("int32", "float32")):
            name = _leaf(elt.args[0]) if elt.args else None
            ctype = "float" if elt.func.attr == "float32" else "int"
            out.append(Arg(_SCALAR_NAMES.get(name, name), ctype))
        elif isinstance(elt, ast.Attribute) and elt.attr in _POINTER_TYPES:
            out.append(Arg(elt.attr, _POINTER_TYPES[elt.attr]))
        else:
            raise RuntimeError(f"PagedDecodeStep.attn_args() passes {ast.unparse(elt)}, whose "
                               "C type sandbox/user_kernel.py does not know: add it to "
                               "_POINTER_TYPES")
        if out[-1].name is None:
            raise RuntimeError(f"cannot name the argument {ast.unparse(elt)} of attn_args()")
    return tuple(out)


def contract_signature(kind: str = "attn", indent: str = "") -> str:
    """The entry's parameter list as C++ (what `mlasandbox new` writes)."""
    args = contract_args(kind)
    return (",\n" + indent).join(f"{a.ctype} {a.name}" for a in args)


def _contract_check(entry: str, kind: str) -> str:
    """C++ appended to the source: static_asserts of the entry's signature, one per argument."""
    args = contract_args(kind)
    lines = [
        f'#line 1 "{CONTRACT_FILE}"',
        f"namespace {CONTRACT_NAMESPACE} {{",
        "template <class A, class B> struct same { static constexpr bool value = false; };",
        "template <class A> struct same<A, A> { static constexpr bool value = true; };",
        "template <int I, class... A> struct arg { using type = void; };",
        "template <int I, class H, class... T> struct arg<I, H, T...> "
        "{ using type = typename arg<I - 1, T...>::type; };",
        "template <class H, class... T> struct arg<0, H, T...> { using type = H; };",
        "template <class F> struct sig { static constexpr int n = -1; };",
        "template <class... A> struct sig<void (*)(A...)> {",
        "    static constexpr int n = sizeof...(A);",
        "    template <int I> using at = typename arg<I, A...>::type; };",
        # qualified from the global scope: an entry named like a helper above stays the user's
        f"using entry = sig<decltype(&{'' if entry.startswith('::') else '::'}{entry})>;",
        f'static_assert(entry::n == {len(args)}, "mlasandbox: the entry must be a __global__ '
        f'void function of the {len(args)} arguments of the paged {kind} contract '
        '(docs/byok.md)");',
    ]
    for i, a in enumerate(args):
        lines.append(f'static_assert(entry::n != {len(args)} || same<entry::at<{i}>, '
                     f'{a.ctype}>::value, "mlasandbox: argument {i + 1} of the entry must be '
                     f'{a.ctype} {a.name}");')
    lines.append(f"}}  // namespace {CONTRACT_NAMESPACE}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- the source

def _resource_dirs():
    return (resources.files("mlasandbox.templates"), resources.files("mlasandbox.cuda_src"))


def _find_include(name: str, base: Path):
    """(text, shown, local) of `#include "name"` from the folder `base`: the user's file
    there (`local`), else the package's header of that name; (None, None, False) where
    neither exists (NVRTC then reports the line)."""
    node = base / name
    if node.is_file():
        return limits.read_input_text(node, "included file"), str(node), True
    node = next((n for n in (root.joinpath(name) for root in _resource_dirs())
                 if n.is_file()), None)
    if node is None:
        return None, None, False
    try:
        return node.read_text(encoding="utf-8-sig"), name, False
    except UnicodeDecodeError:
        raise ValueError(f"included file {name}: not UTF-8 text") from None


def local_includes(path) -> list:
    """The user's files that the kernel file `path` includes, directly or through another
    include, each once: the files a command must not overwrite along with the kernel
    (headers the package ships are not the user's). ValueError as expanded_source."""
    found: list = []
    text = limits.read_input_text(path, "user kernel")
    expanded_source(text, str(path), Path(path).parent, found)
    return found


def expanded_source(text: str, filename: str, base: Path | None = None,
                    local: list | None = None) -> str:
    """`text` with its local includes inlined (each once), behind #line directives so that
    NVRTC's messages name the file and line they came from; the user's included files (not
    the package's headers) are appended to `local` where it is given."""
    base = Path(base or ".")
    seen: set = set()

    def expand(src: str, shown: str, folder: Path) -> str:
        out = [f'#line 1 "{shown}"']
        for no, line in enumerate(src.splitlines(), 1):
            m = _INCLUDE.match(line)
            if not m:
                out.append(line)
                continue
            body, where, is_local = _find_include(m.group(1), folder)
            if body is None:
                out.append(line)     # NVRTC reports it, at this line
                continue
            key = os.path.normpath(where)
            if key not in seen:
                seen.add(key)
                if is_local and local is not None:
                    local.append(where)
                sub = Path(where).parent if os.path.isabs(where) or os.sep in where else folder
                out.append(expand(body, where, sub))
            out.append(f'#line {no + 1} "{shown}"')
        return "\n".join(out)

    return expand(text, filename, base) + "\n"


_ERROR = re.compile(r'^(.*?)\((\d+)\): (error|catastrophic error)\b:?\s*(.*)$')


def _first_error(log: str):
    for line in log.splitlines():
        m = _ERROR.match(line.strip())
        if m:
            return m.group(1), int(m.group(2)), m.group(4)
    return None


def _compile_error(exc: NvrtcCompileError, kernel: "UserKernel", params: dict) -> UserCompileError:
    log = str(exc)
    first = _first_error(log)
    if first is None:
        return UserCompileError(f"{kernel.path}: NVRTC failed at {_spell(params)}", None, log)
    fname, line, msg = first
    text = ""
    if os.path.normpath(fname) == os.path.normpath(str(kernel.path)):
        lines = kernel.text.splitlines()
        if 0 < line <= len(lines):
            text = f"\n    {line} | {lines[line - 1].strip()}"
    hint = ""
    if fname == CONTRACT_FILE and "overloaded function" in msg:
        hint = (f"\n  the entry {kernel.header.fields['entry']} has the name of a function CUDA "
                "or an include declares (printf, sinf, ...): rename the entry")
    if "dynamic shared memory than the header" in msg:
        dec = kernel.header.evaluate(params)["smem"]
        hint = (f"\n  the header declares smem={kernel.header.fields['smem']} = {dec} B at "
                f"{_spell(params)}: declare at least what MLA_SMEM_NEEDS states")
    return UserCompileError(f"{fname}:{line}: error: {msg}{text}{hint}\n  (at "
                            f"{_spell(params)})", (fname, line), log)


# ---------------------------------------------------------------------------- the variant

CXX = registry.CXX_TYPES


@dataclass(frozen=True)
class UserInstance:
    """One compile of a user kernel: its parameters and dtypes; the launch facts follow from
    the header. Duck-types the registry's KernelInstance where the paged step uses one."""

    kernel: "UserKernel" = field(compare=False, repr=False)
    params: tuple            # ((name, value), ...)
    cache: str
    q: str
    key: str = ""            # the kernel's identity (path and text hash), for equality

    @cached_property
    def facts(self) -> dict:
        """The header's values at these parameters, evaluated once: threads and shared
        memory are read at every launch."""
        return self.kernel.header.evaluate(dict(self.params))

    @property
    def heads(self) -> int:
        return self.facts["heads_per_block"]

    @property
    def threads(self) -> int:
        return self.facts["threads"]

    @property
    def tile_rows(self) -> int:
        return self.facts["tile_rows"]

    @property
    def smem_bytes(self) -> int:
        return self.facts["smem"]

    @property
    def min_arch(self) -> str:
        return "sm_80"

    @property
    def name(self) -> str:
        items = [f"{k}={v}" for k, v in self.params] + [f"cache={self.cache}", f"q={self.q}"]
        return f"{self.kernel.stem}<{','.join(items)}>"

    @property
    def expression(self) -> str:
        expr = self.kernel.header.fields["entry"]
        subs = {**{k: str(v) for k, v in self.params}, "MLA_CACHE_T": CXX[self.cache],
                "MLA_Q_T": CXX[self.q]}
        return re.sub(r"\b[A-Za-z_]\w*\b", lambda m: subs.get(m.group(0), m.group(0)), expr)

    @property
    def source(self) -> str:
        """The file's name (where the registry's instances name their cuda_src/ file)."""
        return self.kernel.path.name

    @property
    def defines(self) -> tuple:
        f = self.facts
        return (f"MLA_CACHE_T={CXX[self.cache]}", f"MLA_Q_T={CXX[self.q]}",
                f"MLA_THREADS={f['threads']}", f"MLA_TILE_ROWS={f['tile_rows']}",
                f"MLA_HEADS_PER_BLOCK={f['heads_per_block']}", f"MLA_SMEM_BYTES={f['smem']}",
                *(f"MLA_PARAM_{k}={v}" for k, v in self.params))

    def source_text(self) -> str:
        """What NVRTC compiles: the file, its includes inlined, the contract's checks."""
        return self.kernel.full_source(self.expression)

    def __str__(self) -> str:
        return self.name


class UserKernel:
    """A user kernel file as a variant of the paged step (`decode_paged(variant=k)`,
    `bench --variants split,my.cu`). `params` fixes the parameter values (default: the
    first declared value of each)."""

    family = "user"
    splits = True
    is_cuda = True

    def __init__(self, path, params: dict | None = None, text: str | None = None):
        self.path = Path(path)
        if text is None:   # a regular UTF-8 file only: reading a FIFO would block
            text = limits.read_input_text(self.path, "user kernel")
        self.text = text.removeprefix(_BOM)
        self.header = parse_header(self.text, str(self.path))
        fixed = self.header.default_params()
        for k, v in (params or {}).items():
            if k not in fixed:
                raise HeaderError(f"{self.path}: no parameter {k} in the header (declared: "
                                  f"{', '.join(fixed) or 'none'})")
            fixed[k] = _param_value(f"{self.path}: {k}", v)
        self.params = fixed
        self.header.evaluate(fixed)
        self.kind = self.header.kind
        self._kernels: dict = {}
        self._check_smem_statement()

    # ---- what a Variant has
    @property
    def stem(self) -> str:
        return self.path.stem

    @property
    def name(self) -> str:
        p = "".join(f":{k}={v}" for k, v in self.params.items())
        return f"{self.path}{p}"

    @property
    def hpb(self) -> int:
        return self.header.evaluate(self.params)["heads_per_block"]

    @property
    def about(self) -> str:
        return f"user kernel {self.path} ({self.kind} phase)"

    def with_params(self, params: dict) -> "UserKernel":
        return UserKernel(self.path, params, self.text)

    # ---- the source
    def _check_smem_statement(self) -> None:
        own = re.sub(r"//[^\n]*|/\*.*?\*/", "", self.text, flags=re.S)
        if re.search(r"\bextern\s+__shared__", own) and "MLA_SMEM_NEEDS" not in own:
            raise HeaderError(f"{self.path}: the kernel uses dynamic shared memory (extern "
                              "__shared__) but never states how much: call "
                              "MLA_SMEM_NEEDS(bytes) in it (#include \"mla_user.cuh\"), so a "
                              "header smem= that declares too little fails at compile")

    def full_source(self, expression: str) -> str:
        body = expanded_source(self.text, str(self.path), self.path.parent)
        return body + _contract_check(expression, self.kind)

    def instance(self, cache: str = "f16", q: str = "f32") -> UserInstance:
        if cache not in ("f16", "bf16") or q not in ("f32", cache):
            raise ValueError(f"a user kernel takes cache f16/bf16 and q f32 or the cache "
                             f"dtype, got cache={cache}, q={q}")
        return UserInstance(self, tuple(self.params.items()), cache, q,
                            key=f"{self.path}:{hash(self.text)}")

    # ---- the device (CuPy)
    def kernel(self, inst: UserInstance):
        """The cupy.RawKernel of `inst` on the current device, compiled once."""
        import cupy
        from cupy.cuda.compiler import CompileException

        from .kernels import device_info

        dev = cupy.cuda.Device().id
        key = (dev, inst.name)
        k = self._kernels.get(key)
        if k is not None:
            return k
        info = device_info(dev)
        if inst.smem_bytes > info.smem_per_block_optin:
            raise ValueError(f"{inst.name} declares smem={inst.smem_bytes} B; {info.name} "
                             f"allows at most {info.smem_per_block_optin} B per block")
        opts = tuple(o for o in toolkit.compile_options(info.arch)
                     if not o.startswith(("--gpu-architecture", "-arch")))
        opts += tuple(f"-D{d}" for d in inst.defines)
        try:
            module = cupy.RawModule(code=inst.source_text(), options=opts,
                                    name_expressions=[inst.expression])
            k = module.get_function(inst.expression)
        except CompileException as exc:
            raise _compile_error(NvrtcCompileError(str(exc)), self, dict(inst.params)) from None
        if inst.smem_bytes > 48 * 1024:
            k.max_dynamic_shared_size_bytes = inst.smem_bytes
        if inst.smem_bytes:
            k.preferred_shared_memory_carveout = 100
        self._kernels[key] = k
        return k

    def blocks_per_sm(self, inst: UserInstance) -> int:
        from cupy_backends.cuda.api import driver

        k = self.kernel(inst)
        return int(driver.occupancyMaxActiveBlocksPerMultiprocessor(
            k.kernel.ptr, inst.threads, inst.smem_bytes))

    @staticmethod
    def project(wv_b, latent, out) -> None:
        """out = wv_b @ latent for a whole-step kernel, in f32 (wv_b widened; bf16 as uint16
        words): the f32 latent is not rounded, so out is held to the combine's tolerance."""
        import cupy

        from .bf16 import bf16_bits_to_f32

        w = bf16_bits_to_f32(wv_b) if wv_b.dtype == cupy.uint16 else wv_b.astype(cupy.float32)
        out[...] = cupy.matmul(w, latent[..., None])[..., 0]

    def __repr__(self) -> str:
        return f"UserKernel({self.name!r})"


def is_user_kernel_spec(name) -> bool:
    """Whether a variant name is a user kernel: PATH.cu, optionally :NAME=V:NAME=V."""
    return isinstance(name, str) and name.split(":", 1)[0].endswith(".cu")


@lru_cache(maxsize=64)
def _load(path: str, params: tuple, mtime: float) -> UserKernel:
    return UserKernel(path, dict(params))


def load_kernel(spec, **params) -> UserKernel:
    """A user kernel as a variant: `load_kernel("my.cu")`, `load_kernel("my.cu", HPB=12)` or
    `load_kernel("my.cu:HPB=12")`. HeaderError (a ValueError) for a bad header, a missing
    file is a ValueError naming it."""
    if isinstance(spec, UserKernel):
        return spec.with_params(params) if params else spec
    path, *items = str(spec).split(":")
    for item in items:
        k, eq, v = item.partition("=")
        if not eq:
            raise ValueError(f"{spec}: expected PATH.cu:NAME=VALUE, got {item!r}")
        try:
            params.setdefault(k, int(v))
        except ValueError:
            raise ValueError(f"{spec}: {k}={v}: the value must be an integer") from None
    if not path.endswith(".cu"):
        raise ValueError(f"a user kernel is a .cu file, got {path!r}")
    if not os.path.exists(path):
        raise ValueError(f"user kernel {path}: no such file")
    return _load(path, tuple(sorted(params.items())), os.path.getmtime(path))


# ---------------------------------------------------------------------------- compile report

@dataclass(frozen=True)
class CompileRow:
    params: dict
    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    static_smem: int
    dynamic_smem: int
    threads: int
    blocks_per_sm: int
    limiter: str
    code_bytes: int                 # the kernel's machine code (its .text in the cubin)
    occupancy_step: bool = False    # blocks/SM differs from the previous row's

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def compile_report(kernel: UserKernel, *, params_override: dict | None = None,
                   arch: str = "sm_90", cache: str = "f16", q: str = "f32") -> list[CompileRow]:
    """Registers, spills, shared memory, machine-code size and theoretical blocks/SM per
    parameter set, from a real NVRTC compile with -Xptxas -v (no GPU needed).
    UserCompileError on an NVRTC error (the user's file and line first)."""
    rows: list[CompileRow] = []
    for params in kernel.header.param_sets(params_override):
        k = kernel.with_params(params) if params != kernel.params else kernel
        inst = k.instance(cache, q)
        try:
            compiled = compile_program(inst.source_text(), [inst.expression], arch=arch,
                                       extra_options=tuple(f"-D{d}" for d in inst.defines),
                                       filename=str(kernel.path))
        except NvrtcCompileError as exc:
            raise _compile_error(exc, kernel, params) from None
        mangled = compiled.lowered[inst.expression]
        rec = parse_ptxas_log(compiled.log).get(mangled)
        if rec is None:
            raise PtxasParseError(f"the ptxas log of {kernel.path} has no entry for "
                                  f"{inst.expression}")
        code = code_sizes(compiled, [mangled], arch=arch, filename=str(kernel.path))[mangled]
        occ = occupancy(arch, rec["registers"], inst.threads, rec["smem_bytes"] + inst.smem_bytes)
        step = bool(rows) and rows[-1].blocks_per_sm != occ.blocks_per_sm
        rows.append(CompileRow(params, inst.name, rec["registers"], rec["spill_stores"],
                               rec["spill_loads"], rec["smem_bytes"], inst.smem_bytes,
                               inst.threads, occ.blocks_per_sm, occ.limiter, code_bytes=code,
                               occupancy_step=step))
    return rows
