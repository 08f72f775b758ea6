import pytest
import torch

from wide.checkpoint import ROUTERS_NAME, load, save_wide
from wide.config import WideConfig
from wide.errors import WideError
from wide.model import WideModel
from wide_testutil import tiny_model


def _saved(tmp_path, model):
    wm = WideModel(model, WideConfig(ffn_group_size=32, target_sparsity=0.3))
    with torch.no_grad():
        for p in wm.router_parameters():
            p.add_(torch.randn_like(p))
    save_wide(wm, tmp_path / "ckpt", model_ref="tiny")
    return wm, tmp_path / "ckpt"


def test_round_trip(tmp_path, model):
    wm, path = _saved(tmp_path, model)
    wm2 = load(path, model=tiny_model())
    assert wm2.config == wm.config
    for k, v in wm.router_state_dict().items():
        assert torch.equal(v, wm2.router_state_dict()[k])
    x = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        assert torch.equal(wm.eval()(x).logits, wm2(x).logits)
    assert not list(path.glob(".*"))  # no temporary files left behind


def test_missing_directory(tmp_path):
    with pytest.raises(WideError, match="not found"):
        load(tmp_path / "nope", model=tiny_model())


def test_corrupt_router_file(tmp_path, model):
    _, path = _saved(tmp_path, model)
    (path / ROUTERS_NAME).write_bytes(b"\x00garbage" * 10)
    with pytest.raises(WideError, match="corrupt checkpoint file"):
        load(path, model=tiny_model())


