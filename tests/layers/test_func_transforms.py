"""``torch.func`` with sparse layers: ``torch.func.grad`` of a ``functional_call`` gives what
autograd gives, for every registered layer and router in both modes; a second-order gradient
raises instead of returning a number that leaves the layer out."""

import pytest
import torch
from torch.func import functional_call, grad

import sparseffn
from tests.layers.test_conformance import EXAMPLES, D, _build, _dense_grads

# torch.func has no sparse gradients: the sparse-gradient tables are left out.
FUNCTIONAL = [name for name in EXAMPLES if name != "variant:peer_sparse_grad"]


def _objective(layer, params, x):
    torch.manual_seed(5)            # the same noise, dropout and sampling in both runs
    return functional_call(layer, params, (x,)).square().sum() + sparseffn.aux_loss(layer)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", FUNCTIONAL)
def test_torch_func_grad_gives_autograds_gradients(name, training):
    layer = _build(EXAMPLES[name]).train(training)
    if training:    # PEER's query BatchNorm: torch.func cannot update running statistics
        torch.func.replace_all_batch_norm_modules_(layer)
    x = torch.randn(2, 3, D)
    names = [n for n, _ in layer.named_parameters()]
    params = {n: p.detach() for n, p in layer.named_parameters()}
    counted = hasattr(layer, "usage_counts")
    usage = layer.usage_counts.clone() if counted else None

    got = grad(lambda p: _objective(layer, p, x))(params)
    if counted:                     # documented: no usage is counted inside a transform
        assert torch.equal(layer.usage_counts, usage)

    objective = _objective(layer, dict(layer.named_parameters()), x)
    objective.backward()
    for n, want in zip(names, _dense_grads(list(layer.parameters()))):
        if want is None:            # not reached by this forward (autograd's None)
            assert not got[n].any(), n
        else:
            torch.testing.assert_close(got[n], want, msg=n)
    if counted:                     # and it is again outside
        assert layer.usage_counts.sum() > usage.sum()


@pytest.mark.parametrize("name", ["layer:sigma_moe", "layer:fff", "layer:pkm", "layer:topk"])
def test_a_second_order_gradient_raises(name):
    layer = _build(EXAMPLES[name]).train()
    x = torch.randn(4, D, requires_grad=True)
    first, = torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        first.square().sum().backward()
