"""sparseffn layers inside Hugging Face models: surgery, save/load, initialisation, generation,
and MoEfication of whole models. Tiny randomly initialised configs; nothing is downloaded."""

import json
import math
import logging
import warnings

import pytest
import torch
from torch.nn import functional as F

transformers = pytest.importorskip("transformers")

import sparseffn                                    # noqa: E402
from sparseffn import MoEConfig, SwitchRouterConfig, hf   # noqa: E402

VOCAB = 50


def _quiet():
    logging.getLogger("transformers").setLevel(logging.ERROR)
    transformers.utils.logging.disable_progress_bar()


def gpt2(seed=0):
    _quiet()
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=VOCAB,
                                     n_positions=64, bos_token_id=0, eos_token_id=0,
                                     pad_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def llama(seed=0, mlp_bias=False, layers=2):
    _quiet()
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=32,
                                      intermediate_size=64,
                                      num_attention_heads=2, num_key_value_heads=2,
                                      vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
                                      pad_token_id=0, mlp_bias=mlp_bias)
    return transformers.LlamaForCausalLM(config)


def gemma(seed=0):
    """A gated MLP with GELU (tanh) instead of SiLU."""
    _quiet()
    torch.manual_seed(seed)
    config = transformers.GemmaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
                                      pad_token_id=0)
    return transformers.GemmaForCausalLM(config)


def bert(seed=0, hidden_act="gelu"):
    _quiet()
    torch.manual_seed(seed)
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=128,
                                     num_attention_heads=2, vocab_size=VOCAB,
                                     hidden_act=hidden_act, max_position_embeddings=64)
    return transformers.BertModel(config)


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert}


def _output(model, ids, attention_mask=None):
    out = model(input_ids=ids, attention_mask=attention_mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _ids(batch=2, length=9, seed=1):
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", MODELS)
@pytest.mark.parametrize("preset", ["sigma_moe", "switch", "fff", "pkm", "peer"])
def test_every_preset_replaces_every_mlp_and_trains(family, preset):
    model = MODELS[family]()
    blocks = len(hf.find_mlps(model))
    report = hf.sparsify(model, preset)
    assert len(report) == blocks and all(r.family == family for r in report.replacements)
    sparse = [m for m in model.modules() if isinstance(m, sparseffn.SparseFFN)]
    assert len(sparse) == blocks
    for r in report.replacements:       # the report counts what is there
        assert r.sparse_params == sum(p.numel() for p in
                                      model.get_submodule(r.path).parameters()
                                      if any(p is q for s in sparse for q in s.parameters()))
        assert r.sparse_params <= r.dense_params and r.sparse_flops > 0   # PKM at d=32 costs more
    model.train()
    ids = _ids()
    y = _output(model, ids)
    assert y.shape[:2] == ids.shape
    loss = y.float().pow(2).mean() + sparseffn.aux_loss(model)
    loss.backward()
    for layer in sparse:
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())


def test_bert_keeps_its_residual_layer_norm_and_loses_only_the_dense_mlp():
    model = bert()
    hf.sparsify(model, "sigma_moe")
    layer = model.encoder.layer[0]
    assert isinstance(layer.output.dense, torch.nn.Identity)
    assert isinstance(layer.output.LayerNorm, torch.nn.LayerNorm)
    assert isinstance(layer.intermediate.ffn, sparseffn.SigmaMoE)


def test_which_blocks_and_layer_configs():
    model = gpt2()
    report = hf.sparsify(model, "sigma_moe", which=2)          # GLaM: every other block
    assert [r.path for r in report.replacements] == ["transformer.h.1.mlp"]
    config = MoEConfig(d_model=32, num_experts=4, expert_size=16, k=1)
    report = hf.sparsify(model, config, which=[0])
    assert report.replacements[0].layer == "moe"
    assert isinstance(model.transformer.h[0].mlp.ffn, sparseffn.MoE)
    assert isinstance(model.transformer.h[2].mlp, transformers.models.gpt2.modeling_gpt2.GPT2MLP)
    made = hf.sparsify(model, lambda d_model, d_ff: config.replace(expert_size=d_ff // 8), which=[2])
    assert made.replacements[0].sparse_params == config.replace(expert_size=16).cost().total_params
    assert set(model.config.sparseffn["sites"]) == {f"transformer.h.{i}.mlp" for i in range(3)}


@pytest.mark.parametrize("call,message", [
    (lambda m: hf.sparsify(m, "nonsense"), "unknown layer preset"),
    (lambda m: hf.sparsify(m, MoEConfig(d_model=8, num_experts=2, expert_size=4, k=1)), "d_model"),
    (lambda m: hf.sparsify(m, "sigma_moe", which=[7]), "no block 7"),
    (lambda m: hf.sparsify(m, "sigma_moe", which=0), "n >= 1"),
    (lambda m: hf.sparsify(m, "sigma_moe", which="some"), "which must be"),
    (lambda m: hf.sparsify(torch.nn.Linear(3, 3), "sigma_moe"), "no MLP of a known type"),
    (lambda m: hf.sparsify(m, 3), "LayerConfig"),
])
def test_bad_requests_are_named(call, message):
    model = gpt2()
    with pytest.raises((ValueError, TypeError), match=message):
        call(model)


@pytest.mark.parametrize("family", MODELS)
def test_save_pretrained_then_load_gives_the_same_sparse_model(family, tmp_path):
    model = MODELS[family]()
    hf.sparsify(model, "sigma_moe" if family != "llama" else "peer", which=[1])
    with torch.no_grad():       # weights the load cannot get by drawing its own init again
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    model.eval()
    ids = _ids()
    want = _output(model, ids)
    model.save_pretrained(tmp_path)
    record = json.loads((tmp_path / "config.json").read_text())["sparseffn"]
    assert list(record["sites"]) == [hf.find_mlps(model)[1].path]
    torch.manual_seed(123)
    loaded = hf.from_pretrained(str(tmp_path)).eval()
    assert type(loaded) is type(model)
    torch.testing.assert_close(_output(loaded, ids), want)
    assert not any(b.is_meta for b in loaded.buffers())
    assert sum(isinstance(m, sparseffn.SparseFFN) for m in loaded.modules()) == 1
    if family != "bert":        # an Auto class resolves to the saved architecture
        auto = hf.from_pretrained(str(tmp_path), transformers.AutoModelForCausalLM).eval()
        torch.testing.assert_close(_output(auto, ids), want)


def test_loading_takes_the_arguments_hugging_faces_loading_takes(tmp_path):
    """Config changes (a new classification head: num_labels with ignore_mismatched_sizes;
    output_hidden_states) and dtype, as the class's own from_pretrained takes them."""
    _quiet()
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(bert().config)
    hf.sparsify(model, "sigma_moe")
    model.save_pretrained(tmp_path)
    saved = model.state_dict()
    loaded = hf.from_pretrained(str(tmp_path), num_labels=3, ignore_mismatched_sizes=True,
                                output_hidden_states=True)
    assert loaded.classifier.out_features == 3 and loaded.config.output_hidden_states
    ffn = [name for name in saved if ".ffn." in name]
    assert ffn
    for name in ffn:                     # the sparse layers' trained weights, not a fresh init
        torch.testing.assert_close(loaded.state_dict()[name], saved[name], rtol=0, atol=0)
    half = hf.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    for name in ffn:
        torch.testing.assert_close(half.state_dict()[name], saved[name].bfloat16())


def test_a_model_without_a_record_loads_as_usual(tmp_path):
    model = gpt2().eval()
    model.save_pretrained(tmp_path)
    loaded = hf.from_pretrained(str(tmp_path)).eval()
    ids = _ids()
    torch.testing.assert_close(_output(loaded, ids), _output(model, ids))


def test_sparsify_builds_each_layer_where_the_mlp_it_replaces_lives(monkeypatch):
    """A model on the meta device (accelerate's init_empty_weights) or a GPU gets layers
    initialised there, not on the CPU and copied: a Switch layer the size of a Llama-7B MLP
    took 7 s to initialise on the CPU, and no time on the meta device."""
    _quiet()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama().config)
    built_on = []          # the devices of each new layer's parameters as it is built
    build = hf.build_layer

    def spy(config):
        layer = build(config)
        built_on.append({p.device.type for p in layer.parameters()})
        return layer
    monkeypatch.setattr(hf, "build_layer", spy)
    hf.sparsify(model, "switch")
    assert built_on == [{"meta"}, {"meta"}]


def test_hugging_face_initialisation_leaves_our_layers_alone():
    """post_init() after the swap used to draw PEER's query network again with the model's
    initializer_range (std 0.02 instead of the layer's own)."""
    model = llama()
    hf.sparsify(model, "peer")
    before = {k: v.clone() for k, v in model.state_dict().items() if ".mlp." in k}
    model.post_init()
    model.init_weights()
    after = model.state_dict()
    assert before and all(torch.equal(v, after[k]) for k, v in before.items())


def test_cached_and_uncached_generation_agree_with_a_capacity_router():
    """Switch drops tokens over capacity when training; in evaluation it is dropless by
    default, so a token's output does not depend on how many arrive together."""
    model = gpt2()
    config = MoEConfig(d_model=32, num_experts=4, expert_size=32, k=1,
                       router=SwitchRouterConfig(capacity_factor=1.0))
    hf.sparsify(model, config)
    model.eval()
    prompt = _ids(batch=2, length=5)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    cached = model.generate(prompt, use_cache=True, **kwargs)
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)


