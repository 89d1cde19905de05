"""The registry: spec -> loaded function, a dict hit on the hot path, compiled once under races."""

from __future__ import annotations

import logging
import threading

import pytest
from support.fake_backend import FAKE_FAMILY, FakeBackend

from hipattn.backends.base import CompiledKernel
from hipattn.errors import CompileError, DriverError, HipattnError
from hipattn.jit.cache import DiskCache
from hipattn.jit.registry import LoadedKernel, Registry, compile_inputs, compile_spec
from hipattn.jit.target import Target

SPEC = FAKE_FAMILY.spec(dtype="bf16", head_dim=64)


@pytest.fixture
def cache(tmp_path) -> DiskCache:
    return DiskCache(tmp_path / "cache")


def test_miss_compiles_and_loads_for_the_device_arch(cache):
    backend = FakeBackend(device_arch="sm_90a")
    registry = Registry(backend, cache)
    kernel = registry.get_kernel(SPEC, 0)
    assert isinstance(kernel, LoadedKernel)
    assert (kernel.spec, kernel.device, kernel.target.arch) == (SPEC, 0, "sm_90a")
    assert kernel.params is FAKE_FAMILY.params
    assert kernel.function[1].startswith(b"sm_90a|hipattn::fake_copy<hipattn::bf16_t, 64>")
    assert kernel.lowered_name == kernel.function[2]
    assert (registry.compile_count, registry.load_count) == (1, 1)


def test_second_get_is_a_dict_hit_that_touches_nothing(cache):
    backend = FakeBackend()
    registry = Registry(backend, cache)
    first = registry.get_kernel(SPEC, 0)
    backend.calls.clear()
    assert registry.get_kernel(SPEC, 0) is first
    assert backend.calls == []  # no compile, no load, not even a device query
    assert (registry.compile_count, registry.load_count) == (1, 1)


def test_each_device_loads_its_own_module_from_one_compile(cache):
    backend = FakeBackend()
    registry = Registry(backend, cache)
    on_0, on_1 = registry.get_kernel(SPEC, 0), registry.get_kernel(SPEC, 1)
    assert on_0 is not on_1 and on_1.device == 1
    assert (backend.compiles, registry.load_count) == (1, 2)


def test_a_new_process_reads_the_disk_cache(cache):
    Registry(FakeBackend(), cache).get_kernel(SPEC, 0)
    backend = FakeBackend()
    registry = Registry(backend, DiskCache(cache.directory))
    registry.get_kernel(SPEC, 0)
    assert (backend.compiles, registry.compile_count, registry.load_count) == (0, 0, 1)


def test_threads_racing_for_one_spec_compile_and_load_once(cache):
    backend = FakeBackend(compile_seconds=0.2)
    registry = Registry(backend, cache)
    start = threading.Barrier(8)
    results: list[LoadedKernel] = []
    errors: list[BaseException] = []

    def worker():
        start.wait()
        try:
            results.append(registry.get_kernel(SPEC, 0))
        except BaseException as error:  # reported below; a thread's exception would vanish
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(results) == 8 and all(r is results[0] for r in results)
    assert backend.compiles == 1 and backend.calls.count("load_function") == 1
    assert (registry.compile_count, registry.load_count) == (1, 1)


def test_different_specs_do_not_wait_for_each_other(cache):
    # Each compile takes 0.3 s; four specs on four threads finish in about one compile's time
    # only if compiles of different specs run concurrently.
    import time

    backend = FakeBackend(compile_seconds=0.3)
    registry = Registry(backend, cache)
    specs = [FAKE_FAMILY.spec(dtype=t, head_dim=d) for t in ("fp16", "bf16") for d in (64, 128)]
    threads = [threading.Thread(target=registry.get_kernel, args=(spec, 0)) for spec in specs]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert backend.compiles == 4
    assert time.perf_counter() - began < 0.9


