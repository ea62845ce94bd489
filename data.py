"""data.py -- what the model eats: the built-in shapes, images <-> tensors, WebDataset streaming; files, offline tools.

    python data.py shards SRC OUT --size 256    # your captioned images -> shards + manifest.json + SHA256SUMS
    python data.py emoji OUT                    # real pictures with real names, offline (Noto Color Emoji)
    python data.py precompute SRC OUT --vae V   # the frozen encoders, once: fp16 latents + text states

  * built-in data a 2-core CPU learns in minutes *and* a program can grade: 3 shapes x 6 colours x 5 positions
    (24,000 images of 32 px in 16 shards, 6 caption templates; 2 more held out for evaluation), so "does the
    picture show what its caption says?" is a number (evaluate.judge); `builtin-mixed`: in 5 aspect ratios;
  * streaming by hand: shard shuffle -> this rank's and this loader worker's shards -> tar samples -> shuffle
    buffer -> decode -> a pool per aspect-ratio bucket -> batches of one bucket; a bad sample is skipped and
    counted. The order is a pure function of (seed, epoch, rank, worker), a batch's bucket of its number (the
    same on every rank), and a Position records how far each worker got: that is what makes `--resume` exact; the
    loader's workers live for the whole run (each new epoch reaches them through shared memory);
  * any picture a user brings (transparent, palette, 16-bit, a phone photo stored sideways) becomes upright RGB
    the same way (`to_rgb`); precompute runs the frozen VAE and text encoder (model.py) once instead of per step.
"""
import atexit
import bisect
import collections
import contextlib
import hashlib
import io
import itertools
import json
import math
import multiprocessing
import os
import pathlib
import random
import shutil
import signal
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import webdataset as wds
from PIL import Image, ImageDraw, ImageFont, ImageOps
from tqdm import tqdm

import model

# ---- The built-in dataset: coloured shapes at named positions --------------------------------------------------
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
MIXED = "builtin-mixed"  # the scenes on canvases of `buckets`' aspect ratios, which a square crop would cut
VERSION = 2  # bump when the generator changes, so stale shards are never reused


def render(color, shape, pos, size=32, rng=None):
    """Draw one shape (4x supersampled, then box-filtered) -> PIL RGB image of size x size, or (width, height): the
    position a fraction of each side (the judge's), the shape's size one of the short side."""
    W, H = (size, size) if isinstance(size, int) else size
    rng, S = rng or random.Random(0), 4 * min(W, H)
    img = Image.new("RGB", (4 * W, 4 * H), (rng.randint(0, 60),) * 3)  # on a random dark grey
    fx, fy = POSITIONS[pos]
    cx, cy = (fx + rng.uniform(-0.03, 0.03)) * 4 * W, (fy + rng.uniform(-0.03, 0.03)) * 4 * H
    r = rng.uniform(0.19, 0.25) * S  # half extent: big enough that corners tell square from circle
    draw, box = ImageDraw.Draw(img), [cx - r, cy - r, cx + r, cy + r]
    if shape == "circle":
        draw.ellipse(box, fill=COLORS[color])
    elif shape == "square":
        draw.rectangle(box, fill=COLORS[color])
    else:  # triangle, apex up
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLORS[color])
    return img.resize((W, H), Image.BOX)


def random_caption(rng):
    """-> (caption, attributes) for a uniformly drawn colour, shape and position."""
    attrs = dict(color=rng.choice(list(COLORS)), shape=rng.choice(SHAPES), position=rng.choice(list(POSITIONS)))
    return rng.choice(TEMPLATES).format(color=attrs["color"], shape=attrs["shape"], pos=attrs["position"]), attrs


def heldout_prompts(n_each=1):
    """Every colour x shape x position, worded with templates never used in training."""
    combos = [(c, s, p) for c in COLORS for s in SHAPES for p in POSITIONS]
    return [(HELDOUT_TEMPLATES[(i + k) % len(HELDOUT_TEMPLATES)].format(color=c, shape=s, pos=p),
             dict(color=c, shape=s, position=p)) for k in range(n_each) for i, (c, s, p) in enumerate(combos)]


