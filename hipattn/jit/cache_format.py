"""The cache's entry files: their names and their self-checking layout.

An entry file is::

    magic (8 bytes) | format version (u32) | sha256 of body (32 bytes) | body length (u64) | body
    body = metadata length (u32) | metadata JSON | binary

Decoding checks every field and raises ``InvalidEntry`` naming the first that fails, so a corrupt or
foreign file is a miss, never a load.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import struct
from collections.abc import Mapping
from typing import Any

from .cache_safety import MAX_ENTRY_BYTES, InvalidEntry

# Bump whenever the entry layout, the key's fields or the meaning of a cached binary changes: old
# entries then simply stop matching (the version is hashed into every key) and age out via `clear`.
CACHE_FORMAT_VERSION = 1

MAGIC = b"HIPATTN\x1a"  # \x1a stops `type`/`cat`-style tools from dumping the binary
HEADER = struct.Struct("<8sI32sQ")  # magic, format version, sha256(body), len(body)
_META_LEN = struct.Struct("<I")

# The only names the cache writes, and so the only ones `clear` deletes: an entry per key, and the
# temporary file a writer publishes it from.
ENTRY_SUFFIX = ".hipattn"
TEMP_SUFFIX = ".tmp"
ENTRY_NAME = re.compile(r"[0-9a-f]{64}" + re.escape(ENTRY_SUFFIX))
TEMP_NAME = re.compile(r"\.[0-9a-f]{64}\.[0-9]+\.[0-9a-f]{12}" + re.escape(TEMP_SUFFIX))


def entry_name(key: str) -> str:
    if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise ValueError(f"cache key {key!r} is not a lowercase sha256 hex digest")
    return f"{key}{ENTRY_SUFFIX}"


def temp_name(key: str) -> str:
    """Unique per process and call, for a file in the entry's own directory (so that os.replace is an
    atomic rename)."""
    return f".{key}.{os.getpid()}.{secrets.token_hex(6)}{TEMP_SUFFIX}"


def text_field(metadata: Mapping[str, Any], field: str, default: str | None = None) -> str:
    value = metadata[field] if default is None else metadata.get(field, default)
    if not isinstance(value, str):
        raise InvalidEntry(f"its {field} is not text")
    return value


def encode(metadata: Mapping[str, Any], binary: bytes) -> bytes:
    meta = json.dumps(metadata, sort_keys=True).encode()
    body = _META_LEN.pack(len(meta)) + meta + binary
    return HEADER.pack(MAGIC, CACHE_FORMAT_VERSION, hashlib.sha256(body).digest(), len(body)) + body


def decode_header(header: bytes) -> tuple[bytes, int]:
    """(sha256 of the body, body length) from an entry's header; InvalidEntry naming what is wrong."""
    if len(header) < HEADER.size:
        raise InvalidEntry(f"truncated ({len(header)} bytes, shorter than the header)")
    magic, version, checksum, length = HEADER.unpack_from(header)
    if magic != MAGIC:
        raise InvalidEntry("not a hipattn cache entry (wrong magic)")
    if version != CACHE_FORMAT_VERSION:
        raise InvalidEntry(f"format version {version}, expected {CACHE_FORMAT_VERSION}")
    if length > MAX_ENTRY_BYTES:
        raise InvalidEntry(f"its header announces {length} bytes, more than any entry ({MAX_ENTRY_BYTES})")
    return checksum, length


def decode_body(body: bytes, checksum: bytes) -> tuple[dict[str, Any], bytes]:
    """(metadata, binary) of a body whose sha256 must be ``checksum``."""
    if hashlib.sha256(body).digest() != checksum:
        raise InvalidEntry("checksum mismatch (corrupt)")
    if len(body) < _META_LEN.size:
        raise InvalidEntry("body too short for its metadata")
    (meta_length,) = _META_LEN.unpack_from(body)
    meta_end = _META_LEN.size + meta_length
    if meta_end > len(body):
        raise InvalidEntry("metadata runs past the end of the body")
    try:
        metadata = json.loads(body[_META_LEN.size : meta_end])
    except (ValueError, RecursionError) as error:  # RecursionError: metadata nested thousands deep
        raise InvalidEntry(f"unreadable metadata ({type(error).__name__})") from None
    if not isinstance(metadata, dict):
        raise InvalidEntry("metadata is not a JSON object")
    return metadata, body[meta_end:]
