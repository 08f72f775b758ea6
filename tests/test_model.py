import pytest
import torch

from wide.config import WideConfig
from wide.errors import WideError
from wide.model import WideModel, decoder_layers, router_param_count
from wide_testutil import tiny_model


def ids(b=2, t=12, seed=0):
    return torch.randint(0, 128, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_all_execute_equals_dense(arch):
    base = tiny_model(arch)
    x = ids()
    with torch.no_grad():
        dense = base(x).logits.clone()
        wm = WideModel(base, WideConfig(ffn_group_size=32))
        with wm.masks_fixed(attn=True, ffn=True):
            routed = wm(x).logits
    assert torch.equal(routed, dense)


def test_all_skip_ffn_gives_post_attention_residual(model):
    wm = WideModel(model, WideConfig(ffn_group_size=32))
    layer = decoder_layers(model)[1]
    seen = {}
    layer.post_attention_layernorm.register_forward_pre_hook(lambda m, a: seen.__setitem__("resid", a[0].clone()))
    layer.register_forward_hook(
        lambda m, a, out: seen.__setitem__("out", (out[0] if isinstance(out, tuple) else out).clone()))
    with torch.no_grad(), wm.masks_fixed(attn=None, ffn=False):
        wm(ids())
    assert torch.equal(seen["out"], seen["resid"])


@pytest.mark.parametrize("kind,group", [("attn", 16), ("attn", 32), ("ffn", 16), ("ffn", 64)])
def test_group_gating_matches_float64_reference(model, kind, group):
    """The input of o_proj / down_proj is the ungated input times the group mask, in float64."""
    cfg = WideConfig(attn_group_size=group if kind == "attn" else None, ffn_group_size=group if kind == "ffn" else 16)
    wm = WideModel(model, cfg)
    layer = decoder_layers(model)[0]
    target = layer.self_attn.o_proj if kind == "attn" else layer.mlp.down_proj
    n_groups = target.in_features // group
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(2, 12, n_groups, generator=g) > 0.5
    seen = {}
    target.register_forward_hook(lambda m, a, out: seen.__setitem__("gated", a[0].clone()))
    x = ids()
    with torch.no_grad():
        with wm.masks_fixed(attn=True, ffn=True):
            wm(x)
        ungated = seen["gated"].double()
        full = torch.stack([mask] + [torch.ones_like(mask)] * (len(decoder_layers(model)) - 1))
        with wm.masks_fixed(**{kind: full}, **{("ffn" if kind == "attn" else "attn"): True}):
            out = wm(x).logits
    ref = (ungated.view(2, 12, n_groups, group) * mask.double().unsqueeze(-1)).view(2, 12, -1)
    assert torch.allclose(seen["gated"].double(), ref, rtol=0, atol=1e-6)
    assert torch.isfinite(out).all()


def test_argmax_routing_deterministic(model):
    wm = WideModel(model, WideConfig(ffn_group_size=32)).eval()
    with torch.no_grad():
        a = wm(ids()).logits
        ka = [k.item() for k in wm.record.ffn_keep]
        b = wm(ids()).logits
        kb = [k.item() for k in wm.record.ffn_keep]
    assert torch.equal(a, b) and ka == kb


def test_padding_excluded_from_keep_ratio(model):
    wm = WideModel(model, WideConfig(ffn_group_size=32)).eval()
    x = ids(1, 10)
    att = torch.ones(1, 10, dtype=torch.long)
    att[0, :4] = 0
    with torch.no_grad():
        wm(x, attention_mask=att)
        padded = [k.item() for k in wm.record.ffn_keep]
        wm.record_masks = True
        wm(x, attention_mask=att)
    m = wm.record.masks[("ffn", 0)][0, 4:].float().mean().item()
    assert padded[0] == pytest.approx(m)


def test_router_param_count(model):
    wm = WideModel(model, WideConfig(ffn_group_size=32, router_rank=4))
    assert wm.router_param_count() == router_param_count(wm.dims, wm.config)
    # 2 layers x [attn: 64*4+4 + 4*2*2+2*2 ; ffn: 64*4+4 + 4*2*4+2*4]
    assert wm.router_param_count() == 2 * ((260 + 16 + 4) + (260 + 32 + 8))


def test_unsupported_architecture():
    from transformers import GPT2Config, GPT2LMHeadModel

    m = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    m.config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(WideError, match="unsupported architecture GPT2LMHeadModel"):
        WideModel(m, WideConfig())


def test_group_size_errors_name_value(model):
    with pytest.raises(WideError, match="G=24 must be a multiple of head_dim=16"):
        WideModel(model, WideConfig(attn_group_size=24))
    with pytest.raises(WideError, match="G=256 does not divide the intermediate size 128"):
        WideModel(model, WideConfig(ffn_group_size=256))


def _bpe_tokenizer(clean_up: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(["<unk>", "<eos>", "a", "b", ",", "!", "Ġ"])}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>",
                                   clean_up_tokenization_spaces=clean_up)


