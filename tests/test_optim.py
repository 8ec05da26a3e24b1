"""sparseffn.param_groups: which parameters get weight decay; sparseffn.adam_optimizers;
sparseffn.clip_grad_norm_ with sparse gradients."""

import math

import pytest
import torch
from torch import nn

import sparseffn
from sparseffn import FFFConfig, MoEConfig, PKMConfig


class _Block(nn.Module):
    """An LM-like model: a tied embedding, a LayerNorm and a sparse FFN."""

    def __init__(self, ffn: nn.Module, vocab: int = 11, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        self.ffn = ffn
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight   # tied

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(h + self.ffn(self.norm(h)))


def _ids(params):
    return {id(p) for p in params}


def _groups(model, *args, **kwargs):
    decay, keep = sparseffn.param_groups(model, *args, **kwargs)
    assert decay["name"] == "decay" and keep["name"] == "no_decay" and keep["weight_decay"] == 0
    return decay["params"], keep["params"]


def test_fff_leaf_biases_are_not_decayed_though_two_dimensional():
    layer = sparseffn.build_layer(FFFConfig(d_model=8, depth=2, leaf_width=3))
    decay, keep = _groups(layer, 0.1)
    store = layer.store
    assert store.b1.dim() == 2 and store.b2.dim() == 2
    assert _ids([store.b1, store.b2]) <= _ids(keep)
    assert _ids([store.w1, store.w2, layer.router.weight]) <= _ids(decay)
    assert _ids(keep).isdisjoint(_ids(decay))
    assert _ids(decay) | _ids(keep) == _ids(layer.parameters())


def test_norms_biases_and_embeddings_follow_the_usual_rule():
    model = _Block(sparseffn.build_layer(MoEConfig(d_model=8, num_experts=4, expert_size=3, k=2)))
    decay, keep = _groups(model, 0.1)
    assert _ids([model.norm.weight, model.norm.bias]) <= _ids(keep)
    assert id(model.embed.weight) in _ids(decay)
    assert len(decay) + len(keep) == len(list(model.parameters()))   # the tied weight once
    decay, keep = _groups(model, 0.1, decay_embeddings=False)
    assert id(model.embed.weight) in _ids(keep)


def test_sparse_gradient_and_frozen_parameters_are_left_out():
    pkm = sparseffn.build_layer(PKMConfig(d_model=8, num_subkeys=4, heads=2, k=3, query="linear",
                                          key_dim=6, sparse_grad=True))
    model = _Block(pkm)
    model.norm.weight.requires_grad_(False)
    decay, keep = _groups(model, 0.1)
    grouped = _ids(decay) | _ids(keep)
    assert _ids(sparseffn.sparse_grad_parameters(model)).isdisjoint(grouped)
    assert id(model.norm.weight) not in grouped
    assert grouped == _ids(p for p in sparseffn.dense_grad_parameters(model) if p.requires_grad)


def test_adamw_decays_only_the_decay_group():
    torch.manual_seed(0)
    layer = sparseffn.build_layer(FFFConfig(d_model=8, depth=2, leaf_width=3))
    before = {name: p.detach().clone() for name, p in layer.named_parameters()}
    opt = torch.optim.AdamW(sparseffn.param_groups(layer, 0.5), lr=0.1)
    for p in layer.parameters():
        p.grad = torch.zeros_like(p)     # only the decay moves anything
    opt.step()
    decayed = _ids(opt.param_groups[0]["params"])
    for name, p in layer.named_parameters():
        want = before[name] * (1 - 0.1 * 0.5) if id(p) in decayed else before[name]
        torch.testing.assert_close(p.detach(), want, msg=name)


def test_a_module_can_declare_its_own_biases():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3, 4))
            self.offsets = nn.Parameter(torch.zeros(3, 4))

        def no_weight_decay_parameters(self):
            return [self.offsets]

    module = Scaled()
    decay, keep = _groups(module, 0.1)
    assert _ids(decay) == {id(module.weight)} and _ids(keep) == {id(module.offsets)}


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), "0.1", True, None])
def test_weight_decay_is_checked(bad):
    with pytest.raises(ValueError, match="weight_decay must be a non-negative finite number"):
        sparseffn.param_groups(nn.Linear(2, 2), bad)


def _pkm_block(sparse_grad: bool) -> nn.Module:
    return _Block(sparseffn.build_layer(PKMConfig(d_model=8, num_subkeys=4, heads=2, k=3,
                                                  query="linear", key_dim=6,
                                                  sparse_grad=sparse_grad)))


