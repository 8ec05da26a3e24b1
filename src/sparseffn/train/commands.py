"""The ``train``, ``eval``, ``compare``, ``export``, ``sample`` and ``analyze`` subcommands of
the ``sparseffn`` CLI."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..runtime import COMPILE_MODES
from .config import (apply_overrides, dense_baseline, read_config_file, run_config_from_dict)


def _run_config(args: argparse.Namespace, allow=()):
    data = apply_overrides(read_config_file(args.config), args.set or [])
    return data, run_config_from_dict(data, allow=allow)


def train_command(args: argparse.Namespace) -> int:
    from .trainer import Trainer
    _, run = _run_config(args)
    if args.dense_baseline:
        run = dense_baseline(run, args.dense_baseline)
    out = Path(args.out or Path("runs") / run.name)
    summary = Trainer(run, out, progress=not args.no_progress,
                      device=args.device).train(resume=args.resume)
    if summary["processes"] > 1 and int(os.environ.get("RANK", "0")) != 0:
        return 0      # under torchrun, rank 0 speaks for the run
    val = summary["val"]
    metric = f"bpc {val['bpc']:.4f}" if "bpc" in val else f"accuracy {val['accuracy']:.4f}"
    print(f"{run.name}: {summary['steps']} steps, val loss {val['loss']:.4f}, {metric}, "
          f"{summary['total_params']:,} params ({summary['active_params']:,} active per token); "
          f"files in {out}")
    return 0


def eval_command(args: argparse.Namespace) -> int:
    from .trainer import evaluate, load_trained
    state, run, data, model = load_trained(args.checkpoint)
    results = {"checkpoint": str(args.checkpoint), "step": state["step"]}
    for split in args.split:
        results[split] = evaluate(model, data, run, split).as_dict()
    if args.json:
        print(json.dumps(results))
    else:
        for split in args.split:
            shown = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                              for k, v in results[split].items())
            print(f"{run.name} step {state['step']} {split}: {shown}")
    return 0


def compare_command(args: argparse.Namespace) -> int:
    from .compare import compare
    from .report import text_table
    data, _ = _run_config(args, allow=("compare",))
    out = Path(args.out or Path("runs") / data.get("name", "compare"))
    only = args.variants.split(",") if args.variants else None
    results = compare(data, out, fresh=args.fresh, only=only, device=args.device)
    summaries = results["variants"]
    print()
    if "unigram_bits" in summaries[0]:
        print(f"corpus {summaries[0]['corpus']}: unigram entropy {summaries[0]['unigram_bits']:.3f} "
              f"bits per byte")
    print(text_table(summaries))
    print(f"\nreport: {out / 'report.md'}")
    return 0


def export_command(args: argparse.Namespace) -> int:
    from .export import export_onnx, export_safetensors
    if args.kv_cache and not args.onnx:
        print("sparseffn: export: --kv-cache goes with --onnx", file=sys.stderr)
        return 2
    if args.safetensors:
        path = export_safetensors(args.checkpoint, args.out)
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
        return 0
    path, difference = export_onnx(args.checkpoint, args.out, kv_cache=args.kv_cache)
    print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    checked = ("a prompt, then token by token with the cache" if args.kv_cache
               else "another batch")
    print(f"ONNX Runtime against PyTorch on {checked}: " + (
        "onnxruntime not installed, not run" if difference is None
        else f"largest difference {difference:.1e}"))
    return 0


def sample_command(args: argparse.Namespace) -> int:
    from .sample import sample_texts
    try:
        texts = sample_texts(args.checkpoint, args.prompt, args.tokens, args.samples,
                             args.temperature, args.top_k, args.top_p, args.seed, args.device,
                             use_cache=False if args.no_kv_cache else None,
                             compile=args.compile)
    except ValueError as error:          # a sampling argument out of range, an empty prompt
        print(f"sparseffn: sample: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"checkpoint": str(args.checkpoint), "samples": texts}))
        return 0
    for index, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {index + 1} of {len(texts)} ---")
        print(text)
    return 0


def analyze_command(args: argparse.Namespace) -> int:
    from .analyze import analyze_command as run
    return run(args)


def add_commands(commands) -> None:
    train = commands.add_parser("train", help="train one model from a TOML config")
    train.add_argument("config", help="a run config (.toml or .json), e.g. experiments/lm_pydoc.toml")
    train.add_argument("--out", help="run folder (default runs/<name>)")
    train.add_argument("--resume", action="store_true",
                       help="continue from the checkpoint in the run folder")
    train.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="override a config field, e.g. --set train.steps=100 (repeatable)")
    train.add_argument("--dense-baseline", nargs="?", const="params", choices=("params", "compute"),
                       help="train the dense model with the config's parameters (params, the "
                       "default) or its active parameters per token (compute)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--device", default="cpu",
                       help="cpu (default), cuda or cuda:N; under torchrun with cuda each "
                            "process takes GPU LOCAL_RANK")
    train.set_defaults(func=train_command)

    evaluate = commands.add_parser("eval", help="evaluate a checkpoint")
    evaluate.add_argument("checkpoint", help="a checkpoint.pt written by train")
    evaluate.add_argument("--split", nargs="+", default=["val", "test"], choices=["train", "val", "test"])
    evaluate.add_argument("--json", action="store_true", help="print one JSON object")
    evaluate.set_defaults(func=eval_command)

    export = commands.add_parser("export", help="write a checkpoint's weights in another format")
    export.add_argument("checkpoint", help="a checkpoint.pt written by train")
    export_format = export.add_mutually_exclusive_group(required=True)
    export_format.add_argument("--safetensors", action="store_true",
                               help="as a .safetensors file (the run config in its metadata)")
    export_format.add_argument("--onnx", action="store_true",
                               help="the network as an ONNX model, batch and length dynamic "
                                    "(needs sparseffn[onnx])")
    export.add_argument("--kv-cache", action="store_true",
                        help="with --onnx: a language model's decoding program, the KV cache "
                             "among its inputs (sparseffn.OnnxDecoder generates from it)")
    export.add_argument("--out", help="the file to write (default: model.safetensors, "
                        "model.onnx or decoder.onnx beside the checkpoint)")
    export.set_defaults(func=export_command)

    sample = commands.add_parser("sample", help="text from a language model's checkpoint")
    sample.add_argument("checkpoint", help="a checkpoint.pt written by train (model.kind lm)")
    sample.add_argument("--prompt", default="\n", help="the text to continue (default: a "
                        "newline)")
    sample.add_argument("--tokens", type=int, default=200, help="tokens to draw (default 200)")
    sample.add_argument("--samples", type=int, default=1, help="texts to draw (default 1)")
    sample.add_argument("--temperature", type=float, default=1.0,
                        help="softmax temperature; 0 is greedy (default 1)")
    sample.add_argument("--top-k", type=int, help="draw from the k most likely tokens only")
    sample.add_argument("--top-p", type=float,
                        help="draw from the smallest set of most likely tokens holding this "
                             "probability (nucleus sampling)")
    sample.add_argument("--seed", type=int, default=0, help="the draws' seed (default 0)")
    sample.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    sample.add_argument("--no-kv-cache", action="store_true",
                        help="run the model over the whole window for every token instead of "
                             "one token at a time against the attention keys and values kept "
                             "(the same text, to rounding; slower)")
    sample.add_argument("--compile", choices=COMPILE_MODES, default="none",
                        help="draw with steps of fixed shapes compiled by torch.compile: none "
                             "(the default), default, or reduce-overhead (CUDA graphs); the "
                             "same text, to rounding, faster on long runs after a compile")
    sample.add_argument("--json", action="store_true", help="print one JSON object")
    sample.set_defaults(func=sample_command)

    analyze = commands.add_parser(
        "analyze", help="expert usage, co-occurrence, tokens per expert, tree decisions and "
                        "active dense units of a checkpoint")
    analyze.add_argument("checkpoint", help="a checkpoint.pt written by train or compare")
    analyze.add_argument("--out", help="report folder (default: analysis/ beside the checkpoint)")
    analyze.add_argument("--split", default="val", choices=["train", "val", "test"])
    analyze.add_argument("--windows", type=int, default=256,
                         help="context windows to run (classifiers: batches of 64 examples)")
    analyze.set_defaults(func=analyze_command)

    comp = commands.add_parser(
        "compare", help="train several variants at equal parameters and write a report")
    comp.add_argument("config", help="a run config with a [compare] table, e.g. experiments/compare_pydoc.toml")
    comp.add_argument("--out", help="report folder (default runs/<name>)")
    comp.add_argument("--set", action="append", metavar="KEY=VALUE",
                      help="override a field of every variant, e.g. --set train.steps=50")
    comp.add_argument("--variants", help="only these variants, comma-separated")
    comp.add_argument("--fresh", action="store_true",
                      help="retrain every variant (default: reuse finished ones, resume interrupted)")
    comp.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    comp.set_defaults(func=compare_command)
