"""Which path a call takes: small-seq when every sequence fits its tile, the flash path otherwise,
a NotImplementedError naming both reasons when neither serves the call. Decided from host facts
only (shapes, max_seqlen bounds, the device's arch), with a fake device of each arch."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from hipattn import dispatch, problem, runtime
from hipattn.arrays import raw_array
from hipattn.jit.target import Target


class _Device:
    """Just enough backend for the capability checks: the arch of device 0."""

    def __init__(self, arch: str):
        self.target = Target.parse(arch)

    def device_target(self, device: int) -> Target:
        return self.target


@pytest.fixture
def arch(monkeypatch):
    def use(name: str) -> None:
        monkeypatch.setattr(runtime, "_active", runtime.Runtime(_Device(name)))

    monkeypatch.delenv("HIPATTN_SMALLSEQ", raising=False)
    return use


def varlen(max_seqlen_q: int, max_seqlen_k: int, head_dim: int = 128) -> problem.Problem:
    batch, heads = 4, 8
    total_q, total_k = batch * max_seqlen_q, batch * max_seqlen_k
    q = raw_array(0x10000, (total_q, heads, head_dim), "bf16", 0)
    k = raw_array(0x20000000, (total_k, heads, head_dim), "bf16", 0)
    v = raw_array(0x40000000, (total_k, heads, head_dim), "bf16", 0)
    cu = raw_array(0x60000000, (batch + 1,), "int32", 0)
    return problem.describe(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen_q,
                            max_seqlen_k=max_seqlen_k)


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_sequences_within_the_tile_take_the_small_seq_path(arch, direction):
    arch("sm_90")
    assert dispatch.choose_path(varlen(17, 17), direction) == dispatch.SMALLSEQ
    assert dispatch.choose_path(varlen(1, 17), direction) == dispatch.SMALLSEQ


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("bounds", [(18, 17), (17, 18), (4096, 4096)])
def test_longer_bounds_take_the_flash_path(arch, direction, bounds):
    arch("sm_90")
    assert dispatch.choose_path(varlen(*bounds), direction) == dispatch.FLASH


def test_head_dim_96_takes_the_flash_path_even_when_short(arch):
    arch("sm_90")
    assert dispatch.choose_path(varlen(8, 8, head_dim=96), "forward") == dispatch.FLASH


def test_the_switch_turns_the_small_seq_path_off_and_the_log_says_why(arch, monkeypatch, caplog):
    arch("sm_90")
    monkeypatch.setenv("HIPATTN_SMALLSEQ", "0")
    with caplog.at_level(logging.DEBUG, logger="hipattn"):
        assert dispatch.choose_path(varlen(5, 5), "forward") == dispatch.FLASH
    assert "forward flash path: HIPATTN_SMALLSEQ=0" in caplog.text


def test_a_head_dim_no_path_serves_names_both_reasons(arch):
    arch("sm_90")
    with pytest.raises(NotImplementedError, match=r"small-seq path \(head_dim 80 .*flash path \(head_dim 80"):
        dispatch.choose_path(varlen(8, 8, head_dim=80), "forward")


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_amd_runs_the_mfma_flash_kernels_and_the_portable_small_seq_ones(arch, direction):
    arch("gfx90a")
    assert dispatch.choose_path(varlen(512, 512), direction) == dispatch.FLASH
    assert dispatch.choose_path(varlen(17, 17), direction) == dispatch.SMALLSEQ


def test_an_amd_gpu_without_mfma_gets_a_clear_error_for_long_sequences(arch):
    arch("gfx1100")
    with pytest.raises(NotImplementedError, match="the flash backward needs NVIDIA sm_80.* or AMD gfx90a/gfx94x"):
        dispatch.choose_path(varlen(512, 512), "backward")


def test_a_gpu_without_matrix_cores_gets_a_clear_error_for_long_sequences(arch):
    arch("sm_75")
    with pytest.raises(NotImplementedError, match="needs NVIDIA sm_80"):
        dispatch.choose_path(varlen(64, 64), "forward")


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("name", ["sm_90a", "sm_80", "gfx90a"])
def test_dropout_keeps_short_calls_on_the_small_seq_path(arch, direction, name):
    """Every small-seq kernel drops as the flash kernels do: dropout does not change the path."""
    arch(name)
    short = varlen(17, 17)
    assert dispatch.choose_path(dataclasses.replace(short, dropout_p=0.1), direction) == dispatch.SMALLSEQ
    assert dispatch.choose_path(dataclasses.replace(varlen(18, 17), dropout_p=0.1), direction) == dispatch.FLASH


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("name", ["sm_90a", "sm_80", "gfx90a"])
def test_learnable_sinks_take_the_small_seq_path_when_short(arch, direction, name):
    """The small-seq forwards add the sinks in their last normalization, as the flash ones do, and the
    backwards of both read them through the LSE: sinks change no path."""
    arch(name)
    short = dataclasses.replace(varlen(9, 17), sink=True)
    assert dispatch.choose_path(short, direction) == dispatch.SMALLSEQ
    assert dispatch.choose_path(dataclasses.replace(varlen(18, 17), sink=True), direction) == dispatch.FLASH
