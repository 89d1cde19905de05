"""Kernel families and kernel specs: which template instantiation a launch needs.

A ``KernelFamily`` names one HIP C++ kernel template (its source file under ``kernels/``, its
qualified name, the order of its template parameters and its parameter struct). A ``KernelSpec``
is a frozen choice of template arguments for one family, and holds the family itself, so that
everything downstream (compile unit, name expression, parameter struct, cache metadata) follows
from the spec alone; together with a ``Target`` it names one binary. Specs serialise canonically
(sorted JSON), and that text, never a pickle, goes into the cache key.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from .params import ParamsStruct
from .target import Target

# Element types as template arguments: hipattn's own 16-bit types (kernels/common/types.h), so that
# neither compiler needs a vendor header.
CPP_DTYPES = {"fp16": "hipattn::half_t", "bf16": "hipattn::bf16_t", "fp32": "float"}

TemplateValue = int | bool | str


# eq=False: a family is one object for the life of the process, compared and hashed by identity, so a
# spec's hash (a registry lookup on every launch) costs no walk over the family's fields.
@dataclass(frozen=True, eq=False)
class KernelFamily:
    name: str
    source: str  # path relative to kernels/
    template: str  # qualified C++ name of the __global__ template
    template_params: tuple[str, ...]  # in template order; a parameter named "dtype" takes a CPP_DTYPES key
    params: ParamsStruct
    # The instantiations hipattn ships for a target: what `hipattn warm` compiles and CI checks.
    shipped: Callable[[Target], Iterable[KernelSpec]] = lambda target: ()
    # Further structs the kernel reads through pointers (e.g. varlen_metadata.VARLEN_RECORD),
    # declared in the compile unit before ``params`` so that both sides share one field list.
    structs: tuple[ParamsStruct, ...] = ()

    def spec(self, **template_args: TemplateValue) -> KernelSpec:
        unknown = set(template_args) - set(self.template_params)
        missing = [p for p in self.template_params if p not in template_args]
        if unknown or missing:
            raise TypeError(
                f"{self.name} takes template parameters {list(self.template_params)}; "
                f"missing {missing}, unknown {sorted(unknown)}"
            )
        return KernelSpec(self, tuple((p, template_args[p]) for p in self.template_params))

    def __repr__(self) -> str:
        return f"KernelFamily({self.name})"


@dataclass(frozen=True)
class KernelSpec:
    family: KernelFamily
    template_args: tuple[tuple[str, TemplateValue], ...]

    def arg(self, name: str) -> TemplateValue:
        return dict(self.template_args)[name]

    def canonical(self) -> str:
        return json.dumps({"family": self.family.name, "args": [list(a) for a in self.template_args]},
                          sort_keys=True)

    @classmethod
    def from_canonical(cls, text: str, families: Mapping[str, KernelFamily]) -> KernelSpec:
        """The spec ``canonical()`` wrote, its family looked up by name in ``families``.

        Raises ValueError for text that is not a spec of one of ``families`` with its parameters.
        """
        try:
            data = json.loads(text)
            name, args = data["family"], data["args"]
            values = {str(parameter): value for parameter, value in args}
        except (ValueError, TypeError, KeyError) as error:
            raise ValueError(f"not a kernel spec: {text[:200]!r} ({error})") from None
        family = families.get(name) if isinstance(name, str) else None
        if family is None:
            raise ValueError(f"kernel spec of unknown family {name!r}")
        try:
            return family.spec(**values)
        except TypeError as error:
            raise ValueError(str(error)) from None

    def name_expression(self) -> str:
        """``hipattn::smallseq_forward<hipattn::bf16_t, 128, 17, false>``: what the compiler instantiates."""
        args = ", ".join(cpp_template_argument(n, v) for n, v in self.template_args)
        return f"{self.family.template}<{args}>"

    def __str__(self) -> str:
        args = ", ".join(f"{name}={value}" for name, value in self.template_args)
        return f"{self.family.name}[{args}]"


def cpp_template_argument(name: str, value: TemplateValue) -> str:
    if name == "dtype":
        if value not in CPP_DTYPES:
            raise ValueError(f"dtype template argument {value!r}; expected one of {sorted(CPP_DTYPES)}")
        return CPP_DTYPES[value]
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    raise TypeError(f"template argument {name}={value!r}: only ints, bools and dtype names are supported")
