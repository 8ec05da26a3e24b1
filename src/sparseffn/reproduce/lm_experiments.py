"""The papers' language-model comparisons, in miniature (see :mod:`sparseffn.reproduce.lm`).

Each runs a byte-level Transformer (d_model 128, 4 blocks) on Python's documentation, every
FFN sized to the dense MLP of width ``D_FF`` (Csordás et al. 2023's parameter-equal rule); the
paper's column is its Enwik8 result (bits per character, 41M parameters, d_model 512).

- ``sigma-moe-ablations``: Csordás et al. 2023 (arXiv:2310.10837) Tables 3, 4 and 10.
- ``topk-mlp``: their Table 1, the top-K activation against the dense MLP.
- ``pkm``: their Table 2, product-key memories with softmax and ReLU scores.
- ``switch-vs-dense``: Fedus et al. 2022 (arXiv:2101.03961), Switch against the dense model
  with its active parameters (the "FLOP-matched" baseline), loss against steps and time.
- ``expert-scaling``: the Switch scaling miniature, more experts at fixed active compute.
- ``peer-vs-moe``: He 2024 (arXiv:2407.04153), PEER against σ-MoE and dense at equal
  parameters.
"""

from __future__ import annotations

from .lm import Claim, LMExperiment, all_hold, best_of, better, matches

D_FF = 2056                 # 16 experts of 128 units plus σ-MoE's selection network share
MODEL = {"d_model": 128, "n_layers": 4, "n_heads": 4, "context": 64, "d_ff": D_FF}
TRAIN = {"steps": 600, "batch_size": 32, "lr": 5e-3, "schedule": "cosine", "warmup_steps": 20,
         "clip": 0.25, "eval_every": 100, "eval_windows": 64}

# Each family's learning rate: the best of the main job's sweep (results/lr_sweep_pydoc.md:
# the same model with d_ff 1028, rates 2e-3, 5e-3, 1e-2). Families that sweep did not cover
# take the rate of their closest relative: top-K the dense MLP's, S-BASE and the softmax gates
# σ-MoE's. A variant trained at a worse rate than its rivals would lose for the wrong reason.
RATES = {"dense": 1e-2, "dense-compute": 5e-3, "sigma_moe": 5e-3, "switch": 2e-3, "pkm": 5e-3,
         "peer": 2e-3}


def _at(variant, lr: float) -> dict:
    """``variant`` (a preset name or a compare table) trained at learning rate ``lr``."""
    table = {"name": variant, "ffn": variant} if isinstance(variant, str) else dict(variant)
    return {**table, "train": {**table.get("train", {}), "lr": lr}}


DENSE = _at("dense", RATES["dense"])


def _dense_compute(target: str) -> dict:
    return _at({"name": "dense-compute", "match": target, "by": "compute"},
               RATES["dense-compute"])


# σ-MoE as Csordás et al. 2023 Table 9 sets it for Enwik8: N_E 16, G 128, K 4, δ 0.05, γ 1e-4
SIGMA_ROUTER = {"type": "sigma", "expert_dropout": 0.05, "entropy_weight": 1e-4}


def _sigma(name: str, experts: int = 16, k: int = 4, router: dict | None = None, **fields):
    options = {"num_experts": experts, "k": k, "router": {**SIGMA_ROUTER, **(router or {})},
               **fields}
    return _at({"name": name, "ffn": "sigma_moe", "ffn_options": options}, RATES["sigma_moe"])


def _moe(name: str, experts: int, k: int, router: dict, **fields):
    lr = RATES["switch"] if router.get("type") == "switch" else RATES["sigma_moe"]
    return _at({"name": name, "ffn": {"type": "moe", "num_experts": experts, "k": k,
                                      "expert_size": D_FF // experts if k == 1 else 128,
                                      "router": router, "init_depth": MODEL["n_layers"],
                                      **fields}}, lr)


SWITCH_ROUTER = {"type": "switch", "capacity_factor": 1.25, "balance_weight": 0.01}

