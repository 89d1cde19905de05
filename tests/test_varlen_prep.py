"""The varlen work list: the packer on its own against a slow reference loop (and a model of the
kernel's block -> sequence search), the record's one layout on both sides, and the host path's
stream-async preparation run by a fake GPU.

The fake backend's "device" and pinned memory are both host buffers; it queues each stream's
operations (async copies, host functions) instead of running them, and a fake driver thread runs
them in order later: copies as real memmoves, host functions through their C addresses, as the
runtime's callback thread does. So the bytes that land in the "device" workspace are the ones the
real path would produce, and nothing can come out right by running early. The device path (the
varlen_records kernel) is checked against the packer on the GPU (tests/gpu/test_varlen_prep.py).
"""

from __future__ import annotations

import ctypes
import random
import shutil
import subprocess
import threading
from collections import defaultdict

import numpy as np
import pytest

from hipattn import catalog, pinned, varlen_prep
from hipattn.catalog.flash_backward import FLASH_BACKWARD_MMA_TILES, FLASH_BACKWARD_PARAMS
from hipattn.jit import sources
from hipattn.pinned import PinnedPool, device_pool, pending_host_funcs
from hipattn.problem import THD, Problem
from hipattn.varlen_metadata import (
    INT32_MAX,
    VARLEN_RECORD,
    VARLEN_RECORD_BYTES,
    VARLEN_RECORD_DTYPE,
    SequenceLimits,
    key_block_bound,
    key_blocks,
    pack_varlen_records,
    varlen_record_cpp,
)
from hipattn.varlen_prep import block_bytes, prepare_varlen_metadata_async, reserve_blocks

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
FIELDS = VARLEN_RECORD_DTYPE.names


# ---- the packer on its own ------------------------------------------------------------------------


def reference_records(cu_q, cu_k, block_n, limits: SequenceLimits | None, used_q=None, used_k=None) -> list[tuple[int, ...]]:
    """One sequence at a time, as kernels/common/sequence.h clamps, with the bound rule spelled out."""
    cu_q, cu_k = [int(x) for x in cu_q], [int(x) for x in cu_k]
    batch = len(cu_q) - 1
    if limits is None:
        limits = SequenceLimits(
            max([max(cu_q[b + 1] - cu_q[b], 0) for b in range(batch)], default=0),
            max([max(cu_k[b + 1] - cu_k[b], 0) for b in range(batch)], default=0),
            max(cu_q[-1], 0), max(cu_k[-1], 0),
        )  # fmt: skip
    ceil = lambda n: -(-n // block_n)  # noqa: E731
    bound = min(ceil(limits.total_k) + batch, batch * ceil(limits.max_seqlen_k))

    def bounds(cu, used, b, max_seqlen, total):
        start = min(max(cu[b], 0), total)
        length = int(used[b]) if used is not None else cu[b + 1] - cu[b]
        return start, min(max(length, 0), max_seqlen, total - start)

    records, asked, placed = [], 0, 0  # blocks asked for by the sequences so far; blocks placed
    for b in range(batch):
        query_start, query_length = bounds(cu_q, used_q, b, limits.max_seqlen_q, limits.total_q)
        key_start, key_length = bounds(cu_k, used_k, b, limits.max_seqlen_k, limits.total_k)
        asked += ceil(key_length)
        if asked > bound:  # from here on nothing fits: no keys, no blocks
            key_length = 0
        records.append((query_start, query_length, key_start, key_length, placed))
        placed += ceil(key_length)
    return records


def random_cu_seqlens(rng: random.Random, batch: int, max_len: int) -> np.ndarray:
    lengths = [rng.choice([0, rng.randrange(0, max_len + 1), max_len]) for _ in range(batch)]
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed(cu_q, cu_k, block_n, limits=None, used_q=None, used_k=None) -> np.ndarray:
    out = np.zeros(len(cu_q) - 1, dtype=VARLEN_RECORD_DTYPE)
    used = [None if u is None else np.asarray(u, np.int32) for u in (used_q, used_k)]
    return pack_varlen_records(np.asarray(cu_q, np.int32), np.asarray(cu_k, np.int32), block_n, out, limits, *used)


def as_tuples(records: np.ndarray) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in r) for r in records]


