"""Every kernel's mbarrier arrivals stay in forms compute-sanitizer's synccheck checks.

`cp.async.mbarrier.arrive` without `.noinc` adds the thread's own arrival to the phase's
count before it arrives: valid PTX, but synccheck (compute-sanitizer 2025.3) reports it as a
barrier overflow and stops the kernel, so `.ci/gpu-sanitize` could not check any case after
it (wgmma64's partial tiles on its TMA path did this until the kernel waited for its copies
instead: docs/wgmma-deep-dive.md). The GPU suite does not run the sanitizers, so this check
on the sources keeps the form out where CI can see it.
"""
from __future__ import annotations

import re

from mlasandbox.sources import read_source, source_names

# the arrive, its qualifiers up to the operand list
_ARRIVE = re.compile(r"cp\.async\.mbarrier\.arrive((?:\.[\w:]+)*)")
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)


def counted_arrivals(text: str) -> list[str]:
    """The `cp.async.mbarrier.arrive` forms in the code of `text` (not its comments, which
    may name the form to say why it is not used) that lack `.noinc`."""
    code = _COMMENT.sub("", text)
    return [m.group(0) for m in _ARRIVE.finditer(code) if ".noinc" not in m.group(1)]


def test_no_kernel_source_uses_the_counted_cp_async_arrive():
    names = source_names()
    assert "mla_wgmma.cu" in names and "mla_common.cuh" in names
    found = {n: counted_arrivals(read_source(n)) for n in names}
    assert not any(found.values()), found
    # the forms the kernels do use are seen: the check reads the text they are written in
    assert any(_ARRIVE.search(read_source(n)) for n in names)


def test_the_check_finds_the_counted_form():  # negative control
    assert counted_arrivals('asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];"') == [
        "cp.async.mbarrier.arrive.shared::cta.b64"]
    assert counted_arrivals('"cp.async.mbarrier.arrive.b64 [%0];"') != []
    assert counted_arrivals('"cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];"') == []
    assert counted_arrivals("// not cp.async.mbarrier.arrive.shared::cta.b64: synccheck") == []