def make_builtin(root, size=32, n_shards=16, per_shard=1500, seed=0, mixed=False):
    """Write the built-in dataset as WebDataset shards {__key__, png, txt, json} (idempotent); `mixed`: each picture
    on a canvas of a random bucket (patch 4), counted per bucket in manifest.json as the converter does."""
    if os.path.exists(os.path.join(root, "DONE")):
        return tars(root)
    tmp, counts = f"{root}.tmp{os.getpid()}", collections.Counter()
    os.makedirs(tmp, exist_ok=True)
    for shard in tqdm(range(n_shards), desc=f"generating built-in data -> {root}", unit="shard"):
        rng = random.Random(f"{seed}-{size}-{shard}")  # each shard reproducible on its own
        with wds.TarWriter(os.path.join(tmp, f"shapes-{shard:04d}.tar"), mtime=0) as sink:
            for i in range(per_shard):
                text, a = random_caption(rng)
                wh = rng.choice(buckets(size, 4)) if mixed else (size, size)
                png = encoded(render(a["color"], a["shape"], a["position"], wh, rng), "PNG")
                sink.write({"__key__": f"{shard:04d}{i:06d}", "png": png, "txt": text, "json": a})
                counts["%dx%d" % wh] += mixed
    write_json(os.path.join(tmp, "manifest.json"), dict(buckets=+counts))  # (as the converter counts them)
    open(os.path.join(tmp, "DONE"), "w").close()
    try:
        os.replace(tmp, root)  # atomic: a half-written dataset is never seen as done
    except OSError:  # another process finished first, or `root` is something else
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.exists(os.path.join(root, "DONE")):
            raise SystemExit(f"{root} exists but is not a finished built-in dataset: remove it and rerun")
    return make_builtin(root, size, n_shards, per_shard, seed, mixed)


# ---- Images <-> tensors ---------------------------------------------------------------------------------------------
BACKGROUND = (255, 255, 255)  # what transparent pixels become: white, the page an emoji or a logo sits on


def open_image(src):
    """A path or a file's bytes -> PIL image, decoded now (so a corrupt file fails here, not later)."""
    img = Image.open(io.BytesIO(src) if isinstance(src, bytes) else src)
    img.load()
    return img


def encoded(img, fmt, **kw):
    """PIL image -> the bytes of a file in `fmt` ("PNG", "JPEG"; kw: e.g. quality)."""
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def to_rgb(img):
    """Any image as saved -> upright RGB: EXIF orientation applied (phones store portraits sideways), transparency
    (RGBA, LA, a palette's transparent index) onto BACKGROUND, 16-bit grey scaled to 8 bits."""
    img = ImageOps.exif_transpose(img)
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):  # convert("RGB") would clip 16-bit values at 255
        img = Image.fromarray(np.round(np.asarray(img, dtype=np.float64) / 257).clip(0, 255).astype(np.uint8))
    if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
        img = Image.alpha_composite(Image.new("RGBA", img.size, BACKGROUND + (255,)), img.convert("RGBA"))
    return img.convert("RGB")


def cover_crop(img, size):
    """to_rgb, resize (bicubic, antialiased) to cover `size` (a side, or (W, H)), centre-crop: one crop everywhere."""
    img, (w, h) = to_rgb(img), (size, size) if isinstance(size, int) else size
    if img.size != (w, h):
        s = max(w / img.width, h / img.height)
        img = img.resize((max(w, round(img.width * s)), max(h, round(img.height * s))), Image.BICUBIC)
        l, t = (img.width - w) // 2, (img.height - h) // 2
        img = img.crop((l, t, l + w, t + h))
    return img


def to_tensor(img, size):
    """PIL image -> (3, H, W) float in [-1, 1] of `size` (a side, or (W, H)); other sizes go through cover_crop."""
    return torch.from_numpy(np.asarray(cover_crop(img, size)).copy()).permute(2, 0, 1).float() / 127.5 - 1


def as_uint8(x):
    """Images in [-1, 1], (N, 3, H, W) or (3, H, W) -> uint8: what PNGs and every feature network here take."""
    return ((x.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


def to_pil(x):
    """(3, H, W) tensor, uint8 or in [-1, 1] -> PIL image."""
    return Image.fromarray((x if x.dtype == torch.uint8 else as_uint8(x)).permute(1, 2, 0).cpu().numpy())


# ---- Aspect-ratio buckets: pictures of several shapes, one shape per batch (SDXL, PixArt) ----------------------------
RATIOS = (1 / 2, 2 / 3, 1, 3 / 2, 2)  # width / height: portrait 1:2 ... landscape 2:1 (photos' 2:3, 3:2)


def buckets(size, multiple, ratios=RATIOS):
    """(width, height) of about size^2 pixels per aspect ratio r: w = size sqrt(r), h = size / sqrt(r), each rounded
    to a multiple of `multiple` (the patch, times the VAE's factor). At 32 px, 4: 24x44 28x40 32x32 40x28 44x24."""
    return [tuple(multiple * max(1, round(size * r ** e / multiple)) for e in (0.5, -0.5)) for r in ratios]


def nearest(sizes, w, h):
    """The (width, height) of `sizes` whose aspect ratio is closest to w / h's, in log scale (1:2 as far as 2:1)."""
    return min(sizes, key=lambda b: abs(math.log(b[0] * h / (b[1] * w))))


def bucket_shares(shards, size, multiple):
    """Bucketed data (manifest.json's per-bucket counts: `data.py shards --buckets`, builtin-mixed) -> {(W, H) of
    buckets(size, multiple): samples, each counted at its nearest aspect ratio}; None for square data."""
    counts = (read_json(os.path.join(os.path.dirname(shards[0]), "manifest.json")) or {}).get("buckets") or {}
    shares = collections.Counter()
    for k, n in counts.items():
        shares[nearest(buckets(size, multiple), *map(int, k.split("x")))] += n
    return dict(sorted(shares.items())) or None


# ---- WebDataset streaming: shards -> (rank, worker) split -> samples -> shuffle buffer -> batches -------------------
def tars(folder):
    """The .tar files of a folder, sorted."""
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".tar"))


