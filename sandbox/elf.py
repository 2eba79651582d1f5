"""A strict reader of the ELF64 section headers of a cubin: each kernel's SASS size.

NVRTC's cubin is a little-endian ELF64 file (e_machine EM_CUDA). Each function's machine code
is one section, `.text.<mangled name>`; its size is the function's instruction footprint
(16 bytes an instruction on sm_70 and later, padded to the section's alignment).

The file header, the section header table, each section's extent and the section-name string
table are checked against the file's length, and so is the program header table's extent:
anything out of bounds raises ElfError naming the structure, its offset and the length, never
an IndexError or a wrong size. (CuPy's `nvrtc.getCUBIN` returns a cubin less its last byte,
which lies in the program header table: read cubins with `toolkit.nvrtc_cubin`.)
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["ElfError", "Section", "sections", "text_sizes", "EM_CUDA"]

EM_CUDA = 190
_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")    # Elf64_Ehdr
_SECTION = struct.Struct("<IIQQQQIIQQ")         # Elf64_Shdr
_PROGRAM_HEADER_SIZE = 56                       # Elf64_Phdr
SHT_PROGBITS, SHT_STRTAB, SHT_NOBITS = 1, 3, 8
SHF_EXECINSTR = 0x4
SHN_LORESERVE = 0xFF00                          # e_shnum/e_shstrndx escapes start here
TEXT_PREFIX = ".text."


class ElfError(ValueError):
    """The bytes are not an ELF64 CUDA object this reader can read, or are cut short."""


@dataclass(frozen=True)
class Section:
    name: str
    type: int
    flags: int
    offset: int
    size: int


def _header(data: bytes) -> tuple:
    if len(data) < _HEADER.size:
        raise ElfError(f"ELF truncated: {len(data)} bytes, shorter than the "
                       f"{_HEADER.size}-byte ELF64 header")
    h = _HEADER.unpack_from(data)
    ident = h[0]
    if ident[:4] != b"\x7fELF":
        raise ElfError(f"not an ELF file: magic {ident[:4]!r}, expected b'\\x7fELF'")
    if ident[4] != 2 or ident[5] != 1:
        raise ElfError(f"not a little-endian ELF64 file: EI_CLASS {ident[4]}, EI_DATA "
                       f"{ident[5]} (expected 2 and 1)")
    if h[2] != EM_CUDA:
        raise ElfError(f"not a CUDA object: e_machine {h[2]}, expected {EM_CUDA} (EM_CUDA)")
    return h


def _within(data: bytes, what: str, offset: int, size: int) -> None:
    if offset + size > len(data):
        raise ElfError(f"ELF truncated or corrupt: {what} ({size} bytes at offset {offset}) "
                       f"ends past the end of the file ({len(data)} bytes)")


def _program_headers_within(data: bytes, phoff: int, phentsize: int, phnum: int) -> None:
    """Only the extent: a file cut short ends inside the table written last."""
    if phnum and phentsize != _PROGRAM_HEADER_SIZE:
        raise ElfError(f"ELF corrupt: program header entries of {phentsize} bytes, expected "
                       f"{_PROGRAM_HEADER_SIZE}")
    _within(data, f"the table of {phnum} program headers", phoff, phnum * phentsize)


def _raw_sections(data: bytes) -> tuple[list[tuple], int]:
    """The section headers as tuples, and the index of the section-name string table."""
    h = _header(data)
    _program_headers_within(data, phoff=h[5], phentsize=h[9], phnum=h[10])
    shoff, shentsize, shnum, shstrndx = h[6], h[11], h[12], h[13]
    if shnum == 0 or shnum >= SHN_LORESERVE or shstrndx >= shnum:
        raise ElfError(f"ELF corrupt: {shnum} section headers, section names in section "
                       f"{shstrndx} (an ELF of fewer than {SHN_LORESERVE} sections is expected)")
    if shentsize != _SECTION.size:
        raise ElfError(f"ELF corrupt: section header entries of {shentsize} bytes, expected "
                       f"{_SECTION.size}")
    _within(data, f"the table of {shnum} section headers", shoff, shnum * shentsize)
    raw = [_SECTION.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]
    for i, s in enumerate(raw):
        if s[1] != SHT_NOBITS:  # NOBITS (.bss, shared memory) takes no room in the file
            _within(data, f"section {i}", s[4], s[5])
    return raw, shstrndx


def _name(data: bytes, strtab: tuple, at: int, index: int) -> str:
    off, size = strtab[4], strtab[5]
    if at >= size:
        raise ElfError(f"ELF corrupt: the name of section {index} at {at} lies past the end "
                       f"of the {size}-byte section-name table")
    end = data.find(b"\0", off + at, off + size)
    if end < 0:
        raise ElfError(f"ELF corrupt: the name of section {index} is not NUL-terminated "
                       "within the section-name table")
    return data[off + at:end].decode("ascii", errors="replace")


def sections(data: bytes) -> list[Section]:
    """Every section of an ELF64 CUDA object, in header order."""
    data = bytes(data)
    raw, shstrndx = _raw_sections(data)
    strtab = raw[shstrndx]
    if strtab[1] != SHT_STRTAB:
        raise ElfError(f"ELF corrupt: section {shstrndx}, named as the section-name table, "
                       f"has type {strtab[1]}, not SHT_STRTAB ({SHT_STRTAB})")
    return [Section(_name(data, strtab, s[0], i), s[1], s[2], s[4], s[5])
            for i, s in enumerate(raw)]


def text_sizes(data: bytes) -> dict[str, int]:
    """{function name: bytes of its `.text.<name>` section} for every function of a cubin."""
    out: dict[str, int] = {}
    for s in sections(data):
        if not s.name.startswith(TEXT_PREFIX):
            continue
        if s.type != SHT_PROGBITS or not s.flags & SHF_EXECINSTR:
            raise ElfError(f"ELF corrupt: {s.name} is not executable code (type {s.type}, "
                           f"flags {s.flags:#x})")
        fn = s.name[len(TEXT_PREFIX):]
        if fn in out:
            raise ElfError(f"ELF corrupt: two sections {s.name}")
        out[fn] = s.size
    return out
