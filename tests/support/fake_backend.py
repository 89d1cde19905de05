"""A backend that compiles nothing, for testing the cache and the registry on any machine.

Its "binary" names the arch and the name expression it was built from, so a test can tell which
compile produced which entry. It counts compiles and records every call, and it lives in a module
of its own so that spawned processes can import it (``put_same_key`` below).
"""

from __future__ import annotations

import hashlib
import threading
import time

from hipattn.backends.base import Backend, CompiledKernel
from hipattn.backends.tensor_maps import TensorMapLayout
from hipattn.errors import CompileError
from hipattn.jit.cache import DiskCache
from hipattn.jit.params import TENSOR_MAP_BYTES, ParamsStruct, TensorMapBytes
from hipattn.jit.spec import KernelFamily
from hipattn.jit.target import NVIDIA, Target

# A family whose compile unit is real (it includes an existing kernels/ header) but whose
# "kernel" only the fake compiler ever sees.
FAKE_FAMILY = KernelFamily(
    name="fake_copy",
    source="common/types.h",
    template="hipattn::fake_copy",
    template_params=("dtype", "head_dim"),
    params=ParamsStruct("FakeCopyParams", (("x", "ptr"), ("n", "i32"))),
    shipped=lambda target: [FAKE_FAMILY.spec(dtype=t, head_dim=64) for t in ("fp16", "bf16")],
)


class FakeBackend(Backend):
    name = "fake"
    vendor = NVIDIA

    def __init__(
        self,
        identity: str = "fakecc 1.0",
        device_arch: str = "sm_90",
        compile_seconds: float = 0.0,
        compilable: bool = True,
        options: tuple[str, ...] = ("-O3",),
    ):
        self.identity = identity
        self.device_arch = device_arch
        self.compile_seconds = compile_seconds
        self.compilable = compilable
        self.options = options
        self.fail_with: str | None = None  # set to a log text to make compile raise CompileError
        self.compiles = 0
        self.calls: list[str] = []
        self.launches: list[tuple] = []
        self._lock = threading.Lock()

    def _record(self, call: str) -> None:
        with self._lock:
            self.calls.append(call)

    def compiler_identity(self) -> str:
        self._record("compiler_identity")
        return self.identity

    def compile_options(self, target: Target) -> tuple[str, ...]:
        self._record("compile_options")
        return (*self.options, f"--gpu-architecture={target.arch}")

    def can_compile_for(self, target: Target) -> bool:
        self._record("can_compile_for")
        return self.compilable and super().can_compile_for(target)

    def compile(self, source, headers, name_expression, target, options, spec_text) -> CompiledKernel:
        self._record("compile")
        with self._lock:
            self.compiles += 1
        time.sleep(self.compile_seconds)  # widens the window in which racing threads could double-compile
        if self.fail_with is not None:
            raise CompileError(spec_text, target.arch, options, self.fail_with)
        digest = hashlib.sha256((source + "".join(headers.values())).encode()).hexdigest()
        binary = f"{target.arch}|{name_expression}|{digest}".encode() + bytes(range(256))
        return CompiledKernel(binary=binary, lowered_name=f"_Z{len(name_expression)}fake", log="fake warning")

    def device_count(self) -> int:
        return 2

    def device_target(self, device: int) -> Target:
        self._record("device_target")
        return Target.parse(self.device_arch)

    def device_name(self, device: int) -> str:
        return f"Fake GPU {device}"

    def get_device(self) -> int:
        return 0

    def set_device(self, device: int) -> None:
        self._record("set_device")

    def load_function(self, binary: bytes, lowered_name: str):
        self._record("load_function")
        return ("function", binary, lowered_name)

    def set_max_dynamic_shared_memory(self, function, nbytes: int) -> None:
        self._record("set_max_dynamic_shared_memory")

    def launch(self, function, grid, block, shared_bytes, stream, params) -> None:
        self.launches.append((function, grid, block, shared_bytes, stream, params))


def _unused(self, *args, **kwargs):
    raise AssertionError("the fake backend has no memory, streams or events")


# Memory, streams, events and whatever the interface grows next: never reached by the cache or the
# registry, so every remaining abstract method becomes one that fails loudly if it ever is.
for _name in sorted(FakeBackend.__abstractmethods__):
    setattr(FakeBackend, _name, _unused)
FakeBackend.__abstractmethods__ = frozenset()


class CountingEncoder:
    """A backend whose maps spell their address and layout, counting its encodings."""

    name = "counting"

    def __init__(self):
        self.encoded: list[tuple[int, TensorMapLayout]] = []

    def encode_tensor_map(self, address, layout):
        self.encoded.append((address, layout))
        text = f"{address:x}|{layout.dims}|{layout.box}".encode()
        return TensorMapBytes.from_buffer_copy(text.ljust(TENSOR_MAP_BYTES, b"."))


class HopperWithMaps(FakeBackend):
    """A fake sm_90a whose maps spell their address (CountingEncoder's rule)."""

    def __init__(self):
        super().__init__(device_arch="sm_90a")
        self.maps = CountingEncoder()

    def encode_tensor_map(self, address, layout):
        return self.maps.encode_tensor_map(address, layout)


def put_same_key(directory: str, key: str, payload_byte: int, start, rounds: int) -> None:
    """Spawned writer: wait for the others, then publish the same key ``rounds`` times."""
    cache = DiskCache(directory)
    # Large enough that the writes of several processes overlap in time.
    compiled = CompiledKernel(binary=bytes([payload_byte]) * (4 << 20), lowered_name="_Zrace", log="")
    start.wait()
    for _ in range(rounds):
        cache.put(key, compiled, {"spec": "{}", "family": "race", "arch": "sm_90"})
    if not cache.writable:
        raise SystemExit("the writer fell back to memory")
