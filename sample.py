"""sample.py -- prompts -> a PNG grid; --eval scores held-out prompts.

    python sample.py --ckpt out/run/ckpt.pt --prompt "a red circle in the top left" --n 8
    python sample.py --ckpt out/run/ckpt.pt --eval --steps 8
    python sample.py --ckpt out/moe/ckpt.pt --routing
    python sample.py --ckpt out/run/ckpt.pt --pairs 4096 --steps 8 --out data/pairs

Checkpoints load with weights_only=True: no pickled code runs.
"""
import argparse
import json
import os
import random
import sys

import torch
import torch.nn.functional as F
import webdataset as wds
from PIL import Image
from tqdm import tqdm

import data
import evaluate
import flow
from data import as_uint8, to_pil
from model import DiT, TextEncoder, device, load_vae
from moe import MoE, default_impl
from runfolder import atomic_write


def get_parser():
    p = argparse.ArgumentParser(description="Sample images from a trained MM-DiT checkpoint.")
    a = p.add_argument
    a("--ckpt", help="train.py's checkpoint (<out>/ckpt.pt)")
    a("--prompt", action="append", help="caption (repeatable; default: 4 built-in)")
    a("--n", type=int, default=4, help="samples per prompt")
    a("--size", help="WxH pixels, e.g. 44x24 (default: the training square; --eval: each bucket)")
    a("--steps", type=int, help="Euler steps (MeanFlow: jumps), t=1 (noise) to t=0 "
      "(default: the checkpoint's --sample-steps: 25, MeanFlow 1)")
    a("--cfg", type=float, help="guidance scale w (1: none, 0: ignore the caption; "
      "default: the checkpoint's: 2, MeanFlow 1 as its guidance is trained in)")
    a("--seed", type=int, default=0, help="noise seed")
    a("--out", help="PNG path (default: next to the checkpoint)")
    a("--pairs", type=int, metavar="N", help="reflow: N (noise, sample, caption) pairs into "
      "folder --out, for train.py --data OUT --init CKPT; a rerun resumes")
    a("--eval", action="store_true", help="score held-out prompts; last line: JSON")
    a("--eval-n", type=int, default=2, help="--eval: samples per prompt or name")
    a("--real", help="--eval: raw {jpg|png, txt} shards (as train.py's --data): FID and IS "
      "of their captions' samples")
    a("--real-n", type=int, default=1000, help="--real: images (and samples); compare at one n")
    a("--features", default="inception", help="--real: 'inception' (torch-fidelity) or a "
      "TorchScript file: uint8 (N,3,H,W) -> features or (features, logits)")
    a("--inception-weights", help="Inception's weights (default: $TORCH_HOME/hub/checkpoints/)")
    a("--clip-model", help="--eval: CLIPScore with this CLIP (hub id or folder)")
    a("--routing", action="store_true", help="MoE: expert-choice heatmaps (PNG)")
    a("--raw", action="store_true", help="use the raw weights, not the EMA")
    a("--batch", type=int, default=256, help="prompts per sampling batch")
    return p


def get_args(argv=None):
    p = get_parser()
    args = p.parse_args(argv)
    if not args.ckpt or not os.path.exists(args.ckpt):
        p.error(f"--ckpt {args.ckpt}: no such file; pass train.py's <out>/ckpt.pt")
    if args.pairs and not args.out:
        p.error("--pairs N: name their folder with --out")
    if (args.real or args.clip_model) and not args.eval:
        p.error("--real and --clip-model are scores: add --eval")
    if args.size and (args.pairs or args.routing):
        p.error("--size draws samples and --eval; --pairs and --routing use the "
                "training size: drop --size")
    if args.size:
        wh = args.size.lower().split("x")
        if len(wh) != 2 or not all(v.isdigit() and int(v) > 0 for v in wh):
            p.error(f"--size {args.size}: give width x height in pixels, e.g. 44x24")
        args.size = tuple(map(int, wh))
    return args