def test_generation_inside_no_usage_statistics_counts_nothing_and_draws_the_same_tokens():
    """HF's ``generate()`` counts usage as every forward does (with its KV cache, each token
    once: the prompt's 5 and 5 of the 6 new); wrapped, it counts none and draws the same."""
    model = gpt2()
    hf.sparsify(model, "sigma_moe")
    model.eval()
    layers = [m for m in model.modules() if hasattr(m, "usage_counts")]
    prompt = _ids(batch=2, length=5)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with sparseffn.no_usage_statistics(model):
        quiet = model.generate(prompt, **kwargs)
    assert layers and all(layer.usage_counts.sum() == 0 for layer in layers)
    assert torch.equal(model.generate(prompt, **kwargs), quiet)
    assert [layer.usage_counts.sum().item() for layer in layers] == \
        [2 * (5 + 5) * layer.router.k for layer in layers]


@pytest.mark.parametrize("preset", ["sigma_moe", "fff", "peer"])
def test_generation_with_a_static_cache_compiles_one_graph_per_phase(preset):
    """HF's fast decoding: a static KV cache (fixed shapes) and ``torch.compile(model.forward,
    fullgraph=True)``. The sparse layers add no graph break (fullgraph would raise), the model
    compiles once for the prompt and once for a decoding step, for every step and the next
    prompt of the same shape, and the tokens are the eager model's. Dynamo's ``eager``
    backend, counted, keeps the test fast; Inductor gives the same (docs/huggingface.md)."""
    model = llama()
    hf.sparsify(model, preset)
    model.eval()
    prompts = [_ids(batch=2, length=5, seed=seed) for seed in (1, 2)]
    kwargs = dict(max_new_tokens=9, do_sample=False, pad_token_id=0,
                  cache_implementation="static")
    expected = [model.generate(prompt, **kwargs) for prompt in prompts]

    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, fullgraph=True, backend=counting_backend)
    try:
        for prompt, tokens in zip(prompts, expected):
            assert torch.equal(model.generate(prompt, **kwargs), tokens)
            assert len(graphs) == 2       # the prompt's and a decoding step's, for 8 steps
    finally:
        torch._dynamo.reset()


def test_a_router_with_an_evaluation_capacity_is_warned_of_where_it_is_built(tmp_path):
    """Under an evaluation capacity a token's output depends on the tokens evaluated with it,
    which HF's KV cache changes: sparsify and loading say so, naming the router; the
    dropless default says nothing."""
    def switch(eval_capacity_factor):
        return MoEConfig(d_model=32, num_experts=4, expert_size=32, k=1,
                         router=SwitchRouterConfig(capacity_factor=1.0,
                                                   eval_capacity_factor=eval_capacity_factor))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf.sparsify(gpt2(), switch(None))
    model = gpt2()
    with pytest.warns(UserWarning, match=r"sparsify: transformer\.h\.0\.mlp\.ffn\.router "
                                         r"routes each token by the tokens evaluated with it"):
        hf.sparsify(model, switch(0.5))
    model.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="the sparse layers loaded: transformer"):
        hf.from_pretrained(str(tmp_path))


def test_layers_in_a_hugging_face_model_follow_its_dtype_device_and_mode():
    model = gpt2().to(torch.float64).eval()
    hf.sparsify(model, "sigma_moe")
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert not any(m.training for m in model.modules())
    assert _output(model, _ids()).dtype == torch.float64


# --- MoEfication of whole models -------------------------------------------------------------

def _batches(n=4, length=12):
    return [{"input_ids": _ids(2, length, seed=s), "attention_mask": torch.ones(2, length,
                                                                                dtype=torch.long)}
            for s in range(n)]


def _randomised(model):
    """HF initialises a tiny model's MLPs near zero; spread them so that a wrong unit, gate or
    activation shows in the outputs."""
    with torch.no_grad():
        for site in hf.find_mlps(model):
            for p in site.module.parameters():
                p.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("family,hidden_act", [("bert", "gelu"), ("bert", "relu"),
                                               ("gpt2", None), ("llama", None),
                                               ("gemma", None)])
