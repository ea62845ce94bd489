"""sample.py -- prompts -> a PNG grid, and `--eval`: how often do the samples show what they were asked for?

    python sample.py --ckpt out/run/ckpt.pt --prompt "a red circle in the top left" --n 8
    python sample.py --ckpt out/run/ckpt.pt --eval --steps 8     # last line: the scores as JSON
    python sample.py --ckpt out/moe/ckpt.pt --routing            # MoE: which experts, when, where
    python sample.py --plot out/run                              # a run's curves -> out/run/loss.png

Sampling is flow.generate on the EMA weights (`--raw`: the trained ones; the same under train.py's default
`--ema 0`), decoded by the VAE where the model learnt latents. What scores the samples depends on the data (below
the banner; train.py's grids use the same code):
  * built-in shapes: every colour x shape x position in wordings never trained on, named by judge();
  * a names set (`python data.py emoji`): every name in an unseen wording; NameNet, a small CNN trained here on the
    real pictures alone (cached beside them), gives the features for retrieval top-1/top-5 (is the nearest real
    picture the named one?), FID/KID/IS, and sharpness (mean |Laplacian| over the real pictures');
  * any data: `--real` FID and IS against real shards (Inception, or any TorchScript `--features` file),
    `--clip-model` CLIPScore.
Checkpoints load with weights_only=True: tensors and plain values only, so loading runs no pickled code.
"""
import argparse
import collections
import json
import os
import random
import sys
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

import data
import flow
from model import DiT, TextEncoder, atomic_write, cannot_load, device, load_vae, need_folder, read_json
from moe import MoE, default_impl


def get_args(argv=None):
    p = argparse.ArgumentParser(description="Sample images from a trained MM-DiT checkpoint.")
    a = p.add_argument
    a("--ckpt", help="checkpoint written by train.py (<out>/ckpt.pt)")
    a("--plot", metavar="RUN_FOLDER", help="only draw RUN_FOLDER/loss.png from its log.jsonl")
    a("--prompt", action="append", help="caption to draw (repeatable); default: a few built-in ones")
    a("--n", type=int, default=4, help="samples per prompt")
    a("--size", help="WxH pixels to draw, e.g. 44x24 (default: the training square; --eval: each trained bucket)")
    a("--steps", type=int, default=25, help="Euler steps, t=1 (noise) to t=0")
    a("--cfg", type=float, default=2.0, help="classifier-free guidance scale w (1 = none, 0 = ignore the caption)")
    a("--seed", type=int, default=0, help="noise seed (same seed, same pictures)")
    a("--out", help="PNG path (default: next to the checkpoint)")
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
    args = p.parse_args(argv)
    if args.plot:
        return args
    if not args.ckpt or not os.path.exists(args.ckpt):
        p.error(f"--ckpt {args.ckpt}: no such file; train first (python train.py) or point to <out>/ckpt.pt")
    if (args.real or args.clip_model) and not args.eval:
        p.error("--real and --clip-model are scores: add --eval")
    if args.size:
        wh = args.size.lower().split("x")
        if len(wh) != 2 or not all(v.isdigit() and int(v) > 0 for v in wh):
            p.error(f"--size {args.size}: give width x height in pixels, e.g. 44x24")
        args.size = tuple(map(int, wh))
    return args


def load(path, raw=False):
    """Checkpoint -> (eval-mode model, frozen text encoder, training flags); model.vae: the frozen VAE, or None."""
    dev = device()
    ckpt = torch.load(path, map_location=dev, weights_only=True)
    model = DiT(**dict(ckpt["config"], moe_impl=default_impl(dev))).to(dev)  # the dispatch that suits this device
    model.load_state_dict(ckpt["model" if raw else "ema"])
    model.vae = load_vae(ckpt["args"]["vae"], dev)  # (a plain attribute: not a submodule)
    model.t_shift = ckpt["args"]["t_shift"]  # sample on the time grid it was trained for
    model.buckets = ckpt["buckets"]  # [(W, H)] of a run on pictures of several aspect ratios, else None
    encoder = TextEncoder(ckpt["args"]["text_encoder"], device=dev)
    return model.eval().requires_grad_(False), encoder, ckpt["args"]