# ---- Sampling ----
def load(path, raw=False):
    """Checkpoint -> (eval-mode model, frozen text encoder, training args);
    model.vae: the frozen VAE or None."""
    dev = device()
    ckpt = torch.load(path, map_location=dev, weights_only=True)
    DiT.check_layout(ckpt, path)
    model = DiT(**dict(ckpt["config"], moe_impl=default_impl(dev))).to(dev)
    model.load_weights(ckpt["model" if raw else "ema"], path)
    train_args = ckpt["args"]
    model.vae = load_vae(train_args["vae"], dev)
    # the time grid it was trained on
    model.t_shift = train_args["t_shift"]
    model.buckets = ckpt["buckets"]  # [(W, H)], or None: square
    model.eval().requires_grad_(False)
    return model, TextEncoder(train_args["text_encoder"], device=dev), train_args


def noise(model, n, seed, size=None, factor=1):
    """(n, C, h, w) noise from `seed`, drawn on the CPU to match on any
    device; size: (W, H) pixels, default the training square."""
    W, H = size or (model.n_side * model.patch * factor,) * 2
    shape = (n, model.channels, H // factor, W // factor)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(next(model.parameters()).device)


@torch.no_grad()
def sample_images(model, encoder, vae, captions, steps, cfg, seed, shift=1.0, batch=256, size=None):
    """Captions -> (samples (N, 3, H, W) in [-1, 1] on the CPU, straightness
    of their paths (N,)); captions i.. draw noise() from seed + i."""
    images, straightness = [], []
    for i in range(0, len(captions), batch):
        part = captions[i:i + batch]
        # seeded by position: a prompt's picture does not depend on --batch
        start = noise(model, len(part), seed + i, size, vae.factor if vae else 1)
        x, path = flow.generate(model, encoder, part, start, steps, cfg, shift)
        images.append((x if vae is None else vae.decode(x)).cpu())
        straightness.append(path.cpu())
    return torch.cat(images), torch.cat(straightness)


def save_grid(images, path, nrow=8, scale=2):
    """Tile PIL images into one PNG, scaled up (nearest) to show pixels."""
    w, h = images[0].size
    cols, rows = min(nrow, len(images)), (len(images) + nrow - 1) // nrow
    grid = Image.new("RGB", (cols * w, rows * h))
    for i, im in enumerate(images):
        grid.paste(im, ((i % nrow) * w, (i // nrow) * h))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    big = (cols * w * scale, rows * h * scale)
    atomic_write(path, lambda f: grid.resize(big, Image.NEAREST).save(f, "PNG"))


# ---- Held-out prompts: --eval, train.py's grids ----
def score_heldout(model, encoder, vae, names, grid, n_each, steps, cfg, seed, shift=1.0,
                  fid=False, judge=True, batch=256, size=None):
    """Every held-out prompt, or name of a names set, n_each times -> grid
    PNG, (scores, uint8 samples, captions). size: (W, H), or buckets in
    turn. grid None: only draw (train.py's other FSDP ranks)."""
    if isinstance(size, (list, dict)):
        # "WxH" -> (scores, fake, captions)
        runs = {"%dx%d" % b: score_heldout(
            model, encoder, vae, names, grid and grid.replace(".png", "_%dx%d.png" % b),
            n_each, steps, cfg, seed, shift, fid, judge, batch, b) for b in map(tuple, size)}
        each, fakes, captions = zip(*runs.values())
        scores = None
        # the buckets' mean, and each bucket's own
        if all(each):
            scores = {k: sum(s[k] for s in each) / len(runs) for k in each[0]}
            scores.update(zip(runs, each))
        return scores, [x for f in fakes for x in f], [c for cs in captions for c in cs]
    if names:
        want = torch.arange(len(names["names"])).repeat_interleave(n_each)
        captions = [names["heldout"].format(name=names["names"][i]) for i in want]
    else:
        captions, attrs = map(list, zip(*data.heldout_prompts(n_each)))
    fake, straightness = sample_images(
        model, encoder, vae, captions, steps, cfg, seed, shift, batch, size)
    fake = as_uint8(fake)
    if grid is None:
        return None, fake, captions
    images = None if names else [to_pil(x) for x in fake]
    # a full disk must not end a training run over a picture
    try:
        if names:
            names_grid(fake, want, names["real"], grid)
        else:
            nrow = len(data.SHAPES) * len(data.POSITIONS)
            save_grid(images[:len(images) // n_each], grid, nrow=nrow)
    except OSError as e:
        print(f"warning: sample grid {grid} not written ({e}); going on", file=sys.stderr)
    if names:
        scores = evaluate.retrieval_scores(fake, want, names, fid)
    else:
        scores = evaluate.judge_accuracy(images, attrs) if judge else None
    return scores and dict(scores, straightness=straightness.mean().item()), fake, captions


# ---- Reflow's pairs ----
@torch.no_grad()
def write_pairs(model, encoder, captions, out, steps, cfg, seed, batch, about):
    """(noise, the model's sample, caption) -> shards as prepare.py precompute
    writes them, plus noise.npy; `about` -> precompute.json. A shard is
    named once whole: a rerun skips it."""
    os.makedirs(out, exist_ok=True)
    data.write_json(os.path.join(out, "precompute.json"), about)

    def shard(first):
        return os.path.join(out, f"pairs-{first // batch:05d}.tar")

    def f16(x):
        return x.cpu().half().numpy()

    todo = [i for i in range(0, len(captions), batch) if not os.path.exists(shard(i))]
    factor = model.vae.factor if model.vae else 1
    for first in tqdm(todo, desc=f"reflow pairs -> {out}", unit="shard"):
        part = captions[first:first + batch]
        eps = noise(model, len(part), seed + first, factor=factor)  # (B, C, h, w)
        x0, _ = flow.generate(model, encoder, part, eps, steps, cfg, model.t_shift)
        text, mask = encoder(part)
        with wds.TarWriter(shard(first) + ".tmp", mtime=0) as sink:
            for j, caption in enumerate(part):
                # the real tokens, as precompute keeps them
                n = int(mask[j].sum())
                sink.write({"__key__": f"{first + j:08d}", "latent.npy": f16(x0[j]),
                            "noise.npy": f16(eps[j]), "text.npy": f16(text[j, :n]),
                            "mask.npy": mask[j, :n].cpu().numpy(), "txt": caption})
        os.replace(shard(first) + ".tmp", shard(first))
    print(f"{len(captions)} pairs in {out}: python train.py --data {out} "
          f"--init {about['pairs']}")


def main(argv=None):
    args = get_args(argv)
    model, encoder, train_args = load(args.ckpt, args.raw)
    # the samples the run drew, unless told otherwise
    args.steps = args.steps or train_args["sample_steps"]
    args.cfg = train_args["cfg"] if args.cfg is None else args.cfg
    beside = os.path.dirname(args.ckpt)
    # the pictures behind a precomputed or pair folder
    source, image_size = data.made_from(train_args["data"]), train_args["image_size"]
    if args.pairs:
        encoders = {k: train_args[k] for k in ("vae", "text_encoder", "image_size")}
        about = dict(encoders, source=source, pairs=args.ckpt, steps=args.steps, cfg=args.cfg,
                     seed=args.seed)
        old = data.read_json(os.path.join(args.out, "precompute.json"))
        if old not in (None, about):
            raise SystemExit(f"{args.out} holds pairs drawn with {old}; "
                             "rerun with those flags, or another --out")
        shards = data.resolve_shards(source, image_size)
        captions = [s["txt"].decode() for s in data.read_tars(shards)]
        random.Random(args.seed).shuffle(captions)
        captions = [captions[i % len(captions)] for i in range(args.pairs)]
        return write_pairs(model, encoder, captions, args.out, args.steps, args.cfg,
                           args.seed, args.batch, about)
    if args.routing:
        return routing_maps(model, encoder, image_size, args.out or beside, args.seed)
    patch = model.patch * (model.vae.factor if model.vae else 1)  # pixels
    if args.size:
        W, H = args.size
        if W % patch or H % patch or max(W, H) > model.n_max * patch:
            trained = model.buckets or [(model.n_side * patch,) * 2]
            raise SystemExit(f"--size {W}x{H}: sides must be multiples of {patch} pixels, up "
                             f"to {model.n_max * patch}; trained at "
                             + " ".join("%dx%d" % tuple(b) for b in trained))

    def samples_of(captions):
        return as_uint8(sample_images(model, encoder, model.vae, captions, args.steps, args.cfg,
                                      args.seed, model.t_shift, args.batch, args.size)[0])

    if not args.eval:
        prompts = args.prompt or ["a red circle in the top left", "a blue square in the center",
                                  "a yellow triangle in the bottom right",
                                  "a white circle in the top right"]
        fake = samples_of([p for p in prompts for _ in range(args.n)])
        path = args.out or os.path.join(beside, "samples.png")
        save_grid([to_pil(x) for x in fake], path, nrow=args.n)
        return print(f"{len(fake)} samples ({len(prompts)} prompts x {args.n})"
                     f" -> {path}")
    # scorers first: a missing one fails before sampling
    nets = evaluate.feature_nets(args.features, args.inception_weights) if args.real else None
    clip = evaluate.load_clip(args.clip_model) if args.clip_model else None
    names, scores, fake = evaluate.names_set(source, image_size), {}, None
    if names or source in (data.BUILTIN, data.MIXED):
        grid = args.out or os.path.join(beside, f"eval_{args.steps}steps_cfg{args.cfg:g}.png")
        scores, fake, captions = score_heldout(
            model, encoder, model.vae, names, grid, args.eval_n, args.steps, args.cfg,
            args.seed, model.t_shift, fid=bool(names), batch=args.batch,
            size=[args.size] if args.size else model.buckets)
        kind = "Euler steps" if model.interval_mlp is None else "MeanFlow jumps"
        how = f"{args.steps} {kind}, cfg {args.cfg}; grid: {grid}"
        evaluate.print_scores(scores, len(fake), how)
        scores["n"] = len(fake)
    elif not (args.real or args.clip_model):
        raise SystemExit("--eval: no judge for this data (built-in shapes, names sets): "
                         "pass --real and/or --clip-model")
    if args.real:
        real, captions = evaluate.real_images(args.real, image_size, args.real_n, args.seed)
        fake = samples_of(captions)
        scores.update(evaluate.fid_is(real, fake, nets, args.batch), n_real=len(real))
        print(f"FID {scores['fid']:.2f}, IS {scores['inception_score']:.2f} +- "
              f"{scores['inception_score_std']:.2f}: {len(real)} real images of "
              f"{data.masked(args.real)} vs samples of their captions ({args.features})")
    # CLIPScore of the samples above, else of --prompt's
    if args.clip_model:
        if fake is None and not args.prompt:
            raise SystemExit("--clip-model needs captions to score: pass --real or --prompt")
        if fake is None:
            captions = [p for p in args.prompt for _ in range(args.n)]
            fake = samples_of(captions)
        scores["clip_score"] = evaluate.clip_score(fake, captions, clip, args.batch)
        print(f"CLIPScore {scores['clip_score']:.2f} over {len(fake)} samples ({args.clip_model})")
    print(json.dumps(dict(scores, steps=args.steps, cfg=args.cfg)))
    return scores


# ==== A first read may skip the rest ====
def names_grid(fake, want, real, path, cols=12, blocks=2):
    """`blocks` x `cols` names of the set: real picture above first sample."""
    # name -> its first sample
    first = {i: j for j, i in reversed(list(enumerate(want.tolist())))}
    shown = sorted(first)[::max(1, len(first) // (cols * blocks))][:cols * blocks]
    rows = [shown[b * cols:(b + 1) * cols] for b in range(blocks)]
    pil = [to_pil(x) for r in rows for x in [*real[r], *fake[[first[i] for i in r]]]]
    save_grid(pil, path, nrow=len(rows[0]), scale=3)


@torch.no_grad()
def routing_maps(model, encoder, size, out_dir, seed=0, t_bins=5):
    """Expert choice of image tokens by layer x t, caption colour, shape and
    patch (DiT-MoE's heatmaps), on noised built-in pictures -> PNGs, counts."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        raise SystemExit("--routing needs a checkpoint trained with --moe E")
    L, E, n = len(layers), layers[0].E, model.n_side
    prompts, rng = data.heldout_prompts(1), random.Random(seed)
    pics = [data.render(a["color"], a["shape"], a["position"], size, rng) for _, a in prompts]
    x0 = torch.stack([data.to_tensor(im, size) for im in pics])
    # latent models route latent patches
    x0 = x0 if model.vae is None else model.vae.encode(x0).cpu()
    text, mask = encoder([p for p, _ in prompts])
    dev = next(model.parameters()).device
    labels = {"timestep": [f"t≈{(b + 0.5) / t_bins:.1f}" for b in range(t_bins)],
              "colour": list(data.COLORS), "shape": data.SHAPES}
    counts = {key: torch.zeros(L, len(ticks), E) for key, ticks in labels.items()}
    counts["position"] = torch.zeros(L, E, n * n)
    # each prompt's colour and shape rows
    row_of = {key: torch.tensor([labels[key].index(a[attr]) for _, a in prompts])
              for key, attr in (("colour", "color"), ("shape", "shape"))}
    g = torch.Generator().manual_seed(seed)
    for b in range(t_bins):
        t = torch.full((len(prompts),), (b + 0.5) / t_bins)
        xt = flow.interpolate(x0, torch.randn(x0.shape, generator=g), t)
        model(xt.to(dev), t.to(dev), text, mask)
        for i, moe in enumerate(layers):
            chosen = moe.stats["idx"].cpu().view(len(prompts), n * n, -1)
            hits = F.one_hot(chosen, E).sum(2).float()  # (P, N, E)
            counts["timestep"][i, b] += hits.sum((0, 1))
            for key, rows in row_of.items():
                counts[key][i].index_add_(0, rows, hits.sum(1))
            counts["position"][i] += hits.sum(0).T
    for key, table in counts.items():
        # each expert's share of a row's (or patch's) tokens
        frac = table / table.sum(1 if key == "position" else -1, keepdim=True)
        if key == "position":
            # where on the image each (layer, expert) is chosen
            fig, axes = plt.subplots(L, E, figsize=(1.2 * E, 1.3 * L), squeeze=False)
            maps = frac.view(L * E, n, n)
            for i, ax in enumerate(axes.flat):
                ax.imshow(maps[i].numpy(), vmin=0, vmax=2 * frac.mean(), cmap="viridis")
                ax.set(xticks=[], yticks=[])
                ax.set_title(f"L{i // E} e{i % E}", fontsize=7)
        else:
            ticks, vmax = labels[key], max(2.0 / E, frac.max().item())
            figsize = (2.2 * L + 1, 0.35 * len(ticks) + 1.5)
            fig, axes = plt.subplots(1, L, figsize=figsize, squeeze=False)
            for i, ax in enumerate(axes[0]):
                im = ax.imshow(frac[i].numpy(), vmin=0, vmax=vmax, cmap="viridis", aspect="auto")
                ax.set_title(f"layer {i}", fontsize=9)
                ax.set_xlabel("expert")
                ax.set_yticks(range(len(ticks)), ticks if i == 0 else [""] * len(ticks),
                              fontsize=8)
            fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="share of tokens")
        fig.suptitle(f"expert choice by {key}")
        path = os.path.join(out_dir, f"routing_{key}.png")
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        print(f"routing by {key:9s} -> {path}")
    return counts


if __name__ == "__main__":
    main()
