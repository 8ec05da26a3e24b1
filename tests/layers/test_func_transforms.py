"""``torch.func`` with sparse layers, for every registered layer and router: ``grad`` of a
``functional_call`` gives what autograd gives in both modes; ``vmap`` over inputs, over
stacked models (ensembles) and over ``grad`` (per-sample gradients) gives what a loop over
the entries gives; a second derivative, however it is asked for, raises instead of returning
a number that leaves the layer out."""

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
# tensor the outer transform captured, which torch.func refuses before our error
@pytest.mark.unpoisoned
@pytest.mark.parametrize("name", [name for name in EXAMPLES if name != "layer:dense"])
def test_a_second_derivative_raises_however_it_is_asked_for(name):
    """The kernels' backward is differentiable once. Its second derivative raises whether it
    is asked for by ``.backward()``, by ``torch.autograd.grad`` naming the input or the
    parameters (PyTorch's ``once_differentiable`` hung its error where those prune it, and the
    second derivative silently left the layer out), after an objective whose gradient
    requires no grad (``y.sum()``: nothing was guarded), or by ``torch.func.grad`` of
    ``torch.func.grad``; the first derivative taken with ``create_graph=True`` is the plain
    one (to rounding: PyTorch's own backward of the gated experts' product differs under
    ``create_graph``)."""
    layer = _build(EXAMPLES[name]).train()
    x = torch.randn(4, D, requires_grad=True)
    params = list(layer.parameters())

    def first_derivative(objective, create_graph):
        torch.manual_seed(5)        # the same noise, dropout and sampling each time
        return torch.autograd.grad(objective(layer(x)), x, create_graph=create_graph)[0]

    for objective in (lambda y: y.square().sum(), lambda y: y.sum()):
        plain = first_derivative(objective, False)
        for differentiate in (lambda g: g.square().sum().backward(),
                              lambda g: torch.autograd.grad(g.square().sum(), [x]),
                              lambda g: torch.autograd.grad(g.square().sum(), params,
                                                            allow_unused=True)):
            first = first_derivative(objective, True)
            torch.testing.assert_close(first, plain)   # (gated: autograd's own formulas)
            with pytest.raises(RuntimeError, match="differentiate twice through"):
                differentiate(first)
    if name in FUNCTIONAL:
        layer = _build(EXAMPLES[name]).train()
        torch.func.replace_all_batch_norm_modules_(layer)   # PEER's query BatchNorm
        weights = {n: p.detach() for n, p in layer.named_parameters()}

        def objective(x):
            return functional_call(layer, weights, (x,)).square().sum()
        with pytest.raises(RuntimeError, match="differentiate twice through"):
            grad(lambda x: grad(objective)(x).square().sum())(x.detach())


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
