"""The options every command shares, parsed one way: lists, contexts, arch, variants, --json,
output files, and the exit codes of bad input (2) and failure (1).

Every value is checked when click parses it, so a bad input exits 2 before any work.
"""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mlasandbox import archs, limits, occupancy, registry
from mlasandbox.dims import PRESETS
from mlasandbox.paged_api import MAX_GRID_Z

from .render import console_width, emit_json, jsonable

__all__ = ["int_list", "str_list", "auto_or_int", "blocks_per_sm", "OutputFile", "json_option",
           "write_json", "deliver_json", "MAX_RUNS", "MAX_AA_ROUNDS", "MAX_SEEDS",
           "MAX_CONTEXTS", "bad_input",
           "JsonAwareException", "stderr_console", "progress_bar",
           "ctx_option", "heads_option", "hpb_list", "output_option", "output_problem",
           "non_empty_path", "refuse_overwrites", "lengths_file", "seed_option", "SEED",
           "FiniteFloatRange", "given_options", "sms_option",
           "arch_option", "timing_options", "preset_option", "q_option", "variants_option",
           "splits_option", "cache_option", "DEFAULT_PRESET", "Q_CHOICES", "q_of",
           "paged_options", "peers_option"]

DEFAULT_PRESET = "h96"
Q_CHOICES = ("f32", "cache")


def int_list(ctx, param, value):
    if value is None:
        return None
    if not str(value).strip():
        raise click.BadParameter("give at least one value")
    out = []
    for part in str(value).split(","):
        part = part.strip()
        if not part:
            raise click.BadParameter(f"{str(value)!r:.40} has an empty item: integers "
                                     "separated by single commas")
        try:
            out.append(int(part))
        except ValueError:  # also past Python's 4,300 digits: not a usable integer either
            raise click.BadParameter(f"{part!r:.40} is not an integer") from None
    return tuple(out)


def str_list(choices, user_kernels: bool = False):
    """A comma-separated list among `choices` (and, with user_kernels, FILE.cu[:NAME=V]),
    each value once, in the order given."""
    def cb(ctx, param, value):
        if value is None:
            return None
        out = tuple(dict.fromkeys(p.strip() for p in str(value).split(",") if p.strip()))
        if not out:
            raise click.BadParameter(f"give at least one value, among {', '.join(choices)}")
        bad = [p for p in out if p not in choices
               and not (user_kernels and p.split(":", 1)[0].endswith(".cu"))]
        if user_kernels and any("=" in p for p in bad):
            # FILE.cu:A=1,B=2 splits at the comma into FILE.cu:A=1 and a variant "B=2"
            raise click.BadParameter(
                f"{', '.join(bad)} is not a variant: a user kernel's parameters follow its "
                "file, colon-separated (FILE.cu:NAME=V:NAME=V); to time several values, "
                "name the file once per value (FILE.cu:NAME=4,FILE.cu:NAME=8)")
        if bad:
            raise click.BadParameter(f"{', '.join(bad)} not among {', '.join(choices)}")
        return out
    return cb


def auto_or_int(ctx, param, value):
    """'auto' or an integer >= 1 (blocks per SM)."""
    if value in (None, "auto"):
        return "auto"
    try:
        v = int(value)
    except ValueError:
        raise click.BadParameter(f"must be 'auto' or an integer >= 1, got {value!r}") from None
    if v < 1:
        raise click.BadParameter(f"must be 'auto' or an integer >= 1, got {v}")
    return v


def blocks_per_sm(ctx, param, value):
    """'auto' or an integer from 1 to the most blocks any known arch keeps resident on an SM
    (occupancy.ARCHS): a larger count would plan waves no device runs."""
    v = auto_or_int(ctx, param, value)
    most = max(a.max_blocks_per_sm for a in occupancy.ARCHS.values())
    if v != "auto" and v > most:
        raise click.BadParameter(f"must be 'auto' or an integer from 1 to {most} (the most "
                                 f"blocks an SM keeps resident on any known arch), got {v}")
    return v


def _splits(value):
    v = auto_or_int(None, None, value)
    if v != "auto":
        try:
            limits.check_problem(splits=v)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    return v


# A measurement's run counts stop where `try --repeats` does: 100,000 runs of a step are
# seconds to minutes of GPU time, so a larger count is a typo, not a plan. The A/A rounds
# each time every phase twice; 1,000 of them is an hour-long bench.
MAX_RUNS = 100_000
MAX_AA_ROUNDS = 1_000
# A float64 study of one seed and context is seconds at 131072 positions: `check --seeds`
# and a context list stop where a run would take a day.
MAX_SEEDS = 1_000
MAX_CONTEXTS = 256

