"""sample.py -- prompts -> a PNG grid, and `--eval`: how often do samples show what they were asked?

    python sample.py --ckpt out/run/ckpt.pt --prompt "a red circle in the top left" --n 8
    python sample.py --ckpt out/run/ckpt.pt --eval --steps 8     # last line: JSON accuracies
    python sample.py --ckpt out/moe/ckpt.pt --routing            # MoE: which experts, when, where
    python sample.py --plot out/run                              # the run's curves -> out/run/loss.png

`--eval` on the built-in data samples (EMA weights) every colour x shape x position in wordings never seen in
training (data.HELDOUT_TEMPLATES); the judge (data.judge) names what each picture shows. Checkpoints load
with weights_only=True: tensors and plain Python values only, so loading runs no pickled code.

A set of named real pictures (`python data.py emoji OUT`, which writes OUT/names.json) is scored without any
download: every name is drawn in an unseen wording, and a small CNN trained here on the real pictures alone
(NameNet, cached as OUT/namenet<size>.pt) gives its features to
  * retrieval top-1/top-5: is the real picture nearest a sample (cosine) the one its caption names? Printed
    with chance and the ceiling (shifted, blurred, noised views of the real pictures); `--cfg 0` is the floor;
  * FID, KID and IS in those features: comparable between runs on one set, not with published (Inception) ones;
  * sharpness: mean |Laplacian| of the samples / of the real pictures (1 = as smooth as the data; noise > 1, blur < 1).

Metrics for any data (torchmetrics), added to the same JSON line (the judge stays for built-in data):
    python sample.py --ckpt ... --eval --real shards/ --features inception.pt --clip-model openai/clip-vit-base-patch32
  * `--real`: FID and IS of samples of real shards' captions against their images. `--features net.pt`: a
    TorchScript file, uint8 (N, 3, H, W) -> features, or (features, logits): FID uses the first, IS the second.
  * `--features inception`: torchmetrics' InceptionV3. It needs torch-fidelity, hence torchvision, whose PyPI
    wheels are built for CUDA torch (beside the pinned CPU build they fail to import; the newest pulls in a newer
    torch, GBs), so it is not in requirements.txt. Where torchvision works, install torch-fidelity (weights:
    --inception-weights FILE, or torch.hub's cache), or trace it there once into a file that runs anywhere:
        from torchmetrics.image.fid import NoTrainInceptionV3
        class Both(torch.nn.Module):  # uint8 images -> (pool3 features, unbiased logits)
            def __init__(self):
                super().__init__()
                self.net = NoTrainInceptionV3("inception-v3-compat", ["2048", "logits_unbiased"])
            def forward(self, x):
                return self.net._torch_fidelity_forward(x)
        torch.jit.save(torch.jit.trace(Both(), torch.zeros(2, 3, 32, 32, dtype=torch.uint8)), "inception.pt")
  * `--clip-model`: CLIPScore, a hub id or a local folder holding a transformers CLIPModel + CLIPProcessor.
"""
import argparse
import json
import os
import random
import warnings

import torch
import torch.nn.functional as F

import data
import flow
from model import DiT, TextEncoder, cannot_load, device, load_vae
from moe import MoE, default_impl


