import json

import pytest
import torch

from wide_testutil import tiny_model
from wide.config import WideConfig
from wide.errors import WideError
from wide.modeling import WideModel
from wide.training import STATE_NAME, CalibrationArgs, calibrate, lr_lambda, micro_batch


def blocks(n=12, t=16):
    return torch.randint(0, 128, (n, t), generator=torch.Generator().manual_seed(3))


def run(tmp, steps_total, stop_after=None, resume=False, save_every=2, tied=False):
    wm = WideModel(tiny_model(tie_word_embeddings=tied), WideConfig(ffn_group_size=32, target_sparsity=0.5))
    args = CalibrationArgs(steps=steps_total, batch_size=3, grad_accum=2, lr=1e-2, warmup_steps=1, save_every=save_every)
    if stop_after is not None:  # simulate an interrupted run: stop early by raising from the callback
        class Stop(Exception):
            pass

        def cb(r):
            if r["step"] == stop_after:
                raise Stop
        try:
            calibrate(wm, blocks(), args, tmp, "tiny", progress=False, on_step=cb)
        except Stop:
            pass
        return wm
    calibrate(wm, blocks(), args, tmp, "tiny", progress=False, resume=resume)
    return wm


def losses(path):
    return [(r["step"], r["lm_loss"], r["sparsity_loss"]) for r in map(json.loads, path.read_text().splitlines())]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-embeddings"])
def test_resume_gives_identical_losses(tmp_path, tied):
    """Interrupted and resumed = uninterrupted. Tied embeddings (SmolLM2, the bundled default) once broke
    resume: torch listed the frozen tied lm_head in the saved state, which then never matched."""
    a = run(tmp_path / "a", 6, tied=tied)
    # interrupted after step 5; last checkpoint at step 4, so step 5 is redone on resume
    run(tmp_path / "b", 6, stop_after=5, tied=tied)
    st = torch.load(tmp_path / "b" / STATE_NAME, weights_only=True)
    assert all(k.startswith(("attn_routers.", "ffn_routers.")) for k in st["model"]), sorted(st["model"])[:3]
    if tied:  # a state written before the fix also held the frozen tied alias: it must still resume
        from wide.training import atomic_torch_save

        st["model"]["base.lm_head.weight"] = torch.zeros(128, 64)
        atomic_torch_save(st, tmp_path / "b" / STATE_NAME)
    b = run(tmp_path / "b", 6, resume=True, tied=tied)
    la, lb = losses(tmp_path / "a" / "train_log.jsonl"), losses(tmp_path / "b" / "train_log.jsonl")
    assert [s for s, *_ in lb] == [1, 2, 3, 4, 5, 6]
    assert la == lb
    for k, v in a.router_state_dict().items():
        assert torch.equal(v, b.router_state_dict()[k])


def test_routers_train_base_frozen(tmp_path):
    wm = WideModel(tiny_model(), WideConfig(ffn_group_size=32))
    base_before = {k: v.clone() for k, v in wm.base.state_dict().items()}
    r_before = {k: v.clone() for k, v in wm.router_state_dict().items()}
    recs = calibrate(wm, blocks(), CalibrationArgs(steps=3, batch_size=2, lr=1e-2), tmp_path, "tiny", progress=False)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert recs[0]["tau"] == 5.0 and recs[-1]["tau"] == pytest.approx(0.5)
    assert all(torch.equal(v, wm.base.state_dict()[k]) for k, v in base_before.items())
    assert any(not torch.equal(v, wm.router_state_dict()[k]) for k, v in r_before.items())
    assert not wm.stochastic and not wm.training
    assert (tmp_path / STATE_NAME).is_file() and (tmp_path / "routers.safetensors").is_file()


def test_sparsity_loss_drives_sparsity(tmp_path):
    wm = WideModel(tiny_model(), WideConfig(ffn_group_size=32, target_sparsity=0.9, alpha=50.0), init_keep=0.9)
    recs = calibrate(wm, blocks(), CalibrationArgs(steps=40, batch_size=2, lr=5e-2), tmp_path, "tiny", progress=False)
    first = (recs[0]["attn_sparsity"] + recs[0]["ffn_sparsity"]) / 2
    last = (recs[-1]["attn_sparsity"] + recs[-1]["ffn_sparsity"]) / 2
    assert first < 0.3 and last > 0.7


def test_resume_errors(tmp_path):
    wm = WideModel(tiny_model(), WideConfig(ffn_group_size=32))
    with pytest.raises(WideError, match="no train_state.pt"):
        calibrate(wm, blocks(), CalibrationArgs(steps=2), tmp_path, "tiny", resume=True, progress=False)
    (tmp_path / STATE_NAME).write_bytes(b"not a checkpoint")
    with pytest.raises(WideError, match="corrupt training state"):
        calibrate(wm, blocks(), CalibrationArgs(steps=2), tmp_path, "tiny", resume=True, progress=False)


def test_resume_with_other_settings(tmp_path):
    run(tmp_path, 2)
    wm = WideModel(tiny_model(), WideConfig(ffn_group_size=32, target_sparsity=0.5))
    with pytest.raises(WideError, match="other settings"):
        calibrate(wm, blocks(), CalibrationArgs(steps=4, batch_size=3), tmp_path, "tiny", resume=True, progress=False)


def test_lr_schedule_and_micro_batches():
    assert lr_lambda(0, 4, 100) == pytest.approx(0.25)
    assert lr_lambda(4, 4, 100) == pytest.approx(1.0)
    assert lr_lambda(100, 4, 100) == pytest.approx(0.0)
    b = blocks(5, 4)
    seen = torch.cat([micro_batch(b, k, 1, seed=0) for k in range(5)])
    assert sorted(seen[:, 0].tolist()) == sorted(b[:, 0].tolist())  # one epoch visits every block once
    assert torch.equal(micro_batch(b, 7, 2, seed=0), micro_batch(b, 7, 2, seed=0))


def test_bad_args():
    with pytest.raises(WideError, match="--steps 0"):
        CalibrationArgs(steps=0).validate()
    with pytest.raises(WideError, match="--lr"):
        CalibrationArgs(lr=0.0).validate()


def test_interrupted_checkpoint_is_flagged_on_load(tmp_path):
    """An intermediate save records step < steps, and loading it warns that the run did not finish."""
    from wide.checkpoint import load

    run(tmp_path / "b", 6, stop_after=3)
    info = json.loads((tmp_path / "b" / "base_model.json").read_text())
    assert info["extra"]["step"] == 2 and info["extra"]["steps"] == 6
    with pytest.warns(UserWarning, match="saved at step 2 of 6"):
        load(tmp_path / "b", model=tiny_model())
    run(tmp_path / "a", 2)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(tmp_path / "a", model=tiny_model())
