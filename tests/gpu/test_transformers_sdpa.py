"""A Hugging Face Llama (built from a config: no weights to download) with
``attn_implementation="sdpa"`` and hipattn enabled as torch's flash implementation, against the same
model's eager attention in float32: logits and every parameter's gradient, eager and torch.compile'd."""

from __future__ import annotations

import pytest
import torch

import hipattn.torch as hat
from hipattn import attention

from .conftest import fresh_seed, relative_error

transformers = pytest.importorskip("transformers")

# bf16 rounding of a two-layer model: torch's own flash SDPA lands near 1e-2 here. hipattn must be
# as close to the float32 model as torch's kernel is, within a small margin.
LIMIT = 3e-2


def _model(attn_implementation: str, dtype: torch.dtype, state=None):
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation)
    if state is not None:
        model.load_state_dict(state)
    return model.to(device="cuda", dtype=dtype)


def _logits_and_gradients(model, tokens, run=None):
    """Logits and every parameter's gradient of one step of ``model`` (through ``run``, a compiled
    wrapper of it, when given)."""
    model.zero_grad(set_to_none=True)
    logits = (model if run is None else run)(input_ids=tokens).logits
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.roll(-1, 1).flatten())
    loss.backward()
    grads = {name: p.grad.float() for name, p in model.named_parameters()}
    return logits.detach().float(), grads


def _worst_error(result, reference) -> float:
    logits, grads = result
    errors = [relative_error(logits, reference[0])]
    errors += [relative_error(grads[name], reference[1][name]) for name in grads]
    return max(errors)


@pytest.fixture(scope="module")
def llama():
    """(float32 eager reference result, bf16 SDPA model, the tokens)."""
    torch.manual_seed(fresh_seed())
    reference_model = _model("eager", torch.float32)
    state = {name: t.detach().cpu() for name, t in reference_model.state_dict().items()}
    tokens = torch.randint(0, 512, (2, 384), device="cuda")
    reference = _logits_and_gradients(reference_model, tokens)
    return reference, _model("sdpa", torch.bfloat16, state), tokens


@pytest.fixture
def hipattn_forwards(monkeypatch):
    calls = []
    real = attention.forward

    def recording(*args, **kwargs):
        calls.append(kwargs.get("causal"))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "forward", recording)
    return calls


def test_llama_sdpa_on_hipattn_matches_the_float32_model(llama, hipattn_forwards):
    reference, model, tokens = llama
    torch_error = _worst_error(_logits_and_gradients(model, tokens), reference)
    assert hipattn_forwards == []
    with hat.enabled():
        result = _logits_and_gradients(model, tokens)
    assert hipattn_forwards == [True, True]  # both layers, causal, through hipattn
    error = _worst_error(result, reference)
    assert error < max(LIMIT, 1.5 * torch_error), (error, torch_error)


def test_a_compiled_llama_passes_sdpa_a_mask_so_torchs_masked_kernel_runs(llama, hipattn_forwards):
    """Under torch.compile, transformers materialises the causal mask instead of passing
    is_causal=True, so SDPA picks a masked backend (efficient attention), which hipattn does not
    replace: the model still runs, on torch's kernel, as accurately as before."""
    reference, model, tokens = llama
    with hat.enabled():
        result = _logits_and_gradients(model, tokens, run=torch.compile(model))
    assert hipattn_forwards == []
    assert _worst_error(result, reference) < LIMIT


def test_a_padding_mask_takes_torchs_masked_kernels_and_never_raises(llama, hipattn_forwards):
    _, model, tokens = llama
    mask = torch.ones_like(tokens)
    mask[0, :100] = 0
    with hat.enabled(), torch.no_grad():
        masked = model(input_ids=tokens, attention_mask=mask).logits
    assert torch.isfinite(masked[1]).all() and hipattn_forwards == []