# numpy's generators take any integer >= 0 and raise at the first draw for a negative one,
# after the work began (or in a written repro script); the int64 cap keeps a seed one
# machine integer wherever it is stored or passed on (JSON results, scripts, child argv).
MAX_SEED = 2**63 - 1
SEED = click.IntRange(0, MAX_SEED)


def seed_option(default=0, help="Seed of the inputs."):
    """`--seed`: an integer in 0..2**63-1, checked when parsed."""
    return click.option("--seed", type=SEED, default=default,
                        show_default=default is not None, help=help)


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also refuses nan and inf (nan passes every comparison a range
    makes, and an infinite time or budget never ends)."""

    def convert(self, value, param, ctx):
        v = super().convert(value, param, ctx)
        if not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number; give one in {self._describe_range()}",
                      param, ctx)
        return v


def timing_options(target_ms: float):
    """--repeats, --min-repeats, --target-ms and --seed of the timed commands."""
    def deco(f):
        for opt in reversed((
            click.option("--repeats", type=click.IntRange(1, MAX_RUNS), default=100,
                         show_default=True, help="Most timed runs per measurement."),
            click.option("--min-repeats", type=click.IntRange(1, MAX_RUNS), default=10,
                         show_default=True,
                         help="Fewest timed runs per measurement (long phases stop here)."),
            click.option("--target-ms", type=FiniteFloatRange(min=0.1), default=target_ms,
                         show_default=True,
                         help="GPU time each measurement aims for (sets the runs between "
                              "the two)."),
            seed_option(),
        )):
            f = opt(f)
        return f
    return deco


def hpb_list(ctx, param, value):
    """Comma-separated heads-per-block values, each among the instantiated ones."""
    vals = int_list(ctx, param, value)
    for h in vals or ():
        if h not in registry.HPB_VALUES:
            raise click.BadParameter(f"heads per block must be among "
                                     f"{', '.join(map(str, registry.HPB_VALUES))} (the "
                                     f"instantiated heads_per_block values; 1 is split), "
                                     f"got {h}")
    return vals


def _ctx_list(multiple: bool):
    def cb(ctx, param, value):
        vals = int_list(ctx, param, value)
        if vals is None:
            return None
        if not multiple and len(vals) != 1:
            raise click.BadParameter(f"takes one context length, got {len(vals)}")
        if len(vals) > MAX_CONTEXTS:
            raise click.BadParameter(f"takes at most {MAX_CONTEXTS} context lengths, got "
                                     f"{len(vals):,}")
        for v in vals:
            if v < 1:
                raise click.BadParameter(f"context lengths must be >= 1, got {v}")
            try:
                limits.check_problem(n_ctx=v, names={"n_ctx": "a context length"})
            except ValueError as exc:
                raise click.BadParameter(str(exc)) from None
        return vals if multiple else vals[0]
    return cb


def ctx_option(default, multiple: bool = True, dest: str = "contexts", help: str | None = None):
    """`--ctx`: comma-separated context lengths (one where the command takes one), each in
    1..limits.MAX_CTX."""
    if help is None:
        help = ("Context lengths n_ctx, comma-separated." if multiple else
                "Context length n_ctx.")
    dflt = None if default is None else (",".join(map(str, default)) if multiple else
                                         str(default))
    return click.option("--ctx", dest, callback=_ctx_list(multiple), default=dflt,
                        show_default=dflt is not None, help=help)


def _heads(ctx, param, value):
    if value is None:
        return None
    try:
        limits.check_problem(n_head=value, names={"n_head": "heads"})
    except (ValueError, TypeError) as exc:
        raise click.BadParameter(str(exc)) from None
    return value


def heads_option(default=None, help="Query heads (overrides the preset's)."):
    return click.option("--heads", type=click.IntRange(min=1), default=default,
                        show_default=default is not None, callback=_heads, help=help)


def sms_option(default, help: str):
    """--sms: an SM count to plan for, 1..limits.MAX_SMS (more cannot change a plan)."""
    return click.option("--sms", type=click.IntRange(1, limits.MAX_SMS), default=default,
                        show_default=default is not None, help=help)


def splits_option(help="'auto' (the split rule) or a split count S (1..65535)."):
    return click.option("--splits", callback=lambda c, p, v: _splits(v), default="auto",
                        show_default=True, help=help)


def _arch(ctx, param, value):
    if value is None:
        return None
    try:
        return archs.check_arch(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def arch_option(help="Architecture to compile for without a GPU."):
    return click.option("--arch", default="sm_90", show_default=True, callback=_arch,
                        help=f"{help} One of {', '.join(archs.ARCH_NAMES)}.")


def preset_option(default=DEFAULT_PRESET):
    return click.option("--preset", type=click.Choice(sorted(PRESETS)), default=default,
                        show_default=True,
                        help="Head dims preset: 96 heads ('h96'), dsv3 128, and their "
                             "tensor-parallel shards (-tp8: 12, 16).")


def cache_option(multiple: bool = False):
    if multiple:
        return click.option("--cache", "caches", callback=str_list(("f16", "bf16")),
                            default="f16", show_default=True,
                            help="Cache dtypes, comma-separated (f16, bf16).")
    return click.option("--cache", type=click.Choice(["f16", "bf16"]), default="f16",
                        show_default=True, help="Cache dtype.")


def q_option(multiple: bool = False):
    """`--q`: f32 or the cache dtype, everywhere."""
    if multiple:
        return click.option("--q", "qs", callback=str_list(Q_CHOICES), default="f32,cache",
                            show_default=True,
                            help="q dtypes, comma-separated: f32 and/or cache (the cache "
                                 "dtype).")
    return click.option("--q", "q_dtype", type=click.Choice(Q_CHOICES), default="f32",
                        show_default=True, help="q dtype: f32, or cache (the cache dtype).")


def q_of(q_dtype: str, cache: str) -> str:
    return cache if q_dtype == "cache" else q_dtype


def variants_option(choices=None, default=None, help=None, user_kernels: bool = False,
                    auto: bool = False):
    """`--variants`: a comma-separated list of registry variants (by default every one, the
    paged-only ones included: the command that runs them refuses what it cannot serve), with
    auto, the paged step's "auto", and with user_kernels, user kernel files (docs/byok.md)."""
    choices = tuple(choices or (*registry.variant_names(), *registry.PAGED_ONLY_VARIANTS))
    choices += ("auto",) if auto else ()
    return click.option("--variants", "variants", callback=str_list(choices, user_kernels),
                        default=None if default is None else ",".join(default),
                        show_default=default is not None,
                        help=help or f"Variants, comma-separated, among {', '.join(choices)}.")


