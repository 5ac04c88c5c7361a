"""TiledMLP equals the plain MLP / MoE block in forward and gradients, and keeps far less for backward."""

from __future__ import annotations

import pytest
import torch

from tests.unit.models._tiny import clone, logprob_kernel, padded_batch, tiny_model
from underlay.interfaces import ConfigError, InvalidInput
from underlay.models import TiledMLP, apply_tiled_mlp, packed_forward, prepare_model
from underlay.models.tiled_mlp import tiled_forward
from underlay.ops.packing import unpad


def _param_grads(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in module.parameters() if p.grad is not None]


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("tiles", [1, 3, 7])
def test_tiled_equals_plain_forward_and_grads(arch: str, tiles: int) -> None:
    # the MoE experts use grouped_mm, which has no float64: fp32 there, with fp32 tolerances
    dtype = torch.float32 if arch == "qwen3_moe" else torch.float64
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    mlp = tiny_model(arch).model.layers[0].mlp.to(dtype)
    g = torch.Generator().manual_seed(tiles)
    x = torch.randn(2, 11, 64, generator=g, dtype=dtype, requires_grad=True)
    upstream = torch.randn(2, 11, 64, generator=g, dtype=dtype)
    plain = mlp(x)
    (plain * upstream).sum().backward()
    want_x, want_p = x.grad.clone(), _param_grads(mlp)
    mlp.zero_grad()
    x.grad = None
    tiled = TiledMLP(mlp, tiles)(x)
    torch.testing.assert_close(tiled, plain, rtol=tol, atol=tol)
    (tiled * upstream).sum().backward()
    torch.testing.assert_close(x.grad, want_x, rtol=tol, atol=tol)
    got_p = _param_grads(mlp)
    assert len(got_p) == len(want_p) > 0
    for a, b in zip(got_p, want_p):
        torch.testing.assert_close(a, b, rtol=100 * tol, atol=tol)


def test_tiled_keeps_only_the_input_for_backward() -> None:
    """Bytes saved for backward during the forward pass: the plain MLP keeps [N, ffn] intermediates,
    the tiled one only its input."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.SiLU(), torch.nn.Linear(512, 64))
    x = torch.randn(2048, 64, requires_grad=True)

    def saved_bytes(fn: object) -> int:
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            if not isinstance(t, torch.nn.Parameter):
                total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(x)  # type: ignore[operator]
        out.sum().backward()  # the tiled recomputation in backward is transient, not kept
        assert x.grad is not None and x.grad.abs().sum() > 0
        x.grad = None
        return total

    plain = saved_bytes(mlp)
    tiled = saved_bytes(lambda t: tiled_forward(lambda u: mlp(u), t, 8, list(mlp.parameters())))
    assert plain >= 2 * 2048 * 512 * 4  # activation input and output, [N, ffn] each
    assert tiled <= 2048 * 64 * 4 + 4096  # x (+ scalars)
    assert tiled * 8 < plain


def test_prepare_model_tiles_every_decoder_mlp_with_exact_grads() -> None:
    ref = tiny_model("qwen3_moe")
    plain = prepare_model(clone(ref), attention="eager")
    tiled = prepare_model(clone(ref), attention="eager", tiled_mlp_tiles=4)
    assert all(isinstance(layer.mlp.__dict__.get("forward"), TiledMLP) for layer in tiled.model.layers)
    ids, mask = padded_batch([7, 5, 9], 9)
    packed = unpad(ids, mask)
    outs = []
    for model in (plain, tiled):
        out = packed_forward(model, packed, logprob_kernel=logprob_kernel())
        assert out.log_probs is not None and out.entropy is not None
        (out.log_probs.sum() + 0.5 * out.entropy.sum()).backward()
        outs.append(out.log_probs.detach())
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=0)
    for (name, a), (_, b) in zip(plain.named_parameters(), tiled.named_parameters()):
        assert a.grad is not None and b.grad is not None, name
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_no_grad_is_a_plain_call_and_bad_tiles_raise() -> None:
    mlp = tiny_model("llama").model.layers[0].mlp
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        torch.testing.assert_close(TiledMLP(mlp, 4)(x), mlp(x))
    with pytest.raises(ConfigError, match="tiles=0"):
        TiledMLP(mlp, 0)
    with pytest.raises(ConfigError, match="tiled_mlp_tiles"):
        apply_tiled_mlp(mlp, -2)
    with pytest.raises(InvalidInput, match="tiles"):
        tiled_forward(mlp, x, 0, [])


def test_tiling_under_activation_checkpointing_keeps_grads() -> None:
    """HF gradient checkpointing re-runs each decoder layer (tiled MLP included) in backward."""
    ref = tiny_model("llama")
    plain = prepare_model(clone(ref), attention="eager")
    ckpt = prepare_model(clone(ref), attention="eager", tiled_mlp_tiles=2)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, mask = padded_batch([6, 4], 6)
    packed = unpad(ids, mask)
    for model in (plain, ckpt):
        model.train()
        out = packed_forward(model, packed, logprob_kernel=logprob_kernel())
        assert out.log_probs is not None
        out.log_probs.sum().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        assert a.grad is not None and b.grad is not None, name
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5, msg=name)
