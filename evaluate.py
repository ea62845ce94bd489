"""evaluate.py -- how good are the samples? Scores that need no download, and the standard ones (FID, IS, CLIPScore).

    judge(image) -> {color, shape, position}          the built-in shapes: read off the picture by rule
    judge_accuracy(images, attributes)                how often each attribute, and all three, are right
    retrieval_scores(samples, names wanted, set)      a names set (python data.py emoji): is the nearest real picture,
                                                      in NameNet's features, the named one? top-1/5, sharpness, FID, KID
    fid_is(real, fake, feature networks)              FID (Heusel et al. 2017), KID (Binkowski et al. 2018), IS
    clip_score(images, captions, CLIP)                CLIPScore (Hessel et al. 2021): mean of max(100 cos, 0)

NameNet, a 5-layer CNN trained here on first use on views of the set's real pictures alone (cached beside them), gives
FIDs that compare runs on one set, not with published numbers. FID and IS on real photos take Inception (torch-fidelity)
or any TorchScript `--features` file; CLIPScore a CLIP folder or id. sample.py --eval draws; this file only scores.
"""
import collections
import os
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

import data
from data import as_uint8, read_json
from model import device, loading


# ---- The built-in shapes: a judge that reads colour, shape and position off a picture --------------------------------
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


def judge_accuracy(images, attrs):
    """Judge each image against its intended attributes -> accuracies (0..1) per attribute and all three."""
    keys, hits = ("color", "shape", "position"), collections.Counter()
    for seen, want in zip(map(judge, images), attrs):
        ok = {k: seen[k] == want[k] for k in keys}
        hits.update(dict(ok, all=all(ok.values())))
    return {k: hits[k] / max(len(attrs), 1) for k in keys + ("all",)}


# ---- A names set: retrieval in NameNet's features, sharpness, FID/KID ----------------------------------------------
def laplacian(x):
    """Mean |Laplacian| of uint8 pictures: high-frequency energy (speckle, noise, hard edges)."""
    k = torch.tensor([[0., 1, 0], [1, -4, 1], [0, 1, 0]]).expand(3, 1, 3, 3)
    return F.conv2d(x.float() / 255, k, groups=3).abs().mean().item()


@torch.no_grad()
def retrieval_scores(fake, want, names, fid=True):
    """uint8 samples of the names `want` (indices) -> retrieval top-1/top-5 by cosine in NameNet's features, chance,
    the ceiling (the same on views() of the real pictures), sharpness (÷ the real's: 1 = as smooth), FID/KID/IS."""
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