def test_adam_optimizers_fuse_adam_and_give_sparse_gradients_sparse_adam():
    model = _pkm_block(sparse_grad=True)
    adam, sparse_adam = sparseffn.adam_optimizers(model, lr=1e-3, betas=(0.8, 0.9))
    assert isinstance(adam, torch.optim.Adam) and adam.defaults["fused"] is True
    assert isinstance(sparse_adam, torch.optim.SparseAdam)
    assert _ids(sparse_adam.param_groups[0]["params"]) == _ids(
        sparseffn.sparse_grad_parameters(model))
    assert _ids(adam.param_groups[0]["params"]) == _ids(sparseffn.dense_grad_parameters(model))
    assert adam.defaults["betas"] == sparse_adam.defaults["betas"] == (0.8, 0.9)
    assert len(sparseffn.adam_optimizers(_pkm_block(sparse_grad=False), lr=1e-3)) == 1
    decay, keep = sparseffn.adam_optimizers(model, lr=1e-3, weight_decay=0.1)[0].param_groups
    assert (decay["name"], decay["weight_decay"], keep["weight_decay"]) == ("decay", 0.1, 0.0)


def test_fused_adam_takes_the_steps_of_pytorchs_default_adam():
    torch.manual_seed(0)
    model = _pkm_block(sparse_grad=False)
    twin = _pkm_block(sparse_grad=False)
    twin.load_state_dict(model.state_dict())
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    fused = sparseffn.adam_optimizers(model, lr=1e-2)[0]
    plain = torch.optim.Adam(twin.parameters(), lr=1e-2)
    tokens = torch.randint(0, 11, (4, 5))
    for _ in range(3):
        for m, opt in ((model, fused), (twin, plain)):
            opt.zero_grad()
            m(tokens).square().mean().backward()
            opt.step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert not torch.equal(a, start[name]), name          # every parameter moved
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_adam_is_not_fused_where_a_parameter_has_no_fused_kernel():
    model = nn.Linear(3, 2)
    assert sparseffn.adam_optimizers(model, lr=1e-3)[0].defaults["fused"] is True
    meta = nn.Linear(3, 2, device="meta")
    assert not sparseffn.optim.fused_adam_fits(list(meta.parameters()))
    assert sparseffn.adam_optimizers(meta, lr=1e-3)[0].defaults["fused"] is None


def _peer_with_gradients(sparse_grad: bool, batches: int = 1, scale: float = 1.0):
    torch.manual_seed(0)
    layer = sparseffn.PEER(d_model=8, num_experts=36, heads=2, k=3, sparse_grad=sparse_grad)
    for b in range(batches):          # gradients added over micro-batches
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(b))
        (scale * layer(x).square().sum()).backward()
    return layer


@pytest.mark.parametrize("batches", [1, 2], ids=["one batch", "two micro-batches"])
@pytest.mark.parametrize("max_norm", [0.5, 1e6], ids=["clipped", "under the bound"])
def test_clip_grad_norm_with_sparse_gradients_clips_as_pytorch_clips_the_dense_ones(batches,
                                                                                    max_norm):
    sparse = _peer_with_gradients(True, batches)
    dense = _peer_with_gradients(False, batches)
    tables = sparseffn.sparse_grad_parameters(sparse)
    assert all(t.grad.is_sparse for t in tables)
    with pytest.raises(NotImplementedError):       # what the helper is for
        torch.nn.utils.clip_grad_norm_(sparse.parameters(), max_norm)
    norm = sparseffn.clip_grad_norm_(sparse.parameters(), max_norm)
    want = torch.nn.utils.clip_grad_norm_(dense.parameters(), max_norm)
    torch.testing.assert_close(norm, want)
    assert (norm > max_norm) == (max_norm == 0.5)
    for (name, p), q in zip(sparse.named_parameters(), dense.parameters()):
        if p.grad.is_sparse:
            assert p.grad.is_coalesced(), name           # SparseAdam need not coalesce it again
            torch.testing.assert_close(p.grad.to_dense(), q.grad, msg=name)
        else:
            torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_clip_grad_norm_without_sparse_gradients_is_pytorchs():
    mine, theirs = _peer_with_gradients(False, scale=10.0), _peer_with_gradients(False, scale=10.0)
    torch.testing.assert_close(sparseffn.clip_grad_norm_(mine.parameters(), 1.0),
                               torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0))
    for p, q in zip(mine.parameters(), theirs.parameters()):
        assert torch.equal(p.grad, q.grad)
    untouched = nn.Linear(2, 2)
    assert sparseffn.clip_grad_norm_(untouched.parameters(), 1.0) == 0