def test_bpe_cleanup_warning_silenced(tmp_path, monkeypatch):
    """`wide generate` printed transformers' 'Ignoring clean_up_tokenization_spaces=True for BPE tokenizer'
    warning: load_base_model turns the (ignored) flag off; decoded text is unchanged."""
    from transformers import tokenization_utils_tokenizers as tut

    from wide.hub import load_base_model, quiet_bpe_cleanup

    said = []
    monkeypatch.setattr(tut.logger, "warning_once", lambda msg, *a, **k: said.append(msg))
    raw = _bpe_tokenizer(clean_up=True)
    ids = raw("a , b !")["input_ids"]
    before = raw.decode(ids)
    assert any("Ignoring clean_up_tokenization_spaces" in m for m in said)  # the warning this test is about
    said.clear()
    d = tmp_path / "m"
    from wide_testutil import tiny_model

    tiny_model().save_pretrained(d)
    raw.save_pretrained(d)
    _, tok, _ = load_base_model(str(d), device="cpu")
    assert tok.clean_up_tokenization_spaces is False
    assert tok.decode(ids) == before and said == []
    # a non-BPE tokenizer and a forced clean-up are left alone
    from wide_testutil import tiny_tokenizer

    wl = tiny_tokenizer()
    wl.clean_up_tokenization_spaces = True
    assert quiet_bpe_cleanup(wl).clean_up_tokenization_spaces is True
    forced = _bpe_tokenizer(clean_up=True)
    forced.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    assert quiet_bpe_cleanup(forced).clean_up_tokenization_spaces is True


@pytest.mark.parametrize("make,words", [
    (lambda x: x[0], "input_ids must be an integer tensor [B, T] (batch, tokens), got (12,); a single sequence"),
    (lambda x: x.float(), "input_ids must hold integer token ids, got dtype torch.float32"),
    (lambda x: x[:, :0], "input_ids of shape (2, 0) has no tokens"),
    (lambda x: x.tolist(), "input_ids must be an integer tensor [B, T] (batch, tokens), got list"),
    (lambda x: torch.where(x == x[0, 3], 128, x), "to 128; the model's vocabulary is 0..127"),
    (lambda x: torch.where(x == x[0, 3], -1, x), "input_ids hold token ids from -1 to"),
])
def test_forward_refuses_bad_input_ids_in_one_line(model, make, words):
    wm = WideModel(model, WideConfig(ffn_group_size=32)).eval()  # as wide.load returns it
    x = ids()
    assert int(x.max()) < 128 == model.get_input_embeddings().num_embeddings
    with pytest.raises(WideError) as e, torch.no_grad():
        wm(make(x))
    assert words in str(e.value)


def test_vocabulary_check_is_an_eval_mode_check(model):
    """Out-of-vocabulary ids are refused in eval mode (a user's call); a training forward skips the host sync."""
    wm = WideModel(model, WideConfig(ffn_group_size=32)).eval()
    bad = torch.full((1, 4), 128)
    with pytest.raises(WideError, match="vocabulary is 0..127"), torch.no_grad():
        wm(bad)
    wm.train()
    with pytest.raises(IndexError):  # the embedding's own error: no sync was spent on the check
        wm(bad)


