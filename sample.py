"""sample.py -- prompts -> a PNG grid; `--eval`: every held-out prompt drawn, then scored by evaluate.py.

    python sample.py --ckpt out/run/ckpt.pt --prompt "a red circle in the top left" --n 8
    python sample.py --ckpt out/run/ckpt.pt --eval --steps 8     # last line: the scores as JSON
    python sample.py --ckpt out/moe/ckpt.pt --routing            # MoE: which experts, when, where
    python sample.py --ckpt out/run/ckpt.pt --pairs 4096 --steps 8 --out data/pairs   # reflow's pairs (flow.py)

Sampling is flow.generate (Euler from t = 1 to 0, classifier-free guidance) on the EMA weights (`--raw`: the
trained ones; the same under train.py's default `--ema 0`), decoded by the VAE where the model learnt latents.
What `--eval` draws depends on the data (train.py's grids and final evaluation use the same code):
  * built-in shapes: every colour x shape x position in wordings never trained on, read by evaluate.judge;
  * a names set (`python data.py emoji`): every name in an unseen wording, scored by retrieval (evaluate.py);
  * any data: `--real` FID and IS against real shards, `--clip-model` CLIPScore.
Checkpoints load with weights_only=True: tensors and plain values only, so loading runs no pickled code.
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
from data import as_uint8, atomic_write, to_pil
from model import DiT, TextEncoder, device, load_vae
from moe import MoE, default_impl


def get_parser():
    p = argparse.ArgumentParser(description="Sample images from a trained MM-DiT checkpoint.")
    a = p.add_argument
    a("--ckpt", help="checkpoint written by train.py (<out>/ckpt.pt)")
    a("--prompt", action="append", help="caption to draw (repeatable); default: a few built-in ones")
    a("--n", type=int, default=4, help="samples per prompt")
    a("--size", help="WxH pixels to draw, e.g. 44x24 (default: the training square; --eval: each trained bucket)")
    a("--steps", type=int, default=25, help="Euler steps, t=1 (noise) to t=0")
    a("--cfg", type=float, default=2.0, help="classifier-free guidance scale w (1 = none, 0 = ignore the caption)")
    a("--seed", type=int, default=0, help="noise seed (same seed, same pictures)")
    a("--out", help="PNG path (default: next to the checkpoint)")
    a("--pairs", type=int, metavar="N", help="reflow (flow.py): N pairs (noise, its sample, a caption of the run's "
      "data) into shards in the folder --out, for train.py --data OUT --init CKPT; rerun to resume")
    a("--eval", action="store_true", help="score samples (judge, names set, --real, --clip-model); last line: JSON")
    a("--eval-n", type=int, default=2, help="--eval: samples per colour x shape x position, or per name")
    a("--real", help="--eval: raw shards {jpg|png, txt}: FID + IS of samples of their captions against their images")
    a("--real-n", type=int, default=1000, help="--real: real images (and samples); compare FIDs at the same n")
    a("--features", default="inception", help="--real: 'inception' (needs torch-fidelity) or a TorchScript file, "
      "uint8 (N,3,H,W) -> features or (features, logits)")
    a("--inception-weights", help="--features inception's weights (default: $TORCH_HOME/hub/checkpoints/)")
    a("--clip-model", help="--eval: CLIPScore with this CLIP: hub id or CLIPModel + CLIPProcessor folder")
    a("--routing", action="store_true", help="MoE checkpoints: save expert-choice heatmaps (PNG)")
    a("--raw", action="store_true", help="use the raw weights instead of the EMA weights")
    a("--batch", type=int, default=256, help="prompts per sampling batch (memory bound)")
    return p


def get_args(argv=None):
    p = get_parser()
    args = p.parse_args(argv)
    if not args.ckpt or not os.path.exists(args.ckpt):
        p.error(f"--ckpt {args.ckpt}: no such file; train first (python train.py) or point to <out>/ckpt.pt")
    if args.pairs and not args.out:
        p.error("--pairs N: name the folder of the pairs' shards with --out, e.g. --out data/pairs")
    if (args.real or args.clip_model) and not args.eval:
        p.error("--real and --clip-model are scores: add --eval")
    if args.size:
        wh = args.size.lower().split("x")
        if len(wh) != 2 or not all(v.isdigit() and int(v) > 0 for v in wh):
            p.error(f"--size {args.size}: give width x height in pixels, e.g. 44x24")
        args.size = tuple(map(int, wh))
    return args


# ---- Sampling: the checkpoint's weights through the Euler sampler ------------------------------------------------
def load(path, raw=False):
    """Checkpoint -> (eval-mode model, frozen text encoder, training flags); model.vae: the frozen VAE, or None."""
    dev = device()
    ckpt = torch.load(path, map_location=dev, weights_only=True)
    DiT.check_layout(ckpt, path)
    model = DiT(**dict(ckpt["config"], moe_impl=default_impl(dev))).to(dev)  # the dispatch that suits this device
    model.load_weights(ckpt["model" if raw else "ema"], path)
    model.vae = load_vae(ckpt["args"]["vae"], dev)  # (a plain attribute: not a submodule)
    model.t_shift = ckpt["args"]["t_shift"]  # sample on the time grid it was trained for
    model.buckets = ckpt["buckets"]  # [(W, H)] of a run on pictures of several aspect ratios, else None
    return model.eval().requires_grad_(False), TextEncoder(ckpt["args"]["text_encoder"], device=dev), ckpt["args"]


def noise(model, n, seed, size=None, factor=1):
    """The noise samples i.. of a call start from: (n, C, h, w) drawn from `seed` + i on the CPU (the same pictures on
    any device), on the model's device; `size` (W, H) in pixels (default: the training square), `factor`: the VAE's."""
    W, H = size or (model.n_side * model.p * factor,) * 2
    shape = (n, model.C, H // factor, W // factor)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(next(model.parameters()).device)


@torch.no_grad()
def sample_images(model, encoder, vae, captions, steps, cfg, seed, shift=1.0, batch=256, size=None):
    """Captions -> (samples (N, 3, H, W) in [-1, 1] on the CPU, their paths' straightness (N,): flow.euler's), in
    batches whose noise() comes from seed + i."""
    images, straightness = [], []
    for i in range(0, len(captions), batch):  # (one batch on the device at a time)
        part = captions[i:i + batch]
        start = noise(model, len(part), seed + i, size, vae.factor if vae else 1)
        x, path = flow.generate(model, encoder, part, start, steps, cfg, shift)
        images.append((x if vae is None else vae.decode(x)).cpu())
        straightness.append(path.cpu())
    return torch.cat(images), torch.cat(straightness)


def save_grid(images, path, nrow=8, scale=2):
    """Tile PIL images into one PNG (upscaled with nearest so 32-px pixels stay visible)."""
    w, h = images[0].size
    cols, rows = min(nrow, len(images)), (len(images) + nrow - 1) // nrow
    grid = Image.new("RGB", (cols * w, rows * h))
    for i, im in enumerate(images):
        grid.paste(im, ((i % nrow) * w, (i // nrow) * h))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic_write(path, lambda f: grid.resize((cols * w * scale, rows * h * scale), Image.NEAREST).save(f, "PNG"))


# ---- Held-out prompts drawn and scored: --eval, and train.py's grids and final evaluation ------------------------
def score_heldout(model, encoder, vae, names, grid, n_each, steps, cfg, seed, shift=1.0, fid=False, judge=True,
                  batch=256, size=None):
    """Every held-out prompt (built-in shapes) or name (a names set), n_each times, at `size` (a list: each bucket in
    turn) -> grid PNG and (scores, uint8 samples, captions): the judge's accuracies, or retrieval (+ FID/KID: fid).
    grid None: only draw (train.py's FSDP ranks but the first, which run the same forwards)."""
    if isinstance(size, (list, dict)):  # buckets (a dict: its keys), each in turn: "WxH" -> (scores, fake, captions)
        per = {"%dx%d" % b: score_heldout(model, encoder, vae, names, grid and grid.replace(".png", "_%dx%d.png" % b),
                                          n_each, steps, cfg, seed, shift, fid, judge, batch, tuple(b)) for b in size}
        scores = None
        if all(p[0] for p in per.values()):  # the mean over the buckets, and each bucket's own
            scores = {k: sum(p[0][k] for p in per.values()) / len(per) for k in next(iter(per.values()))[0]}
            scores.update((k, p[0]) for k, p in per.items())
        return scores, [x for p in per.values() for x in p[1]], [c for p in per.values() for c in p[2]]
    if names:
        want = torch.arange(len(names["names"])).repeat_interleave(n_each)
        captions = [names["heldout"].format(name=names["names"][i]) for i in want]
    else:
        captions, attrs = map(list, zip(*data.heldout_prompts(n_each)))  # (caption, attributes) pairs, unzipped
    fake, straightness = sample_images(model, encoder, vae, captions, steps, cfg, seed, shift, batch, size)
    fake = as_uint8(fake)
    if grid is None:
        return None, fake, captions
    images = None if names else [to_pil(x) for x in fake]  # (the judge reads PIL images)
    try:
        if names:
            names_grid(fake, want, names["real"], grid)
        else:
            save_grid(images[:len(images) // n_each], grid, nrow=len(data.SHAPES) * len(data.POSITIONS))
    except OSError as e:  # a full disk must not end a training run over a picture
        print(f"warning: sample grid {grid} not written ({e}); going on", file=sys.stderr)
    scores = (evaluate.retrieval_scores(fake, want, names, fid) if names else
              evaluate.judge_accuracy(images, attrs) if judge else None)
    return scores and dict(scores, straightness=straightness.mean().item()), fake, captions


# ---- Reflow's pairs: the trained model's own couplings of noise and picture (flow.py) -------------------------------
@torch.no_grad()
def write_pairs(model, encoder, captions, out, steps, cfg, seed, batch, about):
    """(noise, the model's sample from it, its caption) -> shards of `batch` pairs in data.py precompute's format plus
    the noise: {latent.npy: the sample (model space), noise.npy, text.npy, mask.npy, txt}. Shard k holds pairs from
    k * batch on, drawn from noise(seed + k * batch): a rerun skips the shards written (each under its final name only
    once whole) and draws the rest the same. `about` goes to precompute.json (train.py reads it)."""
    os.makedirs(out, exist_ok=True)
    data.write_json(os.path.join(out, "precompute.json"), about)
    path = lambda first: os.path.join(out, f"pairs-{first // batch:05d}.tar")
    todo = [first for first in range(0, len(captions), batch) if not os.path.exists(path(first))]
    for first in tqdm(todo, desc=f"reflow pairs -> {out}", unit="shard"):
        part = captions[first:first + batch]
        eps = noise(model, len(part), seed + first, factor=model.vae.factor if model.vae else 1)  # (B, C, h, w)
        x0, _ = flow.generate(model, encoder, part, eps, steps, cfg, model.t_shift)
        text, mask = encoder(part)
        with wds.TarWriter(path(first) + ".tmp", mtime=0) as sink:
            for j, caption in enumerate(part):
                n = int(mask[j].sum())  # (the real tokens, as precompute keeps them)
                sink.write({"__key__": f"{first + j:08d}", "latent.npy": x0[j].cpu().half().numpy(),
                            "noise.npy": eps[j].cpu().half().numpy(), "text.npy": text[j, :n].cpu().half().numpy(),
                            "mask.npy": mask[j, :n].cpu().numpy(), "txt": caption})
        os.replace(path(first) + ".tmp", path(first))
    print(f"{len(captions)} pairs in {out}: train on them with python train.py --data {out} --init {about['pairs']}")


def main(argv=None):
    args = get_args(argv)
    model, encoder, targs = load(args.ckpt, args.raw)
    out = lambda name: args.out or os.path.join(os.path.dirname(args.ckpt), name)  # default: beside the checkpoint
    source = data.source(targs["data"])  # (the pictures a precomputed or pair folder was made from)
    if args.pairs:  # captions of the run's own data, shuffled by the seed, as many times over as N needs
        about = dict(vae=targs["vae"], text_encoder=targs["text_encoder"], image_size=targs["image_size"],
                     source=source, pairs=args.ckpt, steps=args.steps, cfg=args.cfg, seed=args.seed)
        if (old := data.read_json(os.path.join(args.out, "precompute.json"))) not in (None, about):  # (a resume)
            raise SystemExit(f"{args.out} holds pairs drawn with {old}; rerun with those flags, or write a new folder")
        captions = [s["txt"].decode() for s in data.read_tars(data.resolve_shards(source, targs["image_size"]))]
        random.Random(args.seed).shuffle(captions)
        return write_pairs(model, encoder, [captions[i % len(captions)] for i in range(args.pairs)], args.out,
                           args.steps, args.cfg, args.seed, args.batch, about)
    if args.routing:
        return routing_maps(model, encoder, targs["image_size"], args.out or os.path.dirname(args.ckpt), args.seed)
    m = model.p * (model.vae.factor if model.vae else 1)  # a patch, in pixels
    if args.size and (args.size[0] % m or args.size[1] % m or max(args.size) > model.n_max * m):
        raise SystemExit(f"--size {args.size[0]}x{args.size[1]}: this model draws sides that are multiples of {m} "
                         f"pixels (its patch, times the VAE's factor), up to {model.n_max * m}; it was trained at "
                         + " ".join("%dx%d" % tuple(b) for b in model.buckets or [(model.n_side * m,) * 2]))
    samples_of = lambda captions: as_uint8(sample_images(model, encoder, model.vae, captions, args.steps, args.cfg,
                                                         args.seed, model.t_shift, args.batch, args.size)[0])
    if not args.eval:
        prompts = args.prompt or ["a red circle in the top left", "a blue square in the center",
                                  "a yellow triangle in the bottom right", "a white circle in the top right"]
        fake = samples_of([p for p in prompts for _ in range(args.n)])
        save_grid([to_pil(x) for x in fake], out("samples.png"), nrow=args.n)
        return print(f"{len(fake)} samples ({len(prompts)} prompts x {args.n}, one row each) -> {out('samples.png')}")
    nets = evaluate.feature_nets(args.features, args.inception_weights) if args.real else None  # fail before sampling
    clip = evaluate.load_clip(args.clip_model) if args.clip_model else None
    names, scores, fake = evaluate.names_set(source, targs["image_size"]), {}, None
    if names or source in (data.BUILTIN, data.MIXED):  # the judge, or retrieval against the named pictures
        grid = out(f"eval_{args.steps}steps_cfg{args.cfg:g}.png")
        scores, fake, captions = score_heldout(model, encoder, model.vae, names, grid, args.eval_n, args.steps,
                                               args.cfg, args.seed, model.t_shift, fid=bool(names), batch=args.batch,
                                               size=[args.size] if args.size else model.buckets)
        evaluate.print_scores(scores, len(fake), f"{args.steps} Euler steps, cfg {args.cfg}; grid: {grid}")
        scores["n"] = len(fake)
    elif not (args.real or args.clip_model):
        raise SystemExit("--eval: the judge knows only the built-in data and sets with a names.json (python "
                         "data.py emoji); for this checkpoint pass --real and/or --clip-model")
    if args.real:  # FID/IS: the real captions drawn, then set against the real images
        real, captions = evaluate.real_images(args.real, targs["image_size"], args.real_n, args.seed)
        fake = samples_of(captions)
        scores.update(evaluate.fid_is(real, fake, nets, args.batch), n_real=len(real))
        print(f"FID {scores['fid']:.2f}, IS {scores['inception_score']:.2f} +- {scores['inception_score_std']:.2f}"
              f": {len(real)} real images of {args.real} and as many samples of their captions ({args.features})")
    if args.clip_model:  # on the samples above, or else on the --prompt ones
        if fake is None and not args.prompt:
            raise SystemExit("--clip-model needs captions to score: pass --real or --prompt")
        if fake is None:
            captions = [p for p in args.prompt for _ in range(args.n)]
            fake = samples_of(captions)
        scores["clip_score"] = evaluate.clip_score(fake, captions, clip, args.batch)
        print(f"CLIPScore {scores['clip_score']:.2f} over {len(fake)} samples ({args.clip_model})")
    print(json.dumps(dict(scores, steps=args.steps, cfg=args.cfg)))
    return scores


# ==== What a first read may skip: the names grid, routing maps ====================================================
def names_grid(fake, want, real, path, cols=12, blocks=2):
    """Real vs generated: `blocks` x `cols` names spread over the set, the real picture above the first sample."""
    first = {i: j for j, i in reversed(list(enumerate(want.tolist())))}  # name -> its first sample
    pick = sorted(first)[::max(1, len(first) // (cols * blocks))][:cols * blocks]
    rows = [pick[b * cols:(b + 1) * cols] for b in range(blocks)]
    pil = [to_pil(x) for r in rows for x in [*real[r], *fake[[first[i] for i in r]]]]
    save_grid(pil, path, nrow=len(rows[0]), scale=3)


@torch.no_grad()
def routing_maps(model, encoder, size, out_dir, seed=0, t_bins=5):
    """Expert choice of image tokens (DiT-MoE's heatmaps) by layer x timestep, caption colour and shape, and patch
    position, on built-in images of every colour x shape x position noised to each t bin's centre -> PNGs, counts."""
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
    x0 = x0 if model.vae is None else model.vae.encode(x0).cpu()  # latent models route latent patches
    text, mask = encoder([p for p, _ in prompts])
    dev = next(model.parameters()).device
    labels = {"timestep": [f"t~{(b + 0.5) / t_bins:.1f}" for b in range(t_bins)], "colour": list(data.COLORS),
              "shape": data.SHAPES}
    by = dict({key: torch.zeros(L, len(ticks), E) for key, ticks in labels.items()}, position=torch.zeros(L, E, n * n))
    row_of = {key: torch.tensor([labels[key].index(a[attr]) for _, a in prompts])  # each prompt's colour, shape
              for key, attr in (("colour", "color"), ("shape", "shape"))}
    g = torch.Generator().manual_seed(seed)
    for b in range(t_bins):
        t = torch.full((len(prompts),), (b + 0.5) / t_bins)
        model(flow.interpolate(x0, torch.randn(x0.shape, generator=g), t).to(dev), t.to(dev), text, mask)
        for l, m in enumerate(layers):
            hits = F.one_hot(m.stats["idx"].cpu().view(len(prompts), n * n, -1), E).sum(2).float()  # (P, N, E)
            by["timestep"][l, b] += hits.sum((0, 1))
            for key, rows in row_of.items():
                by[key][l].index_add_(0, rows, hits.sum(1))
            by["position"][l] += hits.sum(0).T
    for key, counts in by.items():
        frac = counts / counts.sum(1 if key == "position" else -1, keepdim=True)  # rows: share of tokens per expert
        if key == "position":  # one small map per (layer, expert): where on the image it is chosen
            fig, axes = plt.subplots(L, E, figsize=(1.2 * E, 1.3 * L), squeeze=False)
            for i, ax in enumerate(axes.flat):  # (row-major: i = l * E + e)
                ax.imshow(frac.view(L * E, n, n)[i].numpy(), vmin=0, vmax=2 * frac.mean(), cmap="viridis")
                ax.set(xticks=[], yticks=[]), ax.set_title(f"L{i // E} e{i % E}", fontsize=7)
        else:
            fig, axes = plt.subplots(1, L, figsize=(2.2 * L + 1, 0.35 * len(labels[key]) + 1.5), squeeze=False)
            for l, ax in enumerate(axes[0]):
                im = ax.imshow(frac[l].numpy(), vmin=0, vmax=max(2.0 / E, frac.max().item()), cmap="viridis",
                               aspect="auto")
                ax.set_title(f"layer {l}", fontsize=9), ax.set_xlabel("expert")
                ax.set_yticks(range(len(labels[key])), labels[key] if l == 0 else [""] * len(labels[key]), fontsize=8)
            fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="share of tokens")
        fig.suptitle(f"expert choice by {key}")
        path = os.path.join(out_dir, f"routing_{key}.png")
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        print(f"routing by {key:9s} -> {path}")
    return by


if __name__ == "__main__":
    main()
