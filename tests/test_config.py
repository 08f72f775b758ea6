import json

import pytest

from wide.config import ModelDims, WideConfig
from wide.errors import WideError

SMOL = ModelDims(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536)
LLAMA8B = ModelDims(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336)


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