def resolve_shards(data, image_size):
    """--data value -> sorted list of .tar paths (the built-in set is generated if missing)."""
    if data in (BUILTIN, MIXED):
        name = f"shapes{image_size}{'-mixed' if data == MIXED else ''}-v{VERSION}"
        return make_builtin(os.path.join("data", name), size=image_size, mixed=data == MIXED)
    paths = tars(data) if os.path.isdir(data) else sorted(p for p in data.split(",") if p)
    if not paths or not all(os.path.exists(p) for p in paths):
        raise SystemExit(f"--data {data!r}: no .tar shards found; pass a folder of shards, "
                         f"comma-separated .tar paths, '{BUILTIN}' or '{MIXED}'")
    return paths


def source(folder):
    """--data -> the data it was made from: a precomputed or pair folder's source (its precompute.json), else itself."""
    made = read_json(os.path.join(folder, "precompute.json")) if os.path.isdir(folder) else None
    return made["source"] if made else folder


def worker_shards(shards, seed, epoch, rank, world, wid, nw):
    """The shards one (rank, loader worker) reads in this epoch: one shuffle shared by all ranks, disjoint slices."""
    order = list(shards)
    random.Random(f"shards-{seed}-{epoch}").shuffle(order)  # same on every rank
    if len(order) < world * nw:
        raise ValueError(f"{len(order)} shards cannot feed {world} ranks x {nw} workers: "
                         f"write more shards or lower --workers")
    return order[rank * nw + wid::world * nw]


def read_tars(urls, handler=wds.reraise_exception):
    """.tar paths -> their samples in order, dicts {__key__, __url__, ext: bytes}; handler(error) -> go on?"""
    return wds.tarfile_samples(({"url": u} for u in urls), handler=handler)


def decode(s, sizes):
    """Tar sample -> raw {image (3, H, W), caption, bucket}, bucket = (W, H) the `sizes` entry nearest its aspect ratio,
    or precomputed {latent, text, mask} (square: sizes[0]), reflow's pairs with their noise too; None and a warning
    for a bad one: skipped, not a crash."""
    try:
        if "latent.npy" in s:  # written by `python data.py precompute`: the frozen encoders already ran
            keys = ("latent", "text", "mask") + ("noise",) * ("noise.npy" in s)  # (+ noise: `sample.py --pairs`)
            arr = {k: torch.from_numpy(np.load(io.BytesIO(s[k + ".npy"]))) for k in keys}
            if arr["text"].shape[0] != arr["mask"].shape[0]:
                raise ValueError("text.npy and mask.npy disagree in length")
            return dict(arr, bucket=sizes[0])
        key = next((k for k in ("png", "jpg", "jpeg", "webp") if k in s), None)
        if key is None or "txt" not in s:
            raise ValueError(f"no {'image (png/jpg/jpeg/webp)' if key is None else 'caption (txt)'} in sample")
        img = to_rgb(open_image(s[key]))
        bucket = nearest(sizes, *img.size)
        return dict(image=to_tensor(img, bucket), caption=s["txt"].decode("utf-8"), bucket=bucket)
    except Exception as e:
        warnings.warn(f"skipping bad sample {s.get('__key__')!r} in {s.get('__url__')}: {e}")


def shuffled(it, bufsize, rng):
    """Shuffle buffer: keep `bufsize` samples, emit a random one as each new one arrives."""
    it = iter(it)
    buf = list(itertools.islice(it, bufsize))
    for x in it:
        i = rng.randrange(bufsize)
        yield buf[i]
        buf[i] = x
    rng.shuffle(buf)
    yield from buf


def collate(items):
    """Samples -> a batch: images stacked, captions listed; precomputed text padded to the longest."""
    if "image" in items[0]:
        return dict(image=torch.stack([x["image"] for x in items]), caption=[x["caption"] for x in items])
    text, mask = model.pad([x["text"] for x in items], [x["mask"] for x in items])
    noise = torch.stack([x["noise"] for x in items]) if "noise" in items[0] else None
    return dict(latent=torch.stack([x["latent"] for x in items]), text=text, mask=mask, noise=noise)


