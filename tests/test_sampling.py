"""Sampled generation (``wide.inference.sampling``, ``wide generate --temperature/--top-k/--top-p/--seed``):
draws follow the tempered, filtered softmax computed independently in float64; greedy settings are the argmax;
a seed reproduces the tokens; bad values are refused in one line."""

from __future__ import annotations

import math

import pytest
import torch

from wide import WideError
from wide.inference.sampling import Sampling, filtered_scores, next_tokens
from wide_testutil import tiny_tokenizer

N_DRAWS = 40000


def _reference_distribution(logits: torch.Tensor, T: float, top_k: int, top_p: float) -> torch.Tensor:
    """float64 ``[V]``: softmax(logits / T) restricted to the top-k tokens, then to the smallest set of most
    probable tokens reaching top_p, renormalized (Hugging Face's warper order), computed token by token."""
    z = logits.double() / T
    order = sorted(range(z.numel()), key=lambda i: -float(z[i]))
    keep = order[:top_k] if top_k else order
    w = torch.tensor([math.exp(float(z[i]) - float(z[keep[0]])) for i in keep], dtype=torch.float64)
    w = w / w.sum()
    kept, total = [], 0.0
    for i, wi in zip(keep, w.tolist()):
        if total >= top_p:
            break
        kept.append(i)
        total += wi
    ref = torch.zeros(z.numel(), dtype=torch.float64)
    mass = sum(math.exp(float(z[i]) - float(z[keep[0]])) for i in kept)
    for i in kept:
        ref[i] = math.exp(float(z[i]) - float(z[keep[0]])) / mass
    return ref


