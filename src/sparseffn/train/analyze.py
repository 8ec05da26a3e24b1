"""``sparseffn analyze CHECKPOINT``: the expert analyses of a trained run
(:mod:`sparseffn.analysis`) on its validation (or test) data."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..analysis import analyze_model, byte_label, write_analysis
from ..data import ArrayData, ByteTokenizer, TextData


def token_label_of(data) -> Callable[[int], str]:
    """How a token id of ``data`` reads in a report: a byte, or a BPE token's text."""
    if not isinstance(data, TextData) or isinstance(data.tokenizer, ByteTokenizer):
        return byte_label if isinstance(data, TextData) else str
    tokenizer = data.tokenizer
    return lambda t: repr(tokenizer.decode([t]).decode("utf-8", "replace"))[1:-1]


def analyze_checkpoint(path: str | Path, split: str = "val", windows: int = 256,
                       batch_size: int = 64) -> tuple[dict, Callable[[int], str]]:
    """Analyse the model in checkpoint ``path`` on ``windows`` context windows of ``split``
    (classifiers: that many batches' worth of examples). Returns the result (``name``,
    ``step``, ``split``, ``layers``) and the token labeller."""
    from .trainer import load_trained
    state, run, data, model = load_trained(path)
    if isinstance(data, TextData):
        inputs = data.eval_windows(split, run.model.context, windows)[:, :-1]
        batches = list(inputs.split(batch_size))
        tokens, vocab = inputs.reshape(-1), data.vocab_size
        seen = f"{inputs.numel():,} tokens ({inputs.shape[0]} windows of {inputs.shape[1]})"
    else:
        assert isinstance(data, ArrayData)
        inputs = data.x[split][: windows * batch_size]
        batches, tokens, vocab = list(inputs.split(batch_size)), None, None
        seen = f"{inputs.shape[0]:,} examples"
    label = token_label_of(data)
    layers = analyze_model(model, batches, tokens, vocab, label)
    source = (f"Run `{run.name}` at step {state['step']}, checkpoint `{path}`, on {seen} of the "
              f"{split} split.")
    return {"name": run.name, "step": state["step"], "split": split, "source": source,
            "layers": layers}, label


def analyze_command(args) -> int:
    checkpoint = Path(args.checkpoint)
    result, label = analyze_checkpoint(checkpoint, args.split, args.windows)
    out = Path(args.out) if args.out else checkpoint.parent / "analysis"
    report = write_analysis(result, out, label)
    for name, layer in result["layers"].items():
        if layer["kind"] == "routed":
            print(f"{name}: {layer['num_experts']} experts, usage entropy "
                  f"{layer['usage_entropy']:.3f}, {layer['starved_fraction']:.1%} starved"
                  + (f"  WARNING: {layer['warning']}" if layer["warning"] else ""))
        else:
            print(f"{name}: dense, {layer['active_mean']:.1f} of {layer['d_ff']} hidden units "
                  f"active per token ({layer['active_fraction']:.1%})")
    print(f"report: {report}")
    return 0
