"""Expert analyses: what the routers of a model learned (usage, collapse, co-occurrence, tokens
per expert, tree decisions) and how sparse a dense MLP already is.

    from sparseffn.analysis import analyze_model, write_analysis
    layers = analyze_model(model, batches)          # per layer, JSON-serialisable
    write_analysis({"name": "mine", "layers": layers}, Path("out"))

``sparseffn analyze CHECKPOINT`` does this for a trained run; ``sparseffn compare`` adds it to
every report.
"""

from .record import LayerRecord, RoutingRecorder
from .report import analyze_model, write_analysis
from .stats import (active_channels, co_occurrence, starved_fraction, token_expert_counts,
                    tree_node_decisions, usage_entropy, usage_shares)
from .summary import byte_label, collapse_warning, summarize, usage_curve, usage_health

__all__ = ["LayerRecord", "RoutingRecorder", "active_channels", "analyze_model", "byte_label",
           "co_occurrence", "collapse_warning", "starved_fraction", "summarize",
           "token_expert_counts", "tree_node_decisions", "usage_curve", "usage_entropy",
           "usage_health", "usage_shares", "write_analysis"]
