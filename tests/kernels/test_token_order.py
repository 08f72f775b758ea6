"""token_order: the permutation against a stable argsort of the Gray-code rank of each token's mask bits (computed here
from the Gray code table), the sorted keys and the 64-row tile unions against a direct computation, and U."""

import pytest
import torch
from kernel_testutil import DEVICE, KINDS, gpu, make_mask, seed_for

from wide.kernels import KernelArgumentError
from wide.kernels.token_order import token_order, union_density


def direct(mask: torch.Tensor, tile: int = 64):
    """(perm, keys, unions) by Python loops: rank r with r ^ (r >> 1) == bits, stable sort on it, OR per tile."""
    m = mask.reshape(-1, mask.shape[-1]).cpu()
    NG = m.shape[1]
    rank_of = {r ^ (r >> 1): r for r in range(1 << NG)}
    bits = [sum(1 << g for g in range(NG) if m[i, g]) for i in range(m.shape[0])]
    perm = sorted(range(len(bits)), key=lambda i: rank_of[bits[i]])  # Python's sort is stable
    keys = [bits[i] for i in perm]
    unions = []
    for t in range(0, len(keys), tile):
        u = 0
        for k in keys[t:t + tile]:
            u |= k
        unions.append(u)
    return perm, keys, unions


def check(mask):
    o = token_order(mask)
    perm, keys, unions = direct(mask)
    assert o.perm.dtype == o.keys.dtype == o.union.dtype == torch.int32
    assert o.perm.cpu().tolist() == perm
    assert o.keys.cpu().tolist() == keys
    assert o.union.cpu().tolist() == unions
    NG = mask.shape[-1]
    blocks = sum(bin(u).count("1") for u in unions)
    assert union_density(o, NG) == pytest.approx(blocks / max(1, len(unions) * NG))
    pairs = [unions[j] | (unions[j + 1] if j + 1 < len(unions) else 0) for j in range(0, len(unions), 2)]
    assert union_density(o, NG, 128) == pytest.approx(sum(bin(u).count("1") for u in pairs) / max(1, len(pairs) * NG))
    return o


@pytest.mark.parametrize("NG", [1, 3, 8])
@pytest.mark.parametrize("M", [1, 37, 64, 300])
@pytest.mark.parametrize("kind", KINDS)
def test_permutation_and_unions(M, NG, kind):
    gen = seed_for("token_order", M, NG, kind)
    check(make_mask(kind, (M, NG), gen, 0.4))


@pytest.mark.parametrize("NG,M", [(16, 70), (11, 150)])
def test_many_groups(NG, M):
    # most of the 2**N_G patterns never occur; 150 rows span several blocks and chunks
    check(make_mask("random", (M, NG), seed_for("token_order_many", NG, M), 0.5))


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("NG,M", [(8, 300), (2, 1000), (16, 40)])
def test_two_and_four_launches(NG, M, fuse):
    # the fused launches (the last block scans / computes the unions) and the four-launch form give the same order
    from wide.kernels import token_order as mod

    mask = make_mask("random", (M, NG), seed_for("token_order_fuse", NG, M), 0.3)
    o = mod._launch(mask, fuse) if mod.common.use_triton(mask) else token_order(mask)
    perm, keys, unions = direct(mask)
    assert (o.perm.cpu().tolist(), o.keys.cpu().tolist(), o.union.cpu().tolist()) == (perm, keys, unions)


def test_batched_mask_is_flattened_and_repeatable():
    mask = make_mask("random", (3, 41, 4), seed_for("token_order_3d"), 0.3)
    first = check(mask)
    again = token_order(mask)  # the counters start from zero in every call
    assert all(torch.equal(x, y) for x, y in zip(first, again))


def test_clustered_patterns_give_a_small_union():
    # two patterns, 128 rows each, interleaved in token order: sorted, every tile executes one group
    mask = torch.zeros(256, 4, dtype=torch.bool, device=DEVICE)
    mask[0::2, 0] = True
    mask[1::2, 3] = True
    o = check(mask)
    assert union_density(o, 4) == pytest.approx(0.25)


@pytest.mark.parametrize("bad,msg", [
    (lambda: torch.zeros(4, 17, dtype=torch.bool), "N_G=17"),
    (lambda: torch.zeros(4, 0, dtype=torch.bool), "N_G=0"),
    (lambda: torch.zeros(4, dtype=torch.bool), "shape"),
    (lambda: torch.zeros(4, 2), "dtype"),
])
def test_bad_masks(bad, msg):
    with pytest.raises(KernelArgumentError, match=msg):
        token_order(bad().to(DEVICE))


@gpu
@pytest.mark.parametrize("M,NG,p", [(16384, 8, 0.3), (4096, 8, 0.5), (5000, 3, 0.4), (3000, 16, 0.5), (1, 8, 1.0)])
def test_gpu_shapes(M, NG, p):
    from wide.kernels.reference import token_order_ref

    mask = make_mask("random", (M, NG), seed_for("token_order_gpu", M, NG), p)
    o = token_order(mask)
    ref = token_order_ref(mask.cpu())
    assert all(torch.equal(x.cpu(), y) for x, y in zip(o, ref))


@gpu
def test_gpu_capturable():
    mask = make_mask("random", (4096, 8), seed_for("token_order_graph"), 0.3)
    token_order(mask)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = token_order(mask)
    mask.copy_(make_mask("random", (4096, 8), seed_for("token_order_graph2"), 0.6))
    graph.replay()
    torch.cuda.synchronize()
    ref = token_order(mask)
    assert all(torch.equal(x, y) for x, y in zip(o, ref))
