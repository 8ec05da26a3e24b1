"""``torch.func`` with sparse layers, for every registered layer and router: ``grad`` of a
``functional_call`` gives what autograd gives in both modes; ``vmap`` over inputs, over
stacked models (ensembles) and over ``grad`` (per-sample gradients) gives what a loop over
the entries gives; a second derivative is the same however it is asked for."""

import pytest
import torch
from torch.func import functional_call, grad, stack_module_state, vmap

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


# unpoisoned: the poisoning's fill of a new tensor inside torch.func.grad(grad(...)) mutates a
# tensor the outer transform captured, which torch.func refuses
@pytest.mark.unpoisoned
@pytest.mark.parametrize("name", FUNCTIONAL)
def test_a_second_derivative_is_the_same_however_it_is_asked_for(name):
    """The input Hessian-vector product of a training forward by ``torch.func.grad`` of
    ``torch.func.grad``, by ``torch.autograd.grad`` naming the input and by ``.backward()``,
    after objectives whose gradient does and does not require grad (``square().sum()``,
    ``sum()``), and the first derivative taken with a graph is the fused backward's.
    PyTorch's ``once_differentiable`` raised for ``.backward()`` only and gave
    the others without the layer (PKM's nested ``torch.func.grad`` was zero). In float32 the
    fused kernels run; the float64 product, on the PyTorch implementations, is checked
    against finite differences in the conformance suite."""
    layer = _build(EXAMPLES[name]).train()
    torch.func.replace_all_batch_norm_modules_(layer)   # PEER's query BatchNorm
    weights = {n: p.detach() for n, p in layer.named_parameters()}
    weights64 = {n: p.double() for n, p in weights.items()}
    x = torch.randn(4, D)
    for reduce in (torch.square, lambda y: y):
        def objective(x, weights=weights):
            torch.manual_seed(5)        # the same noise, dropout and sampling each time
            return reduce(functional_call(layer, weights, (x,))).sum()

        want = grad(lambda x: grad(objective)(x).square().sum())(x)
        if name != "router:noisy_topk":   # (its noise differs in float64)
            # the fused kernels run in float32; float64 takes the PyTorch implementations
            want64 = grad(lambda x: grad(objective)(x, weights64).square().sum())(x.double())
            torch.testing.assert_close(want.double(), want64, rtol=1e-4,
                                       atol=1e-5 * want64.abs().max().item())
        # (a ReLU network's sum is piecewise linear in x: its second derivative is zero)
        assert want.abs().max() > 0 or reduce is not torch.square
        leaf = x.clone().requires_grad_()
        first, = torch.autograd.grad(objective(leaf), leaf, create_graph=True)
        # the gradient built with a graph is the fused backward's
        torch.testing.assert_close(first, torch.autograd.grad(objective(leaf), leaf)[0])
        torch.testing.assert_close(torch.autograd.grad(first.square().sum(), leaf)[0], want)
        first, = torch.autograd.grad(objective(leaf), leaf, create_graph=True)
        first.square().sum().backward()
        torch.testing.assert_close(leaf.grad, want)


@pytest.mark.parametrize("name", EXAMPLES)
def test_vmap_over_inputs_and_over_an_ensemble_is_a_loop_over_the_entries(name):
    models = [_build(EXAMPLES[name], seed=seed).eval() for seed in range(3)]
    x = torch.randn(3, 5, D)
    with torch.no_grad():
        torch.testing.assert_close(vmap(models[0])(x), torch.stack([models[0](e) for e in x]))
        params, buffers = stack_module_state(models)     # PyTorch's model-ensembling recipe
        base = _build(EXAMPLES[name]).eval().to("meta")
        ensemble = vmap(lambda p, b, x: functional_call(base, (p, b), (x,)),
                        in_dims=(0, 0, None))(params, buffers, x[0])
        torch.testing.assert_close(ensemble, torch.stack([m(x[0]) for m in models]))


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", FUNCTIONAL)
def test_per_sample_gradients_by_vmap_of_grad_are_a_loop_of_backwards(name, training):
    layer = _build(EXAMPLES[name]).train(training)
    if training:
        torch.func.replace_all_batch_norm_modules_(layer)
    xs = torch.randn(3, 4, D)
    params = {n: p.detach() for n, p in layer.named_parameters()}

    def objective(p, x):
        return functional_call(layer, p, (x,)).square().sum() + sparseffn.aux_loss(layer)
    # randomness="same": every entry draws what one call seeded alike draws (noise, sampling)
    torch.manual_seed(7)
    per_sample = vmap(grad(objective), in_dims=(None, 0), randomness="same")(params, xs)
    for i, x in enumerate(xs):
        layer.zero_grad()
        torch.manual_seed(7)
        objective(dict(layer.named_parameters()), x).backward()
        for (n, _), want in zip(layer.named_parameters(), _dense_grads(list(layer.parameters()))):
            if want is not None:
                torch.testing.assert_close(per_sample[n][i], want, msg=n)