# ---- FID, KID, IS and CLIPScore: torchmetrics' and CLIP's definitions ---------------------------------------------
@torch.no_grad()
def fid_is(real, fake, nets, batch=256):
    """uint8 real and fake images, feature_nets() -> dict(fid, kid, kid_std, inception_score, inception_score_std).
    KID (Binkowski et al. 2018): squared MMD of features, cubic kernel, 100 subsets; unbiased at small n, unlike FID."""
    from torchmetrics.image.fid import FrechetInceptionDistance  # (from their modules: torchmetrics.image lists
    from torchmetrics.image.inception import InceptionScore      # these only when torch-fidelity is installed)
    from torchmetrics.image.kid import KernelInceptionDistance
    dev = device()
    fid = FrechetInceptionDistance(nets[0].cpu(), input_img_size=tuple(real.shape[1:])).to(dev)  # probed on the CPU
    with warnings.catch_warnings(action="ignore"):  # IS: "keeps every feature" (MBs here), "std of one split"
        iscore = InceptionScore(nets[1], splits=max(1, min(10, len(fake) // 100))).to(dev)  # the usual 10, >= 100 each
        size = max(2, min(1000, len(real) // 2, len(fake) // 2))  # half: subsets differ, so its std means something
        kid = KernelInceptionDistance(nets[0], subset_size=size).to(dev)
        for images, is_real in ((real, True), (fake, False)):
            for i in range(0, len(images), batch):
                x = images[i:i + batch].to(dev)
                fid.update(x, real=is_real)
                kid.update(x, real=is_real)
                if not is_real:
                    iscore.update(x)
        with torch.random.fork_rng(devices=[]):  # IS's splits and KID's subsets are random draws: the same ones on
            torch.manual_seed(0)                  # every call, whatever the caller drew before (train.py, sample.py)
            mean, std = iscore.compute()
            kid_mean, kid_std = kid.compute()
    return dict(fid=fid.compute().item(), kid=kid_mean.item(), kid_std=kid_std.item(), inception_score=mean.item(),
                inception_score_std=std.nan_to_num().item())


@torch.no_grad()
def clip_score(images, captions, clip, batch=256):
    """uint8 images, captions, load_clip() -> CLIPScore (Hessel et al. 2021): mean of max(100 cos(image, text), 0)."""
    model, processor, scores = *clip, []
    for i in range(0, len(images), batch):
        x = processor(text=captions[i:i + batch], images=list(images[i:i + batch]), return_tensors="pt",
                      padding=True, truncation=True).to(device())
        out = model(**x)
        scores.append((100 * F.cosine_similarity(out.image_embeds, out.text_embeds)).clamp(min=0))
    return torch.cat(scores).mean().item()


def print_scores(scores, n, how):
    """Print sample.score_heldout's scores as a reader wants them."""
    p = lambda key: f"{100 * scores[key]:.1f}%"
    if "top1" not in scores:
        return print(f"caption accuracy of {n} samples of held-out prompts ({how}): " +
                     " ".join(f"{k} {p(k)}" for k in ("color", "shape", "position", "all")) +
                     "".join(f" | {k}: all {100 * v['all']:.1f}%" for k, v in scores.items() if isinstance(v, dict)) +
                     f" | straightness {scores['straightness']:.4f}")
    fid = f" | FID {scores['fid']:.1f}, KID {scores['kid']:.4f} (NameNet features)" if "fid" in scores else ""
    print(f"{n} samples of the held-out wording ({how}): retrieval top-1 {p('top1')} top-5 {p('top5')} (chance "
          f"{p('chance1')} / {p('chance5')}; the real pictures' near misses {p('ceiling_top1')} / "
          f"{p('ceiling_top5')}) | sharpness {scores['sharpness']:.2f}x the real pictures'{fid} | straightness "
          f"{scores['straightness']:.4f}")


# ==== What a first read may skip: NameNet and its training views, the real pictures, loading the networks =========
class NameNet(torch.nn.Module):
    """A small CNN trained here on the real pictures alone to tell the names apart: uint8 (N, 3, H, W) -> (features
    (N, 4w), logits (N, names)). Not Inception: its FID compares runs on one set, not with published numbers."""

    def __init__(self, n_names, w=16):
        super().__init__()
        conv = lambda i, o: [torch.nn.Conv2d(i, o, 3, padding=1), torch.nn.GroupNorm(8, o), torch.nn.SiLU()]
        self.body = torch.nn.Sequential(*conv(3, w), torch.nn.AvgPool2d(2), *conv(w, 2 * w), *conv(2 * w, 2 * w),
                                        torch.nn.AvgPool2d(2), *conv(2 * w, 4 * w), *conv(4 * w, 4 * w),
                                        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        self.head = torch.nn.Linear(4 * w, n_names)

    def forward(self, x):
        f = self.body(x.float() / 127.5 - 1)
        return f, self.head(f)


def views(x, g):
    """Random views of uint8 pictures, like a sampler's near misses: shifted, scaled, half blurred, all noised."""
    n, x = len(x), x.float() / 127.5 - 1
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0] = theta[:, 1, 1] = 1 / torch.empty(n).uniform_(0.85, 1.15, generator=g)
    theta[:, :, 2] = torch.empty(n, 2).uniform_(-0.125, 0.125, generator=g)  # (grid units: 2 = the side)
    x = F.grid_sample(x, F.affine_grid(theta, x.shape, align_corners=False), padding_mode="border", align_corners=False)
    x = torch.where(torch.rand(n, 1, 1, 1, generator=g) < 0.5, F.avg_pool2d(x, 3, 1, 1, count_include_pad=False), x)
    return as_uint8(x + torch.randn(x.shape, generator=g) * torch.rand(n, 1, 1, 1, generator=g) * 0.2)


def name_net(names, batch=64, seed=0):
    """NameNet for a names set at its pictures' size, trained on views() of them on first use, then cached: 40 steps
    of 64 views a name for a set of fewer than 25 (each name seen in over 2,500 views), else max(1,000, 4 a name):
    each name in 256 views or more (the 241 emoji: 266)."""
    real = names["real"]
    steps = 40 * len(real) if len(real) < 25 else max(1000, 4 * len(real))
    path = os.path.join(names["root"], f"namenet{real.shape[-1]}.pt")
    with torch.random.fork_rng():  # its init must not move the caller's random stream (a training run's)
        torch.manual_seed(seed)
        net = NameNet(len(real))
    saved = torch.load(path, weights_only=True) if os.path.exists(path) else None
    if saved and saved["names"] == names["names"] and saved.get("steps") == steps:
        net.load_state_dict(saved["state"])
        return net.eval()
    from tqdm import tqdm
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 2e-3, total_steps=steps)
    for _ in tqdm(range(steps), desc=f"training the name classifier on {len(real)} real pictures", unit="step"):
        idx = torch.randint(len(real), (batch,), generator=g)
        with torch.enable_grad():  # (retrieval_scores runs under no_grad)
            loss = F.cross_entropy(net(views(real[idx], g))[1], idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    torch.save(dict(state=net.state_dict(), names=names["names"], steps=steps), path)
    return net.eval()


def names_set(folder, size):
    """A names set (`python data.py emoji` writes names.json beside its shards) with its one real picture per name,
    prepared as the converter prepares it, as uint8 (N, 3, size, size) under "real"; None for other data."""
    names = read_json(os.path.join(folder, "names.json")) if os.path.isdir(folder) else None  # (also 'builtin')
    if names is None:
        return None
    real = stack_uint8([data.open_image(os.path.join(folder, p)) for p in names["images"]], size)
    return dict(names, root=folder, real=real)


def stack_uint8(images, size):
    """PIL images -> uint8 (N, 3, size, size), each cropped by to_tensor as a training image is."""
    return as_uint8(torch.stack([data.to_tensor(im, size) for im in images]))


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
                         f"torch.jit.trace and pass --features FILE.pt (evaluate.feature_nets' docstring: how).") from e


def load_clip(name):
    """--clip-model -> (a transformers CLIPModel, its CLIPProcessor); hub ids and local folders alike."""
    from transformers import CLIPModel, CLIPProcessor
    with loading("--clip-model", name):
        return CLIPModel.from_pretrained(name).eval().to(device()), CLIPProcessor.from_pretrained(name)