def test_moefy_with_every_expert_active_reproduces_the_dense_model(family, hidden_act):
    model = {"bert": lambda: bert(hidden_act=hidden_act), "gpt2": gpt2,
             "llama": lambda: _randomised(llama()), "gemma": lambda: _randomised(gemma())}[family]()
    model.eval()
    ids = _ids()
    want = _output(model, ids)
    report = hf.moefy(model, num_experts=4, k=4, batches=_batches(), router_steps=5)
    assert len(report) == len(hf.find_mlps(model)) and set(report.fits) == {
        r.path for r in report.replacements}
    torch.testing.assert_close(_output(model, ids), want, atol=1e-5, rtol=1e-4)


def test_moefy_at_half_the_experts_saves_and_loads(tmp_path):
    model = bert().eval()
    dense_out = _output(model, _ids())
    report = hf.moefy(model, num_experts=8, k=4, batches=_batches(), router_steps=50)
    assert report.totals()["sparse_flops"] < 0.6 * report.totals()["dense_flops"]
    for fit in report.fits.values():
        assert 0 <= fit["recall"] <= 1 and 0 < fit["oracle_share"] <= 1
    out = _output(model, _ids())
    assert not torch.equal(out, dense_out)
    model.save_pretrained(tmp_path)
    loaded = hf.from_pretrained(str(tmp_path)).eval()
    torch.testing.assert_close(_output(loaded, _ids()), out)


def test_moefy_of_a_llama_model_builds_swiglu_experts_that_save_and_load(tmp_path):
    model = _randomised(llama()).eval()
    dense_out = _output(model, _ids())
    report = hf.moefy(model, num_experts=8, k=2, batches=_batches(), router_steps=30)
    layer = model.model.layers[0].mlp.ffn
    assert layer.config.gated and layer.config.activation == "silu" and not layer.config.bias
    # three matrices per unit on both sides: a quarter of the experts, a quarter of the FLOPs
    totals = report.totals()
    assert totals["sparse_params"] > totals["dense_params"]
    assert totals["sparse_flops"] < 0.3 * totals["dense_flops"]
    out = _output(model, _ids())
    assert not torch.equal(out, dense_out)
    model.save_pretrained(tmp_path)
    loaded = hf.from_pretrained(str(tmp_path)).eval()
    assert loaded.model.layers[1].mlp.ffn.store.w_gate.shape == (8, 8, 32)
    torch.testing.assert_close(_output(loaded, _ids()), out)


def test_moefy_refuses_biased_gates_and_inputs_that_never_reach_them():
    with pytest.raises(ValueError, match="gate projection has a bias"):
        hf.moefy(llama(mlp_bias=True), 4, 2, batches=_batches())
    with pytest.raises(ValueError, match="never reached"):
        hf.moefy(bert(), 4, 2, batches=[])


def test_collect_mlp_inputs_leaves_out_padding():
    model = bert()
    sites = hf.find_mlps(model)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    got = hf.collect_mlp_inputs(model, [{"input_ids": _ids(2, 12), "attention_mask": mask}],
                                sites)
    assert all(x.shape == (24 - 5, 32) for x in got.values())


def _switch_everywhere(model, expert_size=8):
    """``model`` with Switch layers at capacity 1.0 in every MLP (where padding would take
    experts' places and change the capacity), in training mode."""
    hf.sparsify(model, MoEConfig(d_model=32, num_experts=4, expert_size=expert_size, k=1,
                                 router=SwitchRouterConfig(capacity_factor=1.0)))
    return model.train()


def _right_padded(length=6, padding=3):
    """Two sequences of ``length`` tokens right-padded by ``padding``: ids and mask [2, L]."""
    ids = torch.cat([_ids(2, length, seed=1), torch.zeros(2, padding, dtype=torch.long)], 1)
    mask = torch.cat([torch.ones(2, length), torch.zeros(2, padding)], 1).long()
    return ids, mask


def _switch_in_training(family):
    """A model of ``family`` without dropout, its MLPs Switch layers at capacity 1.0 (where
    padding would take experts' places and change the capacity), in training mode."""
    model = MODELS[family]()
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop",
                 "embd_pdrop", "attn_pdrop"):
        if hasattr(model.config, name):
            setattr(model.config, name, 0.0)
    model = type(model)(model.config)
    torch.manual_seed(1)
    return _switch_everywhere(model, expert_size=16)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_inside_skipping_padding_a_padded_batch_trains_as_its_tokens_alone(family):
    def model():
        return _switch_in_training(family)

    padded, mask = _right_padded(padding=4)
    ids = padded[:, :6]
    alone = model()
    want = _output(alone, ids)
    want_aux = sparseffn.aux_loss(alone)
    padded_model = model()
    with sparseffn.skipping_padding(padded_model, mask):
        got = _output(padded_model, padded, mask)
    torch.testing.assert_close(got[:, :6], want)
    torch.testing.assert_close(sparseffn.aux_loss(padded_model), want_aux)
    # without it, the padding changes the real tokens' outputs
    assert not torch.allclose(_output(model(), padded, mask)[:, :6], want, atol=1e-4)


def test_skip_padding_runs_each_padded_forward_inside_the_block_until_removed():
    model = _switch_in_training("gpt2")
    ids = _ids(2, 10)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, 6:] = 0
    with torch.no_grad():
        with sparseffn.skipping_padding(model, mask):
            want = _output(model, ids, mask)
        plain = _output(model, ids, mask)
        assert not torch.allclose(plain[0, :6], want[0, :6], atol=1e-4)
        handle = hf.skip_padding(model)
        torch.testing.assert_close(_output(model, ids, mask), want)
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, want)  # positional
        assert all(m._transient.token_mask is None for m in model.modules()
                   if isinstance(m, sparseffn.SparseFFN))      # only during a forward
        # generate() with its KV cache: the decoding steps' masks are longer than their input
        prompt_mask = torch.ones(2, 10, dtype=torch.long)
        prompt_mask[0, :3] = 0                                   # left padding
        model.generate(ids, attention_mask=prompt_mask, max_new_tokens=3, do_sample=False,
                       pad_token_id=0)
        handle.remove()
        torch.testing.assert_close(_output(model, ids, mask), plain)


def test_add_aux_loss_adds_the_aux_losses_to_a_returned_loss_until_removed():
    model = _switch_in_training("gpt2")
    ids = _ids(2, 8)
    plain = model(input_ids=ids, labels=ids).loss
    aux = sparseffn.aux_loss(model)
    assert aux.requires_grad and aux.item() > 0
    with hf.add_aux_loss(model):
        torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, plain + aux)
        tupled = model(input_ids=ids, labels=ids, return_dict=False)
        torch.testing.assert_close(tupled[0], plain + aux)
        assert model(input_ids=ids).loss is None                 # no labels, no loss
        untupled = model(input_ids=ids, return_dict=False)[0]    # the logits, untouched
        torch.testing.assert_close(untupled, model(input_ids=ids).logits)
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, plain)


