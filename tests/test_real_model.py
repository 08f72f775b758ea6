"""The real bundled SmolLM2-135M-Instruct GGUF (slow: loads and runs a 135M model on the CPU)."""

import pytest
import torch

from wide_testutil import needs_bundled_model

pytestmark = [pytest.mark.slow, needs_bundled_model]


@pytest.fixture(scope="module")
def smol():
    """The bundled model, loaded while counting how often the GGUF file is parsed."""
    import gguf.gguf_reader

    import wide.hub as hub

    real, parses = gguf.gguf_reader.GGUFReader, []

    class Counting(real):
        def __init__(self, *a, **k):
            parses.append(a[0])
            super().__init__(*a, **k)

    hub._parse_gguf.cache_clear()
    gguf.gguf_reader.GGUFReader = Counting
    try:
        model, tok, src = hub.load_base_model(None, device="cpu")
    finally:
        gguf.gguf_reader.GGUFReader = real
    return model, tok, len(parses)


def test_config_tokenizer_and_weights_share_one_parse(smol):
    assert smol[2] == 1


def test_dims_and_all_execute_equals_dense(smol):
    from wide.config import WideConfig
    from wide.model import WideModel

    model, tok, _ = smol
    ids = tok("The capital of France is Paris. The capital of Italy is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        dense = model(ids).logits.clone()
        wm = WideModel(model, WideConfig())
        assert (wm.dims.num_layers, wm.dims.hidden_size, wm.dims.num_heads, wm.dims.num_kv_heads,
                wm.dims.head_dim, wm.dims.intermediate_size) == (30, 576, 9, 3, 64, 1536)
        assert (wm.config.attn_group_size, wm.n_attn_groups, wm.n_ffn_groups) == (192, 3, 12)
        with wm.masks_fixed(True, True):
            assert torch.equal(wm(ids).logits, dense)
        routed = wm(ids).logits
    for h in wm._handles:
        h.remove()
    assert not torch.equal(routed, dense)  # argmax routing at init skips groups
    assert tok.decode(dense[0, -1].argmax()).strip() == "Rome"


def test_short_calibration_and_reload(smol, tmp_path):
    from wide.checkpoint import load
    from wide.config import WideConfig
    from wide.data import load_texts, pack
    from wide.model import WideModel
    from wide.train.loop import CalibrationArgs, calibrate

    model, tok, _ = smol
    wm = WideModel(model, WideConfig(target_sparsity=0.5))
    blocks = pack(load_texts(None, "calib"), tok, 64, max_blocks=8)
    recs = calibrate(wm, blocks, CalibrationArgs(steps=2, batch_size=2, lr=1e-2), tmp_path, "smollm2-135m",
                     progress=False)
    assert all(torch.isfinite(torch.tensor(r["lm_loss"])) for r in recs)
    for h in wm._handles:
        h.remove()
    wm2 = load(tmp_path, model=model)
    for k, v in wm.router_state_dict().items():
        assert torch.equal(v, wm2.router_state_dict()[k])
    for h in wm2._handles:
        h.remove()