class ShardStream(torch.utils.data.IterableDataset):
    """One epoch of one rank's batches: collate()'s dicts, each with where its loader worker stands (`worker`, `batches`
    so far, `raw` tar samples read, bad ones included, `skipped`, `pooled`: which raw samples wait in a bucket's pool);
    `resume` = {worker: those four}: see pass_over. `size`: a side (square pictures) or {(W, H): share of the data}
    (buckets); `first`: how many batches this rank took in the epochs before (a batch's bucket follows its number)."""

    def __init__(self, shards, batch_size, size, seed=0, epoch=0, rank=0, world=1, buffer=1000, resume=None, first=0):
        shares = {(size, size): 1} if isinstance(size, int) else size  # (W, H) -> samples
        self.sizes, self.cum = list(shares), list(itertools.accumulate(shares.values()))
        self.shards, self.B, self.buffer, self.resume = list(shards), batch_size, buffer, resume or {}
        self.seed, self.rank, self.world = seed, rank, world
        # (epoch, first) in shared memory: loader workers live across epochs and read each new one's at its start
        self.at = multiprocessing.RawArray("q", [epoch, first])
        self.u0 = random.Random(f"buckets-{seed}").random()  # where bucket()'s sequence starts

    def bucket(self, n):
        """The bucket of this rank's n-th batch: the same on every rank (so DDP's ranks step in one shape), a golden-
        ratio sequence u_n = frac(u_0 + n / phi) over the buckets' shares, so any run of batches keeps those shares."""
        u = (self.u0 + n * 0.6180339887498949) % 1
        return self.sizes[min(bisect.bisect(self.cum, u * self.cum[-1]), len(self.sizes) - 1)]

    def __iter__(self):
        """This worker's shards -> tar samples -> shuffle buffer -> decode (bad ones skipped) -> a pool per bucket ->
        batches of B, each from the pool of the bucket its number is given (one pool, one bucket: plain batching)."""
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        self.epoch, self.first = self.at[:]
        resume, self.resume = self.resume, {}  # (only the first epoch resumes)
        mine = worker_shards(self.shards, self.seed, self.epoch, self.rank, self.world, wid, nw)
        rng = random.Random(f"samples-{self.seed}-{self.epoch}-{self.rank}-{wid}")
        self.skipped, pools = 0, {b: [] for b in self.sizes}  # bucket -> [(raw sample number, sample)]
        stream = shuffled(read_tars(mine, handler=self.unreadable), self.buffer, rng)
        done = resume.get(wid, dict(batches=0, raw=0, skipped=0, pooled=[]))
        yield from self.pass_over(stream, done, wid, pools)
        raw, self.skipped, k = done["raw"], done["skipped"], done["batches"]  # (pass_over's were counted before)
        for s in stream:
            raw += 1
            if (item := decode(s, self.sizes)) is None:
                self.skipped += 1
                continue
            pools[item["bucket"]].append((raw, item))
            while len(pools[want := self.bucket(self.first + k * nw + wid)]) >= self.B:  # worker's k-th: batch n
                items, pools[want], k = pools[want][:self.B], pools[want][self.B:], k + 1
                pooled = sorted(i for pool in pools.values() for i, _ in pool)
                yield dict(collate([x for _, x in items]), worker=wid, batches=k, raw=raw, skipped=self.skipped,
                           pooled=pooled)
            if sum(map(len, pools.values())) > self.buffer + len(self.sizes) * self.B:  # a bucket this worker lacks:
                break  # its epoch ends here, memory bounded (its pools would otherwise hold all it reads)
        # what is left in the pools is dropped (an epoch ends at the first bucket that runs dry): full batches only

    def unreadable(self, exn):
        """read_tars' handler: a truncated or corrupt tar is warned about and counted; the next shard is read."""
        self.skipped += 1
        warnings.warn(f"skipping unreadable shard data: {exn!r}")
        return True

    def pass_over(self, stream, done, wid, pools):
        """Resume: re-read the worker's `raw` consumed samples, decoding only the `pooled` ones back into their pools,
        then yield `batches` placeholders, so the DataLoader interleaves the workers exactly as before."""
        pooled = set(done["pooled"])  # (a set: an epoch's raw count times the pool would be slow at scale)
        for i, s in zip(range(1, done["raw"] + 1), stream):
            if i in pooled:
                item = decode(s, self.sizes)
                pools[item["bucket"]].append((i, item))
        for _ in range(done["batches"]):
            yield dict(consumed=True, worker=wid)


def make_loader(shards, batch_size, size, seed, epoch, rank=0, world=1, workers=1, resume=None, first=0):
    """DataLoader over epoch `epoch` (`size`: see ShardStream), its workers kept for the next: set loader.dataset.at
    to (epoch, batches before it), then iterate again. Batching happens in the stream, so batch_size=None here."""
    ds = ShardStream(shards, batch_size, size, seed, epoch, rank, world, resume=resume, first=first)
    # an explicit generator keeps DataLoader from drawing its base seed from the global RNG
    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, worker_init_fn=leave_stops_to_rank,
                                       generator=torch.Generator().manual_seed(seed), persistent_workers=workers > 0,
                                       pin_memory=torch.cuda.is_available())  # (so copies to the GPU are async)