def block_owners(records: np.ndarray, block_n: int, heads_kv: int, grid: int) -> list[tuple[int, int, int] | None]:
    """What each block of the dK/dV grid does, by the rule of key_block_of (backward_mma.hip): the
    last record whose first_key_block is not past the block's key block, or nothing."""
    owners = []
    first = records["first_key_block"].astype(np.int64)
    for block in range(grid):
        work, head = block // heads_kv, block % heads_kv
        lo, hi = 0, len(records) - 1
        while lo < hi:
            mid = hi - (hi - lo) // 2
            lo, hi = (mid, hi) if first[mid] <= work else (lo, mid - 1)
        n_block = work - int(first[lo])
        blocks = key_blocks(int(records["key_length"][lo]), block_n)
        owners.append((n_block, lo, head) if 0 <= n_block < blocks else None)
    return owners


def assert_the_grid_covers_every_key_block_once(records, block_n, limits, heads_kv=2):
    batch = len(records)
    grid = key_block_bound(limits, batch, block_n) * heads_kv
    owners = block_owners(records, block_n, heads_kv, grid)
    expected = {(n, b, h) for b in range(batch) for n in range(key_blocks(int(records["key_length"][b]), block_n))
                for h in range(heads_kv)}
    real = [o for o in owners if o is not None]
    assert len(real) == len(set(real)) and set(real) == expected
    # The real blocks come first: the idle tail of the host-sized grid is one run at its end.
    assert all(o is not None for o in owners[: len(real)])


def test_a_worked_example():
    # key lengths 65, 0, 135 -> 2, 0, 3 blocks of 64: the work list is [seq 0: 0, 1 | seq 2: 2, 3, 4].
    records = packed([0, 3, 3, 10], [0, 65, 65, 200], 64)
    assert as_tuples(records) == [(0, 3, 0, 65, 0), (3, 0, 65, 0, 2), (3, 7, 65, 135, 2)]
    limits = SequenceLimits(7, 135, 10, 200)
    assert key_block_bound(limits, 3, 64) == min(4 + 3, 3 * 3)
    assert block_owners(records, 64, 1, 7) == [(0, 0, 0), (1, 0, 0), (0, 2, 0), (1, 2, 0), (2, 2, 0), None, None]


def test_batch_zero_packs_nothing():
    assert packed([0], [0], 64).shape == (0,)
    assert packed([5], [7], 64, SequenceLimits(10, 10, 10, 10)).shape == (0,)


def test_the_bound_is_the_tighter_of_two_host_facts():
    assert [key_blocks(n, 64) for n in (0, 1, 64, 65, 128)] == [0, 1, 1, 2, 2]
    # Many short sequences: max_seqlen_k bounds them better than total_k does.
    assert key_block_bound(SequenceLimits(1, 1, 1000, 1000), 1000, 128) == 1000
    # Mixed lengths: total_k does (a grid from max_seqlen_k would be 100 x 32).
    assert key_block_bound(SequenceLimits(4096, 4096, 20000, 20000), 100, 128) == 157 + 100
    assert key_block_bound(SequenceLimits(0, 0, 0, 0), 5, 64) == 0


