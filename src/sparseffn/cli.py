"""The ``sparseffn`` command."""

from __future__ import annotations

import argparse
import sys

from .runtime import tune_cpu_allocator


def _bench_layers(args: argparse.Namespace) -> int:
    from .bench import layers
    layers.run(tokens=args.tokens, repeats=args.repeats, full=args.full, peers=args.peers,
               json_path=args.json, configs=args.configs, routers=not args.no_routers)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparseffn", description="Sparse feed-forward layers: benchmarks and tools.")
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
    layers.add_argument("--json", metavar="PATH", help="write the results as a JSON list")
    layers.set_defaults(func=_bench_layers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "tokens", 1) <= 0 or getattr(args, "repeats", 1) <= 0:
        print("sparseffn: --tokens and --repeats must be positive", file=sys.stderr)
        return 2
    tune_cpu_allocator()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