SIGMA_MOE_ABLATIONS = LMExperiment(
    name="sigma-moe-ablations",
    title="σ-MoE and its ablations against the dense baselines (Csordás et al. 2023, "
          "Tables 3, 4 and 10)",
    source="Csordás, Irie & Schmidhuber 2023, arXiv:2310.10837: σ-MoE (16 experts of 128 "
           "units, K = 4, expert dropout δ = 0.05, entropy regularisation γ = 1e-4) against "
           "the dense MLP with the same parameters, Switch (K = 1, 4 experts of 512) with and "
           "without dropout in the experts, S-BASE, softmax gates, and σ-MoE without its "
           "parts. The dense model with σ-MoE's active parameters is added (Fedus et al. "
           "2022's baseline).",
    variants=[
        DENSE,
        _dense_compute("sigma_moe"),
        _sigma("sigma_moe"),
        _sigma("sigma_moe-standard-dropout", router={"expert_dropout": 0.0},
               hidden_dropout=0.05),
        _moe("sigma_moe-softmax-renorm", 16, 4, {**SIGMA_ROUTER, "type": "softmax",
                                                 "renormalize": True}),
        _moe("sigma_moe-softmax", 16, 4, {**SIGMA_ROUTER, "type": "softmax",
                                          "renormalize": False}),
        _sigma("sigma_moe-standard-init", init="standard"),
        _sigma("sigma_moe-no-reg", router={"expert_dropout": 0.0, "entropy_weight": 0.0}),
        _sigma("sigma_moe-K8-G64", experts=32, k=8, expert_size=64),
        _sigma("sigma_moe-K1-G512", experts=4, k=1),
        _moe("switch", 4, 1, SWITCH_ROUTER, hidden_dropout=0.1, init="switch"),
        _moe("switch-no-dropout", 4, 1, SWITCH_ROUTER, init="switch"),
        _moe("sbase-K4-G128", 16, 4, {"type": "sbase", "entropy_weight": 1e-4}),
    ],
    paper={"dense": "1.08", "sigma_moe": "1.08", "sigma_moe-standard-dropout": "1.08",
           "sigma_moe-softmax-renorm": "1.09", "sigma_moe-softmax": "1.09",
           "sigma_moe-standard-init": "1.08", "sigma_moe-no-reg": "1.08",
           "sigma_moe-K8-G64": "1.08", "sigma_moe-K1-G512": "1.09", "switch": "1.08",
           "switch-no-dropout": "1.10", "sbase-K4-G128": "1.17"},
    claims=[
        Claim("σ-MoE matches the dense model with the same parameters", "1.08 vs 1.08",
              matches("sigma_moe", "dense")),
        Claim("σ-MoE beats the dense model with its active parameters (what the same FLOPs "
              "buy without experts)", "not in the paper; Fedus et al. 2022's comparison",
              better("sigma_moe", "dense-compute")),
        Claim("σ-MoE is at least as good as Switch with and without dropout", "1.08 vs 1.08 "
              "/ 1.10; on WikiText-103 11.59 vs 12.27 / 11.88",
              all_hold(matches("sigma_moe", "switch", 0.0),
                       matches("sigma_moe", "switch-no-dropout", 0.0))),
        Claim("σ-MoE beats S-BASE at the same K and G", "1.08 vs 1.17",
              better("sigma_moe", "sbase-K4-G128")),
        Claim("the sigmoid gate beats softmax gates, with and without renormalisation",
              "1.08 vs 1.09 / 1.09",
              best_of("sigma_moe", ["sigma_moe-softmax-renorm", "sigma_moe-softmax"])),
        Claim("one expert of 512 (K = 1) is worse than four of 128 (K = 4)", "1.09 vs 1.08",
              better("sigma_moe", "sigma_moe-K1-G512")),
        Claim("without regularisation and expert dropout, or with standard dropout or init, "
              "σ-MoE stays within 1%", "1.08 for all four on Enwik8",
              all_hold(*(matches(v, "sigma_moe") for v in (
                  "sigma_moe-no-reg", "sigma_moe-standard-dropout",
                  "sigma_moe-standard-init")))),
    ],
    model=MODEL, train=TRAIN,
    notes="Switch and S-BASE follow the paper's Table 4: Switch has 4 experts of 514 units "
          "(the same parameters), capacity factor 1.25 and the balance loss of weight 0.01; "
          "S-BASE uses the same entropy regulariser as σ-MoE and no capacity limit.",
)

TOPK_MLP = LMExperiment(
    name="topk-mlp",
    title="The top-K activation in the MLP (Csordás et al. 2023, Table 1)",
    source="Csordás, Irie & Schmidhuber 2023, arXiv:2310.10837 §6.1: keeping only the K "
           "largest hidden units of each dense MLP (d_ff 2053 in the paper) preserves, or "
           "slightly improves, the dense model; too small a K must hurt.",
    variants=[DENSE] + [_at({"name": f"topk-K{k}", "ffn": {
        "type": "topk", "d_ff": D_FF, "k": k, "init_depth": MODEL["n_layers"]}}, RATES["dense"])
        for k in (32, 128, 256, 512)],
    paper={"dense": "1.08", "topk-K128": "1.07", "topk-K256": "1.08", "topk-K512": "1.08"},
    claims=[
        Claim("top-K with K = 128, 256 and 512 matches the dense MLP", "1.07, 1.08, 1.08 "
              "vs 1.08", all_hold(*(matches(f"topk-K{k}", "dense") for k in (128, 256, 512)))),
        Claim("a much smaller K costs quality (K = 32 worse than K = 128)", "K = 64 on "
              "WikiText-103: 11.86 vs 11.74", better("topk-K128", "topk-K32")),
    ],
    model=MODEL, train=TRAIN,
)

