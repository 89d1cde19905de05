"""Pinned host buffers whose reuse is ordered by the stream, and host functions that survive graphs.

A pinned block used by an async copy may be reused only after that copy has run. The pool's rule
(docs/ARCHITECTURE.md, "The varlen preparation"): ``release_after(stream, *blocks)`` enqueues a host function at
the stream's tail; the blocks return to the free list once it has run, i.e. once everything
enqueued before it on that stream has run.

That host function is libc's ``sem_post`` with a ``sem_t*`` as its user data: C, not Python. The
runtime's callback thread never needs the GIL, so no main-thread wait that holds the GIL (a C
extension that blocks without releasing it) can deadlock against it. The pool notices completion
by polling ``sem_trywait`` from the main thread (in ``acquire`` and ``collect``). No runtime API is
called inside a host function, ever (CUDA and HIP forbid it).

Graph capture. A host node captured into a graph runs on every replay, and the captured copies
read and write the same pinned block on every replay. So blocks released while their stream is
capturing belong to the graph: they are never recycled, and they and their semaphores are kept for
the life of the process (the semaphore is simply posted again at each replay). This is bounded by
the number of captures, not replays. A future ``release_graph_resources()`` could free them when
the user destroys the graph.

``launch_python_host_func`` is for host logic that needs Python (packing metadata). Its function
pointer is one module-level trampoline, alive for the process; a per-call id passed as user data
finds the Python callable in a registry. Entries launched outside capture are dropped after they
ran; entries captured into a graph are kept forever, since a graph may replay them at any time
(the bugs this avoids, both seen in other libraries: a binding that drops the callable after its
first run makes only the first replay fire; a self-deleting closure crashes the second replay).
A Python host function needs the GIL on the callback thread: while one is pending, the main
thread must not block on the stream while holding the GIL.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from .backends.base import Backend

logger = logging.getLogger("hipattn")

MIN_BLOCK_BYTES = 4096

# glibc's sem_t is 32 bytes on x86-64 and aarch64 (16 on 32-bit targets). The storage is
# over-allocated and 8-byte aligned so any Linux libc fits; extra bytes cost nothing.
_SEM_T_BYTES = 64


def _load_libc() -> Any:
    for candidate in (None, ctypes.util.find_library("c"), "libc.so.6"):
        try:
            libc = ctypes.CDLL(candidate, use_errno=True)
            libc.sem_post  # noqa: B018 - probing that the symbol exists
            return libc
        except (OSError, AttributeError, TypeError):
            continue
    return None


_libc = _load_libc()
if _libc is not None:
    for _fn in ("sem_init", "sem_destroy", "sem_post", "sem_trywait", "sem_wait"):
        getattr(_libc, _fn).restype = ctypes.c_int
    _libc.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
    for _fn in ("sem_destroy", "sem_post", "sem_trywait", "sem_wait"):
        getattr(_libc, _fn).argtypes = [ctypes.c_void_p]
    _libc.sem_timedwait.restype = ctypes.c_int
    _libc.sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    # The int address of sem_post: what the runtime calls as `void fn(void* user_data)`. Its int
    # return value is ignored by the caller; the calling conventions agree on the argument.
    SEM_POST_ADDRESS: int | None = ctypes.cast(_libc.sem_post, ctypes.c_void_p).value
else:  # pragma: no cover - non-POSIX platforms
    SEM_POST_ADDRESS = None


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Semaphore:
    """A POSIX unnamed semaphore in memory that never moves (its address is host-function user data)."""

    __slots__ = ("_storage", "address")

    def __init__(self) -> None:
        if _libc is None:  # pragma: no cover
            raise OSError("hipattn's pinned pool needs POSIX semaphores (libc sem_post); none found")
        self._storage = (ctypes.c_uint64 * (_SEM_T_BYTES // 8))()
        self.address: int = ctypes.addressof(self._storage)
        if _libc.sem_init(self.address, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")

    def try_wait(self) -> bool:
        """Consume one post if there is one; never blocks."""
        return _libc.sem_trywait(self.address) == 0

    def post(self) -> None:
        _libc.sem_post(self.address)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until posted (False after ``timeout`` seconds). Releases the GIL while blocked."""
        if timeout is None:
            while _libc.sem_wait(self.address) != 0:  # EINTR: a signal arrived, wait again
                pass
            return True
        deadline = time.time() + timeout  # sem_timedwait takes an absolute CLOCK_REALTIME time
        spec = _Timespec(int(deadline), int((deadline % 1) * 1e9))
        return _libc.sem_timedwait(self.address, ctypes.byref(spec)) == 0

    def __del__(self) -> None:
        # Only reached once nothing can post it: pools hand in-flight and graph-owned semaphores
        # to _PROCESS_LIFETIME instead of letting them be collected.
        if _libc is not None:
            _libc.sem_destroy(self.address)


