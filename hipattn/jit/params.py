"""Kernel parameter structs, declared once in Python for both sides of the launch.

Every hipattn kernel takes one argument: a plain struct passed by value. The struct is declared here,
once; the C++ declaration the kernel sees is generated from the same field list and prepended to the
compile unit (so it is also part of the cache key), and the ctypes class the launcher fills is built
from it too. The two can therefore never drift apart, and a launch packs a single pointer.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

# field kind -> (ctypes type, C++ type)
FIELD_KINDS: dict[str, tuple[type, str]] = {
    "ptr": (ctypes.c_uint64, "void*"),
    "const_ptr": (ctypes.c_uint64, "const void*"),
    "i32": (ctypes.c_int32, "int"),
    "i64": (ctypes.c_int64, "long long"),
    "f32": (ctypes.c_float, "float"),
}


@dataclass(frozen=True)
class ParamsStruct:
    """A by-value kernel argument: ``name`` is the C++ struct name inside ``namespace hipattn``."""

    name: str
    fields: tuple[tuple[str, str], ...]
    _ctypes_class: type = field(init=False, repr=False, compare=False, hash=False)
    _names: frozenset = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        for field_name, kind in self.fields:
            if kind not in FIELD_KINDS:
                raise ValueError(f"{self.name}.{field_name}: unknown field kind {kind!r}; known: {sorted(FIELD_KINDS)}")
        # Natural C alignment on both sides: ctypes.Structure lays fields out as the C++ compiler does.
        cls = type(self.name, (ctypes.Structure,), {"_fields_": [(n, FIELD_KINDS[k][0]) for n, k in self.fields]})
        object.__setattr__(self, "_ctypes_class", cls)
        object.__setattr__(self, "_names", frozenset(n for n, _ in self.fields))

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
        body = "".join(f"  {FIELD_KINDS[kind][1]} {name};\n" for name, kind in self.fields)
        return f"struct {self.name} {{\n{body}}};\n"

    def cpp_size_assertion(self) -> str:
        """A static_assert that the C++ compiler lays the struct out in ctypes' size."""
        return f'static_assert(sizeof({self.name}) == {self.nbytes}, "hipattn: {self.name} layout");\n'

    def cpp_checked_declaration(self) -> str:
        """The declaration followed by its size check: how a struct that kernels read through a
        pointer (``KernelFamily.structs``) enters a compile unit."""
        return self.cpp_declaration() + self.cpp_size_assertion()

    @property
    def nbytes(self) -> int:
        return ctypes.sizeof(self._ctypes_class)
