"""Kernel parameter structs, declared once in Python for both sides of the launch.

Every hipattn kernel takes one argument: a plain struct passed by value. The struct is declared here,
once; the C++ declaration the kernel sees is generated from the same field list and prepended to the
compile unit (so it is also part of the cache key), and the ctypes class the launcher fills is built
from it too. The two can therefore never drift apart, and a launch packs a single pointer.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

# field kind -> (ctypes type, C++ type). A tensor map is CUDA's opaque CUtensorMap, encoded on the
# host (hipattn.backends.tensor_maps) and read by the copy engine from the kernel's parameter space:
# 128 bytes, 64-byte aligned. The ctypes side holds it as a TensorMapBytes array.
TENSOR_MAP = "tensor_map"
TENSOR_MAP_BYTES = 128
TENSOR_MAP_ALIGNMENT = 64
TensorMapBytes = ctypes.c_uint8 * TENSOR_MAP_BYTES
_TENSOR_MAP_DECLARATION = (
    "#ifndef HIPATTN_TENSOR_MAP_DECLARED\n#define HIPATTN_TENSOR_MAP_DECLARED\n"
    f"struct alignas({TENSOR_MAP_ALIGNMENT}) TensorMap {{ unsigned char bytes[{TENSOR_MAP_BYTES}]; }};\n#endif\n"
)
FIELD_KINDS: dict[str, tuple[type, str]] = {
    "ptr": (ctypes.c_uint64, "void*"),
    "const_ptr": (ctypes.c_uint64, "const void*"),
    "i32": (ctypes.c_int32, "int"),
    "i64": (ctypes.c_int64, "long long"),
    "f32": (ctypes.c_float, "float"),
    TENSOR_MAP: (TensorMapBytes, "TensorMap"),
}


@dataclass(frozen=True)
class ParamsStruct:
    """A by-value kernel argument: ``name`` is the C++ struct name inside ``namespace hipattn``.

    ``fields`` lists every field in memory order. A struct that ``extends`` another starts with all of
    its fields and is declared in C++ as derived from it, so that a kernel hands ``p`` to the helpers
    written for the base struct. Tensor-map fields are placed at 64-byte boundaries, as C++ places
    them, by unnamed padding on the ctypes side."""

    name: str
    fields: tuple[tuple[str, str], ...]
    extends: ParamsStruct | None = None
    _ctypes_class: type = field(init=False, repr=False, compare=False, hash=False)
    _names: frozenset = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        for field_name, kind in self.fields:
            if kind not in FIELD_KINDS:
                raise ValueError(f"{self.name}.{field_name}: unknown field kind {kind!r}; known: {sorted(FIELD_KINDS)}")
        if self.extends is not None and self.fields[:len(self.extends.fields)] != self.extends.fields:
            raise ValueError(f"{self.name} extends {self.extends.name} and must start with its fields")
        # Natural C alignment on both sides: ctypes.Structure lays fields out as the C++ compiler does,
        # but for the tensor maps' 64-byte alignment, which it has no notion of: padding stands in.
        layout, offset = [], 0
        for field_name, kind in self.fields:
            ctype = FIELD_KINDS[kind][0]
            alignment = TENSOR_MAP_ALIGNMENT if kind == TENSOR_MAP else ctypes.alignment(ctype)
            if offset % alignment:
                padding = alignment - offset % alignment
                layout.append((f"_padding_{len(layout)}", ctypes.c_uint8 * padding))
                offset += padding
            layout.append((field_name, ctype))
            offset += ctypes.sizeof(ctype)
        if any(kind == TENSOR_MAP for _, kind in self.fields) and offset % TENSOR_MAP_ALIGNMENT:
            layout.append((f"_padding_{len(layout)}", ctypes.c_uint8 * (TENSOR_MAP_ALIGNMENT - offset % TENSOR_MAP_ALIGNMENT)))
        cls = type(self.name, (ctypes.Structure,), {"_fields_": layout})
        object.__setattr__(self, "_ctypes_class", cls)
        object.__setattr__(self, "_names", frozenset(n for n, _ in self.fields))

    @classmethod
    def extending(cls, name: str, base: ParamsStruct, fields: tuple[tuple[str, str], ...]) -> ParamsStruct:
        """A struct of ``base``'s fields followed by ``fields``."""
        return cls(name, base.fields + fields, extends=base)

    def new(self, **values) -> ctypes.Structure:
        """A filled struct; every field must be given (a forgotten field would silently be zero)."""
        return self.from_dict(values)

    def from_dict(self, values: dict) -> ctypes.Structure:
        """``new(**values)`` without copying ``values`` into a keyword dict: the launch path's form."""
        # One C-level subset test per launch; the field-by-field scan only runs to word the error.
        if not values.keys() >= self._names:
            missing = [n for n, _ in self.fields if n not in values]
            raise TypeError(f"{self.name}: missing fields {missing}")
        return self._ctypes_class(**values)

    def cpp_declaration(self) -> str:
        own = self.fields[len(self.extends.fields):] if self.extends is not None else self.fields
        body = "".join(f"  {FIELD_KINDS[kind][1]} {name};\n" for name, kind in own)
        parent = f" : {self.extends.name}" if self.extends is not None else ""
        prelude = _TENSOR_MAP_DECLARATION if any(kind == TENSOR_MAP for _, kind in own) else ""
        return f"{prelude}struct {self.name}{parent} {{\n{body}}};\n"

    def cpp_size_assertion(self) -> str:
        """A static_assert that the C++ compiler lays the struct out in ctypes' size."""
        return f'static_assert(sizeof({self.name}) == {self.nbytes}, "hipattn: {self.name} layout");\n'

    def cpp_checked_declaration(self) -> str:
        """The declaration followed by its size check: how every struct enters a compile unit."""
        return self.cpp_declaration() + self.cpp_size_assertion()

    @property
    def nbytes(self) -> int:
        return ctypes.sizeof(self._ctypes_class)