# Semaphores and blocks that a stream or a graph may still touch after their pool is gone, or that
# a captured graph posts and copies into at every replay: kept for the life of the process.
_PROCESS_LIFETIME: list[Any] = []


class PinnedBlock:
    """One pinned host buffer. ``nbytes`` is the block's size class, at least what was asked for.

    ``array`` is a NumPy uint8 view of the whole block; it is valid only while the block is held
    (between ``acquire`` and ``release_after``): after that the pool may hand it out again.
    """

    __slots__ = ("ptr", "nbytes", "array", "_state")

    def __init__(self, ptr: int, nbytes: int):
        self.ptr = ptr
        self.nbytes = nbytes
        self.array: np.ndarray = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        self._state = "free"  # free | held | in_flight | graph

    def __repr__(self) -> str:
        return f"PinnedBlock(ptr=0x{self.ptr:x}, nbytes={self.nbytes}, state={self._state})"


@dataclass(frozen=True)
class PoolStats:
    free_blocks: int
    free_bytes: int
    held_blocks: int
    held_bytes: int
    in_flight_blocks: int
    in_flight_bytes: int
    graph_blocks: int
    graph_bytes: int


def size_class(nbytes: int) -> int:
    """The power of two >= max(nbytes, 4 KiB) a request is served from."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"pinned buffer size must be an int >= 0; got {nbytes!r}")
    if nbytes <= MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    return 1 << (nbytes - 1).bit_length()


class PinnedPool:
    """A caching pool of pinned host blocks, returned to the free list in stream order. Thread-safe."""

    def __init__(self, backend: Backend):
        self._backend = backend
        self._lock = threading.Lock()
        self._free: dict[int, list[PinnedBlock]] = {}
        self._held: dict[int, PinnedBlock] = {}  # id(block) -> block
        # Per stream, tickets in enqueue order: a stream runs its host functions in order, so
        # polling stops at the first ticket not yet posted.
        self._in_flight: dict[int, deque[tuple[Semaphore, tuple[PinnedBlock, ...]]]] = {}
        self._spare_semaphores: list[Semaphore] = []
        self._graph_owned: list[tuple[Semaphore, tuple[PinnedBlock, ...]]] = []

    # ---- blocks ---------------------------------------------------------------------------------

    def acquire(self, nbytes: int) -> PinnedBlock:
        """A pinned block of at least ``nbytes``; reuses a completed one of the same size class.

        A new block is a pinned allocation, which a stream capture in global mode (PyTorch's
        default) forbids: ``reserve`` the blocks a captured call needs before capturing.
        """
        size = size_class(nbytes)
        with self._lock:
            self._collect_locked()
            free = self._free.get(size)
            if free:
                block = free.pop()
                block._state = "held"
                self._held[id(block)] = block
                return block
        # Allocate outside the lock: pinning pages is slow and needs no pool state.
        block = PinnedBlock(self._backend.host_alloc(size), size)
        block._state = "held"
        with self._lock:
            self._held[id(block)] = block
        return block

    def reserve(self, nbytes: int, count: int = 1) -> None:
        """Make sure ``count`` free blocks of ``nbytes``' size class exist (allocating the missing ones)."""
        size = size_class(nbytes)
        with self._lock:
            self._collect_locked()
            missing = count - len(self._free.get(size, ()))
        new = [PinnedBlock(self._backend.host_alloc(size), size) for _ in range(max(missing, 0))]
        with self._lock:
            self._free.setdefault(size, []).extend(new)

    def release(self, *blocks: PinnedBlock) -> None:
        """Return blocks that no stream ever used (e.g. an error before anything was enqueued)."""
        with self._lock:
            self._take_held_locked(blocks)
            for block in blocks:
                block._state = "free"
                self._free.setdefault(block.nbytes, []).append(block)

    def release_after(self, stream: int, *blocks: PinnedBlock) -> None:
        """Return ``blocks`` once everything enqueued on ``stream`` so far has run.

        Enqueues ``sem_post`` as a host function at the stream's tail. While ``stream`` is
        capturing, the blocks instead belong to the graph for good (see the module docstring).
        If enqueueing fails the blocks stay held by the caller and the error propagates.
        """
        if not blocks:
            return
        with self._lock:
            self._check_held_locked(blocks)
            semaphore = self._spare_semaphores.pop() if self._spare_semaphores else None
        if semaphore is None:
            semaphore = Semaphore()
        capturing = self._backend.stream_is_capturing(stream)
        try:
            self._backend.launch_host_func(stream, SEM_POST_ADDRESS, semaphore.address)
        except BaseException:
            with self._lock:
                self._spare_semaphores.append(semaphore)
            raise
        with self._lock:
            self._take_held_locked(blocks)
            if capturing:
                for block in blocks:
                    block._state = "graph"
                self._graph_owned.append((semaphore, blocks))
                _PROCESS_LIFETIME.append((semaphore, blocks))
            else:
                for block in blocks:
                    block._state = "in_flight"
                self._in_flight.setdefault(stream, deque()).append((semaphore, blocks))

    def collect(self) -> int:
        """Move blocks whose host function has run back to the free list; returns how many."""
        with self._lock:
            return self._collect_locked()

    def trim(self) -> int:
        """Free the pinned memory of every free block (after collecting); returns bytes freed."""
        with self._lock:
            self._collect_locked()
            blocks = [b for free in self._free.values() for b in free]
            self._free.clear()
        for block in blocks:
            block._state = "released"
            self._backend.host_free(block.ptr)
        return sum(b.nbytes for b in blocks)

    def stats(self) -> PoolStats:
        """Counts and bytes per state, after collecting (for leak tests and debugging)."""
        with self._lock:
            self._collect_locked()
            free = [b for blocks in self._free.values() for b in blocks]
            held = list(self._held.values())
            in_flight = [b for q in self._in_flight.values() for _, bs in q for b in bs]
            graph = [b for _, bs in self._graph_owned for b in bs]
        return PoolStats(
            len(free), sum(b.nbytes for b in free),
            len(held), sum(b.nbytes for b in held),
            len(in_flight), sum(b.nbytes for b in in_flight),
            len(graph), sum(b.nbytes for b in graph),
        )  # fmt: skip

    def __del__(self) -> None:
        # A host function may still post these semaphores and copies still use these blocks:
        # never free them under a running stream; leaking them is the safe choice.
        in_flight = getattr(self, "_in_flight", None)
        # At interpreter exit the module's globals may already be None: the process ends anyway.
        if in_flight and _PROCESS_LIFETIME is not None:
            _PROCESS_LIFETIME.extend(in_flight.values())

    # ---- internals (call with the lock held) -----------------------------------------------------

    def _collect_locked(self) -> int:
        returned = 0
        for stream in list(self._in_flight):
            tickets = self._in_flight[stream]
            while tickets and tickets[0][0].try_wait():
                semaphore, blocks = tickets.popleft()
                self._spare_semaphores.append(semaphore)  # its count is back to 0: reusable
                for block in blocks:
                    block._state = "free"
                    self._free.setdefault(block.nbytes, []).append(block)
                returned += len(blocks)
            if not tickets:
                del self._in_flight[stream]
        return returned

    def _check_held_locked(self, blocks: tuple[PinnedBlock, ...]) -> None:
        for block in blocks:
            if self._held.get(id(block)) is not block:
                raise ValueError(f"{block!r} is not held from this pool (released twice, or another pool's)")
        if len({id(b) for b in blocks}) != len(blocks):
            raise ValueError("the same block was passed twice")

    def _take_held_locked(self, blocks: tuple[PinnedBlock, ...]) -> None:
        self._check_held_locked(blocks)
        for block in blocks:
            del self._held[id(block)]