def get_args(argv=None):
    p = argparse.ArgumentParser(description="Sample images from a trained MM-DiT checkpoint.")
    p.add_argument("--ckpt", help="checkpoint written by train.py (<out>/ckpt.pt)")
    p.add_argument("--plot", metavar="RUN_FOLDER", help="only draw RUN_FOLDER/loss.png from its log.jsonl (losses, LR, "
                   "sample scores, MoE expert loads)")
    p.add_argument("--prompt", action="append", help="caption to draw (repeatable); default: a few built-in ones")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--steps", type=int, default=25, help="Euler steps, t=1 (noise) to t=0; 50 scored the same (README)")
    p.add_argument("--cfg", type=float, default=3.0, help="classifier-free guidance scale w (1 = none, 0 = ignore the "
                   "caption); README: 3 suits shapes and real pictures, 5 speckles")
    p.add_argument("--seed", type=int, default=0, help="noise seed (same seed, same pictures)")
    p.add_argument("--out", help="PNG grid path (default: next to the checkpoint)")
    p.add_argument("--eval", action="store_true", help="score samples (judge, --real, --clip-model); last line: JSON")
    p.add_argument("--eval-n", type=int, default=2, help="--eval: samples per colour x shape x position, or per name")
    p.add_argument("--real", help="--eval: raw shards {jpg|png, txt} (folder, comma-separated .tar paths, or "
                   "'builtin'): FID + IS of samples of their captions against their images")
    p.add_argument("--real-n", type=int, default=1000, help="--real: real images (and samples); FID is biased up at "
                   "small n: compare runs at the same n")
    p.add_argument("--features", default="inception", help="--real: 'inception' (torchmetrics'; needs torch-fidelity) "
                   "or a TorchScript file, uint8 (N,3,H,W) -> features or (features, logits)")
    p.add_argument("--inception-weights", help="--features inception's weights (default: $TORCH_HOME/hub/checkpoints/)")
    p.add_argument("--clip-model", help="--eval: CLIPScore with this CLIP: hub id or CLIPModel + CLIPProcessor folder")
    p.add_argument("--routing", action="store_true", help="MoE checkpoints: save expert-choice heatmaps (PNG)")
    p.add_argument("--raw", action="store_true", help="use the raw weights instead of the EMA weights")
    p.add_argument("--batch", type=int, default=256, help="prompts per sampling batch (memory bound)")
    args = p.parse_args(argv)
    if args.plot:
        return args
    if not args.ckpt or not os.path.exists(args.ckpt):
        p.error(f"--ckpt {args.ckpt}: no such file; train first (python train.py) or point to <out>/ckpt.pt")
    if (args.real or args.clip_model) and not args.eval:
        p.error("--real and --clip-model are scores: add --eval")
    return args


def load(path, raw=False):
    """Checkpoint -> (eval-mode model, frozen text encoder, training flags); model.vae: the frozen VAE, or None."""
    dev = device()
    ckpt = torch.load(path, map_location=dev, weights_only=True)
    model = DiT(**dict(ckpt["config"], moe_impl=default_impl(dev))).to(dev)  # the dispatch that suits this device
    model.load_state_dict(ckpt["model" if raw else "ema"])
    model.vae = load_vae(ckpt["args"].get("vae", "none"), dev)  # (a plain attribute: not a submodule)
    model.t_shift = ckpt["args"].get("t_shift", 1.0)  # sample on the time grid it was trained for
    encoder = TextEncoder(ckpt["args"]["text_encoder"], device=dev)
    return model.eval().requires_grad_(False), encoder, ckpt["args"]


def sample(model, encoder, prompts, args):
    """All prompts, sampled in batches of --batch (latents decoded by the VAE) -> list of PIL images."""
    images, C, n = [], model.C, model.n_side * model.p  # the model's own input (channels, side)
    for i in range(0, len(prompts), args.batch):
        x = flow.generate(model, encoder, prompts[i:i + args.batch], args.steps, args.cfg, seed=args.seed + i,
                          shape=(C, n, n), device=next(model.parameters()).device, shift=model.t_shift)
        images += [data.to_pil(im) for im in (x if model.vae is None else model.vae.decode(x))]
    return images


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


# -----------------------------------------------------------------------------------------------
# Metrics (torchmetrics): FID and Inception Score against real shards, CLIPScore against prompts
# -----------------------------------------------------------------------------------------------
def real_images(shards, size, n, seed=0):
    """n samples (shuffled, bad ones skipped by data.ShardStream) -> (uint8 (n, 3, size, size), captions)."""
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
    return data.as_uint8(torch.stack(images)), captions


class Pick(torch.nn.Module):
    """Output i of a network returning (features, logits), or its only output: FID takes 0, IS takes 1."""

    def __init__(self, net, i):
        super().__init__()
        self.net, self.i = net, i

    def forward(self, x):
        out = self.net(x)
        return out[self.i] if isinstance(out, (tuple, list)) else out


def feature_nets(spec, weights=None):
    """--features -> (network for FID, network for IS), both on the CPU, both taking uint8 (N, 3, H, W)."""
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
                         f"torch.jit.trace and pass --features FILE.pt (see this file's docstring).") from e


@torch.no_grad()
def fid_is(real, fake, nets, batch=256):
    """uint8 real and fake images, feature_nets() -> dict(fid, kid, kid_std, inception_score, inception_score_std).
    KID (Binkowski et al. 2018): squared MMD of features, cubic kernel, 100 subsets; unbiased at small n, unlike FID."""
    # from their own modules: torchmetrics.image lists these when torch-fidelity is installed
    from torchmetrics.image.fid import FrechetInceptionDistance
    from torchmetrics.image.inception import InceptionScore
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


# -----------------------------------------------------------------------------------------------
# Named real pictures (`python data.py emoji`): retrieval, FID/KID and sharpness, no download
# -----------------------------------------------------------------------------------------------
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
    return data.as_uint8(x + torch.randn(x.shape, generator=g) * torch.rand(n, 1, 1, 1, generator=g) * 0.2)