def default_workers():
    """Loader processes where --workers is not given: none on a CPU, whose cores run the model; on a GPU this
    process's share of the cores (torchrun: LOCAL_WORLD_SIZE processes a node), less its own, at most 8."""
    if not torch.cuda.is_available():
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(8, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1)) - 1))


def leave_stops_to_rank(worker_id):
    """Workers ignore TERM and USR1 (sent to every process by torchrun, Slurm): one killed would crash its rank."""
    for s in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(s, signal.SIG_IGN)


@atexit.register  # (after multiprocessing's own exit handler is registered, so it runs before it)
def kill_workers():
    """At exit multiprocessing TERMs its daemonic children, loader workers among them, and waits for them: workers
    ignore TERM, so they are killed first (else a stream left open, by an exception say, would hang the exit)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # (torch's handler would report each as an error)
    for p in multiprocessing.active_children():
        if p.daemon:
            p.kill()


@dataclass
class Position:
    """Where one rank stands in its data: every checkpoint saves it, so a resume reads on from exactly there."""
    epoch: int = 0                                # epochs finished
    batch_in_epoch: int = 0                       # batches taken from this one
    batches_before: int = 0                       # ... and from the finished ones
    workers: dict = field(default_factory=dict)   # loader worker -> its {batches, raw, skipped, pooled} in this epoch
    skipped_before: int = 0                       # bad samples skipped in the finished epochs
    skipped: int = 0                              # ... and in all


def batches(shards, batch_size, size, seed, rank, world, workers, pos):
    """One rank's endless batches, epoch after epoch, from Position `pos` on, which they keep up to date; one loader,
    whose workers live from epoch to epoch."""
    loader = make_loader(shards, batch_size, size, seed, pos.epoch, rank, world, workers, resume=dict(pos.workers))
    while True:
        loader.dataset.at[:] = [pos.epoch, pos.batches_before]  # (read by each worker as the epoch starts)
        for i, b in enumerate(loader):
            if b["worker"] != i % max(workers, 1) and isinstance(size, dict):  # a worker ran dry: with buckets the
                break                                         # epoch ends here (the others' batches have other numbers)
            if (i < pos.batch_in_epoch) != ("consumed" in b):  # placeholders stand where consumed batches stood
                raise RuntimeError(f"resume: epoch {pos.epoch} item {i} is not where the checkpoint put it")
            if i < pos.batch_in_epoch:
                continue
            pos.workers[b["worker"]] = {k: b[k] for k in ("batches", "raw", "skipped", "pooled")}
            pos.skipped = pos.skipped_before + sum(w["skipped"] for w in pos.workers.values())
            pos.batch_in_epoch = i + 1
            yield b
        if pos.batch_in_epoch == 0:  # a whole epoch without one full batch: waiting longer cannot help
            raise SystemExit(no_batch_message(shards, batch_size, seed, pos.epoch, rank, world, workers))
        pos.skipped_before, pos.batches_before = pos.skipped, pos.batches_before + pos.batch_in_epoch
        pos.epoch, pos.batch_in_epoch, pos.workers = pos.epoch + 1, 0, {}


def no_batch_message(shards, batch_size, seed, epoch, rank, world, workers):
    """Why an epoch gave a rank no batch at all: how many samples each of its loader workers read."""
    nw = max(workers, 1)
    counts = [sum(1 for _ in read_tars(worker_shards(shards, seed, epoch, rank, world, w, nw), wds.ignore_and_continue))
              for w in range(nw)]
    return (f"epoch {epoch} gave rank {rank} no batch of --batch-size {batch_size}: its {nw} loader worker(s) read "
            f"{', '.join(map(str, counts))} samples of {len(shards)} shards over {world} rank(s) (each worker "
            f"batches its own samples; bad ones are dropped). Use --batch-size {max(1, max(counts))} or less, "
            f"fewer --workers or ranks, or more data.")


# ==== What a first read may skip: files written whole, JSON; the offline tools (converter, emoji, precompute) ======
def atomic_write(path, write, keep=None):
    """write(f) into path.tmp, fsync it, then rename it over `path` (first moving the old file to `keep`, if
    given): a crash or power loss leaves the old file or the new one, never a torn or empty one."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before a name points at them
        if keep and os.path.exists(path):
            os.replace(path, keep)
        os.replace(tmp, path)
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)  # and so are the renames
        finally:
            os.close(fd)
    finally:  # on any error no .tmp is left behind, and the error goes on
        with contextlib.suppress(OSError):
            os.remove(tmp)


def read_text(path):
    """A file's text; None where there is no such file."""
    return pathlib.Path(path).read_text() if os.path.exists(path) else None


def read_json(path):
    """A JSON file's value; None where there is no such file."""
    return None if (text := read_text(path)) is None else json.loads(text)


def write_json(path, value):
    """value -> path as JSON (indent 1: readable, diffable)."""
    with open(path, "w") as f:
        json.dump(value, f, indent=1)