# ---- one pool per device, for hipattn's own launch paths --------------------------------------

_device_pools: dict[tuple[Backend, int], PinnedPool] = {}
_device_pools_lock = threading.Lock()


def device_pool(backend: Backend, device: int) -> PinnedPool:
    """The process's pinned pool for ``device`` (created on first use; one per backend and device).

    Launch paths that stage data through pinned memory (varlen_prep's host path) share it, so its
    blocks are recycled across calls. Thread-safe; the pool itself is too.
    """
    key = (backend, device)
    pool = _device_pools.get(key)  # the hot path: a dict hit, no lock
    if pool is None:
        with _device_pools_lock:
            pool = _device_pools.get(key)
            if pool is None:
                pool = _device_pools[key] = PinnedPool(backend)
    return pool


# ---- Python host functions --------------------------------------------------------------------


@dataclass
class _HostFuncEntry:
    fn: Any
    keep: bool  # captured into a graph: may run again at any replay


_host_funcs: dict[int, _HostFuncEntry] = {}
# Ids whose one-shot function has run; appended on the callback thread (list.append is atomic
# under the GIL), drained on the main thread. No lock is taken inside a callback: if the main
# thread held that lock while waiting on the stream, the callback could never finish.
_host_funcs_done: list[int] = []
_host_func_ids = itertools.count(1)
_host_funcs_lock = threading.Lock()
host_func_errors: list[BaseException] = []  # exceptions raised by Python host functions, newest last


