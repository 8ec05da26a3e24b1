"""sparseffn layers inside Hugging Face ``transformers`` models (``pip install sparseffn[hf]``).

- :func:`sparsify` puts a sparse layer in the MLP place of every block (or some blocks) of a
  GPT-2, Llama/Mistral/Qwen-family, BERT-family (DeBERTa, MPNet), GPT-NeoX, GPT-J, GPT-Neo,
  BLOOM, Phi, Phi-3, Falcon, StarCoder2, DistilBERT, ModernBERT, T5, OPT, BART-family
  (Marian, Whisper, ...) or ViT-family (CLIP, SigLIP, DINOv2, ...) model, found by module
  type, and returns a report of what it replaced with parameter and FLOP counts;
- :func:`moefy` turns the trained MLPs of such a model into mixtures of their own hidden
  units (MoEfication, Zhang et al. 2022, arXiv:2110.01786; see :mod:`sparseffn.convert`),
  and :func:`upcycle` into mixtures of copies of themselves (sparse upcycling, Komatsuzaki
  et al. 2022, arXiv:2212.05055);
- all three record the replacement in ``model.config.sparseffn``, so ``save_pretrained`` writes
  it to ``config.json`` and :func:`from_pretrained` builds the sparse model again before the
  weights load. The stock ``AutoModel.from_pretrained`` does not know the entry: it would
  build dense MLPs and report the sparse weights as unexpected.

For loops such as the ``Trainer`` that call the model and read its loss themselves:
:func:`skip_padding` makes every forward given an ``attention_mask`` run inside
:func:`sparseffn.skipping_padding`, and :func:`add_aux_loss` adds the aux losses to every
loss the model returns.

Hugging Face's own initialisation (``post_init``, ``init_weights``) leaves the replaced layers
alone: they are marked initialised. Other architectures join with :func:`register_family`.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from .bench.plotting import MissingDependency
from .convert import DenseWeights, fit_router
from .convert import moefy as moefy_mlp
from .convert import upcycle as upcycle_mlp
from .models.presets import PRESETS, ffn_preset
from .registry import LayerConfig, build_layer, config_from_dict

#: The key of the replacement record in a model's config (and its config.json).
CONFIG_KEY = "sparseffn"
_FORMAT = 1

# Hugging Face activation names (config.hidden_act / activation_function) that a sparseffn
# layer computes exactly.
_HF_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                   "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu", "swish": "silu",
                   "quick_gelu": "quick_gelu"}


def require_transformers():
    """The ``transformers`` module, or :class:`MissingDependency` saying how to get it."""
    try:
        return importlib.import_module("transformers")
    except ImportError as err:  # pragma: no cover - the hf extra installs it
        raise MissingDependency("sparseffn.hf needs the transformers package: "
                                "pip install 'sparseffn[hf]'") from err


class SparseMLP(nn.Module):
    """A sparseffn layer in the place of a Hugging Face MLP: ``dropout(ffn(x))``, the dropout
    being the one the replaced MLP applied to its output (GPT-2's ``resid_pdrop``; none for
    the others), plus ``residual`` where the MLP added its block's residual itself (BLOOM).

    forward(hidden_states: [..., d_model], residual: [..., d_model] | None) -> [..., d_model]
    """

    def __init__(self, ffn: nn.Module, dropout: float = 0.0, family: str = "") -> None:
        super().__init__()
        self.ffn = ffn
        self.dropout = nn.Dropout(dropout)
        self.family = family     # the MLPFamily whose MLP this replaced

    def forward(self, hidden_states: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        out = self.dropout(self.ffn(hidden_states))
        return out if residual is None else out + residual


# ---------------------------------------------------------------------------------------------
# Families of MLP blocks, by module type

@dataclass(frozen=True)
class MLPFamily:
    """How to find, measure, read and replace one kind of Hugging Face MLP.

    classes: ``(module, class name)`` pairs of the ``transformers`` classes of the *site*: the
      module that holds the MLP (GPT-2's ``GPT2MLP``, Llama's ``LlamaMLP``, BERT's whole
      ``BertLayer``, whose MLP is split over ``intermediate`` and ``output``).
    dims(site) -> (d_model, d_ff); dense_params(site) -> the MLP's parameter count;
    replace(parent, name, site, ffn) puts ``ffn`` in the MLP's place;
    dense_weights(site, config) -> :class:`~sparseffn.convert.DenseWeights` (with ``w_gate``
      for a gated MLP), or None for an MLP that cannot be converted;
    mlp(site) -> the module whose input is the MLP's input (hooked to collect samples);
    replaced(site) -> whether a site of one of ``classes`` already holds a sparse layer (for
      families whose site is the whole block, like BERT's);
    matrices: the MLP's ``[d_model, d_ff]`` weight matrices (3 for a gated MLP).
    """

    name: str
    classes: tuple[tuple[str, str], ...]
    dims: Callable[[nn.Module], tuple[int, int]]
    dense_params: Callable[[nn.Module], int]
    replace: Callable[[nn.Module, str, nn.Module, nn.Module], None]
    dense_weights: Callable[[nn.Module, Any], DenseWeights | None]
    mlp: Callable[[nn.Module], nn.Module] = lambda site: site
    replaced: Callable[[nn.Module], bool] = lambda site: False
    matrices: int = 2


def _params(*modules: nn.Module) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def _activation(config: Any, *attributes: str) -> str:
    """The sparseffn name of the activation the first set one of ``attributes`` names."""
    name = next((getattr(config, a) for a in attributes if getattr(config, a, None)), None)
    if name not in _HF_ACTIVATIONS:
        raise ValueError(f"cannot convert an MLP with activation {name!r}: sparseffn computes "
                         f"{sorted(_HF_ACTIVATIONS)} exactly")
    return _HF_ACTIVATIONS[name]


def _output_dropout(site: nn.Module) -> float:
    """The dropout probability an MLP applies to its output: its ``dropout`` module (GPT-2,
    GPT-J, DistilBERT) or its ``residual_dropout`` (StarCoder2); 0 for none."""
    dropout = getattr(site, "dropout", None)
    if isinstance(dropout, nn.Dropout):
        return dropout.p
    residual = getattr(site, "residual_dropout", 0.0)
    return float(residual) if isinstance(residual, (int, float)) else 0.0


def _swapper(family: str, output_dropout: bool = True):
    """``replace`` for an MLP that is one module: a :class:`SparseMLP` in its place, with the
    MLP's output dropout (none with ``output_dropout=False``: T5's dropout acts on the hidden
    units, which a sparse layer does not expose)."""
    def swap(parent: nn.Module, name: str, site: nn.Module, ffn: nn.Module) -> None:
        p = _output_dropout(site) if output_dropout else 0.0
        setattr(parent, name, SparseMLP(ffn, p, family))
    return swap


def _two_linears(up: str, down: str, *activation: str):
    """``dense_weights`` of an MLP ``down(act(up(x)))`` held as two ``nn.Linear``s, its
    activation named by the first set one of the config's ``activation`` attributes."""
    def weights(site, config) -> DenseWeights:
        return DenseWeights.from_linears(getattr(site, up), getattr(site, down),
                                         _activation(config, *activation))
    return weights