def append_json(f, rec):
    """One JSON line to an open file (log.jsonl), flushed; NaN and inf become null, since bare NaN is not JSON."""
    def finite(x):
        if isinstance(x, float):
            return x if math.isfinite(x) else None
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        return [finite(v) for v in x] if isinstance(x, (list, tuple)) else x
    if f:
        f.write(json.dumps(finite(rec), allow_nan=False) + "\n")
        f.flush()


def list_images(src):
    """Image folder (captions in sidecar .txt, stripped) or a .csv / .jsonl of path,caption (paths relative to that
    file's folder) -> [(path, caption)]; caption None where there is none."""
    if os.path.isdir(src):
        exts = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
        paths = [os.path.join(src, f) for f in sorted(os.listdir(src)) if f.lower().endswith(exts)]
        caps = [read_text(os.path.splitext(p)[0] + ".txt") for p in paths]  # sidecar captions
        return [(p, c if c is None else c.strip()) for p, c in zip(paths, caps)]
    if not src.endswith((".csv", ".jsonl")):
        raise SystemExit(f"{src}: give an image folder (with .txt captions), a .csv or a .jsonl of path,caption")
    import csv
    with open(src, newline="") as f:
        rows = list(csv.DictReader(f)) if src.endswith(".csv") else [json.loads(l) for l in f if l.strip()]
    return [(os.path.join(os.path.dirname(os.path.abspath(src)), r["path"]), r.get("caption")) for r in rows]


def write_shards(src, out, size=256, per_shard=1000, quality=95, multiple=0):
    """Images -> WebDataset shards {__key__, jpg, txt, json} (cover_crop to `size`; `multiple`: to the nearest bucket of
    buckets(size, multiple) instead), manifest.json (sha256, counts, per-bucket counts, skips) and SHA256SUMS; smaller
    images are skipped, never upsampled (as re-diffusion filters LAION), and corrupt ones."""
    items, skipped, shards, sink, n, counts = list_images(src), [], [], None, 0, collections.Counter()
    os.makedirs(out, exist_ok=True)
    for path, caption in tqdm(items, desc=f"shards -> {out}", unit="img"):
        try:
            img = to_rgb(open_image(path))
            wh = nearest(buckets(size, multiple), *img.size) if multiple else (size, size)
            small = img.width < wh[0] or img.height < wh[1]
            why = "no caption" if caption is None else f"smaller than {wh}: {img.size}" if small else ""
        except Exception as e:
            why = f"unreadable: {e}"
        if why:
            skipped.append(dict(path=path, reason=why))
            continue
        if sink is None or shards[-1]["samples"] == per_shard:
            if sink:
                sink.close()
            shards.append(dict(name=f"shard-{len(shards):05d}.tar", samples=0))
            # mtime 0: the same images give the same bytes on every run
            sink = wds.TarWriter(os.path.join(out, shards[-1]["name"] + ".tmp"), mtime=0)
        jpg = encoded(cover_crop(img, wh), "JPEG", quality=quality)
        counts["%dx%d" % wh] += bool(multiple)
        sink.write({"__key__": f"{n:09d}", "jpg": jpg, "txt": caption,
                    "json": dict(src=os.path.relpath(path, os.path.dirname(os.path.abspath(src))), size=img.size)})
        shards[-1]["samples"] += 1
        n += 1
    if sink:
        sink.close()
    for s in shards:
        os.replace(os.path.join(out, s["name"] + ".tmp"), os.path.join(out, s["name"]))
        with open(os.path.join(out, s["name"]), "rb") as f:
            s["sha256"] = hashlib.file_digest(f, "sha256").hexdigest()
    with open(os.path.join(out, "SHA256SUMS"), "w") as f:  # check the shards anywhere: sha256sum -c SHA256SUMS
        f.writelines(f"{s['sha256']}  {s['name']}\n" for s in shards)
    manifest = dict(size=size, quality=quality, samples=sum(s["samples"] for s in shards), shards=shards,
                    buckets=+counts, skipped=skipped)
    write_json(os.path.join(out, "manifest.json"), manifest)
    print(f"{manifest['samples']} images -> {len(shards)} shards in {out}; {len(skipped)} skipped"
          + "".join(f"\n  bucket {k}: {v}" for k, v in sorted(counts.items()))
          + "".join(f"\n  skipped {s['path']}: {s['reason']}" for s in skipped))
    return manifest