def _trampoline(user_data: int | None) -> None:
    entry = _host_funcs.get(user_data or 0)
    if entry is None:  # nothing to run: dropped, or an id from a destroyed graph
        return
    try:
        entry.fn()
    except BaseException as error:  # an exception cannot cross the C boundary: record and log it
        host_func_errors.append(error)
        logger.exception("hipattn: a Python host function raised")
    if not entry.keep:
        # Only mark it: dropping the last reference here could run a finaliser that calls the
        # runtime (a framework array freeing device memory), which host functions must never do.
        # The main thread drops it on its next launch_python_host_func / collect_host_funcs call.
        _host_funcs_done.append(user_data or 0)


# The one C-callable for every Python host function: a module global, so its address stays valid
# for the whole process, including across graph replays.
_TRAMPOLINE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_trampoline)
TRAMPOLINE_ADDRESS: int = ctypes.cast(_TRAMPOLINE, ctypes.c_void_p).value


def collect_host_funcs() -> int:
    """Drop one-shot Python host functions that have run; returns how many. Main thread only."""
    with _host_funcs_lock:
        done = len(_host_funcs_done)
        ids = _host_funcs_done[:done]
        del _host_funcs_done[:done]
        for key in ids:
            _host_funcs.pop(key, None)
    return len(ids)


def pending_host_funcs() -> int:
    """How many Python host functions the registry still holds (one-shot pending + graph-owned)."""
    return len(_host_funcs)


def launch_python_host_func(backend: Backend, stream: int, fn: Any) -> None:
    """Enqueue ``fn()`` (no arguments) on ``stream`` as a host function.

    ``fn`` runs on the runtime's callback thread and needs the GIL there; it must call no
    runtime API and should not drop the last reference to framework arrays. Exceptions it raises
    are logged and appended to ``host_func_errors``. Captured into a graph, ``fn`` runs at every
    replay and is kept for the life of the process.
    """
    if not callable(fn):
        raise TypeError(f"launch_python_host_func needs a callable; got {type(fn).__name__}")
    collect_host_funcs()
    key = next(_host_func_ids)
    keep = backend.stream_is_capturing(stream)
    with _host_funcs_lock:
        _host_funcs[key] = _HostFuncEntry(fn, keep)
    try:
        backend.launch_host_func(stream, TRAMPOLINE_ADDRESS, key)
    except BaseException:
        with _host_funcs_lock:
            _host_funcs.pop(key, None)
        raise
