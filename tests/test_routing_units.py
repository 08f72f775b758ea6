"""The sparsity units (groups: Eq. 6, flops: the routed compute skipped), the per-module bound, and the realized
sparsity in both units, against values computed by hand in float64."""

import pytest
import torch

from wide.config import ModelDims, WideConfig
from wide.errors import WideError
from wide.routing import module_flops, module_weights, realized_sparsity, sparsity_loss

# D = 64, 4 heads of 16 (2 KV heads: the GQA attention group is 32 channels, N_G = 2), FFN 128 in 8 groups of 16
DIMS = ModelDims(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)
T = 32


def cfg(**kw):
    return WideConfig(**{"ffn_group_size": 16, "seq_len": T, **kw}).resolve(DIMS)


def by_hand() -> tuple[float, float]:
    """Per-token FLOPs of one attention / FFN module, group by group."""
    d, g_a, n_a, g_f, n_f = 64.0, 32.0, 2, 16.0, 8
    attn_group = 2 * d * g_a + 2 * g_a * d + 4 * g_a * (T + 1) / 2  # Q, O, QK^T and PV over (T + 1) / 2 keys
    ffn_group = 2 * d * g_f * 3  # gate, up, down
    return n_a * attn_group, n_f * ffn_group


def test_module_flops_and_weights_by_hand():
    a, f = by_hand()
    assert module_flops(DIMS, cfg(), T) == (a, f) == (20608.0, 49152.0)
    assert module_weights(DIMS, cfg()) == [1.0] * 4
    assert module_weights(DIMS, cfg(sparsity_unit="flops")) == [a, a, f, f]
    assert module_weights(DIMS, cfg(), "flops") == [a, a, f, f]
    assert module_weights(DIMS, cfg(routed="ffn"), "flops") == [f, f]
    # the context length is the config's (the training --seq-len), else the one given
    assert module_weights(DIMS, cfg(seq_len=None), "flops", seq_len=T) == [a, a, f, f]
    with pytest.raises(WideError, match="seq_len"):
        module_weights(DIMS, cfg(seq_len=None), "flops")


KEEP_A, KEEP_F = [0.6, 0.2], [0.5, 0.3]  # skip rates 0.4, 0.8 (attention), 0.5, 0.7 (FFN)


def test_flops_loss_by_hand():
    a, f = by_hand()
    skipped = (a * 0.4 + a * 0.8 + f * 0.5 + f * 0.7) / (2 * a + 2 * f)
    w = module_weights(DIMS, cfg(sparsity_unit="flops"))
    keeps = [torch.tensor(k) for k in KEEP_A], [torch.tensor(k) for k in KEEP_F]
    for target in (0.3, 0.5, 0.9):
        got = sparsity_loss(*keeps, target, 20.0, "global", weights=w)
        assert got.dtype == torch.float32
        assert got.item() == pytest.approx(20.0 * abs(target - skipped), rel=1e-6, abs=1e-6)
    # equal weights are Eq. 6's mean; uniform mode ignores the weights (a class's modules cost the same)
    assert sparsity_loss(*keeps, 0.5, 20.0, weights=[1.0] * 4).item() == pytest.approx(20 * 0.1, rel=1e-6)
    assert sparsity_loss(*keeps, 0.5, 20.0, "uniform", weights=w).item() == pytest.approx(
        sparsity_loss(*keeps, 0.5, 20.0, "uniform").item())


@pytest.mark.parametrize("mode", ["global", "uniform"])
def test_max_module_bound_by_hand(mode):
    keeps = [torch.tensor(k) for k in KEEP_A], [torch.tensor(k) for k in KEEP_F]
    plain = sparsity_loss(*keeps, 0.5, 20.0, mode).item()
    # skip rates 0.4, 0.8, 0.5, 0.7 over the bound 0.6: 0.2 + 0.1
    assert sparsity_loss(*keeps, 0.5, 20.0, mode, max_module=0.6).item() == pytest.approx(plain + 20 * 0.3, rel=1e-6)
    assert sparsity_loss(*keeps, 0.5, 20.0, mode, max_module=0.9).item() == pytest.approx(plain, rel=1e-6)
    # the bound's gradient reaches only the modules over it
    ka = [torch.tensor(k, requires_grad=True) for k in KEEP_A]
    (sparsity_loss(ka, [], 0.6, 1.0, mode, max_module=0.6) - sparsity_loss(ka, [], 0.6, 1.0, mode)).backward()
    assert [k.grad.item() for k in ka] == [0.0, -1.0]


def test_realized_sparsity_both_units_by_hand():
    a, f = by_hand()
    r = realized_sparsity(KEEP_A, KEEP_F, DIMS, cfg())
    assert r["groups"] == pytest.approx((0.4 + 0.8 + 0.5 + 0.7) / 4, abs=1e-12)
    assert r["flops"] == pytest.approx((a * 1.2 + f * 1.2) / (2 * a + 2 * f), abs=1e-12)
    assert r["attn"] == pytest.approx(0.6) and r["ffn"] == pytest.approx(0.6) and r["flops_context"] == T
    assert r["per_module"]["attn"] == pytest.approx([0.4, 0.8]) and r["per_module"]["ffn"] == pytest.approx([0.5, 0.7])
    # FFN-heavy skipping counts more in flops; one class mean per list gives the same units
    r = realized_sparsity([1.0, 1.0], [0.0, 0.0], DIMS, cfg())
    assert r["groups"] == 0.5 and r["flops"] == pytest.approx(f / (a + f), abs=1e-12)
    assert realized_sparsity([1.0], [0.0], DIMS, cfg())["flops"] == pytest.approx(f / (a + f), abs=1e-12)
    # an unrouted kind: its list is empty
    r = realized_sparsity([], [0.25, 0.75], DIMS, cfg(routed="ffn"))
    assert (r["groups"], r["flops"], r["attn"], r["ffn"]) == (0.5, 0.5, 0.0, 0.5)


@pytest.mark.parametrize("kw,words", [
    ({"sparsity_unit": "params"}, "sparsity unit 'params' is not one of groups, flops"),
    ({"max_module_sparsity": 0.0}, "max module sparsity 0.0 is outside (0, 1]"),
    ({"max_module_sparsity": 1.5}, "max module sparsity 1.5 is outside (0, 1]"),
    ({"max_module_sparsity": float("nan")}, "max module sparsity nan"),
    ({"seq_len": 0}, "seq_len=0"),
])
def test_config_refuses_bad_units_and_bounds(kw, words):
    with pytest.raises(WideError, match=words.replace("(", r"\(").replace(")", r"\)")):
        WideConfig(**kw)
