"""Routing plots (Figures 9 and 10) from a routed tiny model."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("matplotlib")

from wide.config import WideConfig  # noqa: E402
from wide.errors import WideError  # noqa: E402
from wide.model import WideModel  # noqa: E402


@pytest.fixture
def wm(model):
    torch.manual_seed(0)
    return WideModel(model, WideConfig(ffn_group_size=16), init_keep=0.5)


def test_layer_profile_png(wm, tmp_path):
    from wide.eval.perplexity import perplexity
    from wide.eval.plots import plot_layer_profile

    ids = torch.randint(0, 128, (3, 16))
    rep = perplexity(wm, ids, progress=False)
    wm.record_masks = True
    wm(ids)
    for r in rep["per_layer"]:  # the skipped fraction of the model's own argmax masks
        for kind in ("attn", "ffn"):
            skipped = 1 - wm.record.masks[(kind, r["layer"])].double().mean().item()
            assert r[kind] == pytest.approx(skipped, abs=1e-9)
    p = plot_layer_profile(rep["per_layer"], tmp_path / "fig9" / "profile.png", title="tiny", target=0.5)
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_token_routing_png(wm, tokenizer, tmp_path):
    from wide.eval.plots import plot_token_routing, token_routing

    text = "w1 w2 w3 w4 w5 w6"
    r = token_routing(wm, tokenizer, text)
    assert r["tokens"] == text.split() and r["attn"].shape == (2, 6) and r["ffn"].shape == (2, 6)
    # per token, the executed fraction equals the model's own argmax masks
    wm.record_masks = True
    wm(torch.tensor([tokenizer(text)["input_ids"]]))
    torch.testing.assert_close(r["ffn"][1], wm.record.masks[("ffn", 1)][0].float().mean(-1))
    p = plot_token_routing(r, tmp_path / "fig10.png", title="tiny")
    assert p.read_bytes()[:4] == b"\x89PNG"


def test_plot_bad_input(tmp_path):
    from wide.eval.plots import plot_layer_profile, plot_token_routing

    with pytest.raises(WideError, match="empty"):
        plot_layer_profile([], tmp_path / "a.png")
    with pytest.raises(WideError, match="must end in .png"):
        plot_layer_profile([{"layer": 0, "attn": 0.1, "ffn": 0.2}], tmp_path / "a.pdf")
    with pytest.raises(WideError, match="nothing to plot"):
        plot_token_routing({"tokens": ["a"], "attn": None, "ffn": None}, tmp_path / "b.png")
