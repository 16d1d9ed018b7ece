"""Builds (and caches) the project's tiny Qwen3-shaped base model. Deterministic for a given config.

Usage: python tools/build_tiny_model.py [--out DIR]   (default: the cache that runs and tests use)
"""
import argparse

from marlaas_hpc.model import TinyModelConfig, build_tiny_model, ensure_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="write here instead of the shared cache")
    args = parser.parse_args()
    if args.out:
        accuracy = build_tiny_model(args.out, TinyModelConfig())
        print(f"built {args.out}: greedy eval accuracy {accuracy}")
    else:
        print(ensure_tiny_model())


if __name__ == "__main__":
    main()