def test_a_trainer_skips_padding_and_trains_the_aux_losses_with_the_hooks(tmp_path):
    pytest.importorskip("accelerate")
    model = transformers.BertForSequenceClassification(bert().config)
    hf.sparsify(model, MoEConfig(d_model=32, num_experts=4, expert_size=16, k=2))
    lengths = [3, 7, 5, 9, 4, 6, 8, 2]
    examples = [{"input_ids": _ids(1, n, seed=n)[0], "labels": n % 2} for n in lengths]

    def pad(batch):             # what DataCollatorWithPadding does, without a tokenizer
        width = max(len(e["input_ids"]) for e in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, e in enumerate(batch):
            ids[i, :len(e["input_ids"])] = e["input_ids"]
            mask[i, :len(e["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask,
                "labels": torch.tensor([e["labels"] for e in batch])}

    losses = []          # (the loss the Trainer got, the task's loss plus the aux losses)
    hf.skip_padding(model)
    hf.add_aux_loss(model)
    model.register_forward_hook(
        lambda m, a, kw, out: losses.append((out.loss.detach(), (F.cross_entropy(
            out.logits, kw["labels"]) + sparseffn.aux_loss(m)).detach())), with_kwargs=True)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4,
                                          max_steps=2, report_to=[], use_cpu=True,
                                          save_strategy="no", logging_strategy="no",
                                          dataloader_num_workers=0)
    layers = [m for m in model.modules() if isinstance(m, sparseffn.SparseFFN)]
    transformers.Trainer(model=model, args=args, train_dataset=examples,
                         data_collator=pad).train()
    # every layer routed the real tokens only: k = 2 slots per token, none of the padding
    for layer in layers:
        assert layer.usage_counts.sum() == 2 * sum(lengths)
    assert len(losses) == 2
    for got, want in losses:
        torch.testing.assert_close(got, want)
    assert sparseffn.aux_loss(model) != 0


def _lm_examples(n=8, length=12):
    return [{"input_ids": ids, "labels": ids} for ids in _ids(n, length, seed=5)]


def _trainer_args(tmp_path, **kwargs):
    return transformers.TrainingArguments(**{
        "output_dir": str(tmp_path), "per_device_train_batch_size": 4, "report_to": [],
        "use_cpu": True, "save_strategy": "no", "logging_steps": 1,
        "dataloader_num_workers": 0, **kwargs})


def _sparse_table_gpt2(seed=0):
    """A GPT-2 without dropout whose MLPs are PEER layers with sparse-gradient tables, drawn
    from ``seed``."""
    model = gpt2()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    torch.manual_seed(seed)
    hf.sparsify(model, sparseffn.PEERConfig(d_model=32, num_experts=64, heads=2, k=4,
                                             sparse_grad=True))
    return model


def test_a_sparse_trainer_trains_sparse_gradient_tables_and_clips_them(tmp_path):
    """The Trainer's AdamW and PyTorch's clipping raise on sparse gradients (PEER's tables
    with sparse_grad=True); SparseTrainer trains them and clips every gradient together."""
    pytest.importorskip("accelerate")
    model = _sparse_table_gpt2()
    tables = sparseffn.sparse_grad_parameters(model)
    assert tables
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    clipped = []          # each step's gradient norm after clipping

    class AfterClipping(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            assert any(p.grad.is_sparse for p in tables)
            clipped.append(float(sparseffn.optim.gradient_norm(
                [p for p in model.parameters() if p.grad is not None])))

    trainer = hf.SparseTrainer(model=model, args=_trainer_args(tmp_path, max_steps=3,
                                                               max_grad_norm=0.05),
                               train_dataset=_lm_examples(), callbacks=[AfterClipping()])
    trainer.train()
    logged = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    assert len(logged) == len(clipped) == 3
    for before_clipping, after in zip(logged, clipped):
        assert before_clipping > 0.05 and after == pytest.approx(0.05, rel=1e-4)
    for name, p in model.named_parameters():        # every parameter trained, tables too
        assert not torch.equal(p, before[name]), name
    assert isinstance(trainer.optimizer.optimizer, sparseffn.optim.MixedAdamW)
    assert set(model.config.sparseffn["hooks"]) == {"add_aux_loss", "skip_padding"}


def test_a_sparse_trainers_logs_hold_the_aux_loss_and_the_least_balanced_usage(tmp_path,
                                                                                capfd):
    pytest.importorskip("accelerate")
    from sparseffn.analysis import usage_health
    model = gpt2()
    hf.sparsify(model, "sigma_moe")
    auxes, health, counted = [], [], []   # each training forward's aux loss; each window's
    #                                       usage, and the slots it counted
    model.register_forward_hook(
        lambda m, args, out: auxes.append(float(sparseffn.aux_loss(m).detach()))
        if torch.is_grad_enabled() else None)

    class Window(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % args.logging_steps == 0:     # (the log comes next)
                health.append(usage_health(model))
                counted.append(sum(float(layer.usage_counts.sum()) for layer in model.modules()
                                   if isinstance(layer, sparseffn.SparseFFN)))

    trainer = hf.SparseTrainer(model=model, args=_trainer_args(tmp_path, max_steps=4,
                                                               logging_steps=2),
                               train_dataset=_lm_examples(16), callbacks=[Window()])
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == len(health) == 2 and len(auxes) == 4
    for i, (log, window) in enumerate(zip(logs, health)):
        assert log["aux_loss"] == pytest.approx(sum(auxes[2 * i:2 * i + 2]) / 2, rel=1e-5)
        assert len(window) == 3          # every layer
        assert log["usage_entropy_min"] == min(e for e, _ in window.values())
        assert log["starved_fraction_max"] == max(s for _, s in window.values())
    assert counted[1] == counted[0] > 0          # each window starts after the last log
    assert "collapsed" not in capfd.readouterr().err
    # every token the same MLP input: every token picks the same experts, and it is said,
    # unless the window routed too few tokens to tell (2 tokens a step)
    def collapsed_model():
        model = gpt2()
        hf.sparsify(model, "sigma_moe")
        with torch.no_grad():
            for block in model.transformer.h:
                block.ln_2.weight.zero_()
                block.ln_2.bias.fill_(1.0)
        return model

    hf.SparseTrainer(model=collapsed_model(), args=_trainer_args(
        tmp_path, max_steps=2, learning_rate=0.0, per_device_train_batch_size=1),
        train_dataset=_lm_examples(8, length=2)).train()
    assert "collapsed" not in capfd.readouterr().err
    hf.SparseTrainer(model=collapsed_model(), args=_trainer_args(
        tmp_path, max_steps=2, learning_rate=0.0), train_dataset=_lm_examples(8)).train()
    assert "expert usage looks collapsed in transformer.h.0.mlp.ffn" in capfd.readouterr().err


def test_a_sparse_seq2seq_trainer_trains_and_generates_a_model_from_model_init(tmp_path):
    """Seq2SeqTrainer (translation, summarisation, Whisper) made sparse-aware by the mixin;
    a model built by ``model_init`` (once in the constructor, again in ``train``) gets the
    hooks too."""
    pytest.importorskip("accelerate")
    built = []

    def model_init():
        _quiet()
        torch.manual_seed(0)
        model = transformers.BartForConditionalGeneration(transformers.BartConfig(**SEQ2SEQ))
        hf.sparsify(model, "switch")
        built.append(model)
        return model

    examples = [{"input_ids": ids, "labels": ids[:5]} for ids in _ids(8, 9, seed=6)]
    args = transformers.Seq2SeqTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, report_to=[],
        use_cpu=True, save_strategy="no", logging_steps=1, predict_with_generate=True,
        generation_max_length=6)
    trainer = hf.SparseSeq2SeqTrainer(model_init=model_init, args=args,
                                      train_dataset=examples, eval_dataset=examples[:4])
    trainer.train()
    metrics = trainer.evaluate()
    assert len(built) == 2 and trainer.model is built[-1]
    for model in built:
        assert set(model.config.sparseffn["hooks"]) == {"add_aux_loss", "skip_padding"}
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all(log["aux_loss"] > 0 for log in logs)   # Switch's balance
    assert math.isfinite(metrics["eval_loss"])


def test_a_sparse_trainer_resumes_a_checkpoint_as_if_never_stopped(tmp_path):
    """The optimiser state of the sparse tables (MixedAdamW's, saved in optimizer.pt) comes
    back with the Trainer's checkpoint."""
    pytest.importorskip("accelerate")

    def train(model, resume=None):
        args = _trainer_args(tmp_path, max_steps=3, save_steps=2, save_strategy="steps",
                             max_grad_norm=0.5, weight_decay=0.1)
        hf.SparseTrainer(model=model, args=args, train_dataset=_lm_examples()).train(
            resume_from_checkpoint=resume)
        return model.state_dict()

    straight = train(_sparse_table_gpt2())
    resumed = train(_sparse_table_gpt2(), resume=str(tmp_path / "checkpoint-2"))
    for name, value in straight.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=name)


def _sparse_trainer_replica(rank, world, port, out_dir):
    import os
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    model = _sparse_table_gpt2(seed=100 + rank)      # tables that differ until broadcast
    args = _trainer_args(out_dir, per_device_train_batch_size=8 // world, max_steps=2,
                         max_grad_norm=0.5, train_sampling_strategy="sequential",
                         ddp_backend="gloo")
    hf.SparseTrainer(model=model, args=args, train_dataset=_lm_examples(16),
                     aux_loss=False).train()
    torch.save(model.state_dict(), f"{out_dir}/rank{rank}.pt")
    torch.distributed.barrier()
    os._exit(0)      # (see tests/layers/test_distributed_usage.py: gloo at teardown)


def test_a_sparse_trainer_over_two_processes_trains_as_one_process_on_both_batches(tmp_path):
    """DDP (gloo) through accelerate: the sparse tables start as rank 0's, their gradients
    are averaged like the dense ones, and the two replicas take the steps one process takes
    on their batches together (the aux losses, of each replica's batch, left out)."""
    pytest.importorskip("accelerate")
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_sparse_trainer_replica, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    model = _sparse_table_gpt2(seed=100)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    args = _trainer_args(tmp_path / "one", per_device_train_batch_size=8, max_steps=2,
                         max_grad_norm=0.5, train_sampling_strategy="sequential")
    hf.SparseTrainer(model=model, args=args, train_dataset=_lm_examples(16),
                     aux_loss=False).train()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(ranks[1][name], ranks[0][name], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(ranks[0][name], value, rtol=1e-4, atol=1e-6, msg=name)
        assert name.endswith(".bias") or not torch.equal(value, before[name]), name


def test_lora_on_the_experts_and_the_attention_trains_saves_and_loads(tmp_path):
    """PEFT's LoRA on the expert tensors (``target_parameters``: a rank-r update of each
    expert's matrices) and on attention, over an upcycled Llama; the adapter saved alone
    loads onto the sparse base model again."""
    peft = pytest.importorskip("peft")
    model = llama()
    hf.upcycle(model, num_experts=4, k=2)
    model.save_pretrained(tmp_path / "base")
    ids = _ids()
    base_out = _output(model.eval(), ids)
    lora = peft.get_peft_model(model, peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], target_parameters=["store.w1", "store.w2"],
        init_lora_weights=False))
    trained = [(name, p) for name, p in lora.named_parameters() if p.requires_grad]
    assert any(".store." in name for name, _ in trained)
    assert all("lora_" in name for name, _ in trained)      # the experts themselves frozen
    lora.train()
    (lora(input_ids=ids, labels=ids).loss + sparseffn.aux_loss(lora)).backward()
    for name, p in trained:
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    lora.eval()
    out = _output(lora, ids)
    assert not torch.allclose(out, base_out)
    lora.save_pretrained(tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(hf.from_pretrained(str(tmp_path / "base")),
                                            str(tmp_path / "adapter")).eval()
    torch.testing.assert_close(_output(loaded, ids), out)


def test_a_sparse_trainer_decays_as_sparseffn_does_and_names_what_it_cannot_train(tmp_path):
    model = gpt2()
    hf.sparsify(model, "fff")
    trainer = hf.SparseTrainer(model=model, args=_trainer_args(tmp_path, weight_decay=0.1),
                               aux_loss=False, skip_padding=False)
    decay, no_decay = trainer.create_optimizer().param_groups
    biases = {id(p) for p in sparseffn.optim.no_weight_decay_parameters(model)}
    assert biases and biases <= {id(p) for p in no_decay["params"]}
    assert not biases & {id(p) for p in decay["params"]} and decay["weight_decay"] == 0.1
    assert not model.config.sparseffn.get("hooks")          # (aux_loss, skip_padding False)
    # another optimiser: the Trainer's, which cannot take sparse gradients
    model = _sparse_table_gpt2()
    trainer = hf.SparseTrainer(model=model, args=_trainer_args(tmp_path, optim="sgd"))
    with pytest.raises(ValueError, match="sparse gradients.*optim='sgd'"):
        trainer.create_optimizer()
    trainer = hf.SparseTrainer(model=model, args=_trainer_args(tmp_path))
    trainer.is_fsdp_enabled = True       # (as accelerate's FSDP plugin sets it)
    with pytest.raises(ValueError, match="FSDP and DeepSpeed cannot"):
        trainer.create_optimizer()


@pytest.mark.parametrize("family", MODELS)
def test_an_upcycled_model_computes_the_dense_model_and_saves_and_loads(family, tmp_path):
    model = MODELS[family]().eval()
    dense_out = _output(model, _ids())
    dense_params = sum(p.numel() for p in model.parameters())
    report = hf.upcycle(model, num_experts=4, k=2)
    assert len(report) == len(hf.find_mlps(model))
    totals = report.totals()
    assert totals["sparse_flops"] > 1.9 * totals["dense_flops"]     # k = 2 copies per token
    assert sum(p.numel() for p in model.parameters()) > dense_params + 2 * totals["dense_params"]
    out = _output(model, _ids())
    torch.testing.assert_close(out, dense_out, atol=1e-5, rtol=1e-4)
    model.save_pretrained(tmp_path)
    loaded = hf.from_pretrained(str(tmp_path)).eval()
    torch.testing.assert_close(_output(loaded, _ids()), out)


def _tiny(name):
    """A tiny random model of a family sparsify knows beyond GPT-2, Llama and BERT, without
    dropout (so that training and evaluation outputs agree)."""
    _quiet()
    torch.manual_seed(0)
    t = transformers
    small = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=VOCAB)
    built = {
        "gpt_neox": lambda: t.GPTNeoXForCausalLM(t.GPTNeoXConfig(intermediate_size=64,
                                                                 **small)),
        "gptj": lambda: t.GPTJForCausalLM(t.GPTJConfig(
            n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=64, rotary_dim=8,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "phi": lambda: t.PhiForCausalLM(t.PhiConfig(intermediate_size=64, resid_pdrop=0.0,
                                                    **small)),
        "phi3": lambda: t.Phi3ForCausalLM(t.Phi3Config(intermediate_size=64,
                                                       num_key_value_heads=2, pad_token_id=0,
                                                       **small)),
        "falcon": lambda: t.FalconForCausalLM(t.FalconConfig(**small)),
        "starcoder2": lambda: t.Starcoder2ForCausalLM(t.Starcoder2Config(
            intermediate_size=64, num_key_value_heads=2, **small)),
        "gemma3": lambda: t.Gemma3ForCausalLM(t.Gemma3TextConfig(
            intermediate_size=64, num_key_value_heads=1, head_dim=16, **small)),
        "distilbert": lambda: t.DistilBertModel(t.DistilBertConfig(
            dim=32, n_layers=2, n_heads=2, hidden_dim=64, vocab_size=VOCAB, dropout=0.0)),
        "t5": lambda: t.T5EncoderModel(t.T5Config(d_model=32, d_ff=64, num_layers=2,
                                                  num_heads=2, d_kv=16, vocab_size=VOCAB,
                                                  dropout_rate=0.0)),
        "deberta_v2": lambda: t.DebertaV2Model(t.DebertaV2Config(
            intermediate_size=64, hidden_dropout_prob=0.0, **small)),
        "mpnet": lambda: t.MPNetModel(t.MPNetConfig(intermediate_size=64,
                                                    hidden_dropout_prob=0.0, **small)),
        "modernbert": lambda: t.ModernBertModel(t.ModernBertConfig(
            intermediate_size=64, mlp_dropout=0.0, pad_token_id=0, **small)),
        "opt": lambda: t.OPTForCausalLM(t.OPTConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
            vocab_size=VOCAB, word_embed_proj_dim=32, dropout=0.0, pad_token_id=0)),
        "t5_gated": lambda: t.T5EncoderModel(t.T5Config(
            d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, vocab_size=VOCAB,
            dropout_rate=0.0, feed_forward_proj="gated-gelu")),
        "bart": lambda: t.BartModel(t.BartConfig(**SEQ2SEQ)),
        "marian": lambda: t.MarianMTModel(t.MarianConfig(**SEQ2SEQ)),
        "whisper": lambda: t.WhisperModel(t.WhisperConfig(
            num_mel_bins=8, max_source_positions=16, max_target_positions=32, **SEQ2SEQ)),
        "vit": lambda: t.ViTModel(t.ViTConfig(image_size=16, patch_size=8,
                                              hidden_dropout_prob=0.0, intermediate_size=64,
                                              **_without_vocab(small))),
        # two towers, with CLIP's own activation (quick_gelu, its default)
        "clip": lambda: t.CLIPModel(t.CLIPConfig(
            text_config=dict(vocab_size=VOCAB, intermediate_size=64, **_without_vocab(small)),
            vision_config=dict(image_size=16, patch_size=8, intermediate_size=64,
                               **_without_vocab(small)), projection_dim=16)),
        # two towers and a pooling head; the activation is named in each tower's config only
        "siglip": lambda: t.SiglipModel(t.SiglipConfig(
            text_config=dict(vocab_size=VOCAB, intermediate_size=64, **_without_vocab(small)),
            vision_config=dict(image_size=16, patch_size=8, intermediate_size=64,
                               **_without_vocab(small)))),
        "gpt_neo": lambda: t.GPTNeoForCausalLM(t.GPTNeoConfig(
            num_layers=2, hidden_size=32, num_heads=2, vocab_size=VOCAB,
            attention_types=[[["global", "local"], 1]], max_position_embeddings=64,
            resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0)),
        "gpt_bigcode": lambda: t.GPTBigCodeForCausalLM(t.GPTBigCodeConfig(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0)),
        "codegen": lambda: t.CodeGenForCausalLM(t.CodeGenConfig(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64, rotary_dim=8,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "bloom": lambda: t.BloomForCausalLM(t.BloomConfig(
            n_layer=2, hidden_size=32, n_head=2, vocab_size=VOCAB, hidden_dropout=0.0,
            attention_dropout=0.0)),
    }
    return built[name]()


# one encoder and one decoder layer, of different MLP widths
SEQ2SEQ = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=48,
               vocab_size=VOCAB, dropout=0.0, activation_dropout=0.0, pad_token_id=0,
               bos_token_id=0, eos_token_id=0, decoder_start_token_id=2,
               max_position_embeddings=64)


def _without_vocab(config):
    return {k: v for k, v in config.items() if k != "vocab_size"}


def _pixels():
    return torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))


# The inputs of the models that take more than token ids
INPUTS = {
    "marian": lambda: {"input_ids": _ids(), "decoder_input_ids": _ids(length=5)},
    "whisper": lambda: {"input_features": torch.randn(
        2, 8, 32, generator=torch.Generator().manual_seed(3)), "decoder_input_ids": _ids(length=5)},
    "vit": lambda: {"pixel_values": _pixels()},
    "siglip": lambda: {"input_ids": _ids(), "pixel_values": _pixels()},
    "clip": lambda: {"input_ids": _ids(), "pixel_values": _pixels()},
}


def _family_output(name, model):
    out = model(**INPUTS.get(name, lambda: {"input_ids": _ids()})())
    return next(getattr(out, key) for key in ("logits", "last_hidden_state", "logits_per_image")
                if getattr(out, key, None) is not None)


MORE_FAMILIES = ["gpt_neox", "gptj", "phi", "phi3", "falcon", "starcoder2", "gemma3",
                 "distilbert", "t5", "t5_gated", "deberta_v2", "mpnet", "modernbert", "opt",
                 "bart", "marian", "whisper", "vit", "clip", "siglip", "gpt_neo", "gpt_bigcode",
                 "codegen", "bloom"]
# (the families these join)
JOINED = {"gemma3": "llama", "deberta_v2": "bert", "mpnet": "bert", "marian": "bart",
          "whisper": "bart", "clip": "vit", "siglip": "vit", "gpt_bigcode": "gpt_neo",
          "codegen": "gptj"}
# MLPs per model where not 2 (two per tower; SigLIP's vision pooling head has one too)
MLPS = {"clip": 4, "siglip": 5}


@pytest.mark.parametrize("name", MORE_FAMILIES)
def test_more_families_are_found_read_exactly_and_made_sparse(name, tmp_path):
    model = _tiny(name).eval()
    with torch.no_grad():   # weights large enough for the MLPs' activations to tell apart
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    sites = hf.find_mlps(model)
    assert len(sites) == MLPS.get(name, 2)
    assert {s.family.name for s in sites} == {JOINED.get(name, name)}
    dense_out = _family_output(name, model)
    hf.upcycle(model, num_experts=3, k=2)        # the dense weights, read back exactly
    torch.testing.assert_close(_family_output(name, model), dense_out, atol=1e-5, rtol=1e-4)
    model = _tiny(name)
    report = hf.sparsify(model, "sigma_moe")
    assert len(report) == len(sites) and report.totals()["sparse_params"] > 0
    model.train()
    (_family_output(name, model).float().pow(2).mean() + sparseffn.aux_loss(model)).backward()
    for layer in (m for m in model.modules() if isinstance(m, sparseffn.SparseFFN)):
        assert layer.router.weight.grad.abs().sum() > 0
    model.eval().save_pretrained(tmp_path)
    loaded = hf.from_pretrained(str(tmp_path)).eval()
    torch.testing.assert_close(_family_output(name, loaded), _family_output(name, model))


def test_within_makes_one_tower_sparse_and_the_whole_model_saves_and_loads(tmp_path):
    """A vision-language model's language model, or CLIP's vision tower, made sparse alone:
    ``within`` selects the submodule's MLPs (``which`` counting among them) and records them
    in the whole model's config, which loading reads."""
    model = _tiny("clip").eval()
    report = hf.sparsify(model, "sigma_moe", within="vision_model", which=[1])
    assert [r.path for r in report.replacements] == ["vision_model.encoder.layers.1.mlp"]
    assert [s.path for s in hf.find_mlps(model, replaced=False)] == [
        "text_model.encoder.layers.0.mlp", "text_model.encoder.layers.1.mlp",
        "vision_model.encoder.layers.0.mlp"]
    model.save_pretrained(tmp_path)
    loaded = hf.from_pretrained(str(tmp_path)).eval()
    torch.testing.assert_close(_family_output("clip", loaded), _family_output("clip", model))
    with pytest.raises(ValueError, match="within='vision': CLIPModel has no submodule"):
        hf.upcycle(_tiny("clip"), num_experts=2, k=1, within="vision")


def test_a_submodule_made_sparse_and_its_parent_saved_is_refused_on_loading(tmp_path):
    """Its record lands in a nested config (vision_config), with paths from the submodule;
    loading would otherwise build dense MLPs where sparse weights were saved, silently."""
    model = _tiny("clip")
    hf.sparsify(model.vision_model, "sigma_moe")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="recorded in config.vision_config.*within="):
        hf.from_pretrained(str(tmp_path))


