"""Fixtures shared by the CPU test modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def emulation_dirs(tmp_path_factory):
    """Build and cache directories for a module's emulated kernels: each compiles once per module."""
    return tmp_path_factory.mktemp("emulated-build"), tmp_path_factory.mktemp("emulated-cache")


@pytest.fixture
def windowed(monkeypatch):
    """``windowed(window)`` makes the raw-array checks (support.raw_calls) run with flash-attn's
    window_size=window: hipattn's forward and backward and the float64 reference all take it."""
    import functools

    from support import raw_calls, reference

    import hipattn

    def use(window):
        for name in ("forward", "backward", "backward_workspace_bytes"):
            monkeypatch.setattr(hipattn, name, functools.partial(getattr(hipattn, name), window_size=window))
        for name in ("reference_forward", "reference_backward"):
            monkeypatch.setattr(raw_calls, name, functools.partial(getattr(reference, name), window=window))

    return use


@pytest.fixture
def score_modified(monkeypatch):
    """``score_modified(device, batch, heads_q, softcap=..., alibi=..., sink=...)`` makes the raw-array
    checks (support.raw_calls) run with flash-attn's score modifiers: ``softcap`` (0.0: none), ALiBi slopes
    (``alibi``: None, "heads" for [heads_q] or "sequences" for [batch, heads_q]; reference.alibi_slopes)
    and learnable sinks (``sink``: reference.sink_logits). hipattn's forward and backward on ``device``
    and the float64 reference all take them."""
    import functools

    import numpy as np
    from support import raw_calls, reference

    import hipattn

    kept = []

    def use(device, batch, heads_q, *, softcap=0.0, alibi=None, sink=False):
        slopes = None if alibi is None else reference.alibi_slopes(batch, heads_q, per_sequence=alibi == "sequences")
        sinks = reference.sink_logits(heads_q) if sink else None
        mods = {"softcap": softcap}
        if slopes is not None:
            mods["alibi_slopes"] = device.array(slopes)
        if sinks is not None:
            kept.append(sinks.astype(np.float32))  # the sinks' memory, alive for the test
            mods["learnable_sink"] = device.array(kept[-1])
        for name in ("forward", "backward"):
            monkeypatch.setattr(hipattn, name, functools.partial(getattr(hipattn, name), **mods))
        for name in ("reference_forward", "reference_backward"):
            monkeypatch.setattr(raw_calls, name, functools.partial(getattr(reference, name), softcap=softcap,
                                                                   alibi=slopes, sink=sinks))
        return slopes

    return use


@pytest.fixture
def dropped(monkeypatch):
    """``dropped(device, dropout_p, seed)`` makes the raw-array checks (support.raw_calls) run with
    flash-attn's dropout: hipattn's forward and backward on ``device`` take ``dropout_p`` and a
    one-element int64 seed array holding ``seed``, and the float64 reference applies hipattn.dropout's
    keep mask for the same seed."""
    import functools

    import numpy as np
    from support import raw_calls

    import hipattn

    seeds = []  # the seed arrays' memory, alive for the test

    def use(device, dropout_p, seed):
        seeds.append(np.array([seed], dtype=np.int64))
        options = {"dropout_p": dropout_p, "dropout_seed": device.array(seeds[-1])}
        for name in ("forward", "backward"):
            monkeypatch.setattr(hipattn, name, functools.partial(getattr(hipattn, name), **options))
        monkeypatch.setattr(hipattn, "backward_workspace_bytes",
                            functools.partial(hipattn.backward_workspace_bytes, dropout_p=dropout_p))
        # On top of what other fixtures gave the references (a window): hipattn's functions above too.
        for name in ("reference_forward", "reference_backward"):
            monkeypatch.setattr(raw_calls, name, functools.partial(getattr(raw_calls, name), dropout=(dropout_p, seed)))

    return use


@pytest.fixture
def sinked(monkeypatch):
    """``sinked(device, sinks)`` makes the raw-array checks (support.raw_calls) run with learnable sinks
    (fp32 [heads_q] logits): hipattn's forward and backward on ``device`` take them as learnable_sink,
    and the float64 reference adds them to every row's denominator."""
    import functools

    import numpy as np
    from support import raw_calls

    import hipattn

    arrays = []  # the sinks' memory, alive for the test

    def use(device, sinks):
        arrays.append(np.ascontiguousarray(sinks, dtype=np.float32))
        for name in ("forward", "backward"):
            monkeypatch.setattr(hipattn, name,
                                functools.partial(getattr(hipattn, name), learnable_sink=device.array(arrays[-1])))
        for name in ("reference_forward", "reference_backward"):
            monkeypatch.setattr(raw_calls, name,
                                functools.partial(getattr(raw_calls, name), sink=arrays[-1].astype(np.float64)))

    return use
