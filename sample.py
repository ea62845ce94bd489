"""sample.py -- prompts -> a PNG grid, and `--eval`: how often do samples show what they were asked?

    python sample.py --ckpt out/run/ckpt.pt --prompt "a red circle in the top left" --n 8
    python sample.py --ckpt out/run/ckpt.pt --eval --steps 8     # last line: JSON accuracies

`--eval` words every colour x shape x position of the built-in data with templates the model never
saw in training (data.HELDOUT_TEMPLATES), samples them from the EMA weights, and lets the judge
(data.judge) name the colour, shape and position of each picture. Checkpoints load with
weights_only=True: they hold tensors and plain Python values only, so loading runs no pickled code.
"""
import argparse
import json
import os

import torch

import data
import flow
from model import DiT


def get_args(argv=None):
    p = argparse.ArgumentParser(description="Sample images from a trained MM-DiT checkpoint.")
    p.add_argument("--ckpt", required=True, help="checkpoint written by train.py (<out>/ckpt.pt)")
    p.add_argument("--prompt", action="append", help="caption to draw (repeatable); default: a few built-in ones")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--steps", type=int, default=50, help="Euler steps from t=1 (noise) to t=0")
    p.add_argument("--cfg", type=float, default=5.0, help="classifier-free guidance scale w (1 = no guidance)")
    p.add_argument("--seed", type=int, default=0, help="noise seed (same seed, same pictures)")
    p.add_argument("--out", default=None, help="PNG grid path (default: next to the checkpoint)")
    p.add_argument("--eval", action="store_true", help="grade held-out prompts with the judge; last line is JSON")
    p.add_argument("--eval-n", type=int, default=2, help="--eval: samples per colour x shape x position")
    p.add_argument("--raw", action="store_true", help="use the raw weights instead of the EMA weights")
    p.add_argument("--batch", type=int, default=256, help="prompts per sampling batch (memory bound)")
    args = p.parse_args(argv)
    if not os.path.exists(args.ckpt):
        p.error(f"--ckpt {args.ckpt}: no such file; train first (python train.py) or point to <out>/ckpt.pt")
    return args


def load(path, raw=False):
    """Checkpoint -> (model in eval mode, its frozen text encoder, the training flags)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ckpt = torch.load(path, map_location=dev, weights_only=True)
    model = DiT(**ckpt["config"]).to(dev)
    model.load_state_dict(ckpt["model" if raw else "ema"])
    encoder = data.TextEncoder(ckpt["args"]["text_encoder"], device=dev)
    return model.eval().requires_grad_(False), encoder, ckpt["args"]


def sample(model, encoder, prompts, args, image_size):
    """All prompts, sampled in batches of --batch -> list of PIL images."""
    images = []
    for i in range(0, len(prompts), args.batch):
        x = flow.generate(model, encoder, prompts[i:i + args.batch], args.steps, args.cfg, seed=args.seed + i,
                          shape=(3, image_size, image_size), device=next(model.parameters()).device)
        images += [data.to_pil(im) for im in x]
    return images


def main(argv=None):
    args = get_args(argv)
    model, encoder, targs = load(args.ckpt, args.raw)
    size = targs["image_size"]
    if args.eval:
        prompts = data.heldout_prompts(args.eval_n)
        images = sample(model, encoder, [p for p, _ in prompts], args, size)
        acc = data.grade(images, [a for _, a in prompts])
        out = args.out or os.path.join(os.path.dirname(args.ckpt), f"eval_{args.steps}steps.png")
        data.save_grid(images[:len(data.heldout_prompts(1))], out, nrow=len(data.SHAPES) * len(data.POSITIONS))
        print(f"{len(prompts)} held-out prompts, {args.steps} Euler steps, cfg {args.cfg}; grid: {out}")
        for k, v in acc.items():
            print(f"  {k:9s} {100 * v:5.1f}%")
        print(json.dumps(dict(acc, n=len(prompts), steps=args.steps, cfg=args.cfg)))
        return acc
    prompts = args.prompt or ["a red circle in the top left", "a blue square in the center",
                              "a yellow triangle in the bottom right", "a white circle in the top right"]
    images = sample(model, encoder, [p for p in prompts for _ in range(args.n)], args, size)
    out = args.out or os.path.join(os.path.dirname(args.ckpt), "samples.png")
    data.save_grid(images, out, nrow=args.n)
    print(f"{len(images)} samples ({len(prompts)} prompts x {args.n}, one row each) -> {out}")


if __name__ == "__main__":
    main()
