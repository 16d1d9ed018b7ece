"""Builds (and caches) the project's tiny Qwen3-shaped base model. Deterministic for a given config on one machine
(another CPU's BLAS gives other weights: hence the shipped copy, marlaas_hpc/tiny_weights).

Usage: python tools/build_tiny_model.py [--out DIR | --ship]
  (default: the cache that runs and tests use, from the shipped weights when they are the current recipe's;
   --ship: pre-train anew and replace the shipped weights, after a change to the recipe)
"""
import argparse
import shutil

from marlaas_hpc.tiny_model import SHIPPED_DIR, TinyModelConfig, build_tiny_model, ensure_tiny_model


def ship() -> None:
    staging = SHIPPED_DIR.with_name(SHIPPED_DIR.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    accuracy = build_tiny_model(staging, TinyModelConfig())
    shutil.rmtree(SHIPPED_DIR, ignore_errors=True)
    staging.rename(SHIPPED_DIR)
    size = sum(p.stat().st_size for p in SHIPPED_DIR.iterdir()) / 1e6
    print(f"shipped {SHIPPED_DIR} ({size:.1f} MB): greedy eval accuracy {accuracy}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", help="write here instead of the shared cache")
    where.add_argument("--ship", action="store_true", help="pre-train anew into the package's shipped weights")
    args = parser.parse_args()
    if args.ship:
        ship()
    elif args.out:
        accuracy = build_tiny_model(args.out, TinyModelConfig())
        print(f"built {args.out}: greedy eval accuracy {accuracy}")
    else:
        print(ensure_tiny_model())


if __name__ == "__main__":
    main()
