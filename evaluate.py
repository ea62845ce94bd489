"""evaluate.py -- scores for samples (sample.py --eval draws them): the
judge of the built-in shapes; retrieval for a names set in the features of
NameNet, a CNN trained here; FID (Heusel et al. 2017), KID (Binkowski et
al. 2018), IS, CLIPScore (Hessel et al. 2021).
"""
import collections
import os
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

import data
from data import as_uint8, read_json
from model import device, loading


# ---- The built-in shapes: colour, shape, position ----
def judge(img):
    """PIL image or uint8 (H, W, 3) array -> dict(color, shape, position);
    None where no shape is seen."""
    from scipy import ndimage
    px = np.asarray(img.convert("RGB") if isinstance(img, Image.Image) else img, np.float32)
    H, W, _ = px.shape
    border = np.concatenate([px[0], px[-1], px[:, 0], px[:, -1]])
    contrast = np.abs(px - np.median(border, axis=0)).max(-1)
    # 4-connected blobs: the largest is the shape, the rest specks
    blobs, n = ndimage.label(contrast > 60)
    mask = (blobs == 1 + np.bincount(blobs.ravel())[1:].argmax()) if n else blobs > 0
    if mask.sum() < 0.01 * H * W:
        return dict(color=None, shape=None, position=None)

    # colour: the named one nearest the blob's core (not its soft rim)
    rgb = px[mask & (contrast > 0.5 * contrast[mask].max())].mean(0)
    color = min(data.COLORS, key=lambda k: np.sum((rgb - np.array(data.COLORS[k])) ** 2))

    # shape: the ideal one, drawn in the blob's box, of highest IoU
    ys, xs = np.nonzero(mask)
    y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
    yy, xx = np.mgrid[0:H, 0:W] + 0.5
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    rx, ry = (x1 - x0) / 2, (y1 - y0) / 2
    box = (xx >= x0) & (xx <= x1) & (yy >= y0) & (yy <= y1)
    ideal = {"circle": ((xx - cx) / rx) ** 2 + ((yy - cy) / ry) ** 2 <= 1, "square": box,
             "triangle": box & (np.abs(xx - cx) <= rx * (yy - y0) / (y1 - y0))}
    iou = {k: (m & mask).sum() / (m | mask).sum() for k, m in ideal.items()}

    # position: the named one nearest the box's centre (a triangle's centroid sits low)
    fx, fy = cx / W, cy / H
    xys = data.POSITIONS
    position = min(xys, key=lambda k: (xys[k][0] - fx) ** 2 + (xys[k][1] - fy) ** 2)
    return dict(color=color, shape=max(iou, key=iou.get), position=position)


def judge_accuracy(images, attrs):
    """Images, attributes drawn -> share judged right of each, and of all."""
    keys, hits = ("color", "shape", "position"), collections.Counter()
    for seen, want in zip(map(judge, images), attrs):
        right = {k: seen[k] == want[k] for k in keys}
        hits.update(dict(right, all=all(right.values())))
    return {k: hits[k] / max(len(attrs), 1) for k in keys + ("all",)}


# ---- A names set: retrieval, sharpness ----
def laplacian(x):
    """Mean |Laplacian| of uint8 pictures: high-frequency energy."""
    k = torch.tensor([[0., 1, 0], [1, -4, 1], [0, 1, 0]]).expand(3, 1, 3, 3)
    return F.conv2d(x.float() / 255, k, groups=3).abs().mean().item()


@torch.no_grad()
def retrieval_scores(fake, want, names, fid=True):
    """uint8 samples of the names `want` (indices) -> top1/5: share whose
    named picture is among the 1/5 nearest real ones in NameNet's features;
    chance1/5 (a guess); ceiling_top1/5 (near_misses() of the real ones);
    sharpness (laplacian() / the real ones'); if `fid`, fid_is()'s."""
    real, net = names["real"], name_net(names)
    real_features = F.normalize(net(real)[0], dim=1)  # (names, features)

    def top1_top5(x, want):
        sim = F.normalize(net(x)[0], dim=1) @ real_features.T  # (n, names)
        # how many names beat the right one
        rank = (sim > sim.gather(1, want[:, None])).sum(1)
        return (rank < 1).float().mean().item(), (rank < 5).float().mean().item()

    out = dict(zip(("top1", "top5"), top1_top5(fake, want)),
               chance1=1 / len(real), chance5=min(1, 5 / len(real)))
    g = torch.Generator().manual_seed(1)
    ceiling = top1_top5(near_misses(real, g), torch.arange(len(real)))
    out.update(ceiling_top1=ceiling[0], ceiling_top5=ceiling[1],
               sharpness=laplacian(fake) / laplacian(real[want]))
    if fid:
        out.update(fid_is(real, fake, (OutputSelector(net, 0), OutputSelector(net, 1))))
    return out