def test_forward_refuses_a_mask_that_does_not_fit(model):
    wm = WideModel(model, WideConfig(ffn_group_size=32))
    x = ids()
    with pytest.raises(WideError, match=r"attention_mask of shape \(2, 11\) does not fit input_ids \(2, 12\)"):
        wm(x, attention_mask=torch.ones(2, 11, dtype=torch.int64))
    with pytest.raises(WideError, match=r"attention_mask of shape \(1, 12\) does not fit"):
        wm(x, attention_mask=torch.ones(1, 12, dtype=torch.int64))
    with pytest.raises(WideError, match=r"attention_mask of shape \(2, 1, 12, 12\): WIDE takes a 2-D \[B, T\] padding "
                                        r"mask .* not a 4-D one"):
        wm(x, attention_mask=torch.ones(2, 1, 12, 12, dtype=torch.bool).tril())
    with pytest.raises(WideError, match=r"attention_mask of shape \(12,\): .* not a 1-D one"):
        wm(x, attention_mask=torch.ones(12, dtype=torch.int64))
    with pytest.raises(WideError, match=r"attention_mask must be a \[B, T\] tensor .* got list"):
        wm(x, attention_mask=[[1] * 12] * 2)
    with torch.no_grad():  # a longer mask is what incremental decoding with past_key_values passes
        out = wm(x, use_cache=True)
        wm(x[:, :1], attention_mask=torch.ones(2, 13, dtype=torch.int64), past_key_values=out.past_key_values)
    # ... but without a past it covers tokens that are not there (it shifted the logits silently before)
    with pytest.raises(WideError, match=r"attention_mask of shape \(2, 13\) does not fit input_ids \(2, 12\)"):
        wm(x, attention_mask=torch.ones(2, 13, dtype=torch.int64))
    wm.eval()
    for bad in (2, 0.5, -1):  # a padding mask is 0 / 1 (checked with the eval-mode vocabulary sync)
        m = torch.ones(2, 12, dtype=torch.float32 if isinstance(bad, float) else torch.int64)
        m[1, 3] = bad
        with pytest.raises(WideError, match=rf"attention_mask holds {bad!r}: a padding mask takes 1 .* or 0"), \
                torch.no_grad():
            wm(x, attention_mask=m)


def test_gguf_is_parsed_once_per_file_version(tmp_path, monkeypatch):
    """gguf_reader parses a file once per (path, size, mtime); transformers' loaders get that parse too."""
    import os

    import gguf
    import gguf.gguf_reader

    import wide.hub as hub

    parsed = []

    class Reader:
        def __init__(self, path, mode="r"):
            parsed.append(path)

    monkeypatch.setattr(gguf.gguf_reader, "GGUFReader", Reader)
    hub._parse_gguf.cache_clear()
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 10)
    a = hub.gguf_reader(f)
    with hub._gguf_parsed_once():
        assert gguf.GGUFReader(str(f)) is a is hub.gguf_reader(str(tmp_path / "." / "m.gguf"))
    assert gguf.GGUFReader is not Reader and len(parsed) == 1
    f.write_bytes(b"y" * 11)
    os.utime(f, ns=(1, 1))
    assert hub.gguf_reader(f) is not a and len(parsed) == 2
    hub._parse_gguf.cache_clear()


def test_corrupt_gguf_and_config_copies(tmp_path, model_dir):
    import wide.hub as hub

    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(WideError, match=r"GGUF file .*bad.gguf' is truncated or corrupt \(24 bytes"):
        hub.read_hf_config(hub.resolve_model(str(tmp_path / "bad.gguf")))
    src = hub.resolve_model(str(model_dir))
    a = hub.read_hf_config(src)
    a.hidden_size = 1  # a caller's change does not reach the next caller
    assert hub.read_hf_config(src).hidden_size == 64