def test_a_dropout_on_the_hidden_units_goes_with_the_dense_mlp():
    """BART-family layers drop out their MLP's hidden units in their own forward
    (``activation_dropout``); after the MLP is replaced there are none there, and the dropout
    must not fall on the sparse layer's output instead."""
    _quiet()
    torch.manual_seed(0)
    model = transformers.BartModel(transformers.BartConfig(**{**SEQ2SEQ,
                                                              "activation_dropout": 0.5}))
    hf.upcycle(model, num_experts=3, k=2)       # deterministic in training too
    want = _family_output("bart", model.eval())
    torch.testing.assert_close(_family_output("bart", model.train()), want)


def test_skip_padding_masks_an_encoder_decoders_encoder_and_decoder_each_by_its_own_mask():
    _quiet()
    torch.manual_seed(0)
    model = transformers.T5Model(transformers.T5Config(
        d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, vocab_size=VOCAB,
        dropout_rate=0.0))
    hf.sparsify(model, "sigma_moe")
    layers = {stack: [m for m in getattr(model, stack).modules()
                      if isinstance(m, sparseffn.SparseFFN)] for stack in ("encoder", "decoder")}
    k = layers["encoder"][0].router.k
    source, target = _ids(2, 8), _ids(2, 8, seed=2)        # the same length: one mask fits both
    source_mask = torch.ones(2, 8, dtype=torch.long)
    source_mask[0, 5:] = 0
    target_mask = torch.ones(2, 8, dtype=torch.long)
    target_mask[1, 6:] = 0
    hf.skip_padding(model)
    with torch.no_grad():
        model(input_ids=source, attention_mask=source_mask, decoder_input_ids=target)
        for layer in layers["encoder"]:
            assert layer.usage_counts.sum() == k * 13          # the source's real tokens
        for layer in layers["decoder"]:
            assert layer.usage_counts.sum() == k * 16          # every target token
        sparseffn.reset_usage(model)
        model(input_ids=source, attention_mask=source_mask, decoder_input_ids=target,
              decoder_attention_mask=target_mask)
        for layer in layers["decoder"]:
            assert layer.usage_counts.sum() == k * 14          # the target's real tokens


