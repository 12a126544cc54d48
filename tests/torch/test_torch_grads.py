"""Row gradients of the dynamic modules equal torch's own autograd, in every input form.

The modules compute the gradient of their distinct rows with numba kernels
(:mod:`tensorkv.kernels.pooling`); the reference here is torch's ``F.embedding`` /
``F.embedding_bag`` backward over the same rows.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from tensorkv.torch import DynamicEmbedding, DynamicEmbeddingBag

PAD = 7


def _reference(module, uniq, call):
    """torch's gradient of ``call(weight, positions)`` for the rows of ``uniq`` (+ a pad row)."""
    rows = module.table.lookup(uniq, insert=False)
    weight = torch.cat([torch.from_numpy(rows), torch.zeros(1, module.dim)]).requires_grad_()
    pos = {int(k): i for i, k in enumerate(uniq)}
    pos.setdefault(PAD, len(uniq))  # the pad row, when PAD is the padding id

    def remap(ids):
        return torch.tensor([pos[int(i)] for i in ids.reshape(-1)]).reshape(ids.shape)

    call(weight, remap, len(uniq)).backward()
    return weight.grad[: len(uniq)].numpy()


def _grads(module):
    (uniq, g), = module.take_gradients()
    return uniq, g


def _check(module, run, ref_call, grad_out):
    out = run(module)
    out.backward(grad_out)
    uniq, g = _grads(module)
    ref = _reference(module, uniq, lambda w, remap, pad: (ref_call(w, remap, pad) * grad_out)
                     .sum())
    np.testing.assert_allclose(g, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("padding", [None, PAD])
def test_embedding_grad(padding):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 12, (5, 9), generator=gen)
    m = DynamicEmbedding(4, padding_idx=padding, seed=1)
    grad_out = torch.randn(5, 9, 4, generator=gen)
    _check(m, lambda m: m(ids), lambda w, remap, pad: F.embedding(
        remap(ids), w, padding_idx=pad if padding is not None else None), grad_out)


@pytest.mark.parametrize("mode, weighted", [("sum", False), ("sum", True), ("mean", False)])
@pytest.mark.parametrize("include_last", [False, True])
def test_bag_1d_grad(mode, weighted, include_last):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 15, (40,), generator=gen)
    ids[::6] = PAD
    offsets = torch.tensor([0, 3, 3, 10, 22, 39])  # an empty bag, a one-id bag
    if include_last:
        offsets = torch.cat([offsets, torch.tensor([40])])
    psw = torch.rand(40, generator=gen) if weighted else None
    bags = len(offsets) - include_last
    m = DynamicEmbeddingBag(3, mode=mode, include_last_offset=include_last, padding_idx=PAD)
    grad_out = torch.randn(bags, 3, generator=gen)
    _check(m, lambda m: m(ids, offsets, per_sample_weights=psw),
           lambda w, remap, pad: F.embedding_bag(
               remap(ids), w, offsets, mode=mode, per_sample_weights=psw,
               include_last_offset=include_last, padding_idx=pad), grad_out)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_bag_2d_grad(mode):
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 10, (6, 4), generator=gen)
    ids[1] = PAD  # a bag of padding only: zero output, no gradient
    ids[2, :2] = PAD
    psw = torch.rand(6, 4, generator=gen) if mode == "sum" else None
    m = DynamicEmbeddingBag(5, mode=mode, padding_idx=PAD, seed=3)
    grad_out = torch.randn(6, 5, generator=gen)
    _check(m, lambda m: m(ids, per_sample_weights=psw),
           lambda w, remap, pad: F.embedding_bag(remap(ids), w, mode=mode,
                                                 per_sample_weights=psw, padding_idx=pad),
           grad_out)


@pytest.mark.parametrize("mode, weighted", [("sum", False), ("mean", False), ("sum", True)])
def test_bags_of_one_id_grad(mode, weighted):
    """A 2-D ``[bags, 1]`` input (one-hot features) takes the one-id scatter: the same row
    gradients, bit for bit, as the general bag pass of the equal 1-D input with offsets."""
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 9, (30, 1), generator=gen)
    ids[::5] = PAD
    psw = torch.rand(30, 1, generator=gen) if weighted else None
    grad_out = torch.randn(30, 5, generator=gen)
    grads = []
    for form in ("2d", "1d"):
        m = DynamicEmbeddingBag(5, mode=mode, padding_idx=PAD, seed=3)
        if form == "2d":
            out = m(ids, per_sample_weights=psw)
        else:
            out = m(ids.reshape(-1), torch.arange(30),
                    per_sample_weights=None if psw is None else psw.reshape(-1))
        out.backward(grad_out)
        grads.append(_grads(m))
    np.testing.assert_array_equal(grads[0][0], grads[1][0])
    np.testing.assert_array_equal(grads[0][1], grads[1][1])
    _check(DynamicEmbeddingBag(5, mode=mode, padding_idx=PAD, seed=3),
           lambda m: m(ids, per_sample_weights=psw),
           lambda w, remap, pad: F.embedding_bag(remap(ids), w, mode=mode,
                                                 per_sample_weights=psw, padding_idx=pad),
           grad_out)


def test_bag_weights_with_grad_use_torch_backward():
    """Per-sample weights that need a gradient get it (torch's own backward runs)."""
    ids = torch.tensor([[1, 2, 3], [3, 4, 1]])
    psw = torch.rand(2, 3, requires_grad=True)
    m = DynamicEmbeddingBag(4, mode="sum")
    m(ids, per_sample_weights=psw).sum().backward()
    rows = torch.from_numpy(m.table.lookup(ids.reshape(-1).numpy(), insert=False))
    assert torch.allclose(psw.grad.reshape(-1), rows.sum(1))
    uniq, g = _grads(m)
    assert sorted(uniq.tolist()) == [1, 2, 3, 4]