class OutputFile(click.Path):
    """A file the command will write, checked when the option is parsed: its directory
    exists and takes a new file, it is not a directory or a device. '-' is stdout where the
    option allows it."""

    name = "output file"

    def __init__(self, allow_dash: bool = False):
        super().__init__(dir_okay=False, allow_dash=allow_dash)

    def convert(self, value, param, ctx):
        if value == "-":
            if self.allow_dash:
                return value
            self.fail("'-' (stdout) is not taken here; give a file path (./- for a file "
                      "named '-')", param, ctx)
        path = os.fspath(value)
        if not path:
            self.fail("an empty path; give a file path", param, ctx)
        problem = output_problem(path)
        if problem:
            self.fail(problem, param, ctx)
        return path


def non_empty_path(ctx, param, value):
    """A click callback for a path option read later: '' is a usage error, not 'not given'."""
    if value is not None and os.fspath(value) == "":
        raise click.BadParameter("an empty path; give a file path", ctx, param)
    return value


def output_problem(path: str, directory: bool = False) -> str | None:
    """Why `path` cannot be written (a file, or a directory to create), or None. A symbolic
    link is judged by where it leads (a dangling one passes no exists() test)."""
    if os.path.islink(path):
        target = os.path.realpath(path)
        problem = output_problem(target, directory) if target != path else None
        return None if problem is None else f"{path!r} is a link to {target!r}: {problem}"
    if os.path.isdir(path):
        if not directory:
            return f"{path!r} is a directory"
        target = path
    elif os.path.exists(path):
        if directory:
            return f"{path!r} exists and is not a directory"
        if not os.path.isfile(path):
            return f"{path!r} is not a regular file (a device or a pipe); give a file path"
        try:
            with open(path, "ab"):
                pass
        except OSError as exc:
            return f"{path!r} is not writable ({exc.strerror})"
        return None
    else:
        target = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(target):
            return f"directory {target!r} does not exist"
    try:
        fd, probe = tempfile.mkstemp(dir=target, prefix=".mlasandbox-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"directory {target!r} does not take new files ({exc.strerror})"
    return None


def _file_key(path: str):
    """What identifies the file `path` names: device and inode where it exists (hard links
    and symlinks included), else its resolved path."""
    try:
        st = os.stat(path)
        return ("inode", st.st_dev, st.st_ino)
    except OSError:
        return ("path", os.path.realpath(path))


def refuse_overwrites(inputs, outputs) -> None:
    """Exit 2 (naming the output option) where an output file is one of the command's input
    files, or two outputs are one file: the second write would destroy the first file's
    contents. `inputs` and `outputs` are (option, path) pairs; None and '-' (stdout) are
    skipped, and one option's own files are not compared with each other."""
    seen: dict = {}
    for opt, path in inputs:
        if path not in (None, "-"):
            seen.setdefault(_file_key(path), ("input", opt, path))
    for opt, path in outputs:
        if path in (None, "-"):
            continue
        key = _file_key(path)
        if key in seen and seen[key][1] != opt:
            kind, other, other_path = seen[key]
            named = "" if other_path == path else f" ({other_path})"
            why = (f"{path} is the input file of {other}{named}: writing it would destroy it"
                   if kind == "input" else
                   f"{path} is also written by {other}{named}: one would overwrite the other")
            raise click.BadParameter(f"{why}; give another path", param_hint=f"'{opt}'")
        seen.setdefault(key, ("output", opt, path))


def kernel_files(opt: str, spec: str) -> list:
    """(option, path) pairs for refuse_overwrites: the user kernel of `spec` (FILE.cu or
    FILE.cu:NAME=V) and the user's files it includes, which an output must not replace
    either. Exit 2 naming `opt` where the kernel or an include cannot be read."""
    from mlasandbox.user_kernel import local_includes

    path = spec.split(":", 1)[0]
    try:
        includes = local_includes(path) if os.path.isfile(path) else []
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=f"'{opt}'") from None
    return [(opt, path), *((f"{opt} (#include)", inc) for inc in includes)]