def test_clip_grad_norm_counts_a_row_held_several_times_once_with_its_sum():
    """An uncoalesced gradient (a row once per addend) is the dense one it sums to."""
    table = nn.Parameter(torch.zeros(6, 3))
    values = torch.tensor([[1.0, 2.0, 2.0], [3.0, 0.0, 4.0], [1.0, 2.0, 2.0]])
    table.grad = torch.sparse_coo_tensor(torch.tensor([[1, 4, 1]]), values, (6, 3),
                                         check_invariants=True)
    assert not table.grad.is_coalesced()
    dense = table.grad.to_dense()                   # row 1: (2, 4, 4), row 4: (3, 0, 4)
    norm = sparseffn.clip_grad_norm_(table, 1.0)    # one tensor, as PyTorch's takes it
    torch.testing.assert_close(norm, dense.norm())  # sqrt(36 + 25) = 7.81, not sqrt(43)
    torch.testing.assert_close(table.grad.to_dense(), dense / (dense.norm() + 1e-6))


@pytest.mark.parametrize("norm_type", [1.0, math.inf], ids=["1-norm", "max"])
def test_clip_grad_norm_takes_pytorchs_norm_types_with_sparse_gradients(norm_type):
    sparse, dense = _peer_with_gradients(True), _peer_with_gradients(False)
    torch.testing.assert_close(sparseffn.clip_grad_norm_(sparse.parameters(), 0.1, norm_type),
                               torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.1, norm_type))
    for p, q in zip(sparse.parameters(), dense.parameters()):
        torch.testing.assert_close(p.grad.to_dense() if p.grad.is_sparse else p.grad, q.grad)


