"""Builds (and caches) the project's small chat models (marlaas_hpc/model/chat_mini.py): chat-mini, a Qwen3 with the
151,936-row vocabulary, and chat-mini-moe, its Qwen3-MoE sibling (--moe), pre-trained on chat-format GSM8K-style
problems. Deterministic for a given config on one machine (another CPU's BLAS gives other weights: hence the
shipped copies, marlaas_hpc/model/chat_mini_weights and chat_mini_moe_weights).

Usage: python tools/build_chat_mini.py [--moe] [--out DIR | --ship]
  (default: the cache that runs and tests use, from the shipped weights when they are the current recipe's;
   --out: pre-train into DIR (the shipped form); --ship: pre-train anew and replace the shipped weights, after a
   change to the recipe; --moe: chat-mini-moe instead of chat-mini)
"""
import argparse
import shutil

from marlaas_hpc.model.chat_mini import CHAT_MINI, CHAT_MINI_MOE, RECIPES, ChatMiniConfig, build_chat_mini, \
    ensure_chat_mini


def ship(cfg: ChatMiniConfig) -> None:
    shipped = cfg.shipped_dir
    staging = shipped.with_name(shipped.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    meta = build_chat_mini(staging, cfg)
    shutil.rmtree(shipped, ignore_errors=True)
    staging.rename(shipped)
    size = sum(p.stat().st_size for p in shipped.iterdir()) / 1e6
    print(f"shipped {shipped} ({size:.1f} MB) after {meta['pretrain_seconds']} s of pre-training: greedy eval "
          f"accuracy {meta['eval_accuracy']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--moe", action="store_true", help=f"{CHAT_MINI_MOE} (Qwen3-MoE) instead of {CHAT_MINI}")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", help="pre-train into this dir (the shipped form) instead of using the cache")
    where.add_argument("--ship", action="store_true", help="pre-train anew into the package's shipped weights")
    args = parser.parse_args()
    cfg = RECIPES[CHAT_MINI_MOE if args.moe else CHAT_MINI]
    if args.ship:
        ship(cfg)
    elif args.out:
        meta = build_chat_mini(args.out, cfg)
        print(f"built {args.out}: greedy eval accuracy {meta['eval_accuracy']}")
    else:
        print(ensure_chat_mini(cfg))


if __name__ == "__main__":
    main()
