"""The size an ELF64 image says it has, from its own headers (for checking a cubin is whole)."""
from __future__ import annotations

import struct

SHT_NOBITS = 8


def elf_extent(image: bytes) -> int:
    """The end of the furthest thing the ELF header and section headers place in the file:
    the program header table, the section header table, or a section's bytes. A whole image
    is at least this long; an image cut short is shorter."""
    assert image[:4] == b"\x7fELF" and image[4] == 2 and image[5] == 1, "not an ELF64 LE image"
    phoff, shoff = struct.unpack_from("<QQ", image, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", image, 0x36)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    for i in range(shnum):
        sh_type, = struct.unpack_from("<I", image, shoff + i * shentsize + 4)
        offset, size = struct.unpack_from("<QQ", image, shoff + i * shentsize + 0x18)
        if sh_type != SHT_NOBITS:
            end = max(end, offset + size)
    return end
