"""The AMDGPU metadata of a code object (what hiprtc returns): each kernel's registers, spills and
scratch, read without a GPU or LLVM's tools.

A code object is an ELF file whose SHT_NOTE section holds an "AMDGPU" note of type
NT_AMDGPU_METADATA: a MessagePack map with ``amdhsa.kernels``, one map per kernel with ``.vgpr_count``
(on gfx90a the unified count: VGPRs and AGPRs), ``.agpr_count``, ``.sgpr_count``,
``.vgpr_spill_count``, ``.sgpr_spill_count``, ``.private_segment_fixed_size`` (scratch bytes per
lane), ``.group_segment_fixed_size`` (static LDS) and more (``llvm-readelf --notes`` prints the same).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

_SHT_NOTE = 7
_NT_AMDGPU_METADATA = 32


def elf_sections(elf: bytes) -> Iterator[tuple[bytes, int, bytes]]:
    """(name, type, contents) of each section of ``elf`` (an ELF64 little-endian file: a code object,
    or a shared library such as libamdhip64)."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        raise ValueError("not an ELF64 file")
    (section_offset,) = struct.unpack_from("<Q", elf, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", elf, 0x3A)

    def section(index: int) -> tuple[int, int, int, int]:
        header = section_offset + index * entry_size
        name, kind = struct.unpack_from("<II", elf, header)
        offset, size = struct.unpack_from("<QQ", elf, header + 0x18)
        return name, kind, offset, size

    _, _, names_offset, _ = section(names_index)
    for index in range(count):
        name, kind, offset, size = section(index)
        yield elf[names_offset + name:elf.index(b"\0", names_offset + name)], kind, elf[offset:offset + size]


def kernels(code_object: bytes) -> list[dict[str, Any]]:
    """The ``amdhsa.kernels`` maps of ``code_object`` (an ELF64 AMDGPU code object)."""
    for _, kind, contents in elf_sections(code_object):
        if kind != _SHT_NOTE:
            continue
        for name, note_type, description in _notes(contents):
            if name == b"AMDGPU" and note_type == _NT_AMDGPU_METADATA:
                return _MessagePack(description).read()["amdhsa.kernels"]
    raise ValueError("the code object has no AMDGPU metadata note")


def _notes(data: bytes):
    position = 0
    while position + 12 <= len(data):
        name_size, description_size, note_type = struct.unpack_from("<III", data, position)
        position += 12
        name = data[position:position + name_size].rstrip(b"\0")
        position += -(-name_size // 4) * 4
        yield name, note_type, data[position:position + description_size]
        position += -(-description_size // 4) * 4


class _MessagePack:
    """The subset of MessagePack that LLVM writes for AMDGPU metadata: maps, arrays, strings, ints,
    booleans, nil and floats."""

    def __init__(self, data: bytes):
        self.data = data
        self.position = 0

    def _take(self, fmt: str):
        values = struct.unpack_from(">" + fmt, self.data, self.position)
        self.position += struct.calcsize(">" + fmt)
        return values[0]

    def _bytes(self, n: int) -> bytes:
        value = self.data[self.position:self.position + n]
        self.position += n
        return value

    def read(self) -> Any:
        tag = self._take("B")
        if tag <= 0x7F:
            return tag
        if tag >= 0xE0:
            return tag - 0x100
        if 0x80 <= tag <= 0x8F:
            return self._map(tag & 0x0F)
        if 0x90 <= tag <= 0x9F:
            return [self.read() for _ in range(tag & 0x0F)]
        if 0xA0 <= tag <= 0xBF:
            return self._bytes(tag & 0x1F).decode()
        simple = {0xC0: None, 0xC2: False, 0xC3: True}
        if tag in simple:
            return simple[tag]
        sized = {0xC4: "B", 0xC5: "H", 0xC6: "I", 0xD9: "B", 0xDA: "H", 0xDB: "I"}
        if tag in sized:
            raw = self._bytes(self._take(sized[tag]))
            return raw.decode() if tag >= 0xD9 else raw
        numbers = {0xCA: "f", 0xCB: "d", 0xCC: "B", 0xCD: "H", 0xCE: "I", 0xCF: "Q", 0xD0: "b", 0xD1: "h", 0xD2: "i",
                   0xD3: "q"}
        if tag in numbers:
            return self._take(numbers[tag])
        if tag in (0xDC, 0xDD):
            return [self.read() for _ in range(self._take("H" if tag == 0xDC else "I"))]
        if tag in (0xDE, 0xDF):
            return self._map(self._take("H" if tag == 0xDE else "I"))
        raise ValueError(f"MessagePack tag 0x{tag:02x} at byte {self.position - 1} is not one AMDGPU metadata uses")

    def _map(self, n: int) -> dict:
        result = {}
        for _ in range(n):
            key = self.read()
            result[key] = self.read()
        return result
