"""Which calls may replay a validated launch (hipattn.launch_plans.signature), on the CPU: forward
calls, and the kind of call, which keeps forward and KV-cache plans apart.

A replay skips every check that does not depend on the pointers, so the signature must hold every
fact those checks read, and no call the full path would judge differently may share one.
tests/gpu/test_forward_plans.py and tests/gpu/test_kvcache.py replay real launches.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hipattn import launch_plans  # noqa: E402

SCALARS = (9, 9, None, False)


def _signature(arrays, scalars, stream, kind="forward"):
    return launch_plans.signature(kind, arrays, scalars, stream, (3, 4))


def _arrays(q=None, out=None, lse=None):
    q = torch.empty(72, 16, 128, dtype=torch.bfloat16) if q is None else q
    cu = torch.zeros(9, dtype=torch.int32)
    return (q, q, q, out, lse, cu, cu, None, None)


def test_equal_calls_share_a_signature_and_any_layout_change_makes_another():
    base = _signature(_arrays(), SCALARS, None)
    assert base is not None and base == _signature(_arrays(), SCALARS, None)
    q = torch.empty(72, 16, 128, dtype=torch.bfloat16)
    for changed in (q.to(torch.float16), q[:, :8], q.transpose(0, 1).contiguous().transpose(0, 1),
                    torch.empty(72, 16, 64, dtype=torch.bfloat16)):
        assert _signature(_arrays(changed), SCALARS, None) != base
    given = _signature(_arrays(out=q, lse=torch.empty(16, 72)), SCALARS, None)
    assert given is not None and given != base


def test_scalars_are_told_apart_by_type_as_the_checks_do():
    true = _signature(_arrays(), (9, 9, None, True), None)
    assert true != _signature(_arrays(), (9, 9, None, 1), None)
    assert _signature(_arrays(), (9, 9, 0.5, False), None) != _signature(
        _arrays(), (9, 9, 0.25, False), None)


@pytest.mark.parametrize("make_call", [
    lambda: (_arrays(q=torch.nn.Parameter(torch.empty(72, 16, 128))), SCALARS, None),  # a subclass
    lambda: (_arrays(q=np.empty((72, 16, 128))), SCALARS, None),  # not a torch tensor
    lambda: (_arrays(), (9, 9, None, np.bool_(True)), None),  # a scalar that is not a plain Python one
    lambda: (_arrays(), (9, 9, torch.tensor(0.5), False), None),  # a mutable scalar
    lambda: (_arrays(), SCALARS, 12345),  # a stream, with outputs left to hipattn to allocate
], ids=["subclass", "numpy", "numpy scalar", "tensor scalar", "stream and allocation"])
def test_calls_a_replay_cannot_serve_have_no_signature(make_call):
    assert _signature(*make_call()) is None


@pytest.mark.parametrize("switch, value", [("HIPATTN_SMALLSEQ_KERNEL", "portable"), ("HIPATTN_SMALLSEQ", "0")])
def test_the_switches_that_choose_a_kernel_take_part(monkeypatch, switch, value):
    plain = _signature(_arrays(), SCALARS, None)
    monkeypatch.setenv(switch, value)
    assert _signature(_arrays(), SCALARS, None) not in (None, plain)


def test_the_debug_checks_and_debug_logging_take_the_full_path(monkeypatch, caplog):
    monkeypatch.setenv("HIPATTN_CHECK", "1")
    assert _signature(_arrays(), SCALARS, None) is None
    monkeypatch.delenv("HIPATTN_CHECK")
    assert _signature(_arrays(), SCALARS, None) is not None
    caplog.set_level(logging.DEBUG, logger="hipattn")  # each call's path is logged by the full path only
    assert _signature(_arrays(), SCALARS, None) is None


def test_a_sparse_tensor_has_no_signature():
    """torch reports strides for a sparse COO tensor too; its layout is what keeps it off the replay."""
    sparse = torch.zeros(72, 16, 128).to_sparse()
    assert _signature(_arrays(q=sparse), SCALARS, None) is None


def test_calls_of_another_kind_with_the_same_arrays_have_another_signature():
    assert _signature(_arrays(), SCALARS, None, kind="kvcache") not in (None, _signature(_arrays(), SCALARS, None))
