"""elf: the strict ELF64 reader behind the code size, on objects built here byte by byte and
on a real cubin, whole, as CuPy hands it over, and cut or corrupted."""
from __future__ import annotations

import struct
from pathlib import Path

import pytest

from mlasandbox import elf, ptxas

PROGBITS, STRTAB, NOBITS = 1, 3, 8
ALLOC_EXEC = 0x2 | 0x4
TOY = (Path(__file__).parent / "data" / "toy_attn.cu").read_text()

# name, type, flags, body (bytes; for NOBITS its size, which takes no room in the file)
SECTIONS = [
    (".nv.info.a", 0x70000000, 0, b"\x04" * 20),
    (".text.a", PROGBITS, ALLOC_EXEC, b"\x11" * 48),
    (".rela.text.a", 4, 0, b""),
    (".text.b", PROGBITS, ALLOC_EXEC, b"\x22" * 32),
    (".nv.shared.a", NOBITS, 0x3, 4096),
    (".nv.constant0.b", PROGBITS, 0x2, b"\0" * 360),
]


def build(sections=SECTIONS, phnum=2) -> bytes:
    """A little-endian ELF64 CUDA object laid out as ptxas lays a cubin: header, section
    bodies, section names, section headers, then the program headers last."""
    body, headers, names = bytearray(), [], bytearray(b"\0")
    start = 64

    def add(name, typ, flags, offset, size):
        headers.append(struct.pack("<IIQQQQIIQQ", len(names), typ, flags, 0, offset, size,
                                   0, 0, 1, 0))
        names.extend(name.encode() + b"\0")

    headers.append(bytes(64))                    # section 0: SHN_UNDEF
    for name, typ, flags, data in sections:
        if typ == NOBITS:
            add(name, typ, flags, start + len(body) + 10**6, data)
        else:
            add(name, typ, flags, start + len(body), len(data))
            body.extend(data)
    strtab_off = start + len(body)
    add(".shstrtab", STRTAB, 0, strtab_off, 0)   # its size is patched in below
    shstrndx = len(headers) - 1
    headers[-1] = struct.pack("<IIQQQQIIQQ", len(names) - len(b".shstrtab\0"), STRTAB, 0, 0,
                              strtab_off, len(names), 0, 0, 1, 0)
    shoff = strtab_off + len(names)
    phoff = shoff + 64 * len(headers)
    header = struct.pack("<16sHHIQQQIHHHHHH", b"\x7fELF\x02\x01\x01\x33" + bytes(8), 2, 190, 1,
                         0, phoff, shoff, 0, 64, 56, phnum, 64, len(headers), shstrndx)
    return header + bytes(body) + bytes(names) + b"".join(headers) + bytes(56 * phnum)


def patch(data: bytes, fmt: str, offset: int, value) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def shdr(data: bytes, index: int) -> int:
    """The file offset of section header `index`."""
    return struct.unpack_from("<Q", data, 40)[0] + 64 * index


def test_text_sizes_of_a_built_object():
    data = build()
    assert elf.text_sizes(data) == {"a": 48, "b": 32}
    assert [s.name for s in elf.sections(data)] == ["", *(s[0] for s in SECTIONS), ".shstrtab"]
    # as CuPy's getCUBIN hands a cubin over, its last byte (in the program headers) gone
    with pytest.raises(elf.ElfError, match="program headers"):
        elf.text_sizes(data[:-1])


def test_a_real_cubin_is_read_whole():
    c = ptxas.compile_program(TOY, ["mla::toy<1, __half, float>", "mla::toy_plain"])
    sizes = elf.text_sizes(c.cubin)
    assert set(c.lowered.values()) <= set(sizes)
    with pytest.raises(elf.ElfError, match="program headers"):
        elf.text_sizes(c.cubin[:-1])


@pytest.mark.parametrize("corrupt, words", [
    (lambda d: d[:40], "40 bytes, shorter than the 64-byte ELF64 header"),
    (lambda d: b"\x7fELG" + d[4:], "not an ELF file: magic b'\\x7fELG'"),
    (lambda d: patch(d, "<B", 4, 1), "not a little-endian ELF64 file: EI_CLASS 1"),
    (lambda d: patch(d, "<B", 5, 2), "EI_DATA 2"),
    (lambda d: patch(d, "<H", 18, 62), "e_machine 62, expected 190"),
    (lambda d: d[:-1], "ELF truncated or corrupt: the table of 2 program headers"),
    (lambda d: d[:-200], "ELF truncated or corrupt"),
    (lambda d: patch(d, "<H", 62, 99), "section names in section 99"),
    (lambda d: patch(d, "<H", 60, 0), "0 section headers"),
    (lambda d: patch(d, "<H", 58, 40), "section header entries of 40 bytes"),
    (lambda d: patch(d, "<H", 54, 32), "program header entries of 32 bytes"),
    (lambda d: patch(d, "<Q", 40, len(d)), "the table of 8 section headers"),
    (lambda d: patch(d, "<Q", shdr(d, 2) + 24, len(d) - 8), "section 2 (48 bytes at offset"),
    (lambda d: patch(d, "<Q", shdr(d, 2) + 32, 2**40), "section 2"),
    (lambda d: patch(d, "<I", shdr(d, 2), 10**4), "the name of section 2 at 10000 lies past"),
    (lambda d: patch(d, "<I", shdr(d, 7) + 4, PROGBITS), "not SHT_STRTAB"),
    (lambda d: patch(d, "<Q", shdr(d, 2) + 8, 0x2), ".text.a is not executable code"),
    (lambda d: patch(d, "<I", shdr(d, 4), struct.unpack_from("<I", d, shdr(d, 2))[0]),
     "two sections .text.a"),
])
def test_a_corrupt_object_raises_naming_what(corrupt, words):
    bad = corrupt(build())
    assert bad != build()
    with pytest.raises(elf.ElfError) as err:
        elf.text_sizes(bad)
    assert words in str(err.value)


def test_an_unterminated_name_is_caught():
    data = build()
    strtab = elf.sections(data)[-1]
    out = bytearray(data)
    out[strtab.offset + strtab.size - 1] = ord("x")   # .shstrtab's own name loses its NUL
    with pytest.raises(elf.ElfError, match="section 7 is not NUL-terminated"):
        elf.text_sizes(bytes(out))


def test_every_cut_of_a_real_cubin_is_an_elf_error():
    """Cut anywhere, a cubin gives ElfError, never an IndexError, struct.error or a size."""
    cubin = ptxas.compile_program(TOY, ["mla::toy<4, __nv_bfloat16, __nv_bfloat16>"]).cubin
    cuts = set(range(0, len(cubin) - 1, 97)) | {0, 1, 63, 64, 65, len(cubin) - 2}
    for n in sorted(cuts):
        with pytest.raises(elf.ElfError):
            elf.text_sizes(cubin[:n])


def test_the_report_names_the_file_and_arch_of_an_unreadable_cubin():
    c = ptxas.compile_program(TOY, ["mla::toy_plain"])
    cut = c._replace(cubin=c.cubin[:1000])
    with pytest.raises(ptxas.PtxasParseError, match="the cubin of toy.cu for sm_90: ELF"):
        ptxas.code_sizes(cut, c.lowered.values(), arch="sm_90", filename="toy.cu")
    with pytest.raises(ptxas.PtxasParseError, match="no .text section for no_such_kernel"):
        ptxas.code_sizes(c, ["no_such_kernel"], arch="sm_90", filename="toy.cu")