EMOJI_FONT = "/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf"  # apt-get install fonts-noto-color-emoji
EMOJI_CATEGORIES = {  # Unicode code-point ranges of the emoji charts' groups; "all" = every glyph in the font
    "animals": [(0x1F400, 0x1F43F), (0x1F54A, 0x1F54A), (0x1F577, 0x1F578), (0x1F980, 0x1F9AE), (0x1FAB0, 0x1FABF)],
    "plants": [(0x1F330, 0x1F344), (0x1F490, 0x1F490), (0x1FAB4, 0x1FAB7)],
    "food": [(0x1F32D, 0x1F32F), (0x1F345, 0x1F37F), (0x1F950, 0x1F96F), (0x1F9C0, 0x1F9CB), (0x1FAD0, 0x1FADF)],
    "faces": [(0x1F600, 0x1F64F), (0x1F910, 0x1F92F), (0x1F970, 0x1F97A), (0x1F9D0, 0x1F9D0), (0x1FAE0, 0x1FAE8)],
}
EMOJI_WORDINGS = ["{name}", "an emoji of the {name}", "a picture of the {name}", "the {name}, drawn as an emoji"]
EMOJI_HELDOUT = "a small icon showing the {name}"  # never in training: the evaluation's wording


def emoji_glyphs(categories, font=EMOJI_FONT):
    """-> [(code point, lower-case Unicode name, RGBA image)] for every single-code-point emoji of the categories
    that the font draws (skin-tone modifiers, flags' letters and unnamed ones left out)."""
    import unicodedata
    if not os.path.exists(font):
        raise SystemExit(f"{font}: no emoji font; install it (Debian/Ubuntu: apt-get install fonts-noto-color-emoji)"
                         f" or pass --font FILE.ttf")
    face = ImageFont.truetype(font, 109)  # the one size Noto's colour bitmaps come in

    def draw(ch):
        img = Image.new("RGBA", (160, 160), (0, 0, 0, 0))
        ImageDraw.Draw(img).text((8, 8), ch, font=face, embedded_color=True)
        return img

    if unknown := set(categories) - set(EMOJI_CATEGORIES) - {"all"}:
        raise SystemExit(f"--categories: unknown {sorted(unknown)}; choose from {sorted(EMOJI_CATEGORIES)} or all")
    ranges = [(0x2000, 0x1FAFF)] if "all" in categories else [r for c in categories for r in EMOJI_CATEGORIES[c]]
    tofu, out = np.asarray(draw(chr(0x10FFFD))), []  # what the font draws for a code point it lacks
    flag_letters_and_skin_tones = {*range(0x1F1E6, 0x1F200), *range(0x1F3FB, 0x1F400)}
    for cp in sorted({cp for a, b in ranges for cp in range(a, b + 1)} - flag_letters_and_skin_tones):
        ch = chr(cp)
        if unicodedata.category(ch) == "So" and unicodedata.name(ch, ""):
            img = draw(ch)
            if img.getbbox() and not np.array_equal(np.asarray(img), tofu):
                out.append((cp, unicodedata.name(ch).lower(), img))
    return out