@torch.no_grad()
def draw(model, encoder, vae, captions, steps, cfg, seed, shift=1.0, batch=256, size=None):
    """Captions -> samples (N, 3, H, W) in [-1, 1] on the CPU, (W, H) = `size` in pixels (default: the training square),
    in batches whose noise comes from seed + i."""
    f, dev, out = vae.factor if vae else 1, next(model.parameters()).device, []
    W, H = size or (model.n_side * model.p * f,) * 2
    for i in range(0, len(captions), batch):
        x = flow.generate(model, encoder, captions[i:i + batch], steps, cfg, seed + i, (model.C, H // f, W // f), dev,
                          shift)
        out.append((x if vae is None else vae.decode(x)).cpu())
    return torch.cat(out)


def evaluate(model, encoder, vae, names, grid, n_each, steps, cfg, seed, shift=1.0, fid=False, judge=True, batch=256,
             size=None):
    """Every held-out prompt (built-in shapes), or every name of a names set, n_each times, at `size` (draw) -> the
    grid PNG and (scores, uint8 samples, captions): the judge's accuracies, or retrieval (+ FID/KID with `fid`) for
    names. A list of sizes (buckets): each in turn, grid_WxH.png, the mean scores and each bucket's under "WxH"."""
    if isinstance(size, (list, dict)):  # buckets (a dict: its keys), each in turn: "WxH" -> (scores, fake, captions)
        per = {"%dx%d" % b: evaluate(model, encoder, vae, names, grid.replace(".png", "_%dx%d.png" % b), n_each, steps,
                                     cfg, seed, shift, fid, judge, batch, tuple(b)) for b in size}
        scores = None
        if all(p[0] for p in per.values()):  # the mean over the buckets, and each bucket's own
            scores = {k: sum(p[0][k] for p in per.values()) / len(per) for k in next(iter(per.values()))[0]}
            scores.update((k, p[0]) for k, p in per.items())
        return scores, [x for p in per.values() for x in p[1]], [c for p in per.values() for c in p[2]]
    if names:
        want = torch.arange(len(names["names"])).repeat_interleave(n_each)
        captions = [names["heldout"].format(name=names["names"][i]) for i in want]
    else:
        prompts = data.heldout_prompts(n_each)
        captions = [p for p, _ in prompts]
    fake = as_uint8(draw(model, encoder, vae, captions, steps, cfg, seed, shift, batch, size))
    images = None if names else [to_pil(x) for x in fake]  # (the judge reads PIL images)
    try:
        if names:
            names_grid(fake, want, names["real"], grid)
        else:
            save_grid(images[:len(images) // n_each], grid, nrow=len(data.SHAPES) * len(data.POSITIONS))
    except OSError as e:  # a full disk must not end a training run over a picture
        print(f"warning: sample grid {grid} not written ({e}); going on", file=sys.stderr)
    if names:
        scores = score_names(fake, want, names, fid)
    else:
        scores = grade(images, [a for _, a in prompts]) if judge else None
    return scores, fake, captions


def report(scores, n, how):
    """Print evaluate()'s scores as a reader wants them."""
    p = lambda key: f"{100 * scores[key]:.1f}%"
    if "top1" not in scores:
        return print(f"caption accuracy of {n} samples of held-out prompts ({how}): " +
                     " ".join(f"{k} {p(k)}" for k in ("color", "shape", "position", "all")) +
                     "".join(f" | {k}: all {100 * v['all']:.1f}%" for k, v in scores.items() if isinstance(v, dict)))
    fid = f" | FID {scores['fid']:.1f}, KID {scores['kid']:.4f} (NameNet features)" if "fid" in scores else ""
    print(f"{n} samples of the held-out wording ({how}): retrieval top-1 {p('top1')} top-5 {p('top5')} (chance "
          f"{p('chance1')} / {p('chance5')}; the real pictures' near misses {p('ceiling_top1')} / "
          f"{p('ceiling_top5')}) | sharpness {scores['sharpness']:.2f}x the real pictures'{fid}")


def as_uint8(x):
    """Images in [-1, 1], (N, 3, H, W) or (3, H, W) -> uint8: what PNGs and every feature network here take."""
    return ((x.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


def to_pil(x):
    """(3, H, W) tensor, uint8 or in [-1, 1] -> PIL image."""
    return Image.fromarray((x if x.dtype == torch.uint8 else as_uint8(x)).permute(1, 2, 0).cpu().numpy())


def stack_uint8(images, size):
    """PIL images -> uint8 (N, 3, size, size), each cropped by to_tensor as a training image is."""
    return as_uint8(torch.stack([data.to_tensor(im, size) for im in images]))


def save_grid(images, path, nrow=8, scale=2):
    """Tile PIL images into one PNG (upscaled with nearest so 32-px pixels stay visible)."""
    w, h = images[0].size
    cols, rows = min(nrow, len(images)), (len(images) + nrow - 1) // nrow
    grid = Image.new("RGB", (cols * w, rows * h))
    for i, im in enumerate(images):
        grid.paste(im, ((i % nrow) * w, (i // nrow) * h))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    grid = grid.resize((cols * w * scale, rows * h * scale), Image.NEAREST)
    atomic_write(path, lambda f: grid.save(f, "PNG"))


def main(argv=None):
    args = get_args(argv)
    if args.plot:
        plot_run(args.plot)
        return print(f"{os.path.join(args.plot, 'loss.png')} drawn from its log.jsonl")
    model, encoder, targs = load(args.ckpt, args.raw)
    out = lambda name: args.out or os.path.join(os.path.dirname(args.ckpt), name)  # default: beside the checkpoint
    if args.routing:
        return routing_maps(model, encoder, targs["image_size"], args.out or os.path.dirname(args.ckpt), args.seed)
    m = model.p * (model.vae.factor if model.vae else 1)  # a patch, in pixels
    if args.size and (args.size[0] % m or args.size[1] % m or max(args.size) > model.n_max * m):
        raise SystemExit(f"--size {args.size[0]}x{args.size[1]}: this model draws sides that are multiples of {m} "
                         f"pixels (its patch, times the VAE's factor), up to {model.n_max * m}; it was trained at "
                         + ("%dx%d" % ((model.n_side * m,) * 2) if not model.buckets else
                            " ".join("%dx%d" % tuple(b) for b in model.buckets)))
    fakes = lambda captions: as_uint8(draw(model, encoder, model.vae, captions, args.steps, args.cfg, args.seed,
                                           model.t_shift, args.batch, args.size))  # (N, 3, H, W) uint8
    if not args.eval:
        prompts = args.prompt or ["a red circle in the top left", "a blue square in the center",
                                  "a yellow triangle in the bottom right", "a white circle in the top right"]
        fake = fakes([p for p in prompts for _ in range(args.n)])
        save_grid([to_pil(x) for x in fake], out("samples.png"), nrow=args.n)
        return print(f"{len(fake)} samples ({len(prompts)} prompts x {args.n}, one row each) -> {out('samples.png')}")
    nets = feature_nets(args.features, args.inception_weights) if args.real else None  # fail before sampling
    clip = load_clip(args.clip_model) if args.clip_model else None
    names, scores, fake = names_set(targs["data"], targs["image_size"]), {}, None
    if names or targs["data"] in (data.BUILTIN, data.MIXED):  # the judge, or retrieval against the named pictures
        grid = out(f"eval_{args.steps}steps_cfg{args.cfg:g}.png")
        scores, fake, captions = evaluate(model, encoder, model.vae, names, grid, args.eval_n, args.steps, args.cfg,
                                          args.seed, model.t_shift, fid=bool(names), batch=args.batch,
                                          size=[args.size] if args.size else model.buckets)
        report(scores, len(fake), f"{args.steps} Euler steps, cfg {args.cfg}; grid: {grid}")
        scores["n"] = len(fake)
    elif not (args.real or args.clip_model):
        raise SystemExit("--eval: the judge knows only the built-in data and sets with a names.json (python "
                         "data.py emoji); for this checkpoint pass --real and/or --clip-model")
    if args.real:  # FID/IS: the real captions drawn, then set against the real images
        real, captions = real_images(args.real, targs["image_size"], args.real_n, args.seed)
        fake = fakes(captions)
        scores.update(fid_is(real, fake, nets, args.batch), n_real=len(real))
        print(f"FID {scores['fid']:.2f}, IS {scores['inception_score']:.2f} +- {scores['inception_score_std']:.2f}"
              f": {len(real)} real images of {args.real} and as many samples of their captions ({args.features})")
    if args.clip_model:  # on the samples above, or else on the --prompt ones
        if fake is None and not args.prompt:
            raise SystemExit("--clip-model needs captions to score: pass --real or --prompt")
        if fake is None:
            captions = [p for p in args.prompt for _ in range(args.n)]
            fake = fakes(captions)
        scores["clip_score"] = clip_score(fake, captions, clip, args.batch)
        print(f"CLIPScore {scores['clip_score']:.2f} over {len(fake)} samples ({args.clip_model})")
    print(json.dumps(dict(scores, steps=args.steps, cfg=args.cfg)))
    return scores


# ==== What a first read may skip: the scorers (the judge, NameNet, FID/IS, CLIPScore), routing maps, loss.png =====
def judge(img):
    """PIL image or uint8 (H, W, 3) array -> dict(color, shape, position); None where nothing is seen."""
    from scipy import ndimage
    a = np.asarray(img.convert("RGB") if isinstance(img, Image.Image) else img, dtype=np.float32)
    H, W, _ = a.shape
    border = np.concatenate([a[0], a[-1], a[:, 0], a[:, -1]])
    diff = np.abs(a - np.median(border, axis=0)).max(-1)  # distance from the background colour
    labels, n = ndimage.label(diff > 60)  # 4-connected blobs: the largest is the shape, the rest noise specks
    mask = labels == 1 + np.bincount(labels.ravel())[1:].argmax() if n else labels > 0
    if mask.sum() < 0.01 * H * W:
        return dict(color=None, shape=None, position=None)
    core = mask & (diff > 0.5 * diff[mask].max())  # skip antialiased rim pixels for the colour
    rgb = a[core].mean(0)
    color = min(data.COLORS, key=lambda k: np.sum((rgb - np.array(data.COLORS[k])) ** 2))
    # shape: which ideal shape, drawn in the blob's bounding box, overlaps it best (IoU)
    ys, xs = np.nonzero(mask)
    y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
    yy, xx = np.mgrid[0:H, 0:W] + 0.5
    cx, cy, rx, ry = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2, (y1 - y0) / 2
    inbox = (xx >= x0) & (xx <= x1) & (yy >= y0) & (yy <= y1)
    ideal = {"circle": ((xx - cx) / rx) ** 2 + ((yy - cy) / ry) ** 2 <= 1, "square": inbox,
             "triangle": inbox & (np.abs(xx - cx) <= rx * (yy - y0) / (y1 - y0))}
    iou = {k: (m & mask).sum() / (m | mask).sum() for k, m in ideal.items()}
    fx, fy = (x0 + x1) / 2 / W, (y0 + y1) / 2 / H  # box centre (a triangle's centroid sits low)
    position = min(data.POSITIONS, key=lambda k: (data.POSITIONS[k][0] - fx) ** 2 + (data.POSITIONS[k][1] - fy) ** 2)
    return dict(color=color, shape=max(iou, key=iou.get), position=position)


def grade(images, attrs):
    """Judge each image against its intended attributes -> accuracies (0..1) per attribute and all three."""
    keys, hits = ("color", "shape", "position"), collections.Counter()
    for img, want in zip(images, attrs):
        got = judge(img)
        ok = {k: got[k] == want[k] for k in keys}
        hits.update(dict(ok, all=all(ok.values())))
    return {k: hits[k] / max(len(attrs), 1) for k in keys + ("all",)}


class NameNet(torch.nn.Module):
    """A small CNN trained here on the real pictures alone to tell the names apart: uint8 (N, 3, H, W) -> (features
    (N, 4w), logits (N, names)). Not Inception: its FID compares runs on one set, not with published numbers."""

    def __init__(self, n_names, w=16):
        super().__init__()
        conv = lambda i, o: [torch.nn.Conv2d(i, o, 3, padding=1), torch.nn.GroupNorm(8, o), torch.nn.SiLU()]
        self.body = torch.nn.Sequential(*conv(3, w), torch.nn.AvgPool2d(2), *conv(w, 2 * w), *conv(2 * w, 2 * w),
                                        torch.nn.AvgPool2d(2), *conv(2 * w, 4 * w), *conv(4 * w, 4 * w),
                                        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())  # 32 px: ~15 MFLOP
        self.head = torch.nn.Linear(4 * w, n_names)

    def forward(self, x):
        f = self.body(x.float() / 127.5 - 1)
        return f, self.head(f)


def views(x, g):
    """Random views of uint8 pictures, like a sampler's near misses: shifted (up to 1/16 of the side),
    scaled by 0.85-1.15, half of them blurred, all with Gaussian noise of a random strength (sigma <= 0.2)."""
    n, x = len(x), x.float() / 127.5 - 1
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0] = theta[:, 1, 1] = 1 / torch.empty(n).uniform_(0.85, 1.15, generator=g)
    theta[:, :, 2] = torch.empty(n, 2).uniform_(-0.125, 0.125, generator=g)  # (grid units: 2 = the side)
    x = F.grid_sample(x, F.affine_grid(theta, x.shape, align_corners=False), padding_mode="border", align_corners=False)
    x = torch.where(torch.rand(n, 1, 1, 1, generator=g) < 0.5, F.avg_pool2d(x, 3, 1, 1, count_include_pad=False), x)
    return as_uint8(x + torch.randn(x.shape, generator=g) * torch.rand(n, 1, 1, 1, generator=g) * 0.2)


def names_set(folder, size):
    """A names set (`python data.py emoji` writes names.json beside its shards) with its one real picture per name,
    prepared as the converter prepares it, as uint8 (N, 3, size, size) under "real"; None for other data."""
    names = read_json(os.path.join(folder, "names.json")) if os.path.isdir(folder) else None  # (also 'builtin')
    if names is None:
        return None
    real = stack_uint8([data.open_image(os.path.join(folder, p)) for p in names["images"]], size)
    return dict(names, root=folder, real=real)


def name_net(names, steps=1000, batch=64, seed=0):
    """NameNet for a names set at its pictures' size, trained on views() of them on first use, then cached."""
    real = names["real"]
    path = os.path.join(names["root"], f"namenet{real.shape[-1]}.pt")
    with torch.random.fork_rng():  # its init must not move the caller's random stream (a training run's)
        torch.manual_seed(seed)
        net = NameNet(len(real))
    saved = torch.load(path, weights_only=True) if os.path.exists(path) else None
    if saved and saved["names"] == names["names"]:
        net.load_state_dict(saved["state"])
        return net.eval()
    from tqdm import tqdm
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 2e-3, total_steps=steps)
    for _ in tqdm(range(steps), desc=f"training the name classifier on {len(real)} real pictures", unit="step"):
        idx = torch.randint(len(real), (batch,), generator=g)
        with torch.enable_grad():  # (score_names runs under no_grad)
            loss = F.cross_entropy(net(views(real[idx], g))[1], idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    torch.save(dict(state=net.state_dict(), names=names["names"]), path)
    return net.eval()


def laplacian(x):
    """Mean |Laplacian| of uint8 pictures: high-frequency energy (speckle, noise, hard edges)."""
    k = torch.tensor([[0., 1, 0], [1, -4, 1], [0, 1, 0]]).expand(3, 1, 3, 3)
    return F.conv2d(x.float() / 255, k, groups=3).abs().mean().item()


@torch.no_grad()
def score_names(fake, want, names, fid=True):
    """uint8 samples of the names `want` (indices) -> retrieval top-1/top-5 (is the nearest real picture, by cosine
    in NameNet's features, the captioned one?), chance, the ceiling (the same for views() of the real pictures),
    sharpness (÷ the real pictures'; 1 = as smooth as the data) and FID/KID/IS."""
    real, net = names["real"], name_net(names)
    ref = F.normalize(net(real)[0], dim=1)  # (names, features)

    def top(x, want):
        sim = F.normalize(net(x)[0], dim=1) @ ref.T  # (n, names)
        rank = (sim > sim.gather(1, want[:, None])).sum(1)  # how many names beat the right one
        return (rank < 1).float().mean().item(), (rank < 5).float().mean().item()

    out = dict(zip(("top1", "top5"), top(fake, want)), chance1=1 / len(real), chance5=min(1, 5 / len(real)))
    ceiling = top(views(real, torch.Generator().manual_seed(1)), torch.arange(len(real)))
    out.update(ceiling_top1=ceiling[0], ceiling_top5=ceiling[1], sharpness=laplacian(fake) / laplacian(real[want]))
    if fid:
        out.update(fid_is(real, fake, (Pick(net, 0), Pick(net, 1))))
    return out


def names_grid(fake, want, real, path, cols=12, blocks=2):
    """Real vs generated: `blocks` x `cols` names spread over the set, the real picture above the first sample."""
    first = {i: j for j, i in reversed(list(enumerate(want.tolist())))}  # name -> its first sample
    pick = sorted(first)[::max(1, len(first) // (cols * blocks))][:cols * blocks]
    rows = [pick[b * cols:(b + 1) * cols] for b in range(blocks)]
    pil = [to_pil(x) for r in rows for x in [*real[r], *fake[[first[i] for i in r]]]]
    save_grid(pil, path, nrow=len(rows[0]), scale=3)


def real_images(shards, size, n, seed=0):
    """n samples of raw shards (shuffled, bad ones skipped) -> (uint8 (n, 3, size, size), their captions)."""
    images, captions = [], []
    for b in data.ShardStream(data.resolve_shards(shards, size), 1, size, seed=seed):
        if "image" not in b:
            raise SystemExit(f"--real {shards!r}: precomputed shards hold no images; pass raw {{jpg|png, txt}} shards")
        images.append(b["image"][0])
        captions.append(b["caption"][0])
        if len(images) == n:
            break
    if len(images) < 2:
        raise SystemExit(f"--real {shards!r}: FID needs at least 2 real images, found {len(images)}")
    return as_uint8(torch.stack(images)), captions


class Pick(torch.nn.Module):
    """Output i of a network returning (features, logits), or its only output: FID takes 0, IS takes 1."""

    def __init__(self, net, i):
        super().__init__()
        self.net, self.i = net, i

    def forward(self, x):
        out = self.net(x)
        return out[self.i] if isinstance(out, (tuple, list)) else out


def feature_nets(spec, weights=None):
    """--features -> (network for FID, network for IS), both on the CPU, both taking uint8 (N, 3, H, W). Where
    torchvision imports, torch-fidelity's InceptionV3 traces once into a `--features` file that runs anywhere:

        import torch
        from torchmetrics.image.fid import NoTrainInceptionV3
        class Both(torch.nn.Module):  # uint8 images -> (pool3 features, unbiased logits)
            def __init__(self):
                super().__init__()
                self.net = NoTrainInceptionV3("inception-v3-compat", ["2048", "logits_unbiased"])
            def forward(self, x):
                return self.net._torch_fidelity_forward(x)
        torch.jit.save(torch.jit.trace(Both(), torch.zeros(2, 3, 32, 32, dtype=torch.uint8)), "inception.pt")
    """
    if spec != "inception":
        try:
            net = torch.jit.load(spec, map_location="cpu").eval()
        except (OSError, RuntimeError, ValueError) as e:
            raise SystemExit(f"--features {spec!r} could not be loaded as TorchScript ({e}); pass a file written by "
                             f"torch.jit.save, or 'inception'") from e
        return Pick(net, 0), Pick(net, 1)
    try:
        from torchmetrics.image.fid import NoTrainInceptionV3  # torch-fidelity's network, weights from torch.hub
        return tuple(NoTrainInceptionV3("inception-v3-compat", [f], weights) for f in ("2048", "logits_unbiased"))
    except Exception as e:  # torch-fidelity/torchvision missing, or the weights neither local nor downloadable
        raise SystemExit(f"--features inception could not be loaded ({type(e).__name__}: {str(e)[:300]}).\nIt "
                         f"needs `pip install torch-fidelity` (which needs a torchvision matching your torch) and "
                         f"its weights: --inception-weights FILE, or weights-inception-2015-12-05-6726825d.pth in "
                         f"{torch.hub.get_dir()}/checkpoints. Or, where that works, export it once with "
                         f"torch.jit.trace and pass --features FILE.pt (sample.feature_nets' docstring: how).") from e


@torch.no_grad()
def fid_is(real, fake, nets, batch=256):
    """uint8 real and fake images, feature_nets() -> dict(fid, kid, kid_std, inception_score, inception_score_std).
    KID (Binkowski et al. 2018): squared MMD of features, cubic kernel, 100 subsets; unbiased at small n, unlike FID."""
    from torchmetrics.image.fid import FrechetInceptionDistance  # (from their modules: torchmetrics.image lists
    from torchmetrics.image.inception import InceptionScore      # these only when torch-fidelity is installed)
    from torchmetrics.image.kid import KernelInceptionDistance
    dev = device()
    fid = FrechetInceptionDistance(nets[0].cpu(), input_img_size=tuple(real.shape[1:])).to(dev)  # probed on the CPU
    splits = max(1, min(10, len(fake) // 100))  # the usual 10 splits, each of at least 100 images
    with warnings.catch_warnings(action="ignore"):  # IS: "keeps every feature" (MBs here), "std of one split"
        iscore = InceptionScore(nets[1], splits=splits).to(dev)
        size = max(2, min(1000, len(real) // 2, len(fake) // 2))  # half: subsets differ, so its std means something
        kid = KernelInceptionDistance(nets[0], subset_size=size).to(dev)
        for images, is_real in ((real, True), (fake, False)):
            for i in range(0, len(images), batch):
                x = images[i:i + batch].to(dev)
                fid.update(x, real=is_real)
                kid.update(x, real=is_real)
                if not is_real:
                    iscore.update(x)
        mean, std = iscore.compute()
        kid_mean, kid_std = kid.compute()
    return dict(fid=fid.compute().item(), kid=kid_mean.item(), kid_std=kid_std.item(), inception_score=mean.item(),
                inception_score_std=std.nan_to_num().item())


def load_clip(name):
    """--clip-model -> (a transformers CLIPModel, its CLIPProcessor); hub ids and local folders alike."""
    from transformers import CLIPModel, CLIPProcessor
    need_folder("--clip-model", name)
    try:
        return CLIPModel.from_pretrained(name).eval().to(device()), CLIPProcessor.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise SystemExit(cannot_load("--clip-model", name, e)) from e


@torch.no_grad()
def clip_score(images, captions, clip, batch=256):
    """uint8 images, their captions, load_clip() -> CLIPScore (Hessel et al. 2021): the mean over pairs of
    max(100 cos(image embedding, caption embedding), 0)."""
    model, processor, scores = *clip, []
    for i in range(0, len(images), batch):
        x = processor(text=captions[i:i + batch], images=list(images[i:i + batch]), return_tensors="pt",
                      padding=True, truncation=True).to(device())
        out = model(**x)
        scores.append((100 * F.cosine_similarity(out.image_embeds, out.text_embeds)).clamp(min=0))
    return torch.cat(scores).mean().item()


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
    by = {"timestep": torch.zeros(L, t_bins, E), "colour": torch.zeros(L, len(data.COLORS), E),
          "shape": torch.zeros(L, len(data.SHAPES), E), "position": torch.zeros(L, E, n * n)}
    col = torch.tensor([list(data.COLORS).index(a["color"]) for _, a in prompts])
    shp = torch.tensor([data.SHAPES.index(a["shape"]) for _, a in prompts])
    g = torch.Generator().manual_seed(seed)
    for b in range(t_bins):
        t = torch.full((len(prompts),), (b + 0.5) / t_bins)
        model(flow.interpolate(x0, torch.randn(x0.shape, generator=g), t).to(dev), t.to(dev), text, mask)
        for l, m in enumerate(layers):
            hits = F.one_hot(m.stats["idx"].cpu().view(len(prompts), n * n, -1), E).sum(2).float()  # (P, N, E)
            by["timestep"][l, b] += hits.sum((0, 1))
            by["colour"][l].index_add_(0, col, hits.sum(1))
            by["shape"][l].index_add_(0, shp, hits.sum(1))
            by["position"][l] += hits.sum(0).T
    labels = {"timestep": [f"t~{(b + 0.5) / t_bins:.1f}" for b in range(t_bins)], "colour": list(data.COLORS),
              "shape": data.SHAPES}
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


def plot_run(folder):
    """<folder>/log.jsonl -> <folder>/loss.png: loss (and per t-quarter), learning rate, the grids' scores and, for an
    MoE, each layer's least and most loaded expert, against the step -> {curve name: (steps, values)}, as drawn.
    train.py redraws it with every grid; a full disk only warns (it must not end a training run over a picture)."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt
    path = os.path.join(folder, "log.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"no log.jsonl in {folder}: pass a run folder (train.py --out), e.g. out/run")
    steps, scores = {}, {}
    with open(path) as f:
        for rec in map(json.loads, f):  # after a resume the same steps come again: the last line wins
            if "loss" in rec:
                steps[rec["step"]] = rec
            elif rec.get("sample_acc") or rec.get("eval"):  # (None where no judge scores the data)
                scores[rec["step"]] = rec.get("sample_acc") or rec["eval"]
    recs = [steps[s] for s in sorted(steps)]
    x = [r["step"] for r in recs]
    curves = {"loss": (x, [r["loss"] for r in recs]), "lr": (x, [r["lr"] for r in recs])}
    for q in range(4):
        curves[f"loss, t in [{q / 4:g}, {(q + 1) / 4:g})"] = (x, [r["loss_t_bins"][q] for r in recs])  # t=0: data
    for key in ("all", "top1", "top5"):  # the judge's "all three", or retrieval on a named-picture set
        if any(s and key in s for s in scores.values()):
            curves[key] = (sorted(scores), [scores[s][key] for s in sorted(scores)])
    moe = [r for r in recs if r.get("routing")]
    for i in range(len(moe[-1]["routing"]) if moe else 0):
        for name, pick in (("min", min), ("max", max)):
            curves[f"layer {i} {name} load"] = ([r["step"] for r in moe], [pick(r["routing"][i]["load"]) for r in moe])
    nan = lambda v: float("nan") if v is None else v  # (a skipped step logs null)
    fig, axes = plt.subplots(1, 4 if moe else 3, figsize=(16 if moe else 12, 3.4))
    for name, (xs, ys) in curves.items():
        panel = 0 if name.startswith("loss") else 1 if name == "lr" else 3 if "load" in name else 2
        axes[panel].plot(xs, [nan(v) for v in ys], "k-" if name == "loss" else ".-" if panel == 2 else "-", lw=1,
                         label=name)
    titles = ("flow loss (log scale)", "learning rate", "sample scores", "expert load: min / max per layer")
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=10), ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    axes[2].set_ylim(0, 1.02)
    fig.tight_layout()
    try:
        atomic_write(os.path.join(folder, "loss.png"), lambda f: fig.savefig(f, format="png", dpi=80))
    except OSError as e:
        print(f"warning: {folder}/loss.png not written ({e}); going on", file=sys.stderr)
    drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for ax in axes for line in ax.lines}
    plt.close(fig)
    return drawn


if __name__ == "__main__":
    main()
