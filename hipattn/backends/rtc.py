"""The compile skeleton NVRTC and hiprtc share: program from in-memory headers, one name expression,
options, log, lowered name, binary.

The two runtime compilers have the same calls under two prefixes (``nvrtcCreateProgram``,
``hiprtcCreateProgram``, ...); what differs is passed in: the name of the call that returns the binary,
how a program is destroyed, whether empty header lists are passed as null, and whether compiles in one
process must be serialised (old comgr keeps global state).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from ..errors import DriverError
from ..jit.target import Target
from .base import CompiledKernel, binding_outputs, compile_error

logger = logging.getLogger("hipattn")


def binding_text(value: Any) -> str:
    """A string the bindings hand back as bytes or as hip-python's CStr: both decode."""
    if value is None:
        return ""
    decode = getattr(value, "decode", None)
    return decode() if decode is not None else str(value)


class RuntimeCompiler:
    """One vendor's runtime compiler behind hipattn's compile call."""

    def __init__(self, module: Any, prefix: str, *, code_call: str, file_name: str, destroy: Callable[[Any], None],
                 empty_as_none: bool = False, serialise: bool = False):
        """``code_call``: the suffix of the call that fills the binary (``CUBIN`` for NVRTC's
        ``nvrtcGetCUBINSize``/``nvrtcGetCUBIN``, ``Code`` for hiprtc's); ``destroy`` frees a program."""
        self._module = module
        self._prefix = prefix
        self._code_call = code_call
        self._file_name = file_name.encode()
        self._destroy = destroy
        self._empty_as_none = empty_as_none
        self._lock = threading.Lock() if serialise else contextlib.nullcontext()

    def call(self, name: str, *args: Any) -> Any:
        """``{prefix}{name}(*args)``'s outputs; a failing result raises DriverError naming the call."""
        call = self._prefix + name
        return binding_outputs(call, getattr(self._module, call)(*args), self._error)

    def _error(self, call: str, result: Any) -> DriverError:
        name = getattr(result, "name", "") or ""
        try:
            error, text = getattr(self._module, self._prefix + "GetErrorString")(result)
            name = (binding_text(text) if not error else "") or name
        except Exception:  # the lookup needs the compiler library; the enum's own name is a fine fallback
            pass
        return DriverError(call, int(result), name)

    def compile(self, source: str, headers: dict[str, str], name_expression: str, target: Target,
                options: tuple[str, ...], spec_text: str) -> CompiledKernel:
        names = [name.encode() for name in headers]
        texts = [text.encode() for text in headers.values()]
        if self._empty_as_none:
            names, texts = names or None, texts or None
        with self._lock:
            program = self.call("CreateProgram", source.encode(), self._file_name, len(headers), texts, names)
            try:
                expression = name_expression.encode()
                self.call("AddNameExpression", program, expression)
                encoded_options = [option.encode() for option in options]
                (result,) = getattr(self._module, self._prefix + "CompileProgram")(
                    program, len(encoded_options), encoded_options)
                log = self._program_log(program)
                if result:
                    # Compilation errors and rejected options (an unknown arch) both come back with a log.
                    detail = log if log.strip() else f"{getattr(result, 'name', '')} ({int(result)})"
                    raise compile_error(spec_text, target, tuple(options), detail, source)
                # The lowered name points into the program: copied out before the program is destroyed.
                lowered = binding_text(self.call("GetLoweredName", program, expression))
                size = self.call(f"Get{self._code_call}Size", program)
                buffer = bytearray(size)  # written in place by the compiler: never a (possibly shared) bytes object
                self.call(f"Get{self._code_call}", program, buffer)
            finally:
                self._destroy(program)
        if log.strip():
            logger.debug("%s log for %s on %s:\n%s", self._prefix, spec_text, target, log)
        return CompiledKernel(binary=bytes(buffer), lowered_name=lowered, log=log)

    def _program_log(self, program: Any) -> str:
        size = self.call("GetProgramLogSize", program)
        if size <= 1:
            return ""
        buffer = bytearray(size)
        self.call("GetProgramLog", program, buffer)
        return bytes(buffer).rstrip(b"\0").decode(errors="replace")