def _linear_dims(up: str, halves: int = 1):
    """``dims`` from the ``up`` linear [d_model → halves · d_ff]."""
    return lambda site: (getattr(site, up).in_features, getattr(site, up).out_features // halves)


def _family(name: str, classes: tuple[tuple[str, str], ...], up: str, down: str,
            *activation: str, output_dropout: bool = True) -> MLPFamily:
    """A family whose MLP is one module ``down(act(up(x)))`` of two ``nn.Linear``s."""
    return MLPFamily(name, classes, dims=_linear_dims(up), dense_params=_params,
                     replace=_swapper(name, output_dropout),
                     dense_weights=_two_linears(up, down, *activation))


def _gpt2_weights(site, config) -> DenseWeights:
    # Conv1D stores [in, out]: y = x @ weight + bias
    return DenseWeights(site.c_fc.weight.detach().t(), site.c_fc.bias.detach(),
                        site.c_proj.weight.detach().t(), site.c_proj.bias.detach(),
                        _activation(config, "activation_function"))


def _bert_replace(parent, name, site, ffn) -> None:
    site.intermediate = SparseMLP(ffn, family="bert")   # BertOutput: dropout, residual, norm
    site.output.dense = nn.Identity()


def _bert_weights(site, config) -> DenseWeights:
    return DenseWeights.from_linears(site.intermediate.dense, site.output.dense,
                                     _activation(config, "hidden_act"))


def _llama_weights(site, config) -> DenseWeights:
    # down_proj(act(gate_proj(x)) * up_proj(x)); Gemma names its activation hidden_activation
    if site.gate_proj.bias is not None:
        raise ValueError("cannot convert a gated MLP whose gate projection has a bias")
    return replace(
        DenseWeights.from_linears(site.up_proj, site.down_proj,
                                  _activation(config, "hidden_activation", "hidden_act")),
        w_gate=site.gate_proj.weight.detach())


def _fused_gate_up(fused: str, down: str, *activation: str):
    """``dense_weights`` of a gated MLP ``down(act(gate) * up)`` whose ``[gate; up]`` come from
    one fused linear ``fused`` (Phi-3's ``gate_up_proj``, ModernBERT's ``Wi``)."""
    def weights(site, config) -> DenseWeights:
        if getattr(site, fused).bias is not None:
            raise ValueError("cannot convert a gated MLP whose gate projection has a bias")
        gate, up = getattr(site, fused).weight.detach().chunk(2, dim=0)
        out = getattr(site, down)
        return DenseWeights(up, None, out.weight.detach(),
                            None if out.bias is None else out.bias.detach(),
                            _activation(config, *activation), w_gate=gate)
    return weights


def _block_fc_family(name: str, classes: tuple[tuple[str, str], ...]) -> MLPFamily:
    """A family whose MLP lives in its block's own forward as ``fc2(act(fc1(x)))``, perhaps
    with a dropout (``activation_dropout``) on the hidden units: OPT's decoder layer, and
    the encoder and decoder layers of BART, Whisper and their kin. ``fc1`` becomes the sparse
    layer, the activation and ``fc2`` identities, and the hidden units' dropout none (a sparse
    layer does not expose them)."""
    def swap(parent, attribute, site, ffn) -> None:
        site.fc1 = SparseMLP(ffn, family=name)
        site.activation_fn = nn.Identity()
        site.fc2 = nn.Identity()
        if hasattr(site, "activation_dropout"):
            site.activation_dropout = 0.0

    return MLPFamily(name, classes, dims=_linear_dims("fc1"),
                     dense_params=lambda site: _params(site.fc1, site.fc2), replace=swap,
                     dense_weights=_two_linears("fc1", "fc2", "activation_function"),
                     mlp=lambda site: site.fc1,
                     replaced=lambda site: isinstance(site.fc1, SparseMLP))


def _bloom_replace(parent, name, site, ffn) -> None:
    # BloomMLP.forward(hidden_states, residual): dropout(mlp(x)) + residual
    setattr(parent, name, SparseMLP(ffn, site.hidden_dropout, "bloom"))


def _t5_gated_weights(site, config) -> DenseWeights:
    # wo(act(wi_0(x)) * wi_1(x)): wi_0 is the gate
    if site.wi_0.bias is not None:
        raise ValueError("cannot convert a gated MLP whose gate projection has a bias")
    return replace(DenseWeights.from_linears(site.wi_1, site.wo,
                                             _activation(config, "dense_act_fn")),
                   w_gate=site.wi_0.weight.detach())


def _models(*pairs: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple((f"transformers.models.{package}.modeling_{package}", cls) for package, cls in pairs)


FAMILIES: list[MLPFamily] = [
    MLPFamily(
        "gpt2", _models(("gpt2", "GPT2MLP")),
        dims=lambda s: (s.c_fc.weight.shape[0], s.c_fc.weight.shape[1]),
        dense_params=_params, replace=_swapper("gpt2"), dense_weights=_gpt2_weights),
    MLPFamily(
        "llama", _models(("llama", "LlamaMLP"), ("mistral", "MistralMLP"), ("qwen2", "Qwen2MLP"),
                         ("qwen3", "Qwen3MLP"), ("gemma", "GemmaMLP"), ("gemma2", "Gemma2MLP"),
                         ("gemma3", "Gemma3MLP"), ("olmo", "OlmoMLP"), ("olmo2", "Olmo2MLP"),
                         ("olmo3", "Olmo3MLP"), ("granite", "GraniteMLP"),
                         ("cohere", "CohereMLP"), ("stablelm", "StableLmMLP"),
                         ("smollm3", "SmolLM3MLP")),
        dims=lambda s: (s.up_proj.in_features, s.up_proj.out_features),
        dense_params=_params, replace=_swapper("llama"),
        dense_weights=_llama_weights, matrices=3),
    MLPFamily(
        "bert", _models(("bert", "BertLayer"), ("roberta", "RobertaLayer"),
                        ("xlm_roberta", "XLMRobertaLayer"), ("electra", "ElectraLayer"),
                        ("camembert", "CamembertLayer"), ("deberta", "DebertaLayer"),
                        ("deberta_v2", "DebertaV2Layer"), ("mpnet", "MPNetLayer")),
        dims=lambda s: (s.intermediate.dense.in_features, s.intermediate.dense.out_features),
        dense_params=lambda s: _params(s.intermediate, s.output.dense),
        replace=_bert_replace, dense_weights=_bert_weights,
        mlp=lambda site: site.intermediate,
        replaced=lambda site: isinstance(site.intermediate, SparseMLP)),
    _family("gpt_neox", _models(("gpt_neox", "GPTNeoXMLP")), "dense_h_to_4h", "dense_4h_to_h",
            "hidden_act"),
    _family("gptj", _models(("gptj", "GPTJMLP"), ("codegen", "CodeGenMLP")), "fc_in", "fc_out",
            "activation_function"),
    _family("phi", _models(("phi", "PhiMLP")), "fc1", "fc2", "hidden_act"),
    _family("falcon", _models(("falcon", "FalconMLP")), "dense_h_to_4h", "dense_4h_to_h",
            "activation"),
    _family("starcoder2", _models(("starcoder2", "Starcoder2MLP")), "c_fc", "c_proj",
            "hidden_act"),
    _family("distilbert", _models(("distilbert", "FFN")), "lin1", "lin2", "activation"),
    _family("t5", _models(("t5", "T5DenseActDense")), "wi", "wo", "dense_act_fn",
            output_dropout=False),
    MLPFamily(
        "t5_gated", _models(("t5", "T5DenseGatedActDense")), dims=_linear_dims("wi_0"),
        dense_params=_params, replace=_swapper("t5_gated", output_dropout=False),
        dense_weights=_t5_gated_weights, matrices=3),
    MLPFamily(
        "phi3", _models(("phi3", "Phi3MLP")), dims=_linear_dims("gate_up_proj", halves=2),
        dense_params=_params, replace=_swapper("phi3"),
        dense_weights=_fused_gate_up("gate_up_proj", "down_proj", "hidden_act"), matrices=3),
    MLPFamily(   # its dropout acts on the hidden units
        "modernbert", _models(("modernbert", "ModernBertMLP")),
        dims=_linear_dims("Wi", halves=2), dense_params=_params,
        replace=_swapper("modernbert", output_dropout=False),
        dense_weights=_fused_gate_up("Wi", "Wo", "hidden_activation"), matrices=3),
    # OPT's MLP input arrives flattened, as [batch·seq, d]
    _block_fc_family("opt", _models(("opt", "OPTDecoderLayer"))),
    _block_fc_family("bart", _models(*(
        (package, f"{prefix}{part}Layer")
        for package, prefix in (("bart", "Bart"), ("mbart", "MBart"), ("marian", "Marian"),
                                ("pegasus", "Pegasus"), ("plbart", "PLBart"),
                                ("blenderbot", "Blenderbot"),
                                ("blenderbot_small", "BlenderbotSmall"), ("m2m_100", "M2M100"),
                                ("whisper", "Whisper"), ("speech_to_text", "Speech2Text"),
                                ("mvp", "Mvp"), ("led", "LED"))
        for part in ("Encoder", "Decoder")),
        ("biogpt", "BioGptDecoderLayer"), ("xglm", "XGLMDecoderLayer"),
        ("trocr", "TrOCRDecoderLayer"))),
    # fc2(act(fc1(x))) with no dropout: the Vision Transformer and its descendants, the towers
    # of CLIP and SigLIP (their activation is read from the tower's config)
    _family("vit", _models(
        ("vit", "ViTMLP"), ("deit", "DeiTMLP"), ("vit_mae", "ViTMAEMLP"), ("vit_msn", "ViTMSNMLP"),
        ("beit", "BeitMLP"), ("dinov2", "Dinov2MLP"),
        ("dinov2_with_registers", "Dinov2WithRegistersMLP"), ("ijepa", "IJepaMLP"),
        ("vivit", "VivitMLP"), ("audio_spectrogram_transformer", "ASTMLP"), ("clip", "CLIPMLP"),
        ("clipseg", "CLIPSegMLP"), ("altclip", "AltCLIPMLP"), ("metaclip_2", "MetaClip2MLP"),
        ("chinese_clip", "ChineseCLIPVisionMLP"), ("x_clip", "XCLIPMLP"),
        ("owlvit", "OwlViTMLP"), ("owlv2", "Owlv2MLP"), ("groupvit", "GroupViTMLP"),
        ("siglip", "SiglipMLP"), ("siglip2", "Siglip2MLP"), ("blip", "BlipMLP"),
        ("blip_2", "Blip2MLP"), ("instructblip", "InstructBlipMLP"),
        ("idefics2", "Idefics2VisionMLP"), ("idefics3", "Idefics3VisionMLP"),
        ("smolvlm", "SmolVLMVisionMLP"), ("kosmos2", "Kosmos2VisionMLP")),
        "fc1", "fc2", "hidden_act"),
    _family("gpt_neo", _models(("gpt_neo", "GPTNeoMLP"), ("gpt_bigcode", "GPTBigCodeMLP")),
            "c_fc", "c_proj", "activation_function"),
    MLPFamily(   # BloomGelu is GELU's tanh approximation; the MLP adds the residual itself
        "bloom", _models(("bloom", "BloomMLP")), dims=_linear_dims("dense_h_to_4h"),
        dense_params=_params, replace=_bloom_replace,
        dense_weights=lambda site, config: DenseWeights.from_linears(
            site.dense_h_to_4h, site.dense_4h_to_h, "gelu_tanh")),
]


def register_family(family: MLPFamily) -> None:
    """Teach :func:`sparsify` another architecture's MLP (checked before the built-in ones)."""
    FAMILIES.insert(0, family)


def _classes(family: MLPFamily) -> tuple[type, ...]:
    found = []
    for module_name, class_name in family.classes:
        try:
            cls = getattr(importlib.import_module(module_name), class_name, None)
        except ImportError:
            continue
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def _known_classes() -> list[tuple[MLPFamily, tuple[type, ...]]]:
    """Each registered family with the classes this ``transformers`` has of it."""
    return [(family, classes) for family in FAMILIES if (classes := _classes(family))]


def _family_of(module: nn.Module, known: list[tuple[MLPFamily, tuple[type, ...]]]
               ) -> MLPFamily | None:
    return next((family for family, classes in known if isinstance(module, classes)), None)


@dataclass(frozen=True)
class Site:
    """One MLP place of a model: its module path, family, block number (0-based, in module
    order) and whether it already holds a sparse layer."""

    path: str
    family: MLPFamily
    block: int
    module: nn.Module
    replaced: bool = False


def _family_named(name: str) -> MLPFamily | None:
    return next((f for f in FAMILIES if f.name == name), None)


def find_mlps(model: nn.Module, *, replaced: bool = True) -> list[Site]:
    """Every MLP place of ``model`` that a registered :class:`MLPFamily` knows, in module order,
    those already holding a sparse layer included (``replaced=False`` leaves them out; block
    numbers stay those of the whole model)."""
    sites: list[Site] = []
    taken: list[str] = []
    known = _known_classes()
    for path, module in model.named_modules():
        if any(path.startswith(prefix + ".") for prefix in taken):
            continue
        family = _family_of(module, known)
        done = family is not None and family.replaced(module)
        if family is None and isinstance(module, SparseMLP):
            family, done = _family_named(module.family), True
        if family is not None:
            sites.append(Site(path, family, len(sites), module, done))
            taken.append(path)
    return [s for s in sites if replaced or not s.replaced]


def _sites(model: nn.Module, within: str | None) -> list[Site]:
    """The MLP places of ``model``, or of its submodule at path ``within`` (numbered among
    themselves, paths still from ``model``, so the record in ``model.config`` finds them)."""
    sites = find_mlps(model)
    if within is None:
        return sites
    try:
        model.get_submodule(within)
    except AttributeError:
        raise ValueError(f"within={within!r}: {type(model).__name__} has no submodule at that "
                         f"path") from None
    inside = [s for s in sites if within == "" or s.path.startswith(within + ".")]
    return [replace(s, block=i) for i, s in enumerate(inside)]


def _chosen(sites: list[Site], which: str | int | Sequence[int]) -> list[Site]:
    """The sites ``which`` names among ``sites`` (all of the model's, in block order) that still
    hold a dense MLP; naming a replaced one by number is an error."""
    if which == "all":
        return [s for s in sites if not s.replaced]
    if isinstance(which, int) and not isinstance(which, bool):
        if which < 1:
            raise ValueError(f"which={which}: every n-th block needs n >= 1")
        # every n-th block, counting from the n-th (GLaM: the second of every two)
        return [s for s in sites if s.block % which == which - 1 and not s.replaced]
    if isinstance(which, (list, tuple, range)):
        blocks = list(which)
        bad = [b for b in blocks if isinstance(b, bool) or not isinstance(b, int)
               or not 0 <= b < len(sites)]
        if bad:
            raise ValueError(f"which: no block {bad[0]!r}; the model has {len(sites)} MLP "
                             f"blocks (0-{len(sites) - 1})")
        again = [s.path for s in sites if s.block in set(blocks) and s.replaced]
        if again:
            raise ValueError(f"which: {again[0]} already holds a sparse layer")
        return [s for s in sites if s.block in set(blocks)]
    raise ValueError(f'which must be "all", an integer n (every n-th block) or a list of '
                     f"block numbers, got {which!r}")


# ---------------------------------------------------------------------------------------------
# The report

@dataclass(frozen=True)
class Replacement:
    """One replaced MLP: dense and sparse parameters and forward FLOPs per token (a
    multiply-add is 2 FLOPs)."""

    path: str
    family: str
    layer: str
    dense_params: int
    sparse_params: int
    dense_flops: int
    sparse_flops: int


@dataclass
class SparsifyReport:
    """What :func:`sparsify` or :func:`moefy` replaced; ``str(report)`` is a table."""

    replacements: list[Replacement] = field(default_factory=list)
    fits: dict[str, dict[str, float]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.replacements)

    def totals(self) -> dict[str, int]:
        keys = ("dense_params", "sparse_params", "dense_flops", "sparse_flops")
        return {k: sum(getattr(r, k) for r in self.replacements) for k in keys}

    def __str__(self) -> str:
        lines = [f"{'module':<32} {'layer':<10} {'dense params':>12} {'sparse params':>13} "
                 f"{'FLOPs/token':>12}"]
        for r in self.replacements:
            lines.append(f"{r.path:<32} {r.layer:<10} {r.dense_params:>12,} "
                         f"{r.sparse_params:>13,} {r.sparse_flops / r.dense_flops:>11.0%}")
        t = self.totals()
        if self.replacements:
            lines.append(f"{'total':<32} {'':<10} {t['dense_params']:>12,} "
                         f"{t['sparse_params']:>13,} "
                         f"{t['sparse_flops'] / max(1, t['dense_flops']):>11.0%}")
        return "\n".join(lines)


def _dense_flops(site: Site) -> int:
    """Forward FLOPs per token of the dense MLP: a multiply-add per weight of its matrices."""
    d_model, d_ff = site.family.dims(site.module)
    return 2 * site.family.matrices * d_model * d_ff


# ---------------------------------------------------------------------------------------------
# Replacing

LayerSpec = str | LayerConfig | Callable[[int, int], LayerConfig]


def _layer_config(spec: LayerSpec, site: Site, n_layers: int) -> LayerConfig:
    d_model, d_ff = site.family.dims(site.module)
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(f"unknown layer preset {spec!r}; presets are {', '.join(PRESETS)}")
        # sized to the parameters of the MLP it replaces (a gated MLP has three matrices)
        equal_width = max(1, round(site.family.dense_params(site.module) / (2 * d_model)))
        return ffn_preset(spec, d_model, equal_width, n_layers).ffn
    config = spec(d_model, d_ff) if callable(spec) and not isinstance(spec, LayerConfig) else spec
    if not isinstance(config, LayerConfig):
        raise TypeError(f"layer must be a preset name, a LayerConfig or a function "
                        f"(d_model, d_ff) -> LayerConfig, got {type(config).__name__}")
    if getattr(config, "d_model", d_model) != d_model:
        raise ValueError(f"{site.path}: the layer's d_model={config.d_model} differs from the "
                         f"model's hidden size {d_model}")
    return config


def _mark_initialised(module: nn.Module) -> None:
    """Keep Hugging Face's ``_init_weights`` off a layer whose own init is deliberate."""
    for sub in module.modules():
        sub._is_hf_initialized = True
        for p in sub.parameters(recurse=False):
            p._is_hf_initialized = True


def _first_parameter(site: Site) -> nn.Parameter | None:
    """A parameter of the MLP at ``site``: its device and dtype are the new layer's."""
    return next(iter(site.module.parameters()), None)


def _install(model: nn.Module, site: Site, layer: nn.Module) -> None:
    parent_path, _, name = site.path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    first = _first_parameter(site)
    if first is not None:
        layer = layer.to(device=first.device, dtype=first.dtype)
    _mark_initialised(layer)
    training = site.module.training
    site.family.replace(parent, name, site.module, layer)
    parent.get_submodule(name).train(training)     # the new modules follow the model's mode


def _put_in_place(model: nn.Module, site: Site, layer: nn.Module,
                  report: SparsifyReport) -> None:
    """Put ``layer`` at ``site``, record it in the model's config for loading, and report it."""
    report.replacements.append(_replacement(site, layer.config, layer))
    _install(model, site, layer)
    _record(model, site, layer.config)


def _update_record(model: nn.Module, change: Callable[[dict], None]) -> None:
    """Apply ``change`` to a copy of the model's replacement record (a new, empty one where it
    has none) and store the copy in ``model.config``; nothing for a model without a config."""
    hf_config = getattr(model, "config", None)
    if hf_config is None:
        return
    record = dict(getattr(hf_config, CONFIG_KEY, None) or {"format": _FORMAT, "sites": {}})
    change(record)
    setattr(hf_config, CONFIG_KEY, record)


def _record(model: nn.Module, site: Site, config: LayerConfig) -> None:
    entry = {"family": site.family.name, "layer": config.to_dict()}
    _update_record(model, lambda record: record.update(
        sites={**record.get("sites", {}), site.path: entry}))


def _replacement(site: Site, config: LayerConfig, layer: nn.Module) -> Replacement:
    return Replacement(site.path, site.family.name, config.type_name,
                       site.family.dense_params(site.module),
                       sum(p.numel() for p in layer.parameters()),
                       _dense_flops(site), config.cost().flops)


def sparsify(model: nn.Module, layer: LayerSpec, *,
             which: str | int | Sequence[int] = "all",
             within: str | None = None) -> SparsifyReport:
    """Replace the MLPs of a ``transformers`` model by sparseffn layers, in place.

    layer: a preset name (``"sigma_moe"``, ``"switch"``, ``"fff"``, ``"pkm"``, ``"peer"``,
      ... of :func:`sparseffn.models.presets.ffn_preset`), sized to the parameters of each MLP
      it replaces; a :class:`~sparseffn.LayerConfig` with the model's hidden size; or a
      function ``(d_model, d_ff) -> LayerConfig``.
    which: ``"all"``, ``n`` (every n-th block: 2 gives GLaM's every other block) or a list of
      block numbers (0-based, in module order).
    within: the path of a submodule (``"model.language_model"`` of a vision-language model,
      ``"vision_model"`` of CLIP): only its MLPs, ``which`` counting among them. Give
      ``model`` itself, the one you save: its config holds the record that loading reads
      (a submodule's config would be nested in it, where ``from_pretrained`` does not look).

    New layers take the dtype and device of the MLP they replace and their own
    initialisation. Returns a :class:`SparsifyReport`. Raises ValueError when the model has no
    MLP of a known type.
    """
    require_transformers()
    sites = _sites(model, within)
    if not sites:
        raise ValueError(f"sparsify: found no MLP of a known type in {type(model).__name__}; "
                         f"known: {', '.join(f.name for f in FAMILIES)} "
                         f"(sparseffn.hf.register_family adds one)")
    report = SparsifyReport()
    for site in _chosen(sites, which):
        config = _layer_config(layer, site, len(sites))
        first = _first_parameter(site)
        # built where it goes: initialising a large layer on the CPU and copying it to a GPU
        # (or to the meta device) took seconds a layer (trunc_normal_ of 135M parameters: 7 s)
        with torch.device(first.device) if first is not None else contextlib.nullcontext():
            new_layer = build_layer(config)
        _put_in_place(model, site, new_layer, report)
    _warn_if_a_cache_changes_outputs(model, "sparsify")
    return report


def _warn_if_a_cache_changes_outputs(model: nn.Module, who: str) -> None:
    """A warning where a router of ``model`` routes each token by the tokens evaluated with
    it: Hugging Face's ``generate()`` with its KV cache then changes the model's outputs."""
    from .models.generate import cache_blocker
    blocker = cache_blocker(model)
    if blocker is not None:
        warnings.warn(f"{who}: {blocker} routes each token by the tokens evaluated with it "
                      f"(an eval_capacity_factor), and generate() with Hugging Face's KV cache "
                      f"evaluates each new token alone, so its outputs differ from a forward of "
                      f"the whole sequence; generate with use_cache=False, or leave "
                      f"eval_capacity_factor unset (dropless evaluation)", stacklevel=3)


# ---------------------------------------------------------------------------------------------
# MoEfication of a whole model

def dense_weights(site: Site, config: Any = None) -> DenseWeights:
    """The weights of the MLP at ``site`` (gated for the Llama family). ``config``: the model's
    config, where the activation is named unless the MLP holds a config of its own (a tower
    of a two-tower model such as CLIP, whose top config names none)."""
    own = getattr(site.module, "config", None)
    if isinstance(own, require_transformers().PretrainedConfig):
        config = own
    weights = site.family.dense_weights(site.module, config)
    if weights is None:
        raise ValueError(f"{site.path}: sparseffn does not know how to read the weights of a "
                         f"{site.family.name}-family MLP (register_family with dense_weights)")
    return weights


@torch.no_grad()
def collect_mlp_inputs(model: nn.Module, batches: Iterable[dict], sites: list[Site], *,
                       max_tokens: int = 50_000) -> dict[str, torch.Tensor]:
    """Run ``model(**batch)`` for each batch and keep what each site's MLP receives:
    ``{path: [N, d_model]}``, padding left out where a batch has an ``attention_mask`` (in
    the MLPs of the part that takes the tokens: not in an image tower's, whatever its token
    count), at most ``max_tokens`` rows per site."""
    store: dict[str, list[torch.Tensor]] = {s.path: [] for s in sites}
    mask: list[torch.Tensor | None] = [None]
    mlps = {id(s.family.mlp(s.module)) for s in sites}
    part = _token_part(model, lambda m: any(id(sub) in mlps for sub in m.modules()))
    masked = {id(m) for m in part.modules()}

    def hook(path):
        def keep(module, args):
            x = args[0]
            rows = x[mask[0]] if mask[0] is not None and mask[0].shape == x.shape[:-1] \
                and id(module) in masked else x.reshape(-1, x.shape[-1])
            if sum(t.shape[0] for t in store[path]) < max_tokens:
                store[path].append(rows.detach().float().cpu())
        return keep

    handles = [s.family.mlp(s.module).register_forward_pre_hook(hook(s.path)) for s in sites]
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            attention = batch.get("attention_mask") if isinstance(batch, dict) else None
            mask[0] = None if attention is None else attention.bool()
            model(**batch)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return {path: torch.cat(rows)[:max_tokens] if rows else torch.zeros(0)
            for path, rows in store.items()}


def moefy(model: nn.Module, num_experts: int, k: int, batches: Iterable[dict], *,
          method: str = "activations", which: str | int | Sequence[int] = "all",
          within: str | None = None, router_steps: int = 300, max_tokens: int = 50_000,
          seed: int = 0) -> SparsifyReport:
    """Convert the trained MLPs of a ``transformers`` model into mixtures of their own hidden
    units, in place (MoEfication, Zhang et al. 2022; :mod:`sparseffn.convert`): split each MLP's
    units into ``num_experts`` experts (``method`` ``"activations"`` or ``"weights"``), fit a
    router to pick each token's ``k`` best experts on the hidden states that ``batches``
    (dicts of model inputs, e.g. tokenizer outputs) produce, and put the result in the MLP's
    place. ``report.fits[path]`` holds each router's held-out recall (see
    :func:`sparseffn.convert.fit_router`). Follow with :func:`sparseffn.convert.distill`
    to fine-tune against the dense model. ``which``, ``within``: as :func:`sparsify`'s.
    """
    require_transformers()
    sites = _chosen(_sites(model, within), which)
    if not sites:
        raise ValueError(f"moefy: found no MLP of a known type in {type(model).__name__}")
    weights = {s.path: dense_weights(s, getattr(model, "config", None)) for s in sites}
    samples = collect_mlp_inputs(model, list(batches), sites, max_tokens=max_tokens)
    report = SparsifyReport()
    for site in sites:
        x = samples[site.path]
        if x.shape[0] == 0:
            raise ValueError(f"moefy: the batches never reached {site.path}")
        dense = weights[site.path]
        device = dense.w1.device
        x = x.to(device=device, dtype=dense.w1.dtype)
        layer = moefy_mlp(dense, num_experts, k, method=method, samples=x, seed=seed)
        report.fits[site.path] = fit_router(layer, x, steps=router_steps, seed=seed)
        _put_in_place(model, site, layer, report)
    return report


def upcycle(model: nn.Module, num_experts: int, k: int, *, router: Any = None,
            which: str | int | Sequence[int] = "all",
            within: str | None = None) -> SparsifyReport:
    """Turn the trained MLPs of a ``transformers`` model into mixtures of ``num_experts``
    copies of themselves, in place: sparse upcycling (Komatsuzaki et al. 2022,
    arXiv:2212.05055; :func:`sparseffn.convert.upcycle`). Each token uses ``k`` copies, so
    each MLP's parameters grow ``num_experts`` times and its FLOPs ``k`` times; with the
    default router (renormalised softmax top-k) the model computes what it computed before,
    until training makes the experts differ. ``router``: as :class:`~sparseffn.MoEConfig`'s
    (a config, a dict with ``type``, or a name); ``which``, ``within``: as :func:`sparsify`'s.
    Recorded like :func:`sparsify`, so ``save_pretrained`` and :func:`from_pretrained` work.
    """
    require_transformers()
    sites = _chosen(_sites(model, within), which)
    if not sites:
        raise ValueError(f"upcycle: found no MLP of a known type in {type(model).__name__}")
    report = SparsifyReport()
    for site in sites:
        dense = dense_weights(site, getattr(model, "config", None))
        _put_in_place(model, site, upcycle_mlp(dense, num_experts, k, router=router), report)
    _warn_if_a_cache_changes_outputs(model, "upcycle")
    return report


# ---------------------------------------------------------------------------------------------
# Loading a saved sparse model

def apply_record(model: nn.Module, record: dict | None = None) -> None:
    """Build the sparse layers a replacement record names (``model.config.sparseffn`` unless
    given) in their places, freshly initialised (weights are loaded afterwards)."""
    record = getattr(model.config, CONFIG_KEY, None) if record is None else record
    if not record:
        return
    if record.get("format") != _FORMAT:
        raise ValueError(f"{CONFIG_KEY} record of format {record.get('format')!r}; this "
                         f"sparseffn reads format {_FORMAT}")
    sites = {s.path: s for s in find_mlps(model, replaced=False)}
    for path, entry in record["sites"].items():
        if path not in sites:
            raise ValueError(f"the saved model replaced {path}, which this model class has "
                             f"no MLP of a known type at")
        config = config_from_dict(entry["layer"])
        _install(model, sites[path], build_layer(config))
    for name in record.get("hooks", ()):      # skip_padding, add_aux_loss, as the model had
        if name not in _HOOKS:
            raise ValueError(f"the saved model had the hook {name!r}, which this sparseffn "
                             f"does not know ({sorted(_HOOKS)})")
        _HOOKS[name](model)
    _warn_if_a_cache_changes_outputs(model, "the sparse layers loaded")


class ModelHooks:
    """What :func:`skip_padding` or :func:`add_aux_loss` installed on a model: ``remove()``
    takes it off, and out of the model's record (so does leaving a ``with`` block over it)."""

    def __init__(self, *handles, model: nn.Module | None = None, name: str = "") -> None:
        self._handles = handles
        self._model, self._name = model, name

    def remove(self) -> None:
        # (hooks that a later call of the same function replaced are no longer there: the
        # record then keeps the name, which the replacing hooks still answer to)
        installed = any(_still_installed(handle) for handle in self._handles)
        for handle in self._handles:
            handle.remove()
        if installed and self._model is not None:
            _forget_hook(self._model, self._name)

    def __enter__(self) -> "ModelHooks":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _still_installed(handle) -> bool:
    hooks = handle.hooks_dict_ref()
    return hooks is not None and handle.id in hooks


def _token_shape(args: tuple, kwargs: dict) -> torch.Size | None:
    """The [batch, seq] of a Hugging Face forward's ``input_ids`` or ``inputs_embeds``."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, torch.Tensor):
        return ids.shape
    embeds = kwargs.get("inputs_embeds")
    return embeds.shape[:-1] if isinstance(embeds, torch.Tensor) else None


def skip_padding(model: nn.Module) -> ModelHooks:
    """From now on, every forward of ``model`` that is given an ``attention_mask`` with padding
    in it, of the shape of its ``input_ids`` (or ``inputs_embeds`` without their last
    dimension), runs inside :func:`sparseffn.skipping_padding`: the routed layers compute
    the real tokens only, as if the batch held them alone. For loops that call
    ``model(**batch)`` themselves, such as Hugging Face's ``Trainer``.

    A forward without padding, or whose mask is longer than its input (a decoding step of
    ``generate()`` with a KV cache), runs as before. An encoder-decoder model (T5) is hooked
    at its encoder and its decoder, each of which receives its own mask (the decoder's is
    ``decoder_attention_mask``), since the source's mask says nothing of the target's
    tokens. The mask reaches the layers of the part that takes the tokens only: CLIP's or
    SigLIP's text tower, a vision-language model's language model, not their image encoders.
    Checking for padding reads the mask on the host once per forward (under ``torch.export``
    it is not checked: the program skips padding for every mask). Noted in the
    model's record, so :func:`from_pretrained` installs it again. Returns a
    :class:`ModelHooks`; its ``remove()`` undoes this."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        stacks = [model.get_encoder(), model.get_decoder()]
    else:
        stacks = [model]
    _remember_hook(model, "skip_padding")
    return ModelHooks(*(hook for stack in stacks for hook in _skip_padding_at(stack)),
                      model=model, name="skip_padding")


def _skip_padding_at(stack: nn.Module) -> tuple:
    """The two hooks of :func:`skip_padding` on ``stack``, whose forward takes the mask."""
    from .auxiliary import skipping_padding
    from .ops.sizes import exporting
    blocks: list[contextlib.ExitStack] = []     # one per forward in flight (nested forwards)

    @_marked("skip_padding")
    def enter(module, args, kwargs):
        block = contextlib.ExitStack()
        mask = kwargs.get("attention_mask")
        # An exported program serves every mask, so it skips padding always (without padding
        # that computes the same), where reading the mask on the host would fail the export.
        if isinstance(mask, torch.Tensor) and mask.shape == _token_shape(args, kwargs) \
                and (exporting() or not bool(mask.bool().all())):
            block.enter_context(skipping_padding(_token_part(module), mask))
        blocks.append(block)

    @_marked("skip_padding")
    def leave(module, args, output):             # also after a forward that raised
        blocks.pop().close()

    _remove_marked(stack, "skip_padding")        # installed once, however often asked
    return (stack.register_forward_pre_hook(enter, with_kwargs=True),
            stack.register_forward_hook(leave, always_call=True))


def _holds_routed_layers(module: nn.Module) -> bool:
    from .routing import RoutedFFN
    return any(isinstance(m, RoutedFFN) for m in module.modules())


def _token_part(stack: nn.Module,
                holds: Callable[[nn.Module], bool] = _holds_routed_layers) -> nn.Module:
    """The part of ``stack`` whose layers see the tokens its mask is about: the deepest
    module on the way to its token embeddings that ``holds`` (a routed layer) (CLIP's text
    tower, a vision-language model's language model, not their image encoders), else
    ``stack``."""
    try:
        embeddings = stack.get_input_embeddings()
    except (AttributeError, NotImplementedError):   # two towers (CLIP, SigLIP): no single one
        text = getattr(stack, "text_model", None)
        return text if isinstance(text, nn.Module) else stack
    path = next((name for name, m in stack.named_modules() if m is embeddings), None)
    part = stack
    if path:
        steps = path.split(".")
        for depth in range(1, len(steps)):
            inner = stack.get_submodule(".".join(steps[:depth]))
            if not holds(inner):
                break
            part = inner
    return part


def add_aux_loss(model: nn.Module) -> ModelHooks:
    """From now on, every forward of ``model`` that returns a ``loss`` (given ``labels``)
    returns ``loss + sparseffn.aux_loss(model)``: the routers' balance losses, with their
    configured weights, join the objective of a loop that only reads the model's loss, such
    as Hugging Face's ``Trainer``. (An evaluation forward without autograd computes no aux
    losses, so there the loss stays the task's.) The layers' ``aux_loss_terms`` stay
    readable as before. Noted in the model's record, so :func:`from_pretrained` installs it
    again. Returns a :class:`ModelHooks`; its ``remove()`` undoes this.

    Given ``num_items_in_batch`` (the ``Trainer`` passes it to a model that takes loss
    arguments, normalises the loss by it over all its gradient-accumulation steps and
    devices, and then no longer divides by the number of steps), the aux loss is weighted by
    this forward's share of those items, counted as the ``Trainer`` counts them: the
    accumulated objective then holds the token-weighted mean of the steps' aux losses, not
    their sum."""
    from .auxiliary import aux_loss

    @_marked("add_aux_loss")
    def add(module, args, kwargs, output):
        if isinstance(output, dict):        # a ModelOutput (its attribute follows the key)
            if output.get("loss") is not None:
                output["loss"] = output["loss"] + aux_loss(module) * _share(module, kwargs)
        elif isinstance(output, tuple) and kwargs.get("labels") is not None and output:
            output = (output[0] + aux_loss(module) * _share(module, kwargs),   # return_dict=False
                      *output[1:])
        return output

    _remember_hook(model, "add_aux_loss")
    _remove_marked(model, "add_aux_loss")        # installed once, however often asked
    return ModelHooks(model.register_forward_hook(add, with_kwargs=True), model=model,
                      name="add_aux_loss")


def _marked(name: str):
    """Decorator: mark a hook function as this module's hook ``name``."""
    def mark(fn):
        fn._sparseffn_hook = name
        return fn
    return mark


def _remove_marked(module: nn.Module, name: str) -> None:
    """Take the hooks marked ``name`` off ``module``: calling :func:`skip_padding` or
    :func:`add_aux_loss` again (on a model :func:`from_pretrained` already hooked, say)
    replaces its hooks instead of adding a second set (which would add the aux loss twice)."""
    extra = (module._forward_pre_hooks_with_kwargs, module._forward_hooks_with_kwargs,
             module._forward_hooks_always_called)
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for hook_id, fn in list(hooks.items()):
            if getattr(fn, "_sparseffn_hook", None) == name:
                del hooks[hook_id]
                for more in extra:
                    more.pop(hook_id, None)


def _remember_hook(model: nn.Module, name: str) -> None:
    """Note ``name`` in the model's replacement record, so that :func:`from_pretrained`
    installs the hook again on the loaded model."""
    _update_record(model, lambda record: record.update(
        hooks=sorted({*record.get("hooks", ()), name})))


def _forget_hook(model: nn.Module, name: str) -> None:
    record = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    if record and name in record.get("hooks", ()):
        record = dict(record, hooks=[h for h in record["hooks"] if h != name])
        setattr(model.config, CONFIG_KEY, record)


_HOOKS = {"skip_padding": skip_padding, "add_aux_loss": add_aux_loss}


def _share(model: nn.Module, kwargs: dict):
    """This forward's share of the ``num_items_in_batch`` its loss is normalised by: its
    labels other than -100 (after the causal shift where the ``Trainer`` shifts them; the
    collator's ``shift_labels`` where given) over that number. 1 without it."""
    total, labels = kwargs.get("num_items_in_batch"), kwargs.get("labels")
    if total is None or not isinstance(labels, torch.Tensor):
        return 1.0
    if isinstance(kwargs.get("shift_labels"), torch.Tensor):
        labels = kwargs["shift_labels"]
    elif _loss_shifts_labels(model):
        labels = labels[..., 1:]
    total = torch.as_tensor(total, device=labels.device)
    return labels.ne(-100).sum() / total.clamp_min(1)


def _loss_shifts_labels(model: nn.Module) -> bool:
    """Whether the ``Trainer`` counts this model's items after the causal shift (its rule:
    a causal-LM loss type, not an encoder-decoder)."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:     # a transformers without loss types counts the labels as they are
        return False
    return (LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss
            and not getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def _sparse_class(model_class: type) -> type:
    def __init__(self, config, *args, **kwargs):
        model_class.__init__(self, config, *args, **kwargs)
        apply_record(self)
    return type(model_class.__name__, (model_class,), {"__init__": __init__,
                                                       "__module__": model_class.__module__})


# The arguments of ``from_pretrained`` that say which files to read, which reading the config
# needs too
_FILE_KWARGS = ("cache_dir", "force_download", "proxies", "local_files_only", "token",
                "revision", "subfolder", "trust_remote_code")


def from_pretrained(path: str, model_class: type | None = None, **kwargs: Any) -> nn.Module:
    """Load a model that :func:`sparsify` or :func:`moefy` changed and ``save_pretrained``
    wrote: the model class (default: the first of ``config.architectures``; an Auto class
    such as ``AutoModelForCausalLM`` resolves to the concrete one) is built, the
    recorded sparse layers are put in place, then the weights load, through the class's own
    ``from_pretrained``. ``kwargs`` go to it, and do what they do there: ``dtype``,
    ``device_map``, ``revision``, ..., and changes to the config (``num_labels=3`` with
    ``ignore_mismatched_sizes=True`` for a new classification head,
    ``output_hidden_states``). A model without a record loads as usual."""
    transformers = require_transformers()
    config = kwargs.get("config")
    if not isinstance(config, transformers.PretrainedConfig):
        config = transformers.AutoConfig.from_pretrained(
            path, **{k: kwargs[k] for k in _FILE_KWARGS if k in kwargs})
    if model_class is None:
        names = getattr(config, "architectures", None) or []
        model_class = getattr(transformers, names[0], None) if names else None
        if model_class is None:
            raise ValueError(f"{path}: config.json names no architecture; pass model_class")
    mapping = getattr(model_class, "_model_mapping", None)    # an Auto class: its concrete one
    if mapping is not None:
        model_class = mapping[type(config)]
    if not getattr(config, CONFIG_KEY, None):
        _refuse_a_nested_record(config, path)
        return model_class.from_pretrained(path, **kwargs)
    model = _sparse_class(model_class).from_pretrained(path, **kwargs)
    model.__class__ = model_class     # the user's class again, so isinstance and pickling hold
    return model


def _refuse_a_nested_record(config: Any, path: str) -> None:
    """A ValueError where a sub-config (``text_config``, ``vision_config``, ...) holds a
    replacement record: a submodule was made sparse and the whole model saved, and a load
    that reads the top config only would build dense MLPs where sparse weights were saved."""
    transformers = require_transformers()
    for name, value in vars(config).items():
        if isinstance(value, transformers.PretrainedConfig) and getattr(value, CONFIG_KEY, None):
            raise ValueError(
                f"{path}: the sparse layers were recorded in config.{name}, not in the model's "
                f"config: a submodule was made sparse and the whole model saved, so its record "
                f"names paths from that submodule. Make the whole model sparse with "
                f"within=<the submodule's path> (sparsify, moefy, upcycle) and save it again")


_TRAINERS = ("SparseTrainer", "SparseSeq2SeqTrainer", "SparseTrainerMixin")


def __getattr__(name: str):
    # the trainers subclass transformers.Trainer, so they are imported when first asked for
    if name in _TRAINERS:
        require_transformers()
        from . import hf_trainer
        return getattr(hf_trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
