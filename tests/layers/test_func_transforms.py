"""``torch.func`` with sparse layers, for every registered layer and router: ``grad`` of a
``functional_call`` gives what autograd gives in both modes; ``vmap`` over inputs, over
stacked models (ensembles) and over ``grad`` (per-sample gradients) gives what a loop over
the entries gives; a second-order gradient raises instead of returning a number that leaves
the layer out."""

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


@pytest.mark.parametrize("name", ["layer:sigma_moe", "layer:fff", "layer:pkm", "layer:topk"])
def test_a_second_order_gradient_raises(name):
    layer = _build(EXAMPLES[name]).train()
    x = torch.randn(4, D, requires_grad=True)
    first, = torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        first.square().sum().backward()


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