@pytest.mark.parametrize("T,top_k,top_p", [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0), (1.0, 3, 1.0),
                                            (1.0, 0, 0.7), (0.8, 5, 0.9), (1.5, 0, 0.3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draws_follow_the_filtered_softmax(T, top_k, top_p, dtype):
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(8, generator=g) * 1.5).to(dtype)
    ref = _reference_distribution(logits.float(), T, top_k, top_p)
    s = Sampling(temperature=T, top_k=top_k, top_p=top_p, seed=5)
    toks = next_tokens(logits.expand(N_DRAWS, -1), s, s.generator(torch.device("cpu")))  # independent rows
    assert toks.dtype == torch.int64 and toks.shape == (N_DRAWS,)
    freq = torch.bincount(toks, minlength=8).double() / N_DRAWS
    assert (freq[ref == 0] == 0).all(), (freq, ref)  # filtered tokens are never drawn
    tol = 4.5 * (ref * (1 - ref) / N_DRAWS).sqrt() + 1e-12
    assert ((freq - ref).abs() <= tol).all(), (freq, ref, tol)


def test_greedy_settings_take_the_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    for s in (Sampling(), Sampling(temperature=0.8, top_k=1), Sampling(temperature=0)):
        assert s.greedy and s.generator(torch.device("cpu")) is None
        assert torch.equal(next_tokens(logits, s, None), logits.argmax(-1))
    # a tiny top-p keeps only the most probable token
    s = Sampling(temperature=1.0, top_p=1e-6, seed=0)
    assert torch.equal(next_tokens(logits, s, s.generator(torch.device("cpu"))), logits.argmax(-1))


@pytest.mark.parametrize("kwargs,words", [
    ({"temperature": -1.0}, "temperature -1.0 must be a finite number >= 0 (0 = greedy)"),
    ({"temperature": float("nan")}, "temperature nan must be a finite number >= 0"),
    ({"temperature": float("inf")}, "temperature inf must be"),
    ({"top_k": -2}, "top-k -2 must be an int >= 0"),
    ({"top_k": 2.5}, "top-k 2.5 must be an int >= 0"),
    ({"top_p": 0.0}, "top-p 0.0 must be in (0, 1]"),
    ({"top_p": 1.5}, "top-p 1.5 must be in (0, 1]"),
    ({"top_p": float("nan")}, "top-p nan must be in (0, 1]"),
    ({"seed": "1"}, "seed '1' must be an integer from 0 to 4294967295 (2**32 - 1); leave it out"),
    ({"seed": -1}, "seed -1 must be an integer from 0 to 4294967295"),
    ({"seed": 2 ** 32}, "seed 4294967296 must be an integer from 0 to 4294967295"),
    ({"seed": 10 ** 23}, f"seed {10 ** 23} must be an integer from 0"),
])
def test_bad_values_are_refused(kwargs, words):
    with pytest.raises(WideError) as e:
        Sampling(**kwargs)
    assert words in str(e.value)


@pytest.mark.parametrize("T", [1e-20, 1e-37, 1e-40, 5e-324])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tiny_temperature_is_greedy(T, dtype):
    """T -> 0 is the argmax: the row's max is subtracted before dividing by T, so a tiny T cannot overflow every
    positive logit to +inf (which made every draw token 0), and a T below float32's smallest normal is greedy."""
    logits = (torch.randn(64, 300, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 4).to(dtype)
    logits[:, 0] = -50.0  # token 0 is never the answer
    s = Sampling(temperature=T, seed=1)
    assert s.greedy == (T < 1.1754943508222875e-38)
    if not s.greedy:
        scores = filtered_scores(logits, s)
        assert (scores.max(-1).values == 0).all() and not scores.isnan().any()
    want = logits.double().argmax(-1)
    unique = (logits.double() == logits.double().max(-1, keepdim=True).values).sum(-1) == 1
    assert unique.float().mean() > 0.9
    got = next_tokens(logits, s, s.generator(torch.device("cpu")))
    assert torch.equal(got[unique], want[unique])  # the smallest gap (1 fp32 ulp of 16, ~1e-6) over T is huge


@pytest.fixture
def reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def test_sampled_generation_equals_a_step_by_step_reference(reference_path):
    """One prompt, 8 sampled tokens: the engine's generation equals drawing each token from the masking path's
    logits with the same seeded generator (one uniform per vocabulary entry per step, as the engine draws)."""
    from test_inference import _wide
    from wide.inference import Engine, generate

    wm = _wide(seed=4)
    tok = tiny_tokenizer()
    s = Sampling(temperature=1.3, top_p=0.95, seed=7)
    res = generate(Engine(wm), tok, ["w1 w2 w3"], max_new_tokens=8, stop_at_eos=False, sampling=s)
    gen = s.generator(torch.device("cpu"))
    ids, want = tok("w1 w2 w3")["input_ids"], []
    with torch.no_grad():
        for _ in range(8):
            t = int(next_tokens(wm(torch.tensor([ids])).logits[:, -1], s, gen)[0])
            want.append(t)
            ids.append(t)
    assert res.tokens[0] == want
    greedy = generate(Engine(wm), tok, ["w1 w2 w3"], max_new_tokens=8, stop_at_eos=False)
    assert greedy.tokens[0] != want  # sampling at T = 1.3 did change the text (this seed)


def test_a_seed_reproduces_a_batch_and_temperature_zero_is_greedy(reference_path):
    from test_inference import _wide
    from wide.inference import Engine, generate

    eng, tok = Engine(_wide(seed=4)), tiny_tokenizer()
    prompts = ["w1 w2 w3 w4", "w9 w8"]

    def run(**kw):
        return generate(eng, tok, prompts, max_new_tokens=6, stop_at_eos=False, **kw).tokens

    a = run(sampling=Sampling(temperature=2.0, seed=3))
    assert run(sampling=Sampling(temperature=2.0, seed=3)) == a
    assert run(sampling=Sampling(temperature=2.0, seed=4)) != a
    assert run(sampling=Sampling(temperature=0.0, top_p=0.5, seed=9)) == run()


def test_cli_sampling_options(tmp_path, model_dir, capsys, reference_path):
    from wide.cli import main
    from wide_testutil import one_line_error

    base = ["generate", "--model", str(model_dir), "--prompt", "w1 w2", "--max-new-tokens", "4", "--device", "cpu",
            "--no-stream"]
    outs = []
    for _ in range(2):
        rc = main([*base, "--temperature", "1.5", "--top-k", "20", "--top-p", "0.9", "--seed", "3"])
        out, err = capsys.readouterr()
        assert rc == 0, err
        outs.append(out.splitlines()[0])
    assert outs[0] == outs[1] and outs[0].startswith("[0] ")  # the same seed, the same text
    for extra, words in [
        (["--top-p", "0.9"], "--top-p only applies when sampling: add --temperature T > 0"),
        (["--top-k", "5", "--seed", "1"], "--top-k, --seed only apply when sampling"),
        (["--temperature", "-0.5"], "temperature -0.5 must be a finite number >= 0"),
        (["--temperature", "1", "--top-p", "0"], "top-p 0.0 must be in (0, 1]"),
        (["--temperature", "1", "--top-k", "-1"], "top-k -1 must be an int >= 0"),
        (["--temperature", "1", "--seed", str(10 ** 23)], f"seed {10 ** 23} must be an integer from 0 to 4294967295"),
        (["--temperature", "1", "--seed", "-1"], "seed -1 must be an integer from 0 to 4294967295"),
    ]:
        rc = main([*base, *extra])
        _, err = capsys.readouterr()
        one_line_error(rc, err, "generate", words)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sampled_decode_is_the_same_with_and_without_graphs():
    """The graph replay's logits feed the same seeded draws as eager decode steps."""
    from test_inference import _wide
    from wide.inference import Engine, generate

    eng = Engine(_wide(seed=4).cuda())
    tok = tiny_tokenizer()
    s = Sampling(temperature=1.3, top_k=30, top_p=0.95, seed=7)
    kw = dict(max_new_tokens=12, stop_at_eos=False, sampling=s)
    graphed = generate(eng, tok, ["w1 w2 w3", "w4"], graphs=True, **kw)
    eager = generate(eng, tok, ["w1 w2 w3", "w4"], graphs=False, **kw)
    assert graphed.path.endswith("+cuda-graphs") and graphed.tokens == eager.tokens