def make_emoji(out, categories=("animals", "food"), size=32, font=EMOJI_FONT, glyphs=None):
    """Real pictures with real names, brought as a user brings theirs: glyphs (or [(id, name, RGBA)]) centred on
    transparent squares in OUT/images/, every EMOJI_WORDINGS wording in OUT/captions.jsonl, shards by write_shards,
    and OUT/names.json: the names, their pictures and the held-out wording, for train.py and sample.py --eval."""
    glyphs = emoji_glyphs(categories, font) if glyphs is None else glyphs
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    rows, names, images = [], [], []
    for cp, name, img in glyphs:
        img = img.crop(img.getbbox())
        side = round(max(img.size) * 1.1)  # a 5% margin on each side, as the font's own em box has
        square = Image.new("RGBA", (side, side), (0, 0, 0, 0))
        square.paste(img, ((side - img.width) // 2, (side - img.height) // 2))
        path = f"images/{cp:05x}.png" if isinstance(cp, int) else f"images/{cp}.png"
        square.save(os.path.join(out, path))
        names.append(name)
        images.append(path)
        rows += [dict(path=path, caption=w.format(name=name)) for w in EMOJI_WORDINGS]
    with open(os.path.join(out, "captions.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    manifest = write_shards(os.path.join(out, "captions.jsonl"), out, size, per_shard=1000)
    write_json(os.path.join(out, "names.json"), dict(names=names, images=images, heldout=EMOJI_HELDOUT,
               wordings=EMOJI_WORDINGS, size=size, background=BACKGROUND, categories=list(categories)))
    print(f"{len(names)} names x {len(EMOJI_WORDINGS)} wordings -> {out}; held-out wording: {EMOJI_HELDOUT!r}")
    return manifest


def precompute(src, out, vae="none", text_encoder="minilm", image_size=32, batch_size=32, device=None):
    """Raw shards -> shards of {latent.npy, text.npy (fp16; real tokens), mask.npy, txt}, one per input shard, same
    order. Resumable: a finished shard exists under its final name (written to .tmp, then renamed) and is skipped."""
    device = device or model.device()
    meta = dict(vae=vae, text_encoder=text_encoder, image_size=image_size, source=src)
    shards, old = resolve_shards(src, image_size), read_json(os.path.join(out, "precompute.json"))
    if bucket_shares(shards, image_size, 1):
        raise SystemExit(f"{src}: pictures of several aspect ratios; precompute writes one square size: train on them")
    if old not in (None, meta):  # resuming must not mix encodings
        raise SystemExit(f"{out} holds shards precomputed with {old}; resume with those flags, or write a new folder")
    # cache_size=0: a one-off pass keeps nothing (each caption's states are the same bits either way)
    enc, ae = model.TextEncoder(text_encoder, device, cache_size=0), model.load_vae(vae, device)
    os.makedirs(out, exist_ok=True)
    write_json(os.path.join(out, "precompute.json"), meta)  # train.py checks its flags against this
    todo, skipped = [s for s in shards if not os.path.exists(os.path.join(out, os.path.basename(s)))], 0
    print(f"{len(shards) - len(todo)} of {len(shards)} shards already done")
    for shard in tqdm(todo, desc=f"precompute -> {out}", unit="shard"):
        dst = os.path.join(out, os.path.basename(shard))
        with wds.TarWriter(dst + ".tmp", mtime=0) as sink:
            samples = list(read_tars([shard], handler=lambda e: warnings.warn(repr(e)) or True))
            for i in range(0, len(samples), batch_size):
                part = [(s, decode(s, [(image_size, image_size)])) for s in samples[i:i + batch_size]]
                ok = [(s, x) for s, x in part if x is not None]
                skipped += len(part) - len(ok)
                if not ok:
                    continue
                b = collate([x for _, x in ok])
                x = b["image"] if ae is None else ae.encode(b["image"])
                text, mask = enc(b["caption"])
                for j, (s, _) in enumerate(ok):
                    n = int(mask[j].sum())
                    sink.write({"__key__": s["__key__"], "latent.npy": x[j].cpu().half().numpy(),  # (np.save'd
                                "text.npy": text[j, :n].cpu().half().numpy(),                    # by TarWriter)
                                "mask.npy": mask[j, :n].cpu().numpy(), "txt": b["caption"][j]})
        os.replace(dst + ".tmp", dst)
    print(f"{len(shards)} shards in {out}; bad samples skipped: {skipped}")


def get_parser():
    """The offline tools' command line: `python data.py shards|emoji|precompute ...`."""
    import argparse
    p = argparse.ArgumentParser(description="The offline tools: shard converter, emoji set, precompute.")
    sub = p.add_subparsers(dest="command", required=True, help="shards | emoji | precompute (each has --help)")
    s = sub.add_parser("shards", help="image folder / CSV / JSONL -> WebDataset shards + manifest.json + SHA256SUMS")
    s.add_argument("src", help="image folder with sidecar .txt captions, or a .csv/.jsonl with path,caption")
    s.add_argument("out", help="output folder for shard-XXXXX.tar, manifest.json and SHA256SUMS")
    s.add_argument("--size", type=int, default=256, help="square side in pixels (smaller images are skipped)")
    s.add_argument("--per-shard", type=int, default=1000, help="images per shard")
    s.add_argument("--quality", type=int, default=95, help="JPEG quality")
    s.add_argument("--buckets", type=int, default=0, metavar="M", help="keep aspect ratios: 5 buckets 1:2 .. 2:1 of "
                   "~size^2 pixels, sides multiples of M (patch x VAE factor); each image goes to the nearest")
    s.set_defaults(run=lambda a: write_shards(a.src, a.out, a.size, a.per_shard, a.quality, a.buckets))
    e = sub.add_parser("emoji", help="the Noto Color Emoji font -> images + captions + shards + names.json")
    e.add_argument("out", help="output folder (images/, captions.jsonl, shard-XXXXX.tar, manifest.json, names.json)")
    e.add_argument("--categories", default="animals,food", help=f"comma-separated {','.join(EMOJI_CATEGORIES)} or all")
    e.add_argument("--size", type=int, default=32, help="square side in pixels of the shards' images")
    e.add_argument("--font", default=EMOJI_FONT, help="a colour emoji font with 109-px bitmaps (Noto Color Emoji)")
    e.set_defaults(run=lambda a: make_emoji(a.out, a.categories.split(","), a.size, a.font))
    c = sub.add_parser("precompute", help="raw shards -> shards of fp16 latents + text states + mask")
    c.add_argument("src", help="raw shard folder (or 'builtin')")
    c.add_argument("out", help="output folder (finished shards are skipped, so rerun to resume)")
    c.add_argument("--vae", default="none", help="as train.py --vae: 'none' keeps pixels, else hub id / folder")
    c.add_argument("--text-encoder", default="minilm", help="as train.py --text-encoder")
    c.add_argument("--image-size", type=int, default=32, help="pixels, as train.py --image-size")
    c.add_argument("--batch-size", type=int, default=32, help="images per encoder call")
    c.set_defaults(run=lambda a: precompute(a.src, a.out, a.vae, a.text_encoder, a.image_size, a.batch_size))
    return p


if __name__ == "__main__":
    a = get_parser().parse_args()
    a.run(a)
