"""sample.py -- prompts -> a PNG grid, and `--eval`: how often do samples show what they were asked?

    python sample.py --ckpt out/run/ckpt.pt --prompt "a red circle in the top left" --n 8
    python sample.py --ckpt out/run/ckpt.pt --eval --steps 8     # last line: JSON accuracies
    python sample.py --ckpt out/moe/ckpt.pt --routing            # MoE: which experts, when, where

`--eval` words every colour x shape x position of the built-in data with templates the model never
saw in training (data.HELDOUT_TEMPLATES), samples them from the EMA weights, and lets the judge
(data.judge) name the colour, shape and position of each picture. Checkpoints load with
weights_only=True: they hold tensors and plain Python values only, so loading runs no pickled code.
"""
import argparse
import json
import os
import random

import torch
import torch.nn.functional as F

import data
import flow
from model import DiT
from moe import MoE


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
    p.add_argument("--routing", action="store_true", help="MoE checkpoints: save expert-choice heatmaps (PNG)")
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


@torch.no_grad()
def routing_maps(model, encoder, size, out_dir, seed=0, t_bins=5):
    """Expert choice of image tokens (DiT-MoE's heatmaps, for text-to-image): by layer x timestep,
    by the caption's colour and shape, and by patch position. Inputs are built-in images of every
    colour x shape x position, noised to the centre of each t bin. Saves PNGs, returns the counts."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        raise SystemExit("--routing needs a checkpoint trained with --moe E")
    L, E, n = len(layers), layers[0].E, model.n_side
    prompts, rng = data.heldout_prompts(1), random.Random(seed)
    x0 = torch.stack([data.to_tensor(data.render(a["color"], a["shape"], a["position"], size, rng), size)
                      for _, a in prompts])
    text, mask, _ = encoder([p for p, _ in prompts])
    dev = next(model.parameters()).device
    by = {"timestep": torch.zeros(L, t_bins, E), "colour": torch.zeros(L, len(data.COLORS), E),
          "shape": torch.zeros(L, len(data.SHAPES), E), "position": torch.zeros(L, E, n * n)}
    col = torch.tensor([list(data.COLORS).index(a["color"]) for _, a in prompts])
    shp = torch.tensor([data.SHAPES.index(a["shape"]) for _, a in prompts])
    g = torch.Generator().manual_seed(seed)
    for b in range(t_bins):
        t = torch.full((len(prompts),), (b + 0.5) / t_bins)
        z = flow.interpolate(x0, torch.randn(x0.shape, generator=g), t)
        model(z.to(dev), t.to(dev), text, mask)
        for l, m in enumerate(layers):
            hits = F.one_hot(m.stats["idx"].cpu().view(len(prompts), n * n, -1), E).sum(2).float()  # (P, N, E)
            by["timestep"][l, b] += hits.sum((0, 1))
            by["colour"][l].index_add_(0, col, hits.sum(1))
            by["shape"][l].index_add_(0, shp, hits.sum(1))
            by["position"][l] += hits.sum(0).T
    labels = {"timestep": [f"t~{(b + 0.5) / t_bins:.1f}" for b in range(t_bins)], "colour": list(data.COLORS),
              "shape": data.SHAPES}
    for key, counts in by.items():
        frac = counts / counts.sum(-1, keepdim=True)  # each row: share of its tokens per expert
        if key == "position":  # one small map per (layer, expert): where on the image it is chosen
            frac = counts / counts.sum(1, keepdim=True)
            fig, axes = plt.subplots(L, E, figsize=(1.2 * E, 1.3 * L), squeeze=False)
            for l in range(L):
                for e in range(E):
                    axes[l, e].imshow(frac[l, e].view(n, n).numpy(), vmin=0, vmax=2 * frac.mean(), cmap="viridis")
                    axes[l, e].set_xticks([]), axes[l, e].set_yticks([])
                    axes[l, e].set_title(f"L{l} e{e}", fontsize=7)
        else:
            fig, axes = plt.subplots(1, L, figsize=(2.2 * L + 1, 0.35 * len(labels[key]) + 1.5), squeeze=False)
            for l in range(L):
                ax = axes[0, l]
                im = ax.imshow(frac[l].numpy(), vmin=0, vmax=max(2.0 / E, frac.max().item()), cmap="viridis",
                               aspect="auto")
                ax.set_title(f"layer {l}", fontsize=9)
                ax.set_xlabel("expert")
                ax.set_yticks(range(len(labels[key])), labels[key] if l == 0 else [""] * len(labels[key]), fontsize=8)
            fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="share of tokens")
        fig.suptitle(f"expert choice by {key}")
        path = os.path.join(out_dir, f"routing_{key}.png")
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        print(f"routing by {key:9s} -> {path}")
    return by


def main(argv=None):
    args = get_args(argv)
    model, encoder, targs = load(args.ckpt, args.raw)
    size = targs["image_size"]
    if args.routing:
        return routing_maps(model, encoder, size, args.out or os.path.dirname(args.ckpt), args.seed)
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
