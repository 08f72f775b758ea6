import json

import pytest

from wide.config import ModelDims, WideConfig
from wide.errors import WideError

SMOL = ModelDims(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536)
LLAMA8B = ModelDims(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                    intermediate_size=14336)


def test_defaults_resolve_to_gqa_group():
    c = WideConfig().resolve(SMOL)
    assert c.attn_group_size == 192 and c.ffn_group_size == 128
    assert c.n_groups(SMOL) == (3, 12)
    assert WideConfig().resolve(LLAMA8B).attn_group_size == 512


def test_legal_group_sizes():
    assert SMOL.legal_attn_group_sizes() == [64, 192, 576]
    assert SMOL.legal_ffn_group_sizes() == [16, 32, 64, 128, 256, 512]
    assert LLAMA8B.legal_ffn_group_sizes() == [16, 32, 64, 128, 256, 512, 1024, 2048]


@pytest.mark.parametrize("s", [-0.1, 1.0, 1.5, float("nan")])
def test_sparsity_outside_range(s):
    with pytest.raises(WideError, match="outside \\[0, 1\\)"):
        WideConfig(target_sparsity=s)


def test_alpha_negative():
    with pytest.raises(WideError, match="alpha=-1"):
        WideConfig(alpha=-1)


@pytest.mark.parametrize("g", [8, 96, 100])
def test_ffn_group_not_power_of_two(g):
    with pytest.raises(WideError, match=f"G={g}"):
        WideConfig(ffn_group_size=g)


def test_ffn_group_not_dividing():
    with pytest.raises(WideError, match="does not divide the intermediate size 1536"):
        WideConfig(ffn_group_size=1024).resolve(SMOL)


@pytest.mark.parametrize("g", [32, 100, 128, 384])
def test_attn_group_bad(g):
    with pytest.raises(WideError, match="multiple of head_dim=64"):
        WideConfig(attn_group_size=g).resolve(SMOL)


def test_bad_mode_and_routed():
    with pytest.raises(WideError, match="sparsity mode"):
        WideConfig(sparsity_mode="layerwise")
    with pytest.raises(WideError, match="routed"):
        WideConfig(routed="qkv")


def test_tau_schedule_end_points():
    c = WideConfig(tau_start=5.0, tau_end=0.5)
    assert c.tau_at(0, 100) == 5.0
    assert c.tau_at(99, 100) == pytest.approx(0.5)
    assert c.tau_at(49.5, 100) == pytest.approx(2.75)
    assert c.tau_at(0, 1) == 0.5


def test_json_round_trip(tmp_path):
    c = WideConfig(target_sparsity=0.25, ffn_group_size=64, sparsity_mode="uniform", routed="ffn")
    c.save(tmp_path)
    assert json.loads((tmp_path / "wide_config.json").read_text())["target_sparsity"] == 0.25
    assert WideConfig.load(tmp_path) == c


def test_json_corrupt(tmp_path):
    (tmp_path / "wide_config.json").write_text("{not json")
    with pytest.raises(WideError, match="corrupt"):
        WideConfig.load(tmp_path)
    (tmp_path / "wide_config.json").write_text('{"bogus": 1}')
    with pytest.raises(WideError, match="unknown WideConfig keys"):
        WideConfig.load(tmp_path)


@pytest.mark.parametrize("g", [0, -64])
def test_attn_group_non_positive(g):
    """`wide info --attn-group-size 0` was a ZeroDivisionError in resolve()."""
    with pytest.raises(WideError, match=f"attention group size G={g} must be a positive multiple of head_dim"):
        WideConfig(attn_group_size=g)


@pytest.mark.parametrize("g", [0, -128])
def test_ffn_group_non_positive(g):
    with pytest.raises(WideError, match=f"FFN group size G={g} must be a power of two >= 16"):
        WideConfig(ffn_group_size=g)


BAD_TYPES = [  # field, JSON value, words of the expected type
    ("ffn_group_size", "abc", "an integer"),
    ("ffn_group_size", 128.0, "an integer"),
    ("ffn_group_size", True, "an integer"),
    ("attn_group_size", "192", "an integer or null"),
    ("router_rank", 16.5, "an integer"),
    ("target_sparsity", "0.5", "a number"),
    ("alpha", None, "a number"),
    ("tau_start", [5.0], "a number"),
    ("sparsity_mode", 1, "a string"),
    ("method", None, "a string"),
]


@pytest.mark.parametrize("field,value,words", BAD_TYPES, ids=[f"{f}={v!r}" for f, v, _ in BAD_TYPES])
def test_from_dict_wrong_type(field, value, words):
    with pytest.raises(WideError) as e:
        WideConfig.from_dict({field: value})
    msg = str(e.value)
    assert f"{field}={value!r}" in msg and f"must be {words}" in msg and type(value).__name__ in msg


def test_from_dict_accepts_json_ints_for_floats():
    c = WideConfig.from_dict({"target_sparsity": 0, "alpha": 1, "tau_start": 2, "tau_end": 1, "attn_group_size": None})
    assert c.target_sparsity == 0 and c.alpha == 1


def test_load_wrong_type_names_file_and_field(tmp_path):
    (tmp_path / "wide_config.json").write_text(json.dumps({**WideConfig().to_dict(), "ffn_group_size": "abc"}))
    with pytest.raises(WideError) as e:
        WideConfig.load(tmp_path)
    msg = str(e.value)
    assert msg.startswith("corrupt ") and "wide_config.json" in msg and "ffn_group_size='abc'" in msg
    assert "\n" not in msg
    (tmp_path / "wide_config.json").write_text(json.dumps({"ffn_group_size": 128, "colour": "red"}))
    with pytest.raises(WideError, match=r"unknown WideConfig keys \['colour'\]"):
        WideConfig.load(tmp_path)


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_atomic_write_text_mode(tmp_path, umask):
    """Atomic writers give the mode of a new file (0666 & ~umask), not mkstemp's 0600."""
    import os
    import stat

    from wide.config import atomic_write_text, new_file_mode

    old = os.umask(umask)
    try:
        assert new_file_mode() == 0o666 & ~umask
        atomic_write_text(tmp_path / "a.json", "{}\n")
        with open(tmp_path / "plain.txt", "w") as f:  # what a direct write gets
            f.write("x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode) == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "plain.txt"]


@pytest.mark.parametrize("method", ["wide", "skipgpt"])
def test_router_rank_above_hidden_size_is_refused(method):
    assert WideConfig(router_rank=576, method=method).resolve(SMOL).router_rank == 576  # D itself is allowed
    with pytest.raises(WideError, match=r"router rank r=100000 must be at most the hidden size D=576"):
        WideConfig(router_rank=100000, method=method).resolve(SMOL)