def real_names(names, size):
    """The set's one picture per name, prepared as the converter prepares it -> uint8 (N, 3, size, size)."""
    return data.stack_uint8([data.open_image(os.path.join(names["root"], p)) for p in names["images"]], size)


def name_net(names, real, steps=1000, batch=64, seed=0):
    """NameNet for this set at this size, trained on views() of the real pictures (cached beside them)."""
    path = os.path.join(names["root"], f"namenet{real.shape[-1]}.pt")
    with torch.random.fork_rng():  # its init must not move the caller's random stream (a training run's)
        torch.manual_seed(seed)
        net = NameNet(len(real))
    if os.path.exists(path):
        saved = torch.load(path, weights_only=True)
        if saved["names"] == names["names"]:
            net.load_state_dict(saved["state"])
            return net.eval()
    from tqdm import tqdm
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 2e-3, total_steps=steps)
    for _ in tqdm(range(steps), desc=f"training the name classifier on {len(real)} real pictures", unit="step"):
        idx = torch.randint(len(real), (batch,), generator=g)
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
def score_names(fake, want, names, real, fid=True):
    """uint8 samples of the names `want` (indices), real_names() (read once by the caller) -> retrieval top-1/top-5
    (is the nearest real picture, by cosine in NameNet's features, the captioned one?), chance, the ceiling (the same
    for views() of the real pictures), sharpness (÷ the real pictures'; 1 = as smooth as the data), FID/KID/IS."""
    net = name_net(names, real)
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
    from PIL import Image
    first = {i: j for j, i in reversed(list(enumerate(want.tolist())))}  # name -> its first sample
    pick = sorted(first)[::max(1, len(first) // (cols * blocks))][:cols * blocks]
    rows = [pick[b * cols:(b + 1) * cols] for b in range(blocks)]
    pil = [Image.fromarray(x.permute(1, 2, 0).numpy()) for r in rows for x in [*real[r], *fake[[first[i] for i in r]]]]
    data.save_grid(pil, path, nrow=len(rows[0]), scale=3)


def print_names(scores, n, args_text):
    """The scores of score_names() as a reader wants them."""
    p = lambda key: f"{100 * scores[key]:.1f}%"
    fid = (f" | FID {scores['fid']:.1f}, KID {scores['kid']:.4f} (NameNet features, not Inception)"
           if "fid" in scores else "")
    print(f"{n} samples of the held-out wording, {args_text}: retrieval top-1 {p('top1')} top-5 {p('top5')} (chance "
          f"{p('chance1')} / {p('chance5')}; real pictures' shifted, blurred, noised views {p('ceiling_top1')} / "
          f"{p('ceiling_top5')}) | sharpness {scores['sharpness']:.2f}x the real pictures'{fid}")


class CLIPFeatures(torch.nn.Module):
    """transformers 5 returns a ModelOutput from get_{image,text}_features where torchmetrics 1.9 wants
    the tensor (torchmetrics issue #3407, fixed after 1.9.0): hand over pooler_output, the projection."""

    def __init__(self, clip):
        super().__init__()
        self.clip, self.config = clip, clip.config

    def get_image_features(self, *a, **k):
        return self.clip.get_image_features(*a, **k).pooler_output

    def get_text_features(self, *a, **k):
        return self.clip.get_text_features(*a, **k).pooler_output


def load_clip(name):
    """--clip-model -> (model, processor) for torchmetrics' CLIPScore; hub ids and local folders alike."""
    from transformers import CLIPModel, CLIPProcessor
    try:
        return CLIPFeatures(CLIPModel.from_pretrained(name).eval()), CLIPProcessor.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise SystemExit(cannot_load("--clip-model", name, e)) from e


@torch.no_grad()
def clip_score(images, captions, clip, batch=256):
    """uint8 images, their captions, load_clip() -> CLIPScore: the mean of 100 * cos(image, text), floored at 0."""
    from torchmetrics.multimodal import CLIPScore
    metric = CLIPScore(model_name_or_path=lambda: clip)  # a callable: its own loader knows a few hub ids only
    dev = device()
    for i in range(0, len(images), batch):
        metric.update(list(images[i:i + batch].to(dev)), captions[i:i + batch])
    return metric.compute().item()


# -----------------------------------------------------------------------------------------------
# A run's curves: loss.png from log.jsonl (train.py redraws it with every grid; `--plot` any time)
# -----------------------------------------------------------------------------------------------
def plot_run(folder):
    """<folder>/log.jsonl -> <folder>/loss.png: loss (and per t-quarter), learning rate, the grids' scores and, for an
    MoE, each layer's least and most loaded expert, against the step -> {curve name: (steps, values)}, as drawn."""
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
    data.atomic_write(os.path.join(folder, "loss.png"), lambda f: fig.savefig(f, format="png", dpi=80))
    plt.close(fig)
    return curves


def main(argv=None):
    args = get_args(argv)
    if args.plot:
        plot_run(args.plot)
        return print(f"{os.path.join(args.plot, 'loss.png')} drawn from its log.jsonl")
    model, encoder, targs = load(args.ckpt, args.raw)
    size = targs["image_size"]
    beside_ckpt = lambda name: args.out or os.path.join(os.path.dirname(args.ckpt), name)  # default output path
    if args.routing:
        return routing_maps(model, encoder, size, args.out or os.path.dirname(args.ckpt), args.seed)
    if args.eval:
        scores, images, captions = {}, [], []
        nets = feature_nets(args.features, args.inception_weights) if args.real else None  # fail before sampling
        clip = load_clip(args.clip_model) if args.clip_model else None
        names = data.names_set(targs.get("data"))
        if names:  # named real pictures (python data.py emoji): retrieval, sharpness, FID/KID
            want = torch.arange(len(names["names"])).repeat_interleave(args.eval_n)
            captions = [names["heldout"].format(name=names["names"][i]) for i in want]
            fake = data.stack_uint8(sample(model, encoder, captions, args), size)
            out, real = beside_ckpt(f"eval_{args.steps}steps_cfg{args.cfg:g}.png"), real_names(names, size)
            names_grid(fake, want, real, out)
            scores.update(score_names(fake, want, names, real), n=len(want))
            print_names(scores, len(want),
                        f"{args.steps} Euler steps, cfg {args.cfg}; grid (real above generated): {out}")
        elif targs.get("data", data.BUILTIN) == data.BUILTIN:  # the built-in data keeps its judge
            prompts = data.heldout_prompts(args.eval_n)
            captions = [p for p, _ in prompts]
            images = sample(model, encoder, captions, args)
            acc = data.grade(images, [a for _, a in prompts])
            out = beside_ckpt(f"eval_{args.steps}steps.png")
            data.save_grid(images[:len(data.heldout_prompts(1))], out, nrow=len(data.SHAPES) * len(data.POSITIONS))
            print(f"{len(prompts)} held-out prompts, {args.steps} Euler steps, cfg {args.cfg}; grid: {out}")
            print("\n".join(f"  {k:9s} {100 * v:5.1f}%" for k, v in acc.items()))
            scores.update(acc, n=len(prompts))
        elif not (args.real or args.clip_model):
            raise SystemExit("--eval: the judge knows only the built-in data and sets with a names.json (python "
                             "data.py emoji); for this checkpoint pass --real and/or --clip-model")
        if args.real:  # FID/IS: the real captions drawn, then set against the real images
            real, captions = real_images(args.real, size, args.real_n, args.seed)
            images = sample(model, encoder, captions, args)
            scores.update(fid_is(real, data.stack_uint8(images, size), nets, args.batch), n_real=len(real))
            print(f"FID {scores['fid']:.2f}, IS {scores['inception_score']:.2f} +- {scores['inception_score_std']:.2f}"
                  f": {len(real)} real images of {args.real} and as many samples of their captions ({args.features})")
        if args.clip_model:  # on the samples above, or else on the --prompt ones
            if not images:
                if not args.prompt:
                    raise SystemExit("--clip-model needs captions to score: pass --real or --prompt")
                captions = [p for p in args.prompt for _ in range(args.n)]
                images = sample(model, encoder, captions, args)
            scores["clip_score"] = clip_score(data.stack_uint8(images, size), captions, clip, args.batch)
            print(f"CLIPScore {scores['clip_score']:.2f} over {len(images)} samples ({args.clip_model})")
        print(json.dumps(dict(scores, steps=args.steps, cfg=args.cfg)))
        return scores
    prompts = args.prompt or ["a red circle in the top left", "a blue square in the center",
                              "a yellow triangle in the bottom right", "a white circle in the top right"]
    images = sample(model, encoder, [p for p in prompts for _ in range(args.n)], args)
    out = beside_ckpt("samples.png")
    data.save_grid(images, out, nrow=args.n)
    print(f"{len(images)} samples ({len(prompts)} prompts x {args.n}, one row each) -> {out}")


if __name__ == "__main__":
    main()
