"""hipattn's environment switches, read one way everywhere.

``flag`` reads an on/off switch: ``1``/``0``, ``true``/``false``, ``yes``/``no`` or ``on``/``off``,
in any case, surrounding blanks ignored. ``choice`` reads one of a few named values. Unset or empty
means the default. Any other value is a ValueError naming the variable, the value and what is
accepted: a typo must not silently leave a switch in the state the user meant to change.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
_ACCEPTED_FLAGS = "1/0, true/false, yes/no or on/off (any case)"


def raw_reader(name: str) -> Callable[[], str | None]:
    """A zero-argument reader of ``name``'s raw value (None when unset), for switches read on every
    launch. ``os.environ.get`` encodes the key and decodes the value on each call (about a
    microsecond); this looks the key, encoded once, up in os.environ's own mapping, which every write
    through os.environ keeps current, so a change still applies at once."""
    data, encode, decode = (getattr(os.environ, a, None) for a in ("_data", "encodekey", "decodevalue"))
    if data is None or encode is None or decode is None:  # not CPython's os._Environ
        return lambda: os.environ.get(name)
    key = encode(name)

    def read() -> str | None:
        raw = data.get(key)
        return None if raw is None else decode(raw)

    return read


def flag(name: str, default: bool) -> bool:
    """The switch ``name`` as a bool; ``default`` when it is unset or empty."""
    raw = os.environ.get(name)
    if raw is None:  # the common case, first: this runs on every call for some switches
        return default
    value = raw.strip().lower()
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    if not value:
        return default
    raise ValueError(f"{name}={raw!r} is not a switch value; expected {_ACCEPTED_FLAGS}, or unset")


def choice(name: str, choices: Sequence[str], default: str) -> str:
    """The value of ``name``, one of ``choices`` (compared case-insensitively); ``default`` when unset or empty."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in choices:
        return value
    if not value:
        return default
    raise ValueError(f"{name}={raw!r}; expected one of {', '.join(choices)}, or unset")