def test_clip_grad_norm_raises_on_a_non_finite_sparse_gradient_when_asked():
    layer = _peer_with_gradients(True)
    table = sparseffn.sparse_grad_parameters(layer)[0]
    table.grad = table.grad.coalesce()
    table.grad._values()[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        sparseffn.clip_grad_norm_(layer.parameters(), 1.0, error_if_nonfinite=True)
    assert sparseffn.clip_grad_norm_(layer.parameters(), 1.0).isnan()


def test_clip_grad_value_clamps_a_sparse_gradient_as_the_dense_one_it_sums_to():
    sparse, dense = _peer_with_gradients(True, batches=2), _peer_with_gradients(False, batches=2)
    limit = 0.5 * max(q.grad.abs().max().item() for q in dense.parameters())
    with pytest.raises(NotImplementedError):       # what the helper is for
        torch.nn.utils.clip_grad_value_(sparse.parameters(), limit)
    sparseffn.clip_grad_value_(sparse.parameters(), limit)
    torch.nn.utils.clip_grad_value_(dense.parameters(), limit)
    for p, q in zip(sparse.parameters(), dense.parameters()):
        torch.testing.assert_close(p.grad.to_dense() if p.grad.is_sparse else p.grad, q.grad)
    table = nn.Parameter(torch.zeros(3, 1))        # a row held twice: 0.4 + 0.4 clamps to 0.5
    table.grad = torch.sparse_coo_tensor(torch.tensor([[2, 2]]), torch.tensor([[0.4], [0.4]]),
                                         (3, 1), check_invariants=True)
    sparseffn.clip_grad_value_(table, 0.5)
    assert table.grad.to_dense().flatten().tolist() == [0.0, 0.0, 0.5]


# --- MixedAdamW: AdamW and SparseAdam in one optimiser -------------------------------------------

def _sparse_pkm_block():
    torch.manual_seed(0)
    return _pkm_block(sparse_grad=True)


def _train(model, optimizers, steps, seed=1, lr_of_step=None):
    torch.manual_seed(seed)
    for step in range(steps):
        tokens = torch.randint(0, 11, (3, 5))
        for opt in optimizers:
            opt.zero_grad()
            if lr_of_step is not None:
                for group in opt.param_groups:
                    group["lr"] = lr_of_step(step)
        model(tokens).pow(2).mean().backward()
        for opt in optimizers:
            opt.step()


@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("fused", [None, True])
def test_mixed_adamw_takes_adamws_and_sparse_adams_steps(maximize, fused):
    ours, theirs = _sparse_pkm_block(), _sparse_pkm_block()
    sparse = sparseffn.sparse_grad_parameters(theirs)
    assert len(sparse) == 1
    groups = sparseffn.param_groups(theirs, 0.1)
    kwargs = dict(betas=(0.8, 0.9), eps=1e-6, maximize=maximize)
    reference = [torch.optim.AdamW(groups, lr=0.01, fused=fused, **kwargs),
                 torch.optim.SparseAdam(sparse, lr=0.01, **kwargs)]
    mixed = sparseffn.optim.MixedAdamW(
        sparseffn.param_groups(ours, 0.1) + [{"params": sparseffn.sparse_grad_parameters(ours),
                                              "weight_decay": 0.1}],
        lr=0.01, fused=fused, **kwargs)
    lr = lambda step: 0.01 / (step + 1)          # noqa: E731  (as a scheduler changes it)
    _train(ours, [mixed], 4, lr_of_step=lr)
    _train(theirs, reference, 4, lr_of_step=lr)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    # the sparse table kept its gradient, and no decay touched it (weight_decay 0.1 asked)
    assert sparseffn.sparse_grad_parameters(ours)[0].grad.is_sparse


def test_mixed_adamw_resumes_from_its_state_dict_as_if_never_stopped():
    whole, resumed = _sparse_pkm_block(), _sparse_pkm_block()
    opt = sparseffn.optim.MixedAdamW(whole.parameters(), lr=0.01)
    _train(whole, [opt], 5)
    first = sparseffn.optim.MixedAdamW(resumed.parameters(), lr=0.01)
    _train(resumed, [first], 3)
    saved = first.state_dict()
    assert set(saved["state"][len(saved["state"]) - 1]) == {"step", "exp_avg", "exp_avg_sq"}
    again = sparseffn.optim.MixedAdamW(resumed.parameters(), lr=0.01)
    again.load_state_dict(saved)
    torch.manual_seed(1)                # the batches of steps 3 and 4
    for _ in range(3):
        torch.randint(0, 11, (3, 5))
    for _ in range(2):
        again.zero_grad()
        resumed(torch.randint(0, 11, (3, 5))).pow(2).mean().backward()
        again.step()
    for p, q in zip(whole.parameters(), resumed.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("copy", ["deepcopy", "pickle"])
def test_a_copied_mixed_adamw_still_takes_sparse_gradients(copy):
    import copy as copying
    import pickle
    model = _sparse_pkm_block()
    opt = sparseffn.optim.MixedAdamW(model.parameters(), lr=0.01)
    _train(model, [opt], 1)
    opt = copying.deepcopy(opt) if copy == "deepcopy" else pickle.loads(pickle.dumps(opt))
    table = sparseffn.sparse_grad_parameters(model)[0]
    state_before = len(opt.state)
    model(torch.randint(0, 11, (3, 5))).pow(2).mean().backward()
    # the copy holds copies of the parameters, in the model's order
    at = next(i for i, p in enumerate(model.parameters()) if p is table)
    copied_table = opt.param_groups[0]["params"][at]
    copied_table.grad = table.grad
    before = copied_table.detach().clone()
    opt.step()                 # (AdamW alone would raise on the sparse gradient)
    assert not torch.equal(copied_table, before) and len(opt.state) == state_before


def test_mixed_adamw_refuses_amsgrad_for_a_sparse_gradient_and_skips_an_empty_one():
    model = _sparse_pkm_block()
    table = sparseffn.sparse_grad_parameters(model)[0]
    with pytest.raises(ValueError, match="amsgrad"):
        _train(model, [sparseffn.optim.MixedAdamW(model.parameters(), amsgrad=True)], 1)
    opt = sparseffn.optim.MixedAdamW([table], lr=0.01)
    table.grad = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long),
                                         torch.zeros(0, table.shape[1]), table.shape,
                                         check_invariants=True)
    before = table.detach().clone()
    opt.step()
    assert torch.equal(table, before) and not opt.state


def test_mixed_adamw_refuses_a_sparse_gradient_of_single_elements():
    table = nn.Parameter(torch.zeros(4, 3))
    table.grad = torch.zeros(4, 3).to_sparse(2)          # sparse_dim 2: elements, not rows
    with pytest.raises(ValueError, match="sparse_dim 1"):
        sparseffn.optim.MixedAdamW([table]).step()


def test_a_mixed_adamw_step_that_raised_leaves_nothing_for_the_next_step():
    model = _sparse_pkm_block()
    opt = sparseffn.optim.MixedAdamW(model.parameters(), lr=0.01)
    reference = _sparse_pkm_block()
    theirs = sparseffn.optim.MixedAdamW(reference.parameters(), lr=0.01)
    model(torch.randint(0, 11, (3, 5))).pow(2).mean().backward()

    def failing():
        raise RuntimeError("a closure that fails")
    with pytest.raises(RuntimeError, match="closure"):
        opt.step(failing)              # after the pre-hook, before the post-hook
    _train(model, [opt], 2)
    _train(reference, [theirs], 2)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)

