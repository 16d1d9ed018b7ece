"""Builds (and caches) the project's small chat model (marlaas_hpc/model/chat_mini.py): a Qwen3 checkpoint with the
151,936-row vocabulary, pre-trained on chat-format GSM8K-style problems. Deterministic for a given config on one
machine (another CPU's BLAS gives other weights: hence the shipped copy, marlaas_hpc/model/chat_mini_weights).

Usage: python tools/build_chat_mini.py [--out DIR | --ship]
  (default: the cache that runs and tests use, from the shipped weights when they are the current recipe's;
   --out: pre-train into DIR (the shipped form); --ship: pre-train anew and replace the shipped weights, after a
   change to the recipe)
"""
import argparse
import shutil

from marlaas_hpc.model.chat_mini import SHIPPED_DIR, ChatMiniConfig, build_chat_mini, ensure_chat_mini


def ship() -> None:
    staging = SHIPPED_DIR.with_name(SHIPPED_DIR.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    meta = build_chat_mini(staging, ChatMiniConfig())
    shutil.rmtree(SHIPPED_DIR, ignore_errors=True)
    staging.rename(SHIPPED_DIR)
    size = sum(p.stat().st_size for p in SHIPPED_DIR.iterdir()) / 1e6
    print(f"shipped {SHIPPED_DIR} ({size:.1f} MB) after {meta['pretrain_seconds']} s of pre-training: greedy eval "
          f"accuracy {meta['eval_accuracy']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", help="pre-train into this dir (the shipped form) instead of using the cache")
    where.add_argument("--ship", action="store_true", help="pre-train anew into the package's shipped weights")
    args = parser.parse_args()
    if args.ship:
        ship()
    elif args.out:
        meta = build_chat_mini(args.out, ChatMiniConfig())
        print(f"built {args.out}: greedy eval accuracy {meta['eval_accuracy']}")
    else:
        print(ensure_chat_mini())


if __name__ == "__main__":
    main()