def test_well_formed_cu_seqlens_match_the_reference_and_are_never_truncated():
    rng = random.Random()
    for _ in range(300):
        batch = rng.randrange(0, 40)
        block_n = rng.choice([16, 32, 64, 128])
        cu_q = random_cu_seqlens(rng, batch, rng.choice([1, 17, 300]))
        cu_k = random_cu_seqlens(rng, batch, rng.choice([1, 64, 1000]))
        for limits in (None, SequenceLimits(  # the host's bounds may be loose, never too tight
                int(np.diff(cu_q).max(initial=0)) + rng.randrange(0, 50), int(np.diff(cu_k).max(initial=0)) + rng.randrange(0, 50),
                int(cu_q[-1]) + rng.randrange(0, 50), int(cu_k[-1]) + rng.randrange(0, 50))):
            records = packed(cu_q, cu_k, block_n, limits)
            assert as_tuples(records) == reference_records(cu_q, cu_k, block_n, limits)
            assert np.array_equal(records["query_length"], np.diff(cu_q))
            assert np.array_equal(records["key_length"], np.diff(cu_k))
            blocks = -(-np.diff(cu_k).astype(np.int64) // block_n)
            assert np.array_equal(records["first_key_block"], (np.cumsum(blocks) - blocks)[:batch])
            if batch and limits is not None:
                assert blocks.sum() <= key_block_bound(limits, batch, block_n)
                assert_the_grid_covers_every_key_block_once(records, block_n, limits)


def test_malformed_cu_seqlens_are_clamped_and_every_block_fits_the_host_bound():
    rng = random.Random()
    for _ in range(300):
        batch = rng.randrange(1, 30)
        block_n = rng.choice([16, 64])
        limits = SequenceLimits(rng.randrange(0, 200), rng.randrange(0, 500), rng.randrange(0, 1000), rng.randrange(0, 2000))
        cu_q = np.array([rng.randrange(-2**31, 2**31) if rng.random() < 0.2 else rng.randrange(-50, 1200)
                         for _ in range(batch + 1)], np.int32)
        # Starts that go back and forth: overlapping sequences, more blocks than total_k allows.
        cu_k = np.array([rng.randrange(-50, 2500) for _ in range(batch + 1)], np.int32)
        records = packed(cu_q, cu_k, block_n, limits)
        assert as_tuples(records) == reference_records(cu_q, cu_k, block_n, limits)
        bound = key_block_bound(limits, batch, block_n)
        first = records["first_key_block"].astype(np.int64)
        end = first + -(-records["key_length"].astype(np.int64) // block_n)
        assert (np.diff(first) >= 0).all() and (first[1:] == end[:-1]).all() and (end <= bound).all()
        for side, max_seqlen, total in (("query", limits.max_seqlen_q, limits.total_q), ("key", limits.max_seqlen_k, limits.total_k)):
            start, length = records[f"{side}_start"], records[f"{side}_length"]
            assert (start >= 0).all() and (length >= 0).all() and (length <= max_seqlen).all()
            assert (start.astype(np.int64) + length <= total).all()
        assert_the_grid_covers_every_key_block_once(records, block_n, limits)


def test_sequences_past_the_bound_keep_no_blocks():
    # Four sequences all spanning the same 100 keys: 4 x 2 blocks of 64, but the bound is 2 + 4 = 6.
    limits = SequenceLimits(10, 100, 40, 100)
    records = packed([0, 10, 20, 30, 40], [0, 0, 0, 0, 100], 64, limits, used_k=[100, 100, 100, 100])
    assert key_block_bound(limits, 4, 64) == 6
    assert records["key_length"].tolist() == [100, 100, 100, 0]
    assert records["first_key_block"].tolist() == [0, 2, 4, 6]
    assert_the_grid_covers_every_key_block_once(records, 64, limits)


def test_seqused_replaces_the_lengths_and_is_clamped_the_same_way():
    rng = random.Random()
    for _ in range(200):
        batch = rng.randrange(1, 20)
        cu_q, cu_k = random_cu_seqlens(rng, batch, 100), random_cu_seqlens(rng, batch, 700)
        limits = SequenceLimits(100, 700, int(cu_q[-1]), int(cu_k[-1]))
        used_q = [rng.choice([-5, 0, rng.randrange(0, 120), INT32_MAX]) for _ in range(batch)]
        used_k = [rng.choice([-1, 0, rng.randrange(0, 800), -2**31]) for _ in range(batch)]
        for uq, uk in ((used_q, None), (None, used_k), (used_q, used_k)):
            records = packed(cu_q, cu_k, 64, limits, uq, uk)
            assert as_tuples(records) == reference_records(cu_q, cu_k, 64, limits, uq, uk)
            assert_the_grid_covers_every_key_block_once(records, 64, limits)


def test_packer_refuses_wrong_arguments():
    out = np.zeros(2, VARLEN_RECORD_DTYPE)
    with pytest.raises(ValueError, match="batch \\+ 1"):
        pack_varlen_records(np.zeros(3, np.int32), np.zeros(4, np.int32), 64, out)
    with pytest.raises(ValueError, match="VARLEN_RECORD_DTYPE"):
        pack_varlen_records(np.zeros(3, np.int32), np.zeros(3, np.int32), 64, np.zeros((2, 5), np.int32))
    with pytest.raises(ValueError, match="seqused_k has 3 entries"):
        pack_varlen_records(np.zeros(3, np.int32), np.zeros(3, np.int32), 64, out, None, None, np.zeros(3, np.int32))
    for block_n in (0, -64, 64.0, True):
        with pytest.raises(ValueError, match="block_n"):
            pack_varlen_records(np.zeros(3, np.int32), np.zeros(3, np.int32), block_n, out)
    with pytest.raises(ValueError, match="int32 block indices"):
        pack_varlen_records(np.zeros(3, np.int32), np.zeros(3, np.int32), 1, out, SequenceLimits(1, INT32_MAX, 2**20, INT32_MAX))


def test_the_launcher_sizes_the_grid_from_the_bound():
    from hipattn.ops import flash_backward

    problem = Problem(layout=THD, dtype="bf16", batch=100, heads_q=8, heads_kv=2, head_dim=128, max_seqlen_q=4096,
                      max_seqlen_k=4096, total_q=20000, total_k=20000, causal=True, softmax_scale=0.1, device=0)
    block_n = FLASH_BACKWARD_MMA_TILES[128][0].block_n  # the dK/dV row's
    bound = key_block_bound(SequenceLimits.of(problem), 100, block_n)
    assert flash_backward.dkdv_grid_blocks(problem, True, block_n) == bound * 2
    assert flash_backward.dkdv_grid_blocks(problem, False, block_n) == 4096 // block_n * 100 * 2 > bound * 2


# ---- the record's one layout, on both sides ---------------------------------------------------------


def test_record_layout_is_five_int32_in_declaration_order():
    assert FIELDS == ("query_start", "query_length", "key_start", "key_length", "first_key_block")
    assert VARLEN_RECORD_BYTES == 20 == VARLEN_RECORD.nbytes
    assert [VARLEN_RECORD_DTYPE.fields[name][1] for name in FIELDS] == [0, 4, 8, 12, 16]
    text = varlen_record_cpp()
    assert "struct VarlenSequenceRecord {" in text and "static_assert(sizeof(VarlenSequenceRecord) == 20" in text
    assert [line.strip() for line in text.splitlines() if line.startswith("  ")] == [f"int {name};" for name in FIELDS]


def test_every_kernel_that_reads_or_writes_records_declares_them_from_the_one_list():
    declaration = VARLEN_RECORD.cpp_declaration() + VARLEN_RECORD.cpp_size_assertion()
    for name in ("flash_backward_dkdv_mma", "flash_backward_dq_mma", "varlen_records"):
        family = catalog.family(name)
        assert declaration in sources.compile_unit(family)[0], name
        assert VARLEN_RECORD.cpp_declaration() in varlen_record_cpp()
    assert ("varlen_records", "const_ptr") in FLASH_BACKWARD_PARAMS.fields


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a host C++ compiler")
def test_generated_cpp_struct_has_numpys_offsets(tmp_path):
    offsets = "".join(f'  std::printf("%zu\\n", offsetof(hipattn::VarlenSequenceRecord, {name}));\n' for name in FIELDS)
    source = tmp_path / "record.cpp"
    source.write_text(f"#include <cstddef>\n#include <cstdio>\n{varlen_record_cpp()}int main() {{\n{offsets}}}\n")
    subprocess.run(["c++", "-std=c++17", str(source), "-o", str(tmp_path / "record")], check=True, timeout=120)
    printed = subprocess.run([str(tmp_path / "record")], check=True, capture_output=True, text=True).stdout.split()
    assert [int(x) for x in printed] == [VARLEN_RECORD_DTYPE.fields[name][1] for name in FIELDS]


# ---- a fake GPU ---------------------------------------------------------------------------------


class StreamBackend:
    """Pinned and "device" memory are ctypes buffers; each stream queues its operations (or, while
    capturing, records them into that stream's graph) for a fake driver to run in order."""

    def __init__(self):
        self.buffers: dict[int, ctypes.Array] = {}
        self.pinned: set[int] = set()
        self.capturing: set[int] = set()
        self.log: list[tuple[int, tuple]] = []  # (stream, operation), in enqueue order
        self.queues: dict[int, list[tuple]] = defaultdict(list)
        self.graphs: dict[int, list[tuple]] = defaultdict(list)
        self.ready = threading.Condition()
        self.fail_at: int | None = None  # the index of the enqueue call that raises
        self.fail_once = False  # False: every enqueue at that index raises (a broken stream)

    def _allocate(self, nbytes: int) -> int:
        buffer = ctypes.create_string_buffer(max(nbytes, 1))
        self.buffers[ctypes.addressof(buffer)] = buffer
        return ctypes.addressof(buffer)

    def host_alloc(self, nbytes: int) -> int:
        ptr = self._allocate(nbytes)
        self.pinned.add(ptr)
        return ptr

    def host_free(self, ptr: int) -> None:
        self.pinned.discard(ptr)
        del self.buffers[ptr]

    def device_alloc(self, nbytes: int, fill: int = 0x7F) -> int:
        ptr = self._allocate(nbytes)
        ctypes.memset(ptr, fill, nbytes)  # poison: a byte never written stays visible
        return ptr

    def where(self, ptr: int) -> str:
        for base, buffer in self.buffers.items():
            if base <= ptr < base + len(buffer):
                return "pinned" if base in self.pinned else "device"
        raise AssertionError(f"0x{ptr:x} is in no allocation")

    def _enqueue(self, stream: int, operation: tuple) -> None:
        with self.ready:
            if self.fail_at is not None and len(self.log) == self.fail_at:
                if self.fail_once:
                    self.fail_at = None
                raise RuntimeError("the stream is broken")
            self.log.append((stream, operation))
            (self.graphs if stream in self.capturing else self.queues)[stream].append(operation)
            self.ready.notify_all()

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._enqueue(stream, ("memcpy", dst, src, nbytes))

    def launch_host_func(self, stream: int, function_address: int, user_data: int) -> None:
        if not isinstance(function_address, int):
            raise TypeError("function_address must be an int")
        self._enqueue(stream, ("host_func", function_address, user_data))

    def stream_is_capturing(self, stream: int) -> bool:
        return stream in self.capturing

    def stream_synchronize(self, stream: int) -> None:
        raise AssertionError("a host-blocking stream_synchronize on the preparation path")

    def event_synchronize(self, event: int) -> None:
        raise AssertionError("a host-blocking event_synchronize on the preparation path")

    def describe(self, operation: tuple) -> str:
        if operation[0] == "memcpy":
            return f"copy {self.where(operation[2])}->{self.where(operation[1])}"
        return {pinned.TRAMPOLINE_ADDRESS: "python host function", pinned.SEM_POST_ADDRESS: "keepalive"}[operation[1]]


def execute(operations: list[tuple]) -> None:
    for operation in operations:
        if operation[0] == "memcpy":
            _, dst, src, nbytes = operation
            ctypes.memmove(dst, src, nbytes)
        else:
            _, address, user_data = operation
            _HOST_FN(address)(user_data)


def run_on_driver_thread(operations: list[tuple]) -> None:
    thread = threading.Thread(target=execute, args=(list(operations),), daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the fake driver thread hung"


def run_stream(backend: StreamBackend, stream: int) -> None:
    """What the GPU does when it reaches the end of ``stream``'s queue."""
    with backend.ready:
        operations = backend.queues.pop(stream, [])
    run_on_driver_thread(operations)


class StreamWorker(threading.Thread):
    """One stream executing concurrently with the host that enqueues onto it."""

    def __init__(self, backend: StreamBackend, stream: int):
        super().__init__(daemon=True)
        self.backend, self.stream, self.stopping = backend, stream, False
        self.rng = random.Random()

    def run(self) -> None:
        backend = self.backend
        while True:
            with backend.ready:
                while not backend.queues[self.stream] and not self.stopping:
                    backend.ready.wait()
                if not backend.queues[self.stream]:
                    return
                operation = backend.queues[self.stream].pop(0)
            if self.rng.random() < 0.05:
                threading.Event().wait(0.001)  # a slow kernel: the host runs ahead
            execute([operation])

    def finish(self) -> None:
        with self.backend.ready:
            self.stopping = True
            self.backend.ready.notify_all()
        self.join(timeout=30)
        assert not self.is_alive(), "the stream worker hung"


@pytest.fixture
def backend():
    return StreamBackend()


def upload(backend: StreamBackend, values: np.ndarray) -> int:
    ptr = backend.device_alloc(values.nbytes)
    ctypes.memmove(ptr, values.ctypes.data, values.nbytes)
    return ptr


def download(ptr: int, batch: int) -> np.ndarray:
    return np.frombuffer(ctypes.string_at(ptr, batch * VARLEN_RECORD_BYTES), VARLEN_RECORD_DTYPE)


def limits_for(cu_q: np.ndarray, cu_k: np.ndarray) -> SequenceLimits:
    return SequenceLimits(int(np.diff(cu_q).max(initial=0)), int(np.diff(cu_k).max(initial=0)), int(cu_q[-1]), int(cu_k[-1]))


def test_operations_are_enqueued_in_the_seeds_order(backend):
    pool = PinnedPool(backend)
    cu_q, cu_k = np.array([0, 3, 10], np.int32), np.array([0, 100, 130], np.int32)
    q_ptr, k_ptr, records_ptr = upload(backend, cu_q), upload(backend, cu_k), backend.device_alloc(2 * VARLEN_RECORD_BYTES)
    prepare_varlen_metadata_async(backend, pool, 5, q_ptr, k_ptr, 2, 64, records_ptr, limits=limits_for(cu_q, cu_k))
    operations = [operation for _, operation in backend.log]
    assert [backend.describe(op) for op in operations] == [
        "copy device->pinned", "copy device->pinned", "python host function", "copy pinned->device", "keepalive"]
    (_, a, src_q, n_q), (_, a_k, src_k, n_k), _, (_, dst, b, n_records), _ = operations
    assert (src_q, src_k, n_q, n_k) == (q_ptr, k_ptr, 12, 12) and a_k == a + 12  # both into block A
    assert (dst, n_records) == (records_ptr, 2 * VARLEN_RECORD_BYTES)
    assert {s for s, _ in backend.log} == {5}
    stats = pool.stats()
    assert (stats.in_flight_blocks, stats.held_blocks) == (2, 0)  # A and B wait for the keepalive
    assert download(records_ptr, 2).tobytes() == b"\x7f" * 2 * VARLEN_RECORD_BYTES, "nothing may run before the stream does"
    run_stream(backend, 5)
    assert pool.collect() == 2
    assert as_tuples(download(records_ptr, 2)) == as_tuples(packed(cu_q, cu_k, 64))


def test_end_to_end_the_workspace_receives_the_packers_bytes(backend):
    pool = PinnedPool(backend)
    rng = random.Random()
    errors_before = len(pinned.host_func_errors)
    calls = []
    for _ in range(40):  # back to back, the "GPU" far behind: every call's blocks are distinct
        batch = rng.randrange(1, 50)
        cu_q, cu_k = random_cu_seqlens(rng, batch, 300), random_cu_seqlens(rng, batch, 2000)
        limits = limits_for(cu_q, cu_k)
        q_ptr, k_ptr = upload(backend, cu_q), upload(backend, cu_k)
        records_ptr = backend.device_alloc(batch * VARLEN_RECORD_BYTES)
        prepare_varlen_metadata_async(backend, pool, 1, q_ptr, k_ptr, batch, 64, records_ptr, limits=limits)
        calls.append((batch, records_ptr, packed(cu_q, cu_k, 64, limits)))
    # Per call: block A at two offsets (both cu_seqlens) and block B; all 40 calls are pending.
    pinned_addresses = {ptr for _, op in backend.log if op[0] == "memcpy" for ptr in op[1:3] if backend.where(ptr) == "pinned"}
    assert len(pinned_addresses) == 3 * 40, "a pinned block was handed to two pending calls"
    run_stream(backend, 1)
    for batch, records_ptr, expected in calls:
        assert as_tuples(download(records_ptr, batch)) == as_tuples(expected)
    assert len(pinned.host_func_errors) == errors_before
    assert pool.collect() == 80 and pool.stats().in_flight_blocks == 0
    pinned.collect_host_funcs()


def test_two_streams_running_concurrently_with_the_host(backend):
    """The pool recycles blocks while streams are still running: a block reused before its
    keepalive would let one call's packer or copy overwrite another's bytes."""
    pool = PinnedPool(backend)
    rng = random.Random()
    workers = {stream: StreamWorker(backend, stream) for stream in (1, 2)}
    for worker in workers.values():
        worker.start()
    calls = []
    try:
        for i in range(300):
            stream = 1 + i % 2
            batch = rng.randrange(1, 20)
            cu_q, cu_k = random_cu_seqlens(rng, batch, 100), random_cu_seqlens(rng, batch, 500)
            limits = limits_for(cu_q, cu_k)
            records_ptr = backend.device_alloc(batch * VARLEN_RECORD_BYTES)
            prepare_varlen_metadata_async(backend, pool, stream, upload(backend, cu_q), upload(backend, cu_k), batch,
                                          32, records_ptr, limits=limits)
            calls.append((batch, records_ptr, packed(cu_q, cu_k, 32, limits)))
    finally:
        for worker in workers.values():
            worker.finish()
    for batch, records_ptr, expected in calls:
        assert as_tuples(download(records_ptr, batch)) == as_tuples(expected)
    pool.collect()
    stats = pool.stats()
    assert stats.in_flight_blocks == 0 and stats.held_blocks == 0
    assert stats.free_blocks < 600, "blocks are recycled, not allocated per call"
    pinned.collect_host_funcs()


def test_capture_makes_the_blocks_graph_owned_and_replays_with_new_cu_seqlens(backend):
    pool = PinnedPool(backend)
    batch, block_n = 6, 64
    limits = SequenceLimits(max_seqlen_q=50, max_seqlen_k=400, total_q=300, total_k=2400)
    q_ptr, k_ptr = backend.device_alloc(4 * (batch + 1)), backend.device_alloc(4 * (batch + 1))
    records_ptr = backend.device_alloc(batch * VARLEN_RECORD_BYTES)
    reserve_blocks(pool, batch)
    pinned.collect_host_funcs()
    functions_before = pending_host_funcs()
    allocations = len(backend.pinned)

    backend.capturing.add(3)
    prepare_varlen_metadata_async(backend, pool, 3, q_ptr, k_ptr, batch, block_n, records_ptr, limits=limits)
    backend.capturing.discard(3)

    assert len(backend.pinned) == allocations, "reserved blocks serve the capture: no pinned allocation during it"
    assert not backend.queues[3], "captured operations are graph nodes, not stream work"
    graph = list(backend.graphs[3])
    assert [backend.describe(op) for op in graph] == [
        "copy device->pinned", "copy device->pinned", "python host function", "copy pinned->device", "keepalive"]
    stats = pool.stats()
    assert (stats.graph_blocks, stats.in_flight_blocks, stats.held_blocks) == (2, 0, 0)
    assert pending_host_funcs() == functions_before + 1

    rng = random.Random()
    graph_blocks = {op[1] for op in graph if op[0] == "memcpy" and backend.where(op[1]) == "pinned"}
    for _ in range(3):  # replays, each with new contents written into the same device buffers
        cu_q, cu_k = random_cu_seqlens(rng, batch, 50), random_cu_seqlens(rng, batch, 400)
        ctypes.memmove(q_ptr, cu_q.ctypes.data, cu_q.nbytes)
        ctypes.memmove(k_ptr, cu_k.ctypes.data, cu_k.nbytes)
        run_on_driver_thread(graph)
        assert as_tuples(download(records_ptr, batch)) == as_tuples(packed(cu_q, cu_k, block_n, limits))
        pinned.collect_host_funcs()
        pool.collect()
        assert pending_host_funcs() == functions_before + 1, "a captured host function must survive replays"
        assert pool.stats().graph_blocks == 2
        fresh = pool.acquire(block_bytes(batch)[0])
        assert fresh.ptr not in graph_blocks, "a graph's pinned block was handed out again"
        pool.release(fresh)


def test_batch_zero_and_bad_arguments_enqueue_nothing(backend):
    pool = PinnedPool(backend)
    limits = SequenceLimits(10, 10, 10, 10)
    prepare_varlen_metadata_async(backend, pool, 0, 0, 0, 0, 64, 0, limits=limits)
    with pytest.raises(ValueError, match="block_n"):
        prepare_varlen_metadata_async(backend, pool, 0, 0, 0, 2, 0, 0, limits=limits)
    with pytest.raises(ValueError, match="batch"):
        prepare_varlen_metadata_async(backend, pool, 0, 0, 0, -1, 64, 0, limits=limits)
    with pytest.raises(ValueError, match="int32 block indices"):
        prepare_varlen_metadata_async(backend, pool, 0, 0, 0, 2, 1, 0, limits=SequenceLimits(1, INT32_MAX, 1, INT32_MAX))
    assert backend.log == [] and pool.stats().held_blocks == 0 and not backend.pinned


def test_a_failure_before_any_copy_returns_the_blocks(backend):
    pool = PinnedPool(backend)
    backend.fail_at = 0
    cu = upload(backend, np.array([0, 1, 2], np.int32))
    with pytest.raises(RuntimeError, match="broken"):
        prepare_varlen_metadata_async(backend, pool, 0, cu, cu, 2, 64, backend.device_alloc(2 * VARLEN_RECORD_BYTES),
                                      limits=SequenceLimits(1, 1, 2, 2))
    stats = pool.stats()
    assert (stats.held_blocks, stats.free_blocks) == (0, 2)


def test_a_failure_after_a_copy_never_frees_blocks_the_stream_may_still_use(backend, caplog):
    pool = PinnedPool(backend)
    cu = upload(backend, np.array([0, 1, 2], np.int32))
    limits = SequenceLimits(1, 1, 2, 2)
    backend.fail_at = 2  # the host function's enqueue fails; the copies are already on the stream
    with pytest.raises(RuntimeError, match="broken"):
        prepare_varlen_metadata_async(backend, pool, 0, cu, cu, 2, 64, backend.device_alloc(2 * VARLEN_RECORD_BYTES), limits=limits)
    stats = pool.stats()
    assert stats.free_blocks == 0 and stats.held_blocks == 2, "kept held (leaked), never reused under a pending copy"
    assert "leaked" in caplog.text


def test_a_failed_host_function_enqueue_hands_the_blocks_back_in_stream_order(backend):
    pool = PinnedPool(backend)
    cu = upload(backend, np.array([0, 1, 2], np.int32))
    backend.fail_at, backend.fail_once = 2, True  # only the host function's enqueue fails
    with pytest.raises(RuntimeError, match="broken"):
        prepare_varlen_metadata_async(backend, pool, 4, cu, cu, 2, 64, backend.device_alloc(2 * VARLEN_RECORD_BYTES),
                                      limits=SequenceLimits(1, 1, 2, 2))
    assert [backend.describe(op) for _, op in backend.log] == ["copy device->pinned", "copy device->pinned", "keepalive"]
    assert pool.stats().in_flight_blocks == 2
    run_stream(backend, 4)
    assert pool.collect() == 2


def test_seqused_is_copied_beside_cu_seqlens_and_packed(backend):
    pool = PinnedPool(backend)
    cu_q, cu_k = np.array([0, 3, 10, 12], np.int32), np.array([0, 100, 130, 300], np.int32)
    used_q, used_k = np.array([2, 0, 9], np.int32), np.array([100, 7, 170], np.int32)
    pointers = [upload(backend, a) for a in (cu_q, cu_k, used_q, used_k)]
    records_ptr = backend.device_alloc(3 * VARLEN_RECORD_BYTES)
    limits = SequenceLimits(10, 170, 12, 300)
    prepare_varlen_metadata_async(backend, pool, 2, *pointers[:2], 3, 64, records_ptr, limits=limits,
                                  seqused_q=pointers[2], seqused_k=pointers[3])
    operations = [operation for _, operation in backend.log]
    assert [backend.describe(op) for op in operations] == ["copy device->pinned"] * 4 + [
        "python host function", "copy pinned->device", "keepalive"]
    base = operations[0][1]
    assert [(op[1] - base, op[2], op[3]) for op in operations[:4]] == [
        (0, pointers[0], 16), (16, pointers[1], 16), (32, pointers[2], 12), (44, pointers[3], 12)]
    run_stream(backend, 2)
    assert as_tuples(download(records_ptr, 3)) == as_tuples(packed(cu_q, cu_k, 64, limits, used_q, used_k))
    assert pool.collect() == 2


def test_the_switch_picks_the_preparation_on_every_call(backend, monkeypatch):
    device_calls = []
    monkeypatch.setattr(varlen_prep, "prepare_varlen_metadata_on_device",
                        lambda *args, **kwargs: device_calls.append((args, kwargs)))
    cu = upload(backend, np.array([0, 1, 2], np.int32))
    records_ptr = backend.device_alloc(2 * VARLEN_RECORD_BYTES)
    limits = SequenceLimits(1, 1, 2, 2)

    def prepare():
        varlen_prep.prepare_varlen_records(backend, 6, 0, cu, cu, 2, 64, records_ptr, limits=limits)

    monkeypatch.delenv(varlen_prep.PREP_SWITCH, raising=False)
    prepare()
    assert len(device_calls) == 1 and backend.log == []  # the default: the kernel, nothing else
    monkeypatch.setenv(varlen_prep.PREP_SWITCH, "host")
    prepare()
    assert len(device_calls) == 1 and len(backend.log) == 5
    run_stream(backend, 6)
    assert as_tuples(download(records_ptr, 2)) == as_tuples(packed([0, 1, 2], [0, 1, 2], 64, limits))
    assert device_pool(backend, 0).collect() == 2, "the host path takes the device's pool"
    monkeypatch.setenv(varlen_prep.PREP_SWITCH, "Device")
    prepare()
    assert len(device_calls) == 2
    monkeypatch.setenv(varlen_prep.PREP_SWITCH, "gpu")
    with pytest.raises(ValueError, match="HIPATTN_VARLEN_PREP='gpu'; expected one of device, host"):
        prepare()
    assert len(device_calls) == 2 and len(backend.log) == 5
