"""The varlen metadata: the packer on its own against a slow reference loop, the record's one layout
on both sides, and the stream-async preparation run by a fake GPU.

The fake backend's "device" and pinned memory are both host buffers; it queues each stream's
operations (async copies, host functions) instead of running them, and a fake driver thread runs
them in order later: copies as real memmoves, host functions through their C addresses, as the
runtime's callback thread does. So the bytes that land in the "device" workspace are the ones the
real path would produce, and nothing can come out right by running early.
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

from hipattn import pinned
from hipattn.pinned import PinnedPool, pending_host_funcs
from hipattn.varlen_metadata import (
    VARLEN_RECORD,
    VARLEN_RECORD_BYTES,
    VARLEN_RECORD_DTYPE,
    SequenceLimits,
    key_block_splits,
    pack_split_offsets,
    varlen_record_cpp,
)
from hipattn.varlen_prep import block_bytes, prepare_varlen_metadata_async, reserve_blocks

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
FIELDS = VARLEN_RECORD_DTYPE.names


# ---- the packer on its own ------------------------------------------------------------------------


def reference_records(cu_q, cu_k, block_n, limits: SequenceLimits | None) -> list[tuple[int, ...]]:
    """One sequence at a time, as kernels/common/sequence.h clamps, with the overflow rule spelled out."""
    cu_q, cu_k = [int(x) for x in cu_q], [int(x) for x in cu_k]
    batch = len(cu_q) - 1
    if limits is None:
        limits = SequenceLimits(
            max([max(cu_q[b + 1] - cu_q[b], 0) for b in range(batch)], default=0),
            max([max(cu_k[b + 1] - cu_k[b], 0) for b in range(batch)], default=0),
            max(cu_q[-1], 0), max(cu_k[-1], 0),
        )  # fmt: skip
    capacity = -(-limits.max_seqlen_k // block_n) * limits.total_q

    def bounds(cu, b, max_seqlen, total):
        start = min(max(cu[b], 0), total)
        length = max(cu[b + 1] - cu[b], 0)
        return start, min(length, max_seqlen, total - start)

    records, offset = [], 0
    for b in range(batch):
        query_start, query_length = bounds(cu_q, b, limits.max_seqlen_q, limits.total_q)
        key_start, key_length = bounds(cu_k, b, limits.max_seqlen_k, limits.total_k)
        splits = (key_length + block_n - 1) // block_n
        rows = splits * query_length
        if offset + rows > capacity:  # does not fit: nothing for this sequence, offset clamped
            records.append((query_start, 0, key_start, key_length, splits, min(offset, capacity)))
        else:
            records.append((query_start, query_length, key_start, key_length, splits, offset))
        offset += rows
    return records


def random_cu_seqlens(rng: random.Random, batch: int, max_len: int) -> np.ndarray:
    lengths = [rng.choice([0, rng.randrange(0, max_len + 1), max_len]) for _ in range(batch)]
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed(cu_q, cu_k, block_n, limits=None) -> np.ndarray:
    out = np.zeros(len(cu_q) - 1, dtype=VARLEN_RECORD_DTYPE)
    return pack_split_offsets(np.asarray(cu_q, np.int32), np.asarray(cu_k, np.int32), block_n, out, limits)


def as_tuples(records: np.ndarray) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in r) for r in records]


def test_a_worked_example():
    # key lengths 65, 0, 135 -> 2, 0, 3 blocks of 64; query lengths 3, 0, 7 -> slices of 6, 0, 21 rows.
    records = packed([0, 3, 3, 10], [0, 65, 65, 200], 64)
    assert as_tuples(records) == [(0, 3, 0, 65, 2, 0), (3, 0, 65, 0, 0, 6), (3, 7, 65, 135, 3, 6)]


def test_batch_zero_packs_nothing():
    assert packed([0], [0], 64).shape == (0,)
    assert packed([5], [7], 64, SequenceLimits(10, 10, 10, 10)).shape == (0,)


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
            assert np.array_equal(records["key_splits"], -(-np.diff(cu_k) // block_n))
            rows = records["key_splits"].astype(np.int64) * records["query_length"]
            assert np.array_equal(records["dq_accum_row_offset"], np.concatenate([[0], np.cumsum(rows)[:-1]])[:batch])


def test_malformed_cu_seqlens_are_clamped_and_every_slice_fits_the_host_bound():
    rng = random.Random()
    for _ in range(300):
        batch = rng.randrange(1, 30)
        block_n = rng.choice([16, 64])
        limits = SequenceLimits(rng.randrange(0, 200), rng.randrange(0, 500), rng.randrange(0, 1000), rng.randrange(0, 2000))
        cu_q = np.array([rng.randrange(-2**31, 2**31) if rng.random() < 0.2 else rng.randrange(-50, 1200)
                         for _ in range(batch + 1)], np.int32)
        cu_k = np.array([rng.randrange(-50, 2500) for _ in range(batch + 1)], np.int32)
        records = packed(cu_q, cu_k, block_n, limits)
        assert as_tuples(records) == reference_records(cu_q, cu_k, block_n, limits)
        capacity = limits.dq_accum_rows(block_n)
        end = records["dq_accum_row_offset"].astype(np.int64) + records["key_splits"].astype(np.int64) * records["query_length"]
        assert (end <= capacity).all()
        for side, max_seqlen, total in (("query", limits.max_seqlen_q, limits.total_q), ("key", limits.max_seqlen_k, limits.total_k)):
            start, length = records[f"{side}_start"], records[f"{side}_length"]
            assert (start >= 0).all() and (length >= 0).all() and (length <= max_seqlen).all()
            assert (start.astype(np.int64) + length <= total).all()


def test_packer_refuses_wrong_arguments():
    out = np.zeros(2, VARLEN_RECORD_DTYPE)
    with pytest.raises(ValueError, match="batch \\+ 1"):
        pack_split_offsets(np.zeros(3, np.int32), np.zeros(4, np.int32), 64, out)
    with pytest.raises(ValueError, match="VARLEN_RECORD_DTYPE"):
        pack_split_offsets(np.zeros(3, np.int32), np.zeros(3, np.int32), 64, np.zeros((2, 6), np.int32))
    with pytest.raises(ValueError, match="block_n"):
        pack_split_offsets(np.zeros(3, np.int32), np.zeros(3, np.int32), 0, out)
    with pytest.raises(ValueError, match="int32 row offsets"):
        pack_split_offsets(np.zeros(3, np.int32), np.zeros(3, np.int32), 1, out, SequenceLimits(1, 2**20, 2**20, 2**20))


def test_key_block_splits():
    assert [key_block_splits(n, 64) for n in (0, 1, 64, 65, 128)] == [0, 1, 1, 2, 2]


# ---- the record's one layout, on both sides ---------------------------------------------------------


def test_record_layout_is_six_int32_in_declaration_order():
    assert FIELDS == ("query_start", "query_length", "key_start", "key_length", "key_splits", "dq_accum_row_offset")
    assert VARLEN_RECORD_BYTES == 24 == VARLEN_RECORD.nbytes
    assert [VARLEN_RECORD_DTYPE.fields[name][1] for name in FIELDS] == [0, 4, 8, 12, 16, 20]
    text = varlen_record_cpp()
    assert "struct VarlenSequenceRecord {" in text and "static_assert(sizeof(VarlenSequenceRecord) == 24" in text
    assert [line.strip() for line in text.splitlines() if line.startswith("  ")] == [f"int {name};" for name in FIELDS]


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
    q_ptr, k_ptr, metadata = upload(backend, cu_q), upload(backend, cu_k), backend.device_alloc(2 * VARLEN_RECORD_BYTES)
    prepare_varlen_metadata_async(backend, pool, 5, q_ptr, k_ptr, 2, 64, metadata, limits=limits_for(cu_q, cu_k))
    operations = [operation for _, operation in backend.log]
    assert [backend.describe(op) for op in operations] == [
        "copy device->pinned", "copy device->pinned", "python host function", "copy pinned->device", "keepalive"]
    (_, a, src_q, n_q), (_, a_k, src_k, n_k), _, (_, dst, b, n_records), _ = operations
    assert (src_q, src_k, n_q, n_k) == (q_ptr, k_ptr, 12, 12) and a_k == a + 12  # both into block A
    assert (dst, n_records) == (metadata, 2 * VARLEN_RECORD_BYTES)
    assert {s for s, _ in backend.log} == {5}
    stats = pool.stats()
    assert (stats.in_flight_blocks, stats.held_blocks) == (2, 0)  # A and B wait for the keepalive
    assert download(metadata, 2).tobytes() == b"\x7f" * 48, "nothing may run before the stream does"
    run_stream(backend, 5)
    assert pool.collect() == 2
    assert as_tuples(download(metadata, 2)) == as_tuples(packed(cu_q, cu_k, 64))


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
        metadata = backend.device_alloc(batch * VARLEN_RECORD_BYTES)
        prepare_varlen_metadata_async(backend, pool, 1, q_ptr, k_ptr, batch, 64, metadata, limits=limits)
        calls.append((batch, metadata, packed(cu_q, cu_k, 64, limits)))
    # Per call: block A at two offsets (both cu_seqlens) and block B; all 40 calls are pending.
    pinned_addresses = {ptr for _, op in backend.log if op[0] == "memcpy" for ptr in op[1:3] if backend.where(ptr) == "pinned"}
    assert len(pinned_addresses) == 3 * 40, "a pinned block was handed to two pending calls"
    run_stream(backend, 1)
    for batch, metadata, expected in calls:
        assert as_tuples(download(metadata, batch)) == as_tuples(expected)
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
            metadata = backend.device_alloc(batch * VARLEN_RECORD_BYTES)
            prepare_varlen_metadata_async(backend, pool, stream, upload(backend, cu_q), upload(backend, cu_k), batch,
                                          32, metadata, limits=limits)
            calls.append((batch, metadata, packed(cu_q, cu_k, 32, limits)))
    finally:
        for worker in workers.values():
            worker.finish()
    for batch, metadata, expected in calls:
        assert as_tuples(download(metadata, batch)) == as_tuples(expected)
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
    metadata = backend.device_alloc(batch * VARLEN_RECORD_BYTES)
    reserve_blocks(pool, batch)
    pinned.collect_host_funcs()
    functions_before = pending_host_funcs()
    allocations = len(backend.pinned)

    backend.capturing.add(3)
    prepare_varlen_metadata_async(backend, pool, 3, q_ptr, k_ptr, batch, block_n, metadata, limits=limits)
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
        assert as_tuples(download(metadata, batch)) == as_tuples(packed(cu_q, cu_k, block_n, limits))
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
    with pytest.raises(ValueError, match="int32 row offsets"):
        prepare_varlen_metadata_async(backend, pool, 0, 0, 0, 2, 1, 0, limits=SequenceLimits(1, 2**20, 2**20, 2**20))
    assert backend.log == [] and pool.stats().held_blocks == 0 and not backend.pinned


def test_a_failure_before_any_copy_returns_the_blocks(backend):
    pool = PinnedPool(backend)
    backend.fail_at = 0
    cu = upload(backend, np.array([0, 1, 2], np.int32))
    with pytest.raises(RuntimeError, match="broken"):
        prepare_varlen_metadata_async(backend, pool, 0, cu, cu, 2, 64, backend.device_alloc(48),
                                      limits=SequenceLimits(1, 1, 2, 2))
    stats = pool.stats()
    assert (stats.held_blocks, stats.free_blocks) == (0, 2)


def test_a_failure_after_a_copy_never_frees_blocks_the_stream_may_still_use(backend, caplog):
    pool = PinnedPool(backend)
    cu = upload(backend, np.array([0, 1, 2], np.int32))
    limits = SequenceLimits(1, 1, 2, 2)
    backend.fail_at = 2  # the host function's enqueue fails; the copies are already on the stream
    with pytest.raises(RuntimeError, match="broken"):
        prepare_varlen_metadata_async(backend, pool, 0, cu, cu, 2, 64, backend.device_alloc(48), limits=limits)
    stats = pool.stats()
    assert stats.free_blocks == 0 and stats.held_blocks == 2, "kept held (leaked), never reused under a pending copy"
    assert "leaked" in caplog.text


def test_a_failed_host_function_enqueue_hands_the_blocks_back_in_stream_order(backend):
    pool = PinnedPool(backend)
    cu = upload(backend, np.array([0, 1, 2], np.int32))
    backend.fail_at, backend.fail_once = 2, True  # only the host function's enqueue fails
    with pytest.raises(RuntimeError, match="broken"):
        prepare_varlen_metadata_async(backend, pool, 4, cu, cu, 2, 64, backend.device_alloc(48),
                                      limits=SequenceLimits(1, 1, 2, 2))
    assert [backend.describe(op) for _, op in backend.log] == ["copy device->pinned", "copy device->pinned", "keepalive"]
    assert pool.stats().in_flight_blocks == 2
    run_stream(backend, 4)
    assert pool.collect() == 2
