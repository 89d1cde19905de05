"""The exceptions hipattn raises. Every runtime and compiler failure ends up as one of these."""

from __future__ import annotations


class HipattnError(RuntimeError):
    """Base class for failures inside hipattn (not for invalid arguments: those are ValueError/TypeError)."""


class DeviceContentError(ValueError, RuntimeError):
    """A device array's contents break what the call promised, found by HIPATTN_CHECK=1 (hipattn.checks):
    a ValueError about an argument, and a RuntimeError, as flash-attn and torch raise for checks made
    at run time."""


class BackendUnavailableError(HipattnError):
    """No usable GPU runtime or compiler: the message says which package or library to install."""


class DriverError(HipattnError):
    """A runtime/driver API call returned an error code."""

    def __init__(self, call: str, code: int, name: str = "", description: str = ""):
        self.call = call
        self.code = code
        self.name = name
        self.description = description
        detail = f"{name} ({code})" if name else f"error {code}"
        super().__init__(f"{call} failed: {detail}" + (f": {description}" if description else ""))

    def __reduce__(self):
        return (type(self), (self.call, self.code, self.name, self.description))


class CompileError(HipattnError):
    """The runtime compiler rejected a kernel instantiation. Carries the log, the spec and the options.

    Pickles (parallel ``hipattn warm`` workers send it back to the parent). Set
    ``HIPATTN_DUMP_SOURCE=1`` to have the full instantiated source appended to the message.
    """

    def __init__(self, spec: str, target: str, options: tuple[str, ...], log: str, source: str | None = None):
        self.spec = spec
        self.target = target
        self.options = tuple(options)
        self.log = log
        self.source = source
        message = f"compiling {spec} for {target} failed (options: {' '.join(self.options)}):\n{log.strip()}"
        if source is not None:
            message += f"\n--- instantiated source ---\n{source}"
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.spec, self.target, self.options, self.log, self.source))