def test_skip_padding_masks_the_text_tower_only_of_a_two_tower_model():
    """CLIP with both towers sparse: the text's mask is about the text tower's tokens; the
    image tower has no padding and a different token count (it raised a shape error)."""
    model = _switch_everywhere(_tiny("clip"))
    hf.skip_padding(model)
    ids, mask = _right_padded()
    torch.manual_seed(0)
    padded = model(input_ids=ids, attention_mask=mask, pixel_values=_pixels())
    torch.manual_seed(0)
    alone = model(input_ids=ids[:, :6], pixel_values=_pixels())
    torch.testing.assert_close(padded.text_embeds, alone.text_embeds)
    torch.testing.assert_close(padded.image_embeds, alone.image_embeds)


def test_collected_mlp_inputs_leave_out_the_texts_padding_not_image_tokens():
    """CLIP's tiny image tower has 5 tokens, as many as the padded text: the text's mask must
    not pick image rows (moefy would fit its routers to the wrong samples)."""
    model = _tiny("clip")
    ids, mask = _right_padded(length=3, padding=2)
    sites = hf.find_mlps(model)
    rows = hf.collect_mlp_inputs(model, [{"input_ids": ids, "attention_mask": mask,
                                          "pixel_values": _pixels()}], sites)
    counts = {path: x.shape[0] for path, x in rows.items()}
    assert counts == {"text_model.encoder.layers.0.mlp": 6, "text_model.encoder.layers.1.mlp": 6,
                      "vision_model.encoder.layers.0.mlp": 10,
                      "vision_model.encoder.layers.1.mlp": 10}


