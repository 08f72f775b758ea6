import pytest
import torch

from wide.routing import Router, argmax_mask, gumbel_hard_mask, masked_mean, sparsity_loss


def test_router_shapes_and_dtype():
    r = Router(32, 5, 4)
    x = torch.randn(2, 7, 32, dtype=torch.bfloat16)
    logits = r(x)
    assert logits.shape == (2, 7, 5, 2) and logits.dtype == torch.float32


def test_straight_through_gradient_reaches_w1_w2():
    torch.manual_seed(0)
    r = Router(16, 4, 3)
    x = torch.randn(3, 5, 16)
    m = gumbel_hard_mask(r(x), tau=1.0)
    assert set(m.unique().tolist()) <= {0.0, 1.0}
    (m * torch.randn_like(m)).sum().backward()
    for p in (r.w1.weight, r.w1.bias, r.w2.weight, r.w2.bias):
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_gumbel_follows_softmax_probability():
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 0.0]]).expand(20000, 2)  # P(execute) = sigmoid(1)
    m = gumbel_hard_mask(logits, tau=3.0)
    assert m.mean().item() == pytest.approx(torch.sigmoid(torch.tensor(1.0)).item(), abs=0.015)


def test_argmax_is_deterministic_and_class0_executes():
    torch.manual_seed(0)
    r = Router(16, 4, 3)
    x = torch.randn(3, 5, 16)
    a, b = argmax_mask(r(x)), argmax_mask(r(x))
    assert a.dtype == torch.bool and torch.equal(a, b)
    logits = torch.tensor([[2.0, 1.0], [1.0, 2.0]])
    assert argmax_mask(logits).tolist() == [True, False]


def test_masked_mean_ignores_padding():
    mask = torch.tensor([[[1.0, 1.0], [0.0, 0.0], [0.0, 1.0]]])  # [1, 3, 2]
    valid = torch.tensor([[True, False, True]])
    assert masked_mean(mask, valid).item() == pytest.approx(3 / 4)
    assert masked_mean(mask, None).item() == pytest.approx(3 / 6)


def test_sparsity_loss_global_by_hand():
    # keeps: attn 0.6, 0.2 -> sparsities 0.4, 0.8; ffn 0.5, 0.3 -> 0.5, 0.7; mean = 0.6
    attn = [torch.tensor(0.6), torch.tensor(0.2)]
    ffn = [torch.tensor(0.5), torch.tensor(0.3)]
    assert sparsity_loss(attn, ffn, 0.5, 20.0, "global").item() == pytest.approx(20 * 0.1)
    assert sparsity_loss(attn, ffn, 0.6, 20.0, "global").item() == pytest.approx(0.0, abs=1e-6)


def test_sparsity_loss_uniform_by_hand():
    # attn sparsity mean 0.6, ffn 0.6 -> global 0 at S=0.6, uniform also 0; at S=0.5: 20/2*(0.1+0.1)=2
    attn = [torch.tensor(0.6), torch.tensor(0.2)]
    ffn = [torch.tensor(0.5), torch.tensor(0.3)]
    assert sparsity_loss(attn, ffn, 0.5, 20.0, "uniform").item() == pytest.approx(2.0)
    # attn 0.9 sparsity, ffn 0.1: global mean 0.5 -> 0 loss; uniform = 10*(0.4+0.4) = 8
    attn, ffn = [torch.tensor(0.1)], [torch.tensor(0.9)]
    assert sparsity_loss(attn, ffn, 0.5, 20.0, "global").item() == pytest.approx(0.0, abs=1e-6)
    assert sparsity_loss(attn, ffn, 0.5, 20.0, "uniform").item() == pytest.approx(8.0)


def test_sparsity_loss_one_module_and_errors():
    assert sparsity_loss([], [torch.tensor(0.25)], 0.5, 2.0, "uniform").item() == pytest.approx(2 * 0.25)
    with pytest.raises(ValueError):
        sparsity_loss([], [], 0.5, 1.0)
    with pytest.raises(ValueError, match="mode"):
        sparsity_loss([torch.tensor(0.5)], [], 0.5, 1.0, "nope")