# ---- FID, KID, IS (as torchmetrics) and CLIPScore ----
@torch.no_grad()
def fid_is(real, fake, nets, batch=256):
    """uint8 real and fake images, feature_nets() -> dict(fid, kid, kid_std,
    inception_score, inception_score_std). KID (squared MMD, cubic kernel,
    100 subsets) is unbiased at small n; FID is not."""
    # torchmetrics.image exports these only with torch-fidelity
    from torchmetrics.image.fid import FrechetInceptionDistance
    from torchmetrics.image.inception import InceptionScore
    from torchmetrics.image.kid import KernelInceptionDistance
    dev = device()
    # FID probes its net on the CPU
    fid = FrechetInceptionDistance(nets[0].cpu(), input_img_size=tuple(real.shape[1:])).to(dev)
    # IS warns: it keeps all features; one split's std
    with warnings.catch_warnings(action="ignore"):
        # the usual 10 splits, of 100 samples or more
        inception = InceptionScore(nets[1], splits=max(1, min(10, len(fake) // 100))).to(dev)
        # half-size subsets differ: their std means something
        subset = max(2, min(1000, len(real) // 2, len(fake) // 2))
        kid = KernelInceptionDistance(nets[0], subset_size=subset).to(dev)
        for images, is_real in ((real, True), (fake, False)):
            for i in range(0, len(images), batch):
                x = images[i:i + batch].to(dev)
                fid.update(x, real=is_real)
                kid.update(x, real=is_real)
                if not is_real:
                    inception.update(x)
        # the same random splits and subsets whatever the caller drew
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            is_mean, is_std = inception.compute()
            kid_mean, kid_std = kid.compute()
    return dict(fid=fid.compute().item(), kid=kid_mean.item(), kid_std=kid_std.item(),
                inception_score=is_mean.item(), inception_score_std=is_std.nan_to_num().item())


@torch.no_grad()
def clip_score(images, captions, clip, batch=256):
    """uint8 images, captions, load_clip() -> mean max(100 cos(image, text), 0)."""
    model, processor, scores = *clip, []
    for i in range(0, len(images), batch):
        x = processor(text=captions[i:i + batch], images=list(images[i:i + batch]),
                      return_tensors="pt", padding=True, truncation=True).to(device())
        out = model(**x)
        scores.append((100 * F.cosine_similarity(out.image_embeds, out.text_embeds)).clamp(min=0))
    return torch.cat(scores).mean().item()


def print_scores(scores, n, how):
    """Print sample.score_heldout's scores."""
    def pct(key):
        return f"{100 * scores[key]:.1f}%"

    straight = f" | straightness {scores['straightness']:.4f}"
    if "top1" not in scores:
        shares = " ".join(f"{k} {pct(k)}" for k in ("color", "shape", "position", "all"))
        buckets = "".join(f" | {k}: all {100 * v['all']:.1f}%"
                          for k, v in scores.items() if isinstance(v, dict))
        return print(f"caption accuracy of {n} samples of held-out prompts ({how}): "
                     f"{shares}{buckets}{straight}")
    fid = (f" | FID {scores['fid']:.1f}, KID {scores['kid']:.4f} (NameNet features)"
           if "fid" in scores else "")
    print(f"{n} samples of the held-out wording ({how}): retrieval top-1 {pct('top1')} "
          f"top-5 {pct('top5')} (chance {pct('chance1')} / {pct('chance5')}; the real "
          f"pictures' near misses {pct('ceiling_top1')} / {pct('ceiling_top5')}) | "
          f"sharpness {scores['sharpness']:.2f}x the real pictures'{fid}{straight}")


# ==== What a first read may skip: NameNet, real pictures, networks ====
class NameNet(nn.Module):
    """A small CNN telling a set's names apart, trained on its real pictures:
    uint8 (N, 3, H, W) -> (features (N, 4w), logits). Not Inception: its
    FIDs compare runs on one set only."""

    def __init__(self, n_names, w=16):
        super().__init__()

        def conv(i, o):
            return [nn.Conv2d(i, o, 3, padding=1), nn.GroupNorm(8, o), nn.SiLU()]

        self.body = nn.Sequential(
            *conv(3, w), nn.AvgPool2d(2),
            *conv(w, 2 * w), *conv(2 * w, 2 * w), nn.AvgPool2d(2),
            *conv(2 * w, 4 * w), *conv(4 * w, 4 * w),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(4 * w, n_names)

    def forward(self, x):
        features = self.body(x.float() / 127.5 - 1)
        return features, self.head(features)


def near_misses(x, g):
    """Random views of uint8 pictures, like a sampler's near misses."""
    n, x = len(x), x.float() / 127.5 - 1
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0] = theta[:, 1, 1] = 1 / torch.empty(n).uniform_(0.85, 1.15, generator=g)
    # the shift, in grid units (2 = the side)
    theta[:, :, 2] = torch.empty(n, 2).uniform_(-0.125, 0.125, generator=g)
    grid = F.affine_grid(theta, x.shape, align_corners=False)
    x = F.grid_sample(x, grid, padding_mode="border", align_corners=False)
    blurred = F.avg_pool2d(x, 3, 1, 1, count_include_pad=False)
    x = torch.where(torch.rand(n, 1, 1, 1, generator=g) < 0.5, blurred, x)
    noise = torch.randn(x.shape, generator=g)
    return as_uint8(x + noise * torch.rand(n, 1, 1, 1, generator=g) * 0.2)


def name_net(names, batch=64, seed=0):
    """A names set's NameNet, trained on near_misses() of its pictures at
    first use, cached beside them."""
    real = names["real"]
    # each name seen in 2,560 near misses (under 25 names), else 256 or more
    steps = 40 * len(real) if len(real) < 25 else max(1000, 4 * len(real))
    path = os.path.join(names["root"], f"namenet{real.shape[-1]}.pt")
    # init without moving the caller's random stream
    with torch.random.fork_rng():
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
    desc = f"training the name classifier on {len(real)} real pictures"
    for _ in tqdm(range(steps), desc=desc, unit="step"):
        idx = torch.randint(len(real), (batch,), generator=g)
        # retrieval_scores calls this under no_grad
        with torch.enable_grad():
            loss = F.cross_entropy(net(near_misses(real[idx], g))[1], idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    torch.save(dict(state=net.state_dict(), names=names["names"], steps=steps), path)
    return net.eval()


def names_set(folder, size):
    """The names set (python prepare.py emoji) in `folder`, or None; "real":
    its pictures, prepared as the converter does."""
    names = read_json(os.path.join(folder, "names.json")) if os.path.isdir(folder) else None
    if names is None:
        return None
    images = [data.open_image(os.path.join(folder, p)) for p in names["images"]]
    return dict(names, root=folder, real=stack_uint8(images, size))


def stack_uint8(images, size):
    """PIL images -> uint8 (N, 3, size, size), cropped as in training."""
    return as_uint8(torch.stack([data.to_tensor(im, size) for im in images]))


def real_images(shards, size, n, seed=0):
    """n pictures of raw shards (shuffled, bad ones skipped) ->
    (uint8 (n, 3, size, size), their captions)."""
    images, captions, where = [], [], data.masked(shards)
    for b in data.ShardStream(data.resolve_shards(shards, size), 1, size, seed=seed):
        if "image" not in b:
            raise SystemExit(f"--real {where!r}: precomputed shards hold no images; "
                             "pass raw {jpg|png, txt} shards")
        images.append(b["image"][0])
        captions.append(b["caption"][0])
        if len(images) == n:
            break
    if len(images) < 2:
        raise SystemExit(f"--real {where!r}: {len(images)} real image(s); FID needs 2 or more")
    return as_uint8(torch.stack(images)), captions


class OutputSelector(nn.Module):
    """Output `index` of a net's (features, logits), or its only output."""

    def __init__(self, net, index):
        super().__init__()
        self.net, self.index = net, index

    def forward(self, x):
        out = self.net(x)
        return out[self.index] if isinstance(out, (tuple, list)) else out


def feature_nets(spec, weights=None):
    """--features -> (net for FID, net for IS) on the CPU, taking uint8
    (N, 3, H, W). Where torchvision works, trace Inception once into a file
    that runs anywhere:

        import torch
        from torchmetrics.image.fid import NoTrainInceptionV3 as Net
        class Both(torch.nn.Module):  # uint8 -> (pool3, logits)
            def __init__(self):
                super().__init__()
                self.net = Net("inception-v3-compat", ["2048", "logits_unbiased"])
            def forward(self, x):
                return self.net._torch_fidelity_forward(x)
        x = torch.zeros(2, 3, 32, 32, dtype=torch.uint8)
        torch.jit.save(torch.jit.trace(Both(), x), "inception.pt")
    """
    if spec != "inception":
        try:
            net = torch.jit.load(spec, map_location="cpu").eval()
        except (OSError, RuntimeError, ValueError) as e:
            raise SystemExit(f"--features {spec!r} could not be loaded as TorchScript ({e}); "
                             "pass a file written by torch.jit.save, or 'inception'") from e
        return OutputSelector(net, 0), OutputSelector(net, 1)
    try:
        # torch-fidelity's network, its weights from torch.hub
        from torchmetrics.image.fid import NoTrainInceptionV3
        return tuple(NoTrainInceptionV3("inception-v3-compat", [f], weights)
                     for f in ("2048", "logits_unbiased"))
    except Exception as e:
        raise SystemExit(
            f"--features inception could not be loaded ({type(e).__name__}: {str(e)[:300]})."
            "\nIt needs `pip install torch-fidelity` (with a matching torchvision) and its weights "
            "(--inception-weights FILE, or weights-inception-2015-12-05-6726825d.pth in "
            f"{torch.hub.get_dir()}/checkpoints); or pass --features FILE.pt, traced once by "
            "torch.jit.trace (see evaluate.feature_nets).") from e


def load_clip(name):
    """--clip-model (hub id or folder) -> (CLIPModel, CLIPProcessor)."""
    from transformers import CLIPModel, CLIPProcessor
    with loading("--clip-model", name):
        model = CLIPModel.from_pretrained(name).eval().to(device())
        return model, CLIPProcessor.from_pretrained(name)
