"""Expert-choice routing (Zhou et al. 2022, arXiv:2202.09368) against the paper's algorithm
written as a loop over the experts."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

import sparseffn
from sparseffn import ExpertChoiceRouterConfig, MoE, MoEConfig
from sparseffn.models import LMConfig, TransformerLM, ffn_preset
from sparseffn.models.generate import cache_blocker
from sparseffn.routers.expert_choice import choose_tokens, expert_choice_capacity


def _layer(num_experts=6, k=2, seed=0, **router):
    torch.manual_seed(seed)
    return MoE(MoEConfig(d_model=10, num_experts=num_experts, expert_size=7, k=k,
                         router=ExpertChoiceRouterConfig(**router)))


def _loop_reference(layer, x):
    """Zhou et al. 2022 as written: S = softmax(X W_g); each expert e takes the
    ceil(k n / e) tokens of largest S[:, e] (sorted on the host, one expert at a time) and
    adds S[t, e] · f_e(x_t) to each of them."""
    scores = torch.softmax(x @ layer.router.weight.t(), dim=-1)              # [n, E]
    tokens, experts = scores.shape
    capacity = math.ceil(layer.router.k * tokens / experts)
    rows = [x.new_zeros(layer.d_model) for _ in range(tokens)]
    for e in range(experts):
        ranked = sorted(range(tokens), key=lambda t: -float(scores[t, e]))
        for t in ranked[:capacity]:
            hidden = F.relu(layer.store.w1[e] @ x[t])
            rows[t] = rows[t] + scores[t, e] * (hidden @ layer.store.w2[e])
    return torch.stack(rows) if rows else x.new_zeros(0, layer.d_model)


@pytest.mark.parametrize("tokens", [1, 5, 13, 24])
@pytest.mark.parametrize("k", [1, 2, 6])
def test_output_and_gradients_are_the_paper_algorithms(tokens, k):
    layer = _layer(k=k).train()
    x = torch.randn(tokens, 10, requires_grad=True)
    y = layer(x)
    want = _loop_reference(layer, x)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(y)
    params = [x, layer.router.weight, layer.store.w1, layer.store.w2]
    for got, expected in zip(torch.autograd.grad(y, params, grad),
                             torch.autograd.grad(want, params, grad)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(0, 40), experts=st.integers(1, 9), data=st.data())
def test_every_expert_takes_its_capacity_of_its_best_tokens(tokens, experts, data):
    k = data.draw(st.integers(1, experts))
    scores = torch.rand(tokens, experts, generator=torch.Generator().manual_seed(tokens))
    capacity = expert_choice_capacity(tokens, k, experts)
    assert capacity == math.ceil(k * tokens / experts) <= tokens
    chosen = choose_tokens(scores, capacity)
    assert chosen.shape == (tokens, experts) and chosen.dtype == torch.bool
    assert chosen.sum(0).tolist() == [capacity] * experts      # perfectly balanced
    for e in range(experts):                  # no unchosen token scores above a chosen one
        taken, left = scores[chosen[:, e], e], scores[~chosen[:, e], e]
        if len(taken) and len(left):
            assert taken.min() >= left.max()


def test_a_token_may_get_several_experts_or_none_and_the_stats_say_how_many_got_none():
    layer = _layer(num_experts=4, k=1).train()
    x = torch.randn(12, 10)
    with torch.no_grad():
        # tokens 0-2 score 1/4 for every expert, the others about 1 for expert 0 and 0 for the
        # rest: experts 1-3 all take tokens 0-2, expert 0 the three with the largest x[:, 0]
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 1.0
        x[:, 0] = torch.cat([torch.zeros(3), torch.arange(1.0, 10.0)])
    routing = layer.router(x)
    assert routing.dispatched.sum(-1).tolist() == [3, 3, 3] + [0] * 6 + [1, 1, 1]
    assert routing.dispatched[:3, 0].sum() == 0 and routing.dispatched[9:, 0].all()
    y = layer(x)
    assert torch.all(y[3:9] == 0) and torch.all(y[:3].abs().sum(-1) > 0)
    stats = sparseffn.routing_stats(layer)["<root>"]
    assert stats["unrouted_fraction"].item() == pytest.approx(6 / 12)
    assert stats["capacity"].item() == 3
    assert stats["counts"].tolist() == [3.0] * 4


def test_one_token_is_taken_by_every_expert():
    layer = _layer(num_experts=5, k=2).train()
    routing = layer.router(torch.randn(1, 10))
    assert routing.dispatched.all()


def test_top_k_evaluation_routes_each_token_alone_and_expert_choice_evaluation_does_not():
    x = torch.randn(9, 10)
    chooser = _layer().eval()
    alone = _layer(eval_routing="top_k").eval()
    assert not chooser.router.routes_tokens_alone_in_eval
    assert alone.router.routes_tokens_alone_in_eval
    with torch.no_grad():
        one_by_one = torch.cat([alone(x[t:t + 1]) for t in range(9)])
        torch.testing.assert_close(alone(x), one_by_one)
        routing = alone.router(x)
        scores = torch.softmax(x @ alone.router.weight.t(), -1)
        top = scores.topk(2, dim=-1)
        assert torch.equal(routing.indices.sort(-1).values, top.indices.sort(-1).values)
        torch.testing.assert_close(routing.weights.sort(-1).values, top.values.sort(-1).values)
        # a token alone is taken by every expert; among others, by some of them
        assert not torch.allclose(chooser(x), torch.cat([chooser(x[t:t + 1]) for t in range(9)]))
    alone.train()      # training is expert choice for both
    assert alone.router(x).dispatched is not None


def test_a_language_model_with_it_generates_without_a_kv_cache_unless_evaluation_is_top_k():
    def model(eval_routing):
        layout = ffn_preset("softmax_moe", 16, 64, 1, router={
            "type": "expert_choice", "eval_routing": eval_routing})
        torch.manual_seed(0)
        return TransformerLM(LMConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=2,
                                      context=8, ffn=layout.ffn)).eval()
    assert cache_blocker(model("expert_choice")) is not None
    assert cache_blocker(model("top_k")) is None
    prompt = torch.tensor([[1, 2, 3]])
    for eval_routing in ("expert_choice", "top_k"):
        out = sparseffn.models.generate(model(eval_routing), prompt, max_new_tokens=4)
        assert out.shape == (1, 7)


def test_z_loss_is_st_moe_and_weighted_as_configured():
    layer = _layer(z_loss_weight=0.01).train()
    x = torch.randn(8, 10)
    layer(x)
    logits = x @ layer.router.weight.t()
    torch.testing.assert_close(layer.aux_losses["z_loss"],
                               torch.logsumexp(logits, -1).square().mean())
    assert layer.aux_loss_weights == {"z_loss": 0.01}


@pytest.mark.parametrize("router, message", [
    ({"type": "expert_choice", "eval_routing": "topk"}, "eval_routing must be one of"),
    ({"type": "expert_choice", "z_loss_weight": -1}, "z_loss_weight"),
    ({"type": "expert_choice", "capacity_factor": 2}, "no field"),
])
def test_bad_configs_are_named(router, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig(d_model=4, num_experts=4, expert_size=2, k=2, router=router)