def test_truncated_router_file(tmp_path, model):
    _, path = _saved(tmp_path, model)
    data = (path / ROUTERS_NAME).read_bytes()
    (path / ROUTERS_NAME).write_bytes(data[: len(data) // 2])
    with pytest.raises(WideError, match="corrupt checkpoint file"):
        load(path, model=tiny_model())


@pytest.mark.parametrize("garbage", [b"\x3f" * 64, b"\xff" * 64], ids=["finite", "nan"])
def test_changed_bytes_are_refused_naming_the_file(tmp_path, model, garbage):
    """Bytes overwritten inside the tensor data still parse as safetensors: the recorded SHA-256 catches them."""
    _, path = _saved(tmp_path, model)
    data = bytearray((path / ROUTERS_NAME).read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = garbage
    (path / ROUTERS_NAME).write_bytes(bytes(data))
    with pytest.raises(WideError) as e:
        load(path, model=tiny_model())
    assert str(e.value) == (f"corrupt checkpoint file {path / ROUTERS_NAME}: does not match its SHA-256 in "
                            f"base_model.json: it changed after it was saved")


def test_config_edited_by_hand_and_unrecorded_files_are_refused(tmp_path, model):
    import json

    _, path = _saved(tmp_path, model)
    cfg = json.loads((path / "wide_config.json").read_text())
    (path / "wide_config.json").write_text(json.dumps({**cfg, "target_sparsity": 0.7}))  # valid, but not what trained
    with pytest.raises(WideError, match="wide_config.json: does not match its SHA-256"):
        load(path, model=tiny_model())
    (path / "wide_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (path / "adapter").mkdir()
    (path / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(WideError, match="adapter/adapter_config.json: is not recorded in base_model.json"):
        load(path, model=tiny_model())


def test_nan_routers_saved_as_such_are_refused(tmp_path, model):
    wm = WideModel(model, WideConfig(ffn_group_size=32))
    with torch.no_grad():
        wm.ffn_routers[1].w2.bias[0] = float("nan")
    save_wide(wm, tmp_path / "ckpt", model_ref="tiny")
    with pytest.raises(WideError, match="tensor 'ffn.1.w2.bias' holds 1 NaN or infinite values"):
        load(tmp_path / "ckpt", model=tiny_model())


def test_other_base_model_weights(tmp_path, model):
    _, path = _saved(tmp_path, model)
    with pytest.raises(WideError, match="was made for base model 'tiny'"):
        load(path, model=tiny_model(seed=1))


def test_base_model_changed_in_one_middle_layer(tmp_path, model):
    """A fine-tune or merged adapter touching one layer (q_proj of layer 1 scaled by 1.01) is another base model."""
    _, path = _saved(tmp_path, model)
    other = tiny_model()
    with torch.no_grad():
        other.model.layers[1].self_attn.q_proj.weight.mul_(1.01)
    with pytest.raises(WideError, match="was made for base model 'tiny'"):
        load(path, model=other)


def test_other_base_model_dims(tmp_path, model):
    _, path = _saved(tmp_path, model)
    with pytest.raises(WideError, match="was made for a model with dims"):
        load(path, model=tiny_model(intermediate_size=256))


def test_router_shapes_that_do_not_fit(tmp_path, model):
    from safetensors.torch import save_file

    wm, path = _saved(tmp_path, model)
    sd = wm.router_state_dict()
    sd["ffn.0.w1.weight"] = torch.zeros(3, 64)
    save_file(sd, str(path / ROUTERS_NAME))
    with pytest.raises(WideError, match=r"ffn.0.w1.weight has shape \(3, 64\).*; routers.safetensors does not match "
                                        r"its SHA-256 in base_model.json: changed after it was saved\)$"):
        load(path, model=tiny_model())


def test_edited_group_size_is_named_as_an_edit(tmp_path, model):
    """A legal but different FFN group size written into wide_config.json after saving: the shape error says the
    config changed after it was saved; an empty path is refused before anything is read."""
    import json

    _, path = _saved(tmp_path, model)
    cfg = json.loads((path / "wide_config.json").read_text())
    cfg["ffn_group_size"] = 64
    (path / "wide_config.json").write_text(json.dumps(cfg))
    with pytest.raises(WideError, match=r"group sizes of .*wide_config.json; wide_config.json does not match its "
                                        r"SHA-256 in base_model.json: changed after it was saved\)$"):
        load(path, model=tiny_model())
    with pytest.raises(WideError, match="wide.load: path is empty"):
        load("", model=tiny_model())


def test_checkpoint_files_get_the_new_file_mode(tmp_path, model):
    """routers.safetensors, wide_config.json, base_model.json: 0666 & ~umask like train_log.jsonl, not 0600."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        _, path = _saved(tmp_path, model)
    finally:
        os.umask(old)
    names = sorted(p.name for p in path.iterdir())
    assert {"routers.safetensors", "wide_config.json", "base_model.json"} <= set(names)
    for name in names:
        assert stat.S_IMODE((path / name).stat().st_mode) == 0o644, name


def test_atomic_write_failure_keeps_the_previous_file(tmp_path):
    from wide.config import atomic_write, atomic_write_text

    atomic_write_text(tmp_path / "f.json", "{}")

    def boom(tmp):
        open(tmp, "w").write("partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(tmp_path / "f.json", boom)
    assert (tmp_path / "f.json").read_text() == "{}" and [p.name for p in tmp_path.iterdir()] == ["f.json"]


@pytest.mark.parametrize("field,value,words", [
    ("extra", "oops", "field 'extra' is the string 'oops'; it must be an object"),
    ("model", 123, "field 'model' is the number 123; it must be a non-empty string"),
    ("model", None, "field 'model' is null; it must be a non-empty string"),
    ("dims", "x", "field 'dims' is the string 'x'; it must be an object of the six model dims"),
    ("dims", {"num_layers": 2}, "field 'dims' is an object; it must be an object of the six model dims"),
    ("fingerprint", 7, "field 'fingerprint' is the number 7"),
    ("architecture", [], "field 'architecture' is a list; it must be a string"),
    ("files", None, "field 'files' is null; it must be an object of file name -> SHA-256"),
    ("extra", {"step": "2", "steps": 4}, "field 'extra.step' is the string '2'; it must be an integer >= 0"),
    ("bogus", 1, "unknown field(s) ['bogus']; allowed: ['model', 'fingerprint',"),
])
def test_garbled_base_model_json_is_refused_before_any_weight_loads(tmp_path, model, monkeypatch, field, value,
                                                                     words):
    """Every field of base_model.json is type-checked when it is read: one WideError naming the file and the field,
    before any base model is loaded."""
    import json
    import re

    import wide.checkpoint as C

    _, path = _saved(tmp_path, model)
    info = json.loads((path / "base_model.json").read_text())
    info[field] = value
    (path / "base_model.json").write_text(json.dumps(info))

    def no_load(*a, **k):
        raise AssertionError("a base model was loaded before base_model.json was checked")

    monkeypatch.setattr(C, "load_base_model", no_load)
    for m in (None, "some/model"):
        with pytest.raises(WideError, match=re.escape(f"corrupt {path / 'base_model.json'}: {words}")):
            load(path, model=m)
    (path / "base_model.json").write_text("[1]")
    with pytest.raises(WideError, match="it holds a list; it must be a JSON object"):
        C.read_base_info(path)
    (path / "base_model.json").write_text(json.dumps({"model": "tiny"}))
    with pytest.raises(WideError, match="field 'fingerprint' is missing"):
        C.read_base_info(path)


def test_load_refuses_bad_arguments_in_one_error(tmp_path, model, model_dir):
    """wide.load: a path that is not a path, tokenizer=True with a loaded module, a dtype given as a string: a
    WideError naming what is allowed, not a TypeError / AttributeError from inside."""
    _, path = _saved(tmp_path, model)
    for bad in (None, 123):
        with pytest.raises(WideError, match="path must be a WIDE checkpoint directory"):
            load(bad, model=tiny_model())
    with pytest.raises(WideError, match="tokenizer=True .* not an already loaded module"):
        load(path, model=tiny_model(), tokenizer=True)
    with pytest.raises(WideError, match="dtype 'bf16' must be torch.bfloat16, torch.float16, torch.float32"):
        load(path, model=str(model_dir), dtype="bf16")
    for bad in (123, 0.5, ["tiny"]):  # not a model reference: one line, not pathlib's TypeError
        with pytest.raises(WideError) as e:
            load(path, model=bad)
        assert str(e.value) == (f"model {bad!r} (type {type(bad).__name__}) is not a path: give a Hugging Face "
                                "checkpoint directory or a .gguf file (a str or os.PathLike), or 'smollm2-135m' "
                                "(wide.load also takes a loaded torch.nn.Module)")
    assert load(path, model=model_dir).config.target_sparsity == 0.3  # a Path is a model reference
    with pytest.raises(WideError, match="text is the text a dialed sparsity is fitted on: give sparsity= too"):
        load(path, model=tiny_model(), text=str(tmp_path / "calib.txt"))
    with pytest.raises(WideError, match="not found"):  # named before any weight loads
        load(path, model=str(tmp_path / "no-model"), sparsity=0.4, text=str(tmp_path / "missing.txt"))
    (tmp_path / "t.csv").write_text("text\nhello\n")
    with pytest.raises(WideError, match="t.csv"):
        load(path, model=str(tmp_path / "no-model"), sparsity=0.4, text=str(tmp_path / "t.csv"))


@pytest.mark.parametrize("name", ["tokenizer", "merge_lora", "calibrated"])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_load_flags_must_be_bools(tmp_path, model, name, value):
    _, path = _saved(tmp_path, model)
    with pytest.raises(WideError) as e:
        load(path, model=str(tmp_path / "no-model"), **{name: value})  # before the model is looked up
    assert str(e.value) == f"wide.load: {name} must be True or False, got {type(value).__name__} {value!r}"
    assert load(path, model=tiny_model(), **({name: False} if name == "tokenizer" else {name: True})) is not None


def test_load_names_a_recorded_base_model_that_moved(tmp_path, model):
    """model=None loads the base model recorded in base_model.json; when that path is gone, the error says the
    path came from the checkpoint and how to give the model instead."""
    wm = WideModel(model, WideConfig(ffn_group_size=32, target_sparsity=0.3))
    gone = tmp_path / "moved-away"
    save_wide(wm, tmp_path / "ckpt", model_ref=str(gone))
    with pytest.raises(WideError, match="records base model .*moved-away.* not there any more: give the base model"):
        load(tmp_path / "ckpt")
    assert load(tmp_path / "ckpt", model=tiny_model()).config == wm.config  # given explicitly: loads


def test_a_wide_checkpoint_given_as_the_base_model_points_to_wide(tmp_path, model):
    from wide.hub import resolve_model

    _, path = _saved(tmp_path, model)
    with pytest.raises(WideError, match="is a WIDE checkpoint .* give it as --wide"):
        resolve_model(str(path))


def test_load_in_float16(tmp_path, model, model_dir):
    """fp16 rounds weights differently from the bf16 values the fingerprint hashes: wide.load(dtype=float16) checks
    an fp32 load, then casts; a module already in fp16 is refused with the way out named."""
    wm, path = _saved(tmp_path, model)
    from wide.model import fingerprint

    half = tiny_model().half()
    assert fingerprint(half) != fingerprint(tiny_model())  # the case this test is about
    wm16 = load(path, model=str(model_dir), dtype=torch.float16, device="cpu")
    assert {p.dtype for p in wm16.base.parameters()} == {torch.float16}
    assert {p.dtype for p in wm16.router_parameters()} == {torch.float32}
    x = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        ref = wm.eval()(x).logits.double()
        got = wm16(x).logits.double()
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2
    with pytest.raises(WideError, match="already loaded in float16 cannot be checked"):
        load(path, model=half)


def test_router_file_that_is_a_directory_and_edited_dims_are_named(tmp_path, model):
    import json

    _, path = _saved(tmp_path, model)
    info = json.loads((path / "base_model.json").read_text())
    info["dims"]["intermediate_size"] = 2 * info["dims"]["intermediate_size"]
    (path / "base_model.json").write_text(json.dumps(info))
    with pytest.raises(WideError, match="the shapes it needs come from the dims recorded in .*base_model.json"):
        load(path, model=tiny_model())
    (path / ROUTERS_NAME).unlink()
    (path / ROUTERS_NAME).mkdir()
    with pytest.raises(WideError, match="routers.safetensors is a directory; it must be the safetensors file"):
        load(path, model=tiny_model())