def test_target_the_compiler_cannot_handle_is_a_clear_error(cache):
    backend = FakeBackend(compilable=False)
    registry = Registry(backend, cache)
    with pytest.raises(
        HipattnError, match=r"cannot compile fake_copy\[dtype=bf16, head_dim=64\] for sm_90.*fakecc"
    ):
        registry.get_kernel(SPEC, 0)
    assert backend.compiles == 0
    with pytest.raises(HipattnError, match="amd target gfx90a"):
        compile_spec(SPEC, Target.parse("gfx90a"), FakeBackend(), cache)


def test_compile_error_propagates_and_is_not_cached(cache):
    backend = FakeBackend()
    backend.fail_with = "error: expected ';'"
    registry = Registry(backend, cache)
    with pytest.raises(CompileError, match="expected ';'") as raised:
        registry.get_kernel(SPEC, 0)
    assert raised.value.spec == SPEC.canonical()
    backend.fail_with = None
    assert registry.get_kernel(SPEC, 0).spec == SPEC
    assert backend.compiles == 2


def test_launch_forwards_to_the_backend_unchanged(cache):
    backend = FakeBackend()
    kernel = Registry(backend, cache).get_kernel(SPEC, 0)
    params = kernel.params.new(x=0x1000, n=7)
    kernel.launch((3, 2, 1), (256, 1, 1), 1024, 0xABC, params)
    assert backend.launches == [(kernel.function, (3, 2, 1), (256, 1, 1), 1024, 0xABC, params)]


def test_shared_memory_reservation_reaches_the_backend_only_when_it_grows(cache):
    backend = FakeBackend()
    kernel = Registry(backend, cache).get_kernel(SPEC, 0)
    for nbytes in (64 << 10, 32 << 10, 64 << 10, 96 << 10):
        kernel.reserve_dynamic_shared_memory(nbytes)
    assert backend.calls.count("set_max_dynamic_shared_memory") == 2


class RefusesBinaries(FakeBackend):
    """A backend whose runtime will not load binaries that start with ``refused``."""

    def __init__(self, refused: bytes = b"stale"):
        super().__init__()
        self.refused = refused

    def load_function(self, binary: bytes, lowered_name: str):
        if binary.startswith(self.refused):
            self._record("load_function")
            raise DriverError("cuModuleLoadData", 200, "CUDA_ERROR_INVALID_IMAGE")
        return super().load_function(binary, lowered_name)


def test_cached_binary_that_fails_to_load_is_discarded_and_rebuilt(cache, caplog):
    backend = RefusesBinaries()
    key = compile_inputs(SPEC, backend.device_target(0), backend).key
    stale = CompiledKernel(binary=b"stale binary that verifies", lowered_name="_Zstale", log="")
    cache.put(key, stale, {"spec": SPEC.canonical(), "family": SPEC.family.name, "arch": "sm_90"})
    registry = Registry(backend, cache)
    with caplog.at_level(logging.WARNING, logger="hipattn"):
        kernel = registry.get_kernel(SPEC, 0)
    assert kernel.function[1].startswith(b"sm_90|")
    assert backend.compiles == 1 and registry.compile_count == 1
    assert any("does not load" in r.getMessage() for r in caplog.records)
    # The rebuilt entry replaced the stale one: a new process loads it without compiling.
    fresh_backend = RefusesBinaries()
    Registry(fresh_backend, DiskCache(cache.directory)).get_kernel(SPEC, 1)
    assert fresh_backend.compiles == 0


def test_fresh_binary_that_fails_to_load_too_raises(cache):
    backend = RefusesBinaries(refused=b"")  # every binary
    key = compile_inputs(SPEC, backend.device_target(0), backend).key
    cache.put(key, CompiledKernel(b"stale", "_Zstale", ""), {"spec": SPEC.canonical(), "family": SPEC.family.name,
                                                              "arch": "sm_90"})
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_IMAGE"):
        Registry(backend, cache).get_kernel(SPEC, 0)
    assert backend.compiles == 1 and backend.calls.count("load_function") == 2


def test_a_load_failure_of_a_fresh_compile_is_not_retried(cache):
    backend = RefusesBinaries(refused=b"")
    with pytest.raises(DriverError):
        Registry(backend, cache).get_kernel(SPEC, 0)
    assert backend.compiles == 1 and backend.calls.count("load_function") == 1
