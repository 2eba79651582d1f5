"""Files the tools read by path: `--lengths @FILE`, `bench --vs`, `stalls --from`.

Each is read only where it is a regular file, and at most a capped number of bytes: /dev/zero
(st_size 0, endless) and a FIFO (a read that waits for a writer) are refused by name. A
reader that regressed would exhaust memory or hang, so those cases run where a regression
fails instead: in a child interpreter with an address-space cap and a time limit, or (the
commands, in this process) in a thread whose FIFO is opened for writing on a timeout.
"""
from __future__ import annotations

import copy
import gzip
import json
import os
import random
import subprocess
import sys
import threading

import pytest
from click.testing import CliRunner

from lab_fakes import FakeBackend
from mlasandbox import baseline, limits, stalls
from mlasandbox.baseline import SchemaError, compare_runs, load_result
from mlasandbox.clocks import NO_CLOCKS
from mlasandbox.bench import run_bench
from mlasandbox.cli.main import main
from mlasandbox.paged_inputs import parse_lengths

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this OS")
needs_dev_zero = pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")


@pytest.fixture
def fifo(tmp_path):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this OS")
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return str(path)


def _child(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter under a 3 GiB address-space cap (a read of /dev/zero to
    its end fails with MemoryError) and a time limit (a read that waits on a FIFO is
    killed, raising subprocess.TimeoutExpired)."""
    cap = "import resource\nresource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
    if sys.platform != "linux":
        cap = ""
    return subprocess.run([sys.executable, "-c", cap + code], capture_output=True, text=True,
                          timeout=timeout)


def _invoke(args, fifo: str | None = None, seconds: float = 60):
    """CliRunner's result of `args`, failing (not hanging) where the command waits on `fifo`:
    on the timeout the FIFO is opened for writing and closed, so the waiting read sees its
    end and the thread ends."""
    out = {}
    t = threading.Thread(target=lambda: out.update(res=CliRunner().invoke(main, args)),
                         daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        if fifo:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
            t.join(seconds)
        pytest.fail(f"{' '.join(args)} still ran after {seconds} s: it waits on the FIFO")
    return out["res"]


def words(res) -> str:
    return " ".join(res.stderr.split())


# ---------------------------------------------------------------------------- the helper

def test_a_regular_file_is_read_whole_up_to_the_limit(tmp_path):
    f = tmp_path / "x.txt"
    f.write_bytes(b"12345")
    assert limits.read_input_bytes(f, "thing", 5) == b"12345"
    with pytest.raises(ValueError, match=r"^thing '.*x\.txt' is larger than 4 bytes$"):
        limits.read_input_bytes(f, "thing", 4)
    with pytest.raises(ValueError, match="larger than 1 MiB"):
        f.write_bytes(b"0" * ((1 << 20) + 1))
        limits.read_input_bytes(f, "thing", 1 << 20)
    # at most limit + 1 bytes are asked for, whatever the file's size: a huge file is
    # refused without being read whole
    asked = []
    real_fdopen = os.fdopen

    class Spy:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def read(self, n=-1):
            asked.append(n)
            return self.f.read(n)

    import unittest.mock
    with unittest.mock.patch.object(limits.os, "fdopen",
                                    lambda fd, mode: Spy(real_fdopen(fd, mode))):
        with pytest.raises(ValueError, match="larger than 1,000 bytes"):
            limits.read_input_bytes(f, "thing", 1000)
    assert asked == [1001]
    f.write_bytes(b"\xef\xbb\xbf5\n")   # a byte-order mark is not content
    assert limits.read_input_text(f, "thing") == "5\n"
    f.write_bytes(b"5\n\xff")
    with pytest.raises(ValueError, match=r"'.*x\.txt' is not UTF-8 text \(byte 2 is b'\\xff'\)"):
        limits.read_input_text(f, "thing")


def test_what_is_not_a_regular_file_is_refused_by_kind(tmp_path, fifo):
    for path, kind in ((tmp_path, "a directory"), (fifo, r"a FIFO \(named pipe\)"),
                       ("/dev/null", "a character device")):
        if os.path.exists(path):
            with pytest.raises(ValueError, match=f"^thing '.*' is {kind}, not a regular file"):
                limits.read_input_bytes(path, "thing")
    with pytest.raises(ValueError, match="cannot read thing '.*none': No such file"):
        limits.read_input_bytes(tmp_path / "none", "thing")
    with pytest.raises(ValueError, match="cannot read thing 'a.x00b': a path holds no NUL"):
        limits.read_input_bytes("a\0b", "thing")


@needs_fifo
@needs_dev_zero
@pytest.mark.parametrize("read", [
    "from mlasandbox.paged_inputs import parse_lengths as f; g = lambda p: f('@' + p, 2)",
    "from mlasandbox.baseline import load_result as g",
    "from mlasandbox.stalls import read_saved as g",
], ids=["lengths", "vs", "from"])
def test_dev_zero_and_a_fifo_are_refused_before_any_read(tmp_path, read):
    path = tmp_path / "fifo"
    os.mkfifo(path)
    res = _child(f"{read}\n"
                 f"for p in ('/dev/zero', {str(path)!r}):\n"
                 "    try:\n        g(p)\n    except ValueError as e:\n        print(e)\n")
    assert res.returncode == 0 and "MemoryError" not in res.stderr, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 2, res.stdout
    assert "'/dev/zero' is a character device, not a regular file" in lines[0]
    assert "is a FIFO (named pipe), not a regular file" in lines[1]


# ---------------------------------------------------------------------------- lengths files

@needs_dev_zero
def test_bench_refuses_lengths_from_dev_zero_with_exit_2():
    res = _child("import sys\nfrom mlasandbox.cli.main import main\n"
                 "sys.argv = ['mlasandbox', 'bench', '--batch', '2', '--lengths', '@/dev/zero']\n"
                 "main()\n")
    assert res.returncode == 2, res.stderr
    assert "lengths file '/dev/zero' is a character device" in " ".join(res.stderr.split())


@pytest.mark.parametrize("cmd", [
    ("bench", "--batch", "2"), ("repro", "--variant", "split", "--batch", "2"),
    ("sweep", "--no-gpu", "--batch", "2"), ("ablate", "--batch", "2"),
    ("stalls", "--batch", "2"), ("try", "tests/data/toy_attn.cu", "--no-time", "--batch", "2"),
], ids=lambda c: c[0])
def test_every_command_refuses_a_lengths_fifo_with_exit_2(fifo, cmd, tmp_path):
    out = ("-o", str(tmp_path / "r.py")) if cmd[0] == "repro" else ()
    root = os.path.join(os.path.dirname(__file__), "..")
    args = [os.path.join(root, a) if a.endswith(".cu") else a for a in cmd]
    res = _invoke([*args, "--lengths", f"@{fifo}", *out], fifo)
    assert res.exit_code == 2, res.output
    assert f"lengths file {fifo!r} is a FIFO (named pipe), not a regular file" in words(res)
    assert not (tmp_path / "r.py").exists()


def test_a_lengths_file_past_its_cap_is_refused_by_bytes_read(tmp_path, monkeypatch):
    from mlasandbox import paged_inputs

    f = tmp_path / "lens.txt"
    f.write_text("5\n" * 20)
    monkeypatch.setattr(paged_inputs, "MAX_LENGTHS_FILE_BYTES", 39)
    with pytest.raises(ValueError, match=r"lengths file '.*lens\.txt' is larger than 39 bytes"):
        parse_lengths(f"@{f}", 64)
    monkeypatch.setattr(paged_inputs, "MAX_LENGTHS_FILE_BYTES", 40)
    assert parse_lengths(f"@{f}", 20).tolist() == [5] * 20


# ---------------------------------------------------------------------------- bench --vs

@pytest.fixture(scope="module")
def base():
    return run_bench(backend=FakeBackend(seed=1), contexts=(64, 131072),
                     variants=("per_head", "split"))


def _save(tmp_path, data, name="b.json") -> str:
    p = tmp_path / name
    p.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(p)


def _without(d: dict, key):
    d = copy.deepcopy(d)
    del d[key]
    return d


def _changed(base, fn):
    d = copy.deepcopy(base)
    fn(d)
    return d


def _timed_row(d: dict) -> dict:
    """The first row compare_runs matches (the control's q_absorb rows are not)."""
    return next(r for r in d["rows"] if r["phase"] != "q_absorb")


def _set_row(key, value):
    return lambda d: _timed_row(d).__setitem__(key, value)


@pytest.mark.parametrize("make, phrase", [
    (lambda b: {**b, "rows": [{}]}, "rows[0] without a phase"),
    (lambda b: {**b, "noise_floor": None}, "'noise_floor' of type NoneType, not dict"),
    (lambda b: {**b, "control": []}, "'control' of type list, not dict"),
    (lambda b: {**b, "rows": {"a": 1}}, "'rows' of type dict, not list"),
    (lambda b: {**b, "meta": [1]}, "'meta' of type list, not dict"),
    (lambda b: {**b, "config": "x"}, "'config' of type str, not dict"),
    (lambda b: _without(b, "control"), "lacks 'control'"),
    (lambda b: _changed(b, lambda d: d["noise_floor"].__setitem__("floor", "0.1")),
     "noise floor of '0.1', not a number >= 0"),
    (lambda b: _changed(b, lambda d: d["noise_floor"].__setitem__("floor", -1.0)),
     "noise floor of -1.0, not a number >= 0"),
    (lambda b: _changed(b, lambda d: d["control"].__setitem__("series", [{"label": "x"}])),
     "control series entry 0 without a median_us > 0"),
    (lambda b: _changed(b, lambda d: d["control"].__setitem__("series", 5)),
     "control series that is not a list"),
    (lambda b: _changed(b, _set_row("median_us", 0)), "'median_us' is 0, not a number > 0"),
    (lambda b: _changed(b, _set_row("median_us", None)), "'median_us' is None"),
    (lambda b: _changed(b, _set_row("n_ctx", "64")), "'n_ctx' is '64', not an integer"),
    (lambda b: _changed(b, _set_row("sm_mhz", "1980")), "'sm_mhz' is '1980', not a number > 0"),
    (lambda b: _changed(b, _set_row("sm_mhz", 0.0)), "'sm_mhz' is 0.0, not a number > 0"),
    (lambda b: _changed(b, _set_row("variant", ["x"])), "'variant' is ['x'], not a name"),
    (lambda b: _changed(b, lambda d: _timed_row(d).pop("cache")), "without 'cache'"),
    (lambda b: _changed(b, lambda d: d["rows"].append(3)), "that is not an object: 3"),
    (lambda b: "[" * 100_000 + "]" * 100_000, "is not JSON"),
    (lambda b: '{"schema": ' + "9" * 5000 + "}", "is not JSON"),
    # integers JSON allows and a float cannot hold (math.isfinite raises OverflowError)
    (lambda b: _changed(b, lambda d: d["noise_floor"].__setitem__("floor", 10 ** 400)),
     "noise floor of 1000"),
    (lambda b: _changed(b, lambda d: d["control"].__setitem__("series",
                                                              [{"median_us": 10 ** 400}])),
     "control series entry 0 without a median_us > 0"),
    (lambda b: _changed(b, _set_row("median_us", 10 ** 400)), "'median_us' is 1000"),
    (lambda b: _changed(b, _set_row("sm_mhz", -10 ** 400)), "'sm_mhz' is -1000"),
    (lambda b: '{"schema": "mlasandbox.bench/1", "rows": [], "noise_floor": {}, "control": '
               '{"series": [{"median_us": NaN}]}}', "control series entry 0"),
])
def test_a_baseline_is_checked_as_deep_as_compare_runs_reads_it(tmp_path, base, make, phrase):
    path = _save(tmp_path, make(base))
    with pytest.raises(SchemaError, match="^--vs: ") as exc:
        load_result(path)
    assert f"baseline {path!r}" in str(exc.value) and phrase in str(exc.value), str(exc.value)


def test_a_real_baseline_loads_and_compares(tmp_path, base):
    loaded = load_result(_save(tmp_path, base))
    assert compare_runs(base, loaded)["rows"]
    # a run from before the bench read clocks: no sm_mhz in its rows, still a baseline
    old = _changed(base, lambda d: [r.pop(k, None) for r in d["rows"] for k in NO_CLOCKS])
    cmp = compare_runs(base, load_result(_save(tmp_path, old, "old.json")))
    assert cmp["rows"] and all(r["clock_differs"] is None for r in cmp["rows"])


def _mutate(d, rng: random.Random) -> None:
    """One random damage at a random place the comparison reads: a key dropped, or a value
    replaced by another JSON type."""
    spots = [d, *(d.get(k) for k in ("noise_floor", "control", "meta", "config"))]
    control = d.get("control")
    for many in (d.get("rows"), control.get("series") if isinstance(control, dict) else None):
        spots += many if isinstance(many, list) else []
    target = rng.choice([s for s in spots if isinstance(s, dict) and s])
    key = rng.choice(sorted(target))
    if rng.random() < 0.3:
        del target[key]
    else:
        target[key] = rng.choice([None, "x", 0, -1.5, [], {}, True, [1], {"a": 1}])


def test_what_load_result_accepts_compare_runs_can_read(tmp_path, base, seeds):
    # every damaged baseline is refused up front or compared without an exception
    rng = random.Random(seeds.one())
    refused = 0
    for i in range(400):
        d = copy.deepcopy(base)
        for _ in range(rng.randint(1, 3)):
            _mutate(d, rng)
        path = _save(tmp_path, d, f"m{i}.json")
        try:
            loaded = load_result(path)
        except SchemaError:
            refused += 1
            continue
        compare_runs(base, loaded)   # a KeyError, TypeError, ... here fails the test
    assert 0 < refused < 400, seeds


def test_a_baseline_past_its_cap_is_refused(tmp_path, base, monkeypatch):
    path = _save(tmp_path, base)
    monkeypatch.setattr(baseline, "MAX_BASELINE_BYTES", os.path.getsize(path) - 1)
    with pytest.raises(SchemaError, match="is larger than"):
        load_result(path)


def test_bench_vs_names_the_option_and_exits_2(tmp_path, fifo):
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe{}")
    shallow = _save(tmp_path, '{"schema": "mlasandbox.bench/1", "rows": [{}], '
                              '"noise_floor": {}, "control": {}}', "s.json")
    for path, phrase in ((str(tmp_path / "bin.json"), "is not UTF-8 text"),
                         (fifo, "is a FIFO (named pipe), not a regular file"),
                         (shallow, "rows[0] without a phase")):
        res = _invoke(["bench", "--vs", path], fifo)
        assert res.exit_code == 2 and f"--vs: baseline {path!r}" in words(res), res.output
        assert phrase in words(res)


# ---------------------------------------------------------------------------- stalls --from

def test_read_saved_reads_a_directory_a_csv_and_a_gzipped_csv(tmp_path):
    (tmp_path / "source.csv").write_text("page", encoding="utf-8")
    (tmp_path / "raw.csv").write_text("raw", encoding="utf-8")
    assert stalls.read_saved(str(tmp_path)) == ("page", "raw")
    assert stalls.read_saved(str(tmp_path / "source.csv")) == ("page", None)
    gz = tmp_path / "p.csv.gz"
    gz.write_bytes(gzip.compress(b"zipped"))
    assert stalls.read_saved(str(gz)) == ("zipped", None)
    (tmp_path / "raw.csv").unlink()
    assert stalls.read_saved(str(tmp_path)) == ("page", None)


def test_read_saved_refuses_what_it_cannot_read(tmp_path, fifo, monkeypatch):
    d = tmp_path / "saved"
    d.mkdir()
    with pytest.raises(ValueError, match="source.csv does not exist"):
        stalls.read_saved(str(d))
    (d / "source.csv").write_text("page")
    os.mkfifo(d / "raw.csv")
    with pytest.raises(ValueError, match=r"ncu raw page '.*raw\.csv' is a FIFO"):
        stalls.read_saved(str(d))
    with pytest.raises(ValueError, match="is a FIFO"):
        stalls.read_saved(fifo)
    bad = tmp_path / "x.csv.gz"
    bad.write_text("Address,Source\n")
    with pytest.raises(ValueError, match="is not a gzip-compressed ncu CSV"):
        stalls.read_saved(str(bad))
    (tmp_path / "b.csv").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match=r"ncu CSV .*b\.csv' is not UTF-8 text"):
        stalls.read_saved(str(tmp_path / "b.csv"))
    # a small file that decompresses past the cap: refused after cap + 1 bytes, not inflated
    monkeypatch.setattr(stalls, "MAX_PAGE_BYTES", 100_000)
    bomb = tmp_path / "bomb.csv.gz"
    bomb.write_bytes(gzip.compress(b"0" * 10_000_000))
    assert bomb.stat().st_size < 100_000
    asked = []

    class SpyGzip(gzip.GzipFile):
        def read(self, size=-1):
            asked.append(size)
            return super().read(size)

    monkeypatch.setattr(stalls.gzip, "GzipFile", SpyGzip)
    with pytest.raises(ValueError, match="larger than 100,000 bytes uncompressed"):
        stalls.read_saved(str(bomb))
    assert asked == [100_001]   # never the whole stream