def test_skip_padding_masks_the_language_model_of_a_vision_language_model():
    _quiet()
    torch.manual_seed(0)
    small = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                 intermediate_size=64)
    model = _switch_everywhere(transformers.LlavaForConditionalGeneration(
        transformers.LlavaConfig(
            vision_config=transformers.CLIPVisionConfig(image_size=16, patch_size=8, **small),
            text_config=transformers.LlamaConfig(vocab_size=VOCAB + 10, num_key_value_heads=2,
                                                 **small),
            image_token_index=VOCAB + 5, vision_feature_layer=-1)))
    hf.skip_padding(model)
    ids, mask = _right_padded()
    ids = torch.cat([torch.full((2, 4), VOCAB + 5), ids], 1)        # 4 image tokens first
    mask = torch.cat([torch.ones(2, 4, dtype=torch.long), mask], 1)
    torch.manual_seed(0)
    padded = model(input_ids=ids, attention_mask=mask, pixel_values=_pixels()).logits
    torch.manual_seed(0)
    alone = model(input_ids=ids[:, :10], pixel_values=_pixels()).logits
    torch.testing.assert_close(padded[:, :10], alone)


def test_an_opt_model_skips_padding_in_its_flattened_mlp_input():
    model = _tiny("opt")
    hf.sparsify(model, "sigma_moe")
    layers = [m for m in model.modules() if isinstance(m, sparseffn.SparseFFN)]
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, 4:] = 0
    hf.skip_padding(model)
    with torch.no_grad():
        model(input_ids=_ids(2, 9), attention_mask=mask)
    for layer in layers:
        assert layer.usage_counts.sum() == layer.router.k * 13