PKM = LMExperiment(
    name="pkm",
    title="Product-key memories with softmax and ReLU scores (Csordás et al. 2023, Table 2)",
    source="Csordás, Irie & Schmidhuber 2023, arXiv:2310.10837 §6.2: parameter-matched PKMs "
           "(4 heads, k = 32) with the original softmax over each head's scores (Lample et "
           "al. 2019) and with ReLU; ReLU is closer to dense, both stay behind it.",
    variants=[DENSE] + [_at({"name": f"pkm-{score}", "ffn": "pkm",
                             "ffn_options": {"score": score}}, RATES["pkm"])
                         for score in ("softmax", "relu")],
    paper={"dense": "1.08", "pkm-softmax": "1.16", "pkm-relu": "1.11"},
    claims=[
        Claim("ReLU scores beat softmax scores", "1.11 vs 1.16", better("pkm-relu", "pkm-softmax")),
        Claim("even the better PKM stays behind the dense model", "1.11 vs 1.08",
              best_of("dense", ["pkm-relu", "pkm-softmax"])),
    ],
    model=MODEL, train=TRAIN,
)

SWITCH_VS_DENSE = LMExperiment(
    name="switch-vs-dense",
    title="Switch against the dense model with the same compute (Fedus et al. 2022)",
    source="Fedus, Zoph & Shazeer 2022, arXiv:2101.03961: a Switch Transformer (top-1 of "
           "several experts each as wide as the dense MLP) reaches a FLOP-matched dense "
           "model's quality faster, in steps and in time. Here 8 experts of 257 units "
           "against the dense MLP of 257 units, and the dense model with Switch's parameters.",
    variants=[_at({"name": "switch", "ffn": "switch", "ffn_options": {"num_experts": 8}},
                  RATES["switch"]),
              _dense_compute("switch"),
              _at({"name": "dense-params", "match": "switch"}, RATES["dense"])],
    paper={"switch": "7× faster to the dense quality (T5-Base, 128 experts)"},
    paper_unit="paper",
    claims=[
        Claim("Switch beats the dense model with its active parameters", "Switch-Base vs "
              "T5-Base, Fig. 4-5", better("switch", "dense-compute")),
        Claim("Switch stays behind the dense model with all its parameters", "implied: Switch "
              "trades parameters for compute", better("dense-params", "switch")),
    ],
    model={**MODEL, "d_ff": D_FF}, train=TRAIN,
)

EXPERT_SCALING = LMExperiment(
    name="expert-scaling",
    title="More experts at the same active compute (the Switch scaling miniature)",
    source="Fedus, Zoph & Shazeer 2022, arXiv:2101.03961 Fig. 4: at a fixed compute per "
           "token, more experts (more parameters) give a lower loss. Here σ-MoE with K = 4 "
           "experts of 128 units active, and 4, 8, 16 or 32 experts in all.",
    variants=[_at({"name": f"sigma_moe-E{e}", "ffn": {
        "type": "sigma_moe", "num_experts": e, "expert_size": 128, "k": 4,
        "router": SIGMA_ROUTER, "init_depth": MODEL["n_layers"]}}, RATES["sigma_moe"])
        for e in (4, 8, 16, 32)],
    paper={"sigma_moe-E32": "loss falls with every doubling of experts"},
    paper_unit="paper",
    claims=[
        Claim("the loss falls as the number of experts grows (4 → 8 → 16 → 32)",
              "Fig. 4: monotone", all_hold(better("sigma_moe-E8", "sigma_moe-E4"),
                                            better("sigma_moe-E16", "sigma_moe-E8"),
                                            better("sigma_moe-E32", "sigma_moe-E16"))),
    ],
    model=MODEL, train=TRAIN,
)

PEER_VS_MOE = LMExperiment(
    name="peer-vs-moe",
    title="PEER against σ-MoE and dense at equal parameters (He 2024)",
    source="He 2024, arXiv:2407.04153: a million single-neuron experts retrieved by product "
           "keys beat coarse-grained MoE and dense FFNs at the same compute (isoFLOP curves, "
           "Fig. 1). Here all three with the dense MLP's parameters.",
    variants=[DENSE, _sigma("sigma_moe"),
              _at({"name": "peer", "ffn": "peer", "ffn_options": {"heads": 8, "k": 16}},
                  RATES["peer"])],
    paper={"peer": "lowest perplexity at every FLOP budget"},
    paper_unit="paper",
    claims=[
        Claim("PEER beats σ-MoE at the same parameters", "Fig. 1 and Table 2",
              better("peer", "sigma_moe")),
        Claim("PEER beats the dense model at the same parameters", "Table 2 (dense: "
              "the FLOP-matched one)", better("peer", "dense")),
    ],
    model=MODEL, train=TRAIN,
)

LM_EXPERIMENTS = {e.name: e for e in (SIGMA_MOE_ABLATIONS, TOPK_MLP, PKM, SWITCH_VS_DENSE,
                                      EXPERT_SCALING, PEER_VS_MOE)}