def lengths_file(spec) -> str | None:
    """The file of a `--lengths @FILE` spec, None for the other forms."""
    return spec[1:] if isinstance(spec, str) and spec.startswith("@") else None


def output_option(*names, help: str, dest: str | None = None):
    decls = list(names) + ([dest] if dest else [])
    return click.option(*decls, type=OutputFile(), default=None, metavar="FILE", help=help)


def json_option(f):
    """`--json` alone: JSON on stdout instead of tables (every command); `--json FILE`:
    tables on stdout and the JSON written to FILE (checked before any work)."""
    return click.option("--json", "json_out", type=OutputFile(allow_dash=True), is_flag=False,
                        flag_value="-", default=None, metavar="[FILE]",
                        help="JSON on stdout instead of tables, or with FILE: write it there.")(f)


class JsonAwareException(click.ClickException):
    """A failure (exit 1) whose JSON error object carries a payload."""

    def __init__(self, message: str, payload: dict | None = None, exit_code: int = 1):
        super().__init__(message)
        self.payload = payload or {}
        self.exit_code = exit_code


class NoGpu(click.ClickException):
    """A command or option that needs a GPU, run where there is none: exit 2 with the
    reason, as bad input does (a missing device is an input the run cannot take, not a
    failed check)."""

    exit_code = 2


def require_gpu(what: str) -> str:
    """The device's description; NoGpu ("WHAT: the reason") where no CUDA device is usable."""
    from mlasandbox import toolkit

    ok, why = toolkit.device_available()
    if not ok:
        raise NoGpu(f"{what}: {why}")
    return why


def given_options(ctx, names) -> list[str]:
    """The options among the parameters `names` that the command line gave, as
    '--opt' ('--flag/--no-flag' for a switch)."""
    return ["/".join(p.opts + p.secondary_opts) for p in ctx.command.params
            if p.name in names
            and ctx.get_parameter_source(p.name) == click.core.ParameterSource.COMMANDLINE]


def bad_input(msg: str):
    """Exit 2 with `msg` (the group adds the JSON error object under --json)."""
    raise click.UsageError(msg)


def write_json(obj, path) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(jsonable(obj), f, indent=2)
            f.write("\n")
    except OSError as exc:
        raise click.ClickException(f"could not write {path}: {exc.strerror}") from None