@pytest.mark.parametrize("family", ["llama", "gpt2"])     # a causal-LM loss type, and none
def test_add_aux_loss_weights_the_aux_loss_by_the_forwards_share_of_the_items(family):
    model = MODELS[family]().train()
    ids = _ids(2, 8)
    labels = ids.clone()
    labels[0, 5:] = -100
    shifted = hf._loss_shifts_labels(model)
    assert shifted == (family == "llama")
    mine = int((labels[..., 1:] if shifted else labels).ne(-100).sum())
    total = torch.tensor(3 * mine)                     # as if two more micro-batches followed
    torch.manual_seed(0)
    plain = model(input_ids=ids, labels=labels, num_items_in_batch=total).loss
    aux = sparseffn.aux_loss(model)
    with hf.add_aux_loss(model):
        torch.manual_seed(0)
        got = model(input_ids=ids, labels=labels, num_items_in_batch=total).loss
    torch.testing.assert_close(got, plain + aux * mine / (3 * mine))


def test_under_gradient_accumulation_a_trainers_steps_share_the_aux_loss(tmp_path):
    """The Trainer normalises a causal LM's loss by the items of all its accumulation steps
    and no longer divides by their number: the aux loss must be weighted alike."""
    pytest.importorskip("accelerate")
    model = llama()
    hf.sparsify(model, "sigma_moe")
    shares = []
    hf.add_aux_loss(model)
    model.register_forward_hook(
        lambda m, a, kw, out: shares.append((kw.get("num_items_in_batch"), hf._share(m, kw))),
        with_kwargs=True)
    examples = [{"input_ids": _ids(1, n, seed=n)[0]} for n in (5, 9, 7, 3)]

    def pad(batch):
        width = max(len(e["input_ids"]) for e in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.full((len(batch), width), -100)
        for i, e in enumerate(batch):
            ids[i, :len(e["input_ids"])] = labels[i, :len(e["input_ids"])] = e["input_ids"]
        return {"input_ids": ids, "labels": labels}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=1, report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
        dataloader_num_workers=0)
    transformers.Trainer(model=model, args=args, train_dataset=examples,
                         data_collator=pad).train()
    assert len(shares) == 2 and all(total is not None for total, _ in shares)
    torch.testing.assert_close(sum(share for _, share in shares), torch.tensor(1.0))


def test_the_hooks_are_saved_with_the_model_and_installed_again_until_removed(tmp_path):
    model = gpt2()
    hf.sparsify(model, "sigma_moe")           # dropless: every kept token is counted
    model.train()
    padding = hf.skip_padding(model)
    hf.add_aux_loss(model)
    ids = _ids(2, 9)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 3:] = 0

    def check(model, hooked):
        layers = [m for m in model.modules() if isinstance(m, sparseffn.SparseFFN)]
        sparseffn.reset_usage(model)
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        counted = sum(int(layer.usage_counts.sum()) for layer in layers)
        tokens = 12 if hooked["skip_padding"] else 18
        assert counted == sum(layer.router.k for layer in layers) * tokens
        aux = sparseffn.aux_loss(model)
        assert aux.item() != 0
        task = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB),
                                                 ids[:, 1:].reshape(-1))
        torch.testing.assert_close(out.loss, task + aux if hooked["add_aux_loss"] else task)

    check(model, {"skip_padding": True, "add_aux_loss": True})
    model.save_pretrained(tmp_path / "both")
    loaded = hf.from_pretrained(str(tmp_path / "both")).train()
    check(loaded, {"skip_padding": True, "add_aux_loss": True})
    hf.add_aux_loss(loaded)     # as a user might after loading: still added once
    hf.skip_padding(loaded)
    check(loaded, {"skip_padding": True, "add_aux_loss": True})
    padding.remove()
    stale = hf.add_aux_loss(model)
    hf.add_aux_loss(model)      # replaces the hook that stale holds
    stale.remove()              # which then takes nothing off, the record included
    model.save_pretrained(tmp_path / "one")
    check(hf.from_pretrained(str(tmp_path / "one")).train(),
          {"skip_padding": False, "add_aux_loss": True})


def test_left_padded_generation_draws_the_same_tokens_with_skip_padding():
    """A dropless router in evaluation: the padding never reached a real token anyway, so
    computing it or not changes none of the tokens drawn (the prompt runs inside the block,
    the decoding steps outside)."""
    model = llama()
    hf.sparsify(model, "sigma_moe")
    model.eval()
    ids = _ids(2, 7)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :3] = 0                                        # left padding
    ids[0, :3] = 0

    def generate():
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                  pad_token_id=0)
    plain = generate()
    with hf.skip_padding(model):
        assert torch.equal(generate(), plain)