def deliver_json(result, json_out, err: Console) -> bool:
    """Where `--json` sends a finished result: to FILE (saying so on `err`), or to stdout
    instead of the tables. True when it went to stdout (the command prints nothing else)."""
    if json_out == "-":
        emit_json(result)
        return True
    if json_out:
        write_json(result, json_out)
        err.print(f"wrote {escape(str(json_out))}")
    return False


def stderr_console() -> Console:
    """rich's own width for stderr, but for a COLUMNS too small to print in (console_width)."""
    width = console_width(sys.stderr) if "COLUMNS" in os.environ else None
    return Console(stderr=True, width=width, highlight=False, emoji=False)


def progress_bar(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}", style="bold"), BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                    transient=False)


# ---- the paged (serving batch) options of bench and repro ------------------------------------

def _batch(ctx, param, value):
    if value is None:
        return None
    if value > MAX_GRID_Z:
        raise click.BadParameter(f"the batch is the grid's z dimension: at most {MAX_GRID_Z}, "
                                 f"got {value}")
    return value


def paged_options(serving_choices=None, serving_help: str = ""):
    """--batch, --lengths, --page-size, --s-q, --causal (and --serving where presets are
    given): one serving step of B requests in a paged cache."""
    def deco(f):
        opts = [
            click.option("--batch", type=click.IntRange(min=1), default=None, callback=_batch,
                         help="Requests in the step: runs the paged (serving) step."),
            click.option("--lengths", "lengths_spec", default=None, metavar="SPEC",
                         help="Request lengths: N, N,N,... (cycled to the batch), "
                              "normal:MEAN:STD (drawn from the seed, clipped at 0), or @FILE "
                              "(one length per line). Default 4096."),
            click.option("--page-size", type=click.Choice(["1", "16", "64"]), default="64",
                         show_default=True, callback=lambda c, p, v: int(v),
                         help="Rows per cache page (64 is FlashMLA's)."),
            click.option("--s-q", "s_q", type=click.IntRange(min=1), default=None,
                         help="Query tokens per request (multi-token prediction). Default 1."),
            click.option("--causal/--no-causal", default=None,
                         help="Query i sees positions < len - (s_q - 1 - i). Default off."),
        ]
        if serving_choices:
            opts.append(click.option("--serving", type=click.Choice(list(serving_choices)),
                                     default=None,
                                     help="A serving shape (sets batch, lengths, heads, s_q, "
                                          "causal; explicit options override): "
                                          + serving_help))
        for opt in reversed(opts):
            f = opt(f)
        return f
    return deco


def paged_step_config(o: dict, ctx, variants, heads=None, preset: str = "dsv3"):
    """(config, q dtype) of a command's paged options (`o`: its parameters by name; batch,
    lengths_spec, s_q, causal, page_size, serving, cache, q_dtype, splits, seed), validated
    by the paged bench's make_paged_config: click.UsageError naming the bad option. --ctx
    given with them is refused; q is the cache dtype unless --q was given (as bench --batch)."""
    from mlasandbox.bench_paged import make_paged_config

    given = lambda name: ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE
    if given("n_ctx"):
        raise click.UsageError("--ctx is the batch-1 step's context; a paged step takes "
                               "--lengths")
    q = o["q_dtype"] if given("q_dtype") else "cache"
    try:
        cfg = make_paged_config(batch=o["batch"], lengths=o["lengths_spec"], s_q=o["s_q"],
                                causal=o["causal"], page_size=o["page_size"],
                                serving=o["serving"], preset=preset, heads=heads,
                                variants=tuple(variants), cache_dtype=o["cache"], q_dtype=q,
                                splits=o["splits"], seed=o["seed"])
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    return cfg, q_of(q, o["cache"])


def refuse_paged_options(lengths_spec, s_q, causal, *, also=(),
                         needs: str = "--batch B or --serving PRESET (the paged step)") -> None:
    """--lengths, --s-q, --causal, --page-size (and the options named in `also`) without the
    paged step: click.UsageError naming them."""
    given = [f"--{n.replace('_', '-')}" for n, v in (("lengths", lengths_spec), ("s_q", s_q),
                                                      ("causal", causal)) if v is not None]
    given += given_options(click.get_current_context(), ("page_size",)) + list(also)
    if given:
        raise click.UsageError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} "
                               f"{needs}")


def peers_option(choices):
    return click.option("--peers", callback=str_list(tuple(choices)), default=None,
                        help=f"Time these implementations of the same step beside ours, "
                             f"among {', '.join(choices)} (optional extra: pip install -e "
                             "'.[peers]'; a peer that cannot load is skipped with the "
                             "reason).")
