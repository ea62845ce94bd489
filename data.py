"""data.py -- what the model eats while training: the built-in shapes,
pictures <-> tensors, aspect-ratio buckets, and the shard stream (from
disk, HTTP or a store's client, with retries), one batch at a time.

    shards -> samples -> shuffle buffer -> a pool per bucket -> batches

The stream is a pure function of (seed, epoch, rank, worker), and a
checkpoint saves where each worker stands in it (Position): `--resume`
continues with the very batches an uninterrupted run would have seen.
Data preparation (your pictures -> shards, the emoji set, precompute)
is prepare.py's.
"""
import atexit
import base64
import bisect
import collections
import contextlib
import http.client
import io
import itertools
import json
import math
import multiprocessing
import os
import pathlib
import random
import re
import select
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import webdataset as wds
from braceexpand import braceexpand
from PIL import Image, ImageDraw, ImageOps
from tqdm import tqdm

import model

# ---- The built-in dataset: coloured shapes ----
COLORS = {"red": (230, 40, 40), "green": (40, 190, 60), "blue": (50, 80, 240),
          "yellow": (240, 220, 40), "purple": (170, 60, 220), "white": (235, 235, 235)}
SHAPES = ["circle", "square", "triangle"]
# name -> (x, y) as fractions of the sides
POSITIONS = {"top left": (0.3, 0.3), "top right": (0.7, 0.3), "center": (0.5, 0.5),
             "bottom left": (0.3, 0.7), "bottom right": (0.7, 0.7)}
TEMPLATES = ["a {color} {shape} in the {pos}", "{color} {shape}, {pos}",
             "a picture of a {color} {shape} at the {pos}", "the {pos} has a {color} {shape}",
             "one {color} {shape} located in the {pos}", "a {shape} that is {color}, in the {pos}"]
HELDOUT_TEMPLATES = ["there is a {color} {shape} in the {pos} of the image",
                     "{pos}: {color} {shape}"]
# --data's default, made on first use
BUILTIN = "builtin"
# the scenes on canvases of `buckets`' aspect ratios
MIXED = "builtin-mixed"
# bumped with the generator: stale shards are never reused
VERSION = 2


def render(color, shape, pos, size=32, rng=None):
    """One shape, 4x supersampled -> PIL RGB image of `size` (side or W, H)."""
    W, H = (size, size) if isinstance(size, int) else size
    rng, S = rng or random.Random(0), 4 * min(W, H)
    img = Image.new("RGB", (4 * W, 4 * H), (rng.randint(0, 60),) * 3)  # dark grey
    fx, fy = POSITIONS[pos]
    cx = (fx + rng.uniform(-0.03, 0.03)) * 4 * W
    cy = (fy + rng.uniform(-0.03, 0.03)) * 4 * H
    # half the extent: big enough that corners tell square from circle
    r = rng.uniform(0.19, 0.25) * S
    draw, box = ImageDraw.Draw(img), [cx - r, cy - r, cx + r, cy + r]
    if shape == "circle":
        draw.ellipse(box, fill=COLORS[color])
    elif shape == "square":
        draw.rectangle(box, fill=COLORS[color])
    else:  # triangle, apex up
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLORS[color])
    return img.resize((W, H), Image.BOX)


def random_caption(rng):
    """-> (caption, attributes) of a random colour, shape and position."""
    attrs = dict(color=rng.choice(list(COLORS)), shape=rng.choice(SHAPES),
                 position=rng.choice(list(POSITIONS)))
    return rng.choice(TEMPLATES).format(pos=attrs["position"], **attrs), attrs


def heldout_prompts(n_each=1):
    """Every colour x shape x position, in templates never trained on."""
    combos = [(c, s, p) for c in COLORS for s in SHAPES for p in POSITIONS]
    return [(HELDOUT_TEMPLATES[(i + k) % len(HELDOUT_TEMPLATES)].format(color=c, shape=s, pos=p),
             dict(color=c, shape=s, position=p))
            for k in range(n_each) for i, (c, s, p) in enumerate(combos)]


def make_builtin(root, size=32, n_shards=16, per_shard=1500, seed=0, mixed=False):
    """Write the built-in shards {__key__, png, txt, json}, once; `mixed`:
    on random buckets' canvases (patch 4)."""
    if os.path.exists(os.path.join(root, "DONE")):
        return tars(root)
    tmp, counts = f"{root}.tmp{os.getpid()}", collections.Counter()
    names = [f"shapes-{shard:04d}.tar" for shard in range(n_shards)]
    os.makedirs(tmp, exist_ok=True)
    for shard in tqdm(range(n_shards), desc=f"generating built-in data -> {root}", unit="shard"):
        # each shard reproducible on its own
        rng = random.Random(f"{seed}-{size}-{shard}")
        with wds.TarWriter(os.path.join(tmp, names[shard]), mtime=0) as sink:
            for i in range(per_shard):
                text, a = random_caption(rng)
                wh = rng.choice(buckets(size, 4)) if mixed else (size, size)
                png = encoded(render(a["color"], a["shape"], a["position"], wh, rng), "PNG")
                sink.write({"__key__": f"{shard:04d}{i:06d}", "png": png, "txt": text, "json": a})
                counts["%dx%d" % wh] += mixed
    # a served folder lists its shards here
    write_json(os.path.join(tmp, "manifest.json"), dict(
        buckets=+counts, shards=[dict(name=n, samples=per_shard) for n in names]))
    open(os.path.join(tmp, "DONE"), "w").close()
    try:
        # atomic: a half-written dataset is never seen as done
        os.replace(tmp, root)
    except OSError:
        # another process finished first, or `root` is something else
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.exists(os.path.join(root, "DONE")):
            raise SystemExit(f"{root} exists but is not a finished built-in dataset: "
                             f"remove it and rerun")
    return make_builtin(root, size, n_shards, per_shard, seed, mixed)


# ---- Images <-> tensors ----
# transparent pixels become white: the page an emoji sits on
BACKGROUND = (255, 255, 255)


def open_image(src):
    """Path or bytes -> PIL image, decoded: a corrupt file fails here."""
    img = Image.open(io.BytesIO(src) if isinstance(src, bytes) else src)
    img.load()
    return img


def encoded(img, fmt, **kw):
    """PIL image -> the bytes of a `fmt` file."""
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def to_rgb(img):
    """Any image -> upright RGB: EXIF rotation applied, transparency onto
    BACKGROUND, 16 bits to 8."""
    img = ImageOps.exif_transpose(img)
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        # convert("RGB") would clip 16-bit values at 255
        grey = np.asarray(img, dtype=np.float64) / 257
        img = Image.fromarray(np.round(grey).clip(0, 255).astype(np.uint8))
    if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
        page = Image.new("RGBA", img.size, BACKGROUND + (255,))
        img = Image.alpha_composite(page, img.convert("RGBA"))
    return img.convert("RGB")


def cover_crop(img, size):
    """to_rgb, resize to cover `size` (a side or (W, H)), crop the centre:
    the one crop everywhere."""
    img, (w, h) = to_rgb(img), (size, size) if isinstance(size, int) else size
    if img.size != (w, h):
        s = max(w / img.width, h / img.height)
        cover = (max(w, round(img.width * s)), max(h, round(img.height * s)))
        img = img.resize(cover, Image.BICUBIC)
        left, top = (img.width - w) // 2, (img.height - h) // 2
        img = img.crop((left, top, left + w, top + h))
    return img


def to_tensor(img, size):
    """PIL image -> (3, H, W) float in [-1, 1] of `size`."""
    pixels = torch.from_numpy(np.asarray(cover_crop(img, size)).copy())
    return pixels.permute(2, 0, 1).float() / 127.5 - 1


def as_uint8(x):
    """Images in [-1, 1] -> uint8."""
    return ((x.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


def to_pil(x):
    """(3, H, W) tensor, uint8 or in [-1, 1] -> PIL image."""
    x = x if x.dtype == torch.uint8 else as_uint8(x)
    return Image.fromarray(x.permute(1, 2, 0).cpu().numpy())


# ---- Aspect-ratio buckets: one picture shape per batch (SDXL) ----
# width / height, portrait 1:2 to landscape 2:1
RATIOS = (1 / 2, 2 / 3, 1, 3 / 2, 2)


def buckets(size, multiple, ratios=RATIOS):
    """(width, height) of about size^2 pixels for each aspect ratio r,

        w = size sqrt(r),   h = size / sqrt(r),

    rounded to multiples of `multiple` (patch x the VAE's factor).
    At 32 px, 4: 24x44 28x40 32x32 40x28 44x24.
    """
    return [tuple(multiple * max(1, round(size * r ** e / multiple)) for e in (0.5, -0.5))
            for r in ratios]


def nearest(sizes, w, h):
    """The (W, H) of `sizes` nearest w / h in log aspect ratio."""
    return min(sizes, key=lambda b: abs(math.log(b[0] * h / (b[1] * w))))


def bucket_shares(shards, size, multiple):
    """manifest.json's bucket counts -> {(W, H) of buckets(size, multiple):
    samples}; None for square data."""
    manifest = read_beside(shards[0], "manifest.json")
    counts = (manifest or {}).get("buckets") or {}
    shares = collections.Counter()
    for k, n in counts.items():
        shares[nearest(buckets(size, multiple), *map(int, k.split("x")))] += n
    return dict(sorted(shares.items())) or None


# ---- Streaming: shards -> samples -> shuffle buffer -> batches ----
# what read_tars downloads rather than opens
REMOTE = ("http://", "https://", "gs://", "pipe:")
# --retries' default
RETRIES = 3
# seconds before the first reopening, doubled for each next
BACKOFF = 1.0
# seconds of silence before a connection or a client counts as cut
TIMEOUT = 60


def tars(folder):
    """The .tar files of a folder, sorted."""
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".tar"))


def resolve_shards(data, image_size):
    """--data -> sorted shards: paths, URLs or pipe: commands."""
    if data in (BUILTIN, MIXED):
        name = f"shapes{image_size}{'-mixed' if data == MIXED else ''}-v{VERSION}"
        return make_builtin(os.path.join("data", name), size=image_size, mixed=data == MIXED)
    if data.startswith("gs://") and not shutil.which("gsutil"):
        raise SystemExit(f"{masked(data)}: gs:// is read through gsutil, not found on PATH: "
                         "install the Google Cloud CLI, or pass https://storage.googleapis.com/ "
                         "URLs or 'pipe:gcloud storage cat gs://...'")
    if os.path.isdir(data):
        shards = tars(data)
    elif is_folder_url(data):
        shards = served_shards(data)
    else:
        shards = sorted(s for part in comma_list(data) if part for s in braceexpand(part))
    local = [s for s in shards if not s.startswith(REMOTE)]
    urls = [s for s in shards if s.startswith(REMOTE) and not s.startswith("pipe:")]
    if not_tar := [u for u in urls if not urllib.parse.urlsplit(u).path.endswith(".tar")]:
        raise SystemExit(f"--data: {masked(not_tar[0])} names no .tar; a folder URL ends in /")
    if not shards or not all(os.path.exists(s) for s in local):
        raise SystemExit(
            f"--data {masked(data)!r}: no .tar shards found; pass a folder, .tar paths or "
            f"URLs (comma-separated or x-{{00..99}}.tar), a folder URL ending in /, "
            f"'pipe:CMD', '{BUILTIN}' or '{MIXED}'")
    return shards


def comma_list(data):
    """'a-{0..1}.tar,b-{x,y}.tar' -> ['a-{0..1}.tar', 'b-{x,y}.tar']: a comma
    inside braces is braceexpand's, not the list's."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(data):
        depth = max(0, depth + (c == "{") - (c == "}"))
        if c == "," and depth == 0:
            parts.append(data[start:i])
            start = i + 1
    return parts + [data[start:]]


def made_from(folder):
    """--data -> what it was made from (precomputed shards: their raw
    source, as precompute.json names it), else --data itself."""
    made = read_json(os.path.join(folder, "precompute.json")) if os.path.isdir(folder) else None
    return made["source"] if made else folder


def worker_shards(shards, seed, epoch, rank, world, worker, n_workers):
    """One (rank, worker)'s shards this epoch: disjoint slices of one
    shuffle, the same on every rank."""
    order = list(shards)
    random.Random(f"shards-{seed}-{epoch}").shuffle(order)
    if len(order) < world * n_workers:
        raise ValueError(f"{len(order)} shards cannot feed {world} ranks x {n_workers} "
                         f"workers: write more shards or lower --workers")
    return order[rank * n_workers + worker::world * n_workers]


def read_tars(urls, handler=wds.reraise_exception, retries=0, faults=None):
    """Shards -> their samples {__key__, __url__, ext: bytes}, in order;
    handler(error) -> go on to the next shard?"""
    faults = Faults() if faults is None else faults
    for url in urls:
        try:
            yield from shard_samples(url, retries, faults)
        except ShardLost as e:
            faults.unreachable, faults.last = faults.unreachable + 1, str(e)
            warnings.warn(f"skipping unreachable shard {e}")
        except Exception as e:
            if not handler(e):
                return


def shard_samples(url, retries, faults):
    """One shard's samples; a remote one that fails part-way is reopened
    up to `retries` times past the samples read: none lost or repeated.
    ShardLost where that fails."""
    if not url.startswith(REMOTE):
        with open(url, "rb") as f:
            yield from tar_samples(f, url)
        return
    done = 0
    for attempt in range(retries + 1):
        try:
            with Download(url) as stream:
                for s in itertools.islice(tar_samples(stream, url), done, None):
                    done += 1
                    yield s
            return
        except (OSError, http.client.HTTPException) as e:
            why = f"{masked(url)}: {masked(reason(e))}" + f" ({done} samples read)" * bool(done)
            if attempt == retries or unrecoverable(e):
                raise ShardLost(why) from None
            faults.retries += 1
            wait = BACKOFF * 2 ** attempt
            warnings.warn(f"retry {attempt + 1} of {retries} in {wait:g} s: {why}")
            time.sleep(wait)


def reason(error):
    """A download error's message, less webdataset's " @ stream" and more."""
    own_text = (urllib.error.URLError, http.client.HTTPException)
    if isinstance(error, own_text) or getattr(error, "strerror", None):
        return str(error)
    return str(error.args[0] if error.args else error).partition(" @ ")[0]


def tar_samples(stream, url):
    """An open tar -> its samples; errors raised, partial samples dropped."""
    files = wds.tariterators.tar_file_expander([dict(url=url, stream=stream)])
    return wds.tariterators.group_by_keys(files)


def decode(s, sizes):
    """Tar sample -> {image (3, H, W), caption, bucket (of `sizes`)} or
    precomputed {latent, text, mask, (noise)}; None for a bad one."""
    try:
        # noise: reflow's pairs
        if "latent.npy" in s:
            keys = ("latent", "text", "mask") + ("noise",) * ("noise.npy" in s)
            arr = {k: torch.from_numpy(np.load(io.BytesIO(s[k + ".npy"]))) for k in keys}
            if arr["text"].shape[0] != arr["mask"].shape[0]:
                raise ValueError("text.npy and mask.npy disagree in length")
            return dict(arr, bucket=sizes[0])
        key = next((k for k in ("png", "jpg", "jpeg", "webp") if k in s), None)
        if key is None or "txt" not in s:
            missing = "image (png/jpg/jpeg/webp)" if key is None else "caption (txt)"
            raise ValueError(f"no {missing} in sample")
        img = to_rgb(open_image(s[key]))
        bucket = nearest(sizes, *img.size)
        return dict(image=to_tensor(img, bucket), caption=s["txt"].decode("utf-8"),
                    bucket=bucket)
    except Exception as e:
        where = masked(s.get("__url__"))
        warnings.warn(f"skipping bad sample {s.get('__key__')!r} in {where}: {e}")


def shuffled(it, bufsize, rng):
    """Shuffle buffer: hold `bufsize` samples, emit a random one per arrival."""
    it = iter(it)
    buf = list(itertools.islice(it, bufsize))
    for x in it:
        i = rng.randrange(bufsize)
        yield buf[i]
        buf[i] = x
    rng.shuffle(buf)
    yield from buf


def collate(items):
    """Samples -> a batch: tensors stacked, precomputed text padded."""
    if "image" in items[0]:
        return dict(image=torch.stack([x["image"] for x in items]),
                    caption=[x["caption"] for x in items])
    text, mask = model.pad([x["text"] for x in items], [x["mask"] for x in items])
    noise = torch.stack([x["noise"] for x in items]) if "noise" in items[0] else None
    latent = torch.stack([x["latent"] for x in items])
    return dict(latent=latent, text=text, mask=mask, noise=noise)


class ShardStream(torch.utils.data.IterableDataset):
    """One epoch of one rank's batches: collate()'s dicts, each with its
    loader worker's record:

        batches  batches it made this epoch
        raw      tar samples it read, bad ones included
        skipped  bad samples and unreadable tar data
        pooled   which raw ones (from 1) wait in a bucket's pool
        retries, unreachable  its Faults' counts

    `resume`: {worker: that record}; `size`: a side, or {(W, H): share}.
    """

    def __init__(self, shards, batch_size, size, seed=0, epoch=0, rank=0, world=1,
                 buffer=1000, resume=None, batches_before=0, retries=RETRIES):
        shares = {(size, size): 1} if isinstance(size, int) else size
        self.sizes = list(shares)
        self.share_ends = list(itertools.accumulate(shares.values()))
        self.shards, self.batch_size = list(shards), batch_size
        self.buffer, self.resume = buffer, resume or {}
        self.seed, self.rank, self.world, self.retries = seed, rank, world, retries
        # shared memory: workers live across epochs and read it at each start
        self.epoch_start = multiprocessing.RawArray("q", [epoch, batches_before])
        # u_0, where bucket()'s golden-ratio sequence starts
        self.u0 = random.Random(f"buckets-{seed}").random()

    def bucket(self, n):
        """The bucket of this rank's n-th batch, the same on every rank:
        u_n = frac(u_0 + n / phi) over the shares (golden-ratio steps), so
        any run of batches keeps those shares."""
        u = (self.u0 + n * 0.6180339887498949) % 1
        i = bisect.bisect(self.share_ends, u * self.share_ends[-1])
        return self.sizes[min(i, len(self.sizes) - 1)]

    def __iter__(self):
        """This worker's batches, each from the pool of its number's bucket."""
        info, B = torch.utils.data.get_worker_info(), self.batch_size
        worker, n_workers = (info.id, info.num_workers) if info else (0, 1)
        self.epoch, self.batches_before = self.epoch_start[:]
        # only the first epoch resumes
        resume, self.resume = self.resume, {}
        my_shards = worker_shards(self.shards, self.seed, self.epoch, self.rank, self.world,
                                  worker, n_workers)
        rng = random.Random(f"samples-{self.seed}-{self.epoch}-{self.rank}-{worker}")
        # bucket -> [(sample number, sample)]
        self.skipped, self.faults, pools = 0, Faults(), {b: [] for b in self.sizes}
        samples = read_tars(my_shards, self.unreadable, self.retries, self.faults)
        stream = shuffled(samples, self.buffer, rng)
        saved = resume.get(worker, dict(batches=0, raw=0, skipped=0, pooled=[]))
        yield from self.fast_forward(stream, saved, worker, pools)
        n_read, self.skipped, n_made = saved["raw"], saved["skipped"], saved["batches"]
        # the faults before the checkpoint, and the re-reading's
        self.faults.retries += saved.get("retries", 0)
        self.faults.unreachable += saved.get("unreachable", 0)
        for s in stream:
            n_read += 1
            if (item := decode(s, self.sizes)) is None:
                self.skipped += 1
                continue
            pools[item["bucket"]].append((n_read, item))
            while True:
                # this worker's batch n_made is its rank's batch n
                n = self.batches_before + n_made * n_workers + worker
                bucket = self.bucket(n)
                if len(pools[bucket]) < B:
                    break
                batch, pools[bucket] = pools[bucket][:B], pools[bucket][B:]
                n_made += 1
                waiting = sorted(i for pool in pools.values() for i, _ in pool)
                yield dict(collate([x for _, x in batch]), worker=worker, batches=n_made,
                           raw=n_read, skipped=self.skipped, pooled=waiting,
                           retries=self.faults.retries, unreachable=self.faults.unreachable)
            # a bucket its shards lack would pool all it reads: end the epoch
            if sum(map(len, pools.values())) > self.buffer + len(self.sizes) * B:
                break
        # the pools' rest is dropped: an epoch ends where a bucket runs dry

    def unreadable(self, exn):
        """read_tars' handler: count a bad tar, read on."""
        self.skipped += 1
        warnings.warn(f"skipping unreadable shard data: {masked(repr(exn))}")
        return True

    def fast_forward(self, stream, saved, worker, pools):
        """Resume: read past the `raw` samples, decoding the `pooled` ones
        back into their pools; yield `batches` placeholders, so the workers
        interleave as before."""
        waiting = set(saved["pooled"])
        for i, s in zip(range(1, saved["raw"] + 1), stream):
            if i in waiting:
                item = decode(s, self.sizes)
                pools[item["bucket"]].append((i, item))
        for _ in range(saved["batches"]):
            yield dict(consumed=True, worker=worker)


def make_loader(shards, batch_size, size, seed, epoch, rank=0, world=1, workers=1,
                resume=None, batches_before=0, retries=RETRIES):
    """DataLoader over one epoch; for the next, set dataset.epoch_start
    and iterate again."""
    ds = ShardStream(shards, batch_size, size, seed, epoch, rank, world, resume=resume,
                     batches_before=batches_before, retries=retries)
    # its own generator: the base seed is not drawn from the global RNG
    return torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=workers, worker_init_fn=leave_stops_to_rank,
        generator=torch.Generator().manual_seed(seed), persistent_workers=workers > 0,
        pin_memory=torch.cuda.is_available())


def default_workers():
    """--workers' default: 0 on a CPU (its cores run the model), else this
    process's share of the cores less one, at most 8."""
    if not torch.cuda.is_available():
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(8, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1)) - 1))


def leave_stops_to_rank(worker_id):
    """Ignore the TERM and USR1 torchrun and Slurm send every process: a
    killed worker would crash its rank."""
    for s in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(s, signal.SIG_IGN)


# registered after multiprocessing's exit handler, so it runs first
@atexit.register
def kill_workers():
    """Kill the loader workers at exit: they ignore multiprocessing's TERM."""
    # torch's handler would report each as an error
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for p in multiprocessing.active_children():
        if p.daemon:
            p.kill()


@dataclass
class Position:
    """Where one rank stands in its data, saved in every checkpoint."""
    epoch: int = 0  # epochs finished
    batch_in_epoch: int = 0  # batches taken from this one
    batches_before: int = 0  # ... and from the finished ones
    # loader worker -> its record (ShardStream)
    workers: dict = field(default_factory=dict)
    skipped_before: int = 0  # bad samples in the finished epochs
    skipped: int = 0  # ... and in all
    # Faults' counts, in all
    retries: int = 0
    unreachable: int = 0


def batches(shards, batch_size, size, seed, rank, world, workers, pos, retries=RETRIES):
    """One rank's endless batches from Position `pos` on, kept up to date."""
    loader = make_loader(shards, batch_size, size, seed, pos.epoch, rank, world, workers,
                         resume=dict(pos.workers), retries=retries)
    while True:
        loader.dataset.epoch_start[:] = [pos.epoch, pos.batches_before]
        for i, b in enumerate(loader):
            # a worker ran dry: with buckets, batch i is not the rank's batch i
            if b["worker"] != i % max(workers, 1) and isinstance(size, dict):
                break
            # placeholders stand where the consumed batches stood
            if (i < pos.batch_in_epoch) != ("consumed" in b):
                raise RuntimeError(f"resume: epoch {pos.epoch} item {i} is not where the "
                                   f"checkpoint put it")
            if i < pos.batch_in_epoch:
                continue
            # the faults since this worker's last batch
            before = pos.workers.get(b["worker"], {})
            pos.retries += b["retries"] - before.get("retries", 0)
            pos.unreachable += b["unreachable"] - before.get("unreachable", 0)
            keys = ("batches", "raw", "skipped", "pooled", "retries", "unreachable")
            pos.workers[b["worker"]] = {k: b[k] for k in keys}
            pos.skipped = pos.skipped_before + sum(w["skipped"] for w in pos.workers.values())
            pos.batch_in_epoch = i + 1
            yield b
        # a whole epoch without one full batch: waiting cannot help
        if pos.batch_in_epoch == 0:
            why = no_batch_message(shards, batch_size, seed, pos.epoch, rank, world, workers)
            raise SystemExit(why)
        pos.skipped_before = pos.skipped
        pos.batches_before += pos.batch_in_epoch
        pos.epoch, pos.batch_in_epoch, pos.workers = pos.epoch + 1, 0, {}


def no_batch_message(shards, batch_size, seed, epoch, rank, world, workers):
    """Why an epoch gave a rank no batch: each worker's samples read."""
    n_workers, faults = max(workers, 1), Faults()
    parts = [worker_shards(shards, seed, epoch, rank, world, w, n_workers)
             for w in range(n_workers)]
    with warnings.catch_warnings():
        # the epoch just warned of each
        warnings.simplefilter("ignore")
        counts = [sum(1 for _ in read_tars(part, wds.ignore_and_continue, faults=faults))
                  for part in parts]
    if faults.unreachable == sum(map(len, parts)):
        return (f"no shard of rank {rank} could be read ({faults.unreachable} unreachable); "
                f"the last: {faults.last}. Check --data's address and its server (pipe: run "
                f"CMD by hand)")
    return (f"epoch {epoch} gave rank {rank} no batch of --batch-size {batch_size}: its "
            f"{n_workers} loader worker(s) read {', '.join(map(str, counts))} samples of "
            f"{len(shards)} shards over {world} rank(s). Use --batch-size "
            f"{max(1, max(counts))} or less, fewer --workers or ranks, or more data.")


# ==== A first read may skip the rest ====
# ---- Shards over a network ----
@dataclass
class Faults:
    """What read_tars met over a network."""
    retries: int = 0  # reopenings after a fault
    unreachable: int = 0  # shards given up
    last: str = ""  # the last shard given up, and why


class ShardLost(Exception):
    """A remote shard given up: not there, or failing past --retries."""


class ShardCut(OSError):
    """A download that ended short, where tar alone would see a clean end."""


# what a shell's exit status says about the client it ran
CLIENT_FAULTS = {126: " (found, not runnable: check its mode)",
                 127: " (not found: install it, or put it on PATH)"}


class Download:
    """A remote file as a file object, read as it arrives."""

    def __init__(self, url):
        self.url, self.process, self.response, self.stalled = url, None, None, False
        if url.startswith(("http://", "https://")):
            self.response = urllib.request.urlopen(http_request(url), timeout=TIMEOUT)
            self.stream = self.response
        else:
            # gs:// as webdataset opens it; pipe:'s command in a shell, in a
            # process group of its own: a stalled one is killed whole
            cmd = ["gsutil", "cat", url] if url.startswith("gs://") else url[len("pipe:"):]
            self.process = subprocess.Popen(cmd, shell=isinstance(cmd, str), bufsize=0,
                                            stdout=subprocess.PIPE, start_new_session=True)
            self.stream = self.process.stdout

    def read(self, n=-1):
        if n < 0:
            return b"".join(iter(lambda: self.read(1 << 16), b""))
        # a pipe has no socket timeout: wait for its bytes TIMEOUT s at most
        if self.process and not select.select([self.stream], [], [], TIMEOUT)[0]:
            self.stalled = True
            raise TimeoutError(f"its client wrote nothing for {TIMEOUT:g} s")
        chunk = self.stream.read(n)
        if not chunk and n:
            self.check_whole()
        return chunk

    def check_whole(self):
        """At the end: ShardCut unless all came (the Content-Length, or the
        client's exit 0)."""
        if self.response and self.response.length:
            raise ShardCut(f"the connection closed {self.response.length} bytes short")
        if self.process and (status := self.process.wait()):
            cut = ShardCut(f"its client exited with status {status}{CLIENT_FAULTS.get(status, '')}")
            cut.status = status
            raise cut

    def close(self):
        self.stream.close()
        # a tar ends before its padding: the client may still be writing
        if self.process:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=0 if self.stalled else 5)
            # a stalled shell may have left a silent child holding the pipe
            if self.stalled or self.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def __enter__(self):
        return self

    def __exit__(self, *error):
        self.close()


def http_request(url):
    """An http(s) URL -> a Request, its user:password sent as Basic auth
    (urllib would take it for part of the host)."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return urllib.request.Request(url)
    host = parts.netloc.rpartition("@")[2]
    request = urllib.request.Request(urllib.parse.urlunsplit(parts._replace(netloc=host)))
    user, password = (urllib.parse.unquote(x or "") for x in (parts.username, parts.password))
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    request.add_header("Authorization", f"Basic {token}")
    return request


def unrecoverable(error):
    """A fault no retry mends: HTTP 4xx but 408 (timeout) and 429 (rate
    limit); a client not found or not runnable (the shell's 127, 126)."""
    if isinstance(error, urllib.error.HTTPError):
        return 400 <= error.code < 500 and error.code not in (408, 429)
    return isinstance(error, FileNotFoundError) or getattr(error, "status", 0) in (126, 127)


def fetch(url, retries=RETRIES):
    """A remote file's bytes; None where the fault is unrecoverable() or its
    client fails (it cannot say why); SystemExit where a server or client
    keeps failing."""
    for attempt in range(retries + 1):
        try:
            with Download(url) as f:
                whole = f.read()
                f.check_whole()
            return whole
        except (OSError, http.client.HTTPException) as e:
            by_client = not url.startswith(("http://", "https://"))
            if unrecoverable(e) or by_client and isinstance(e, ShardCut):
                return None
            if attempt == retries:
                raise SystemExit(f"could not read {masked(url)}: {masked(e)}") from None
            time.sleep(BACKOFF * 2 ** attempt)


# scheme://, up to a space or a quote
URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"]+")


def masked(text):
    """text with URLs' passwords and query values hidden:
    https://user:***@host/x.tar?token=***."""
    def hide(match):
        try:
            parts = urllib.parse.urlsplit(match.group())
            netloc = parts.netloc
            if parts.password is not None:
                user_and_password, _, host = netloc.rpartition("@")
                netloc = f"{user_and_password.partition(':')[0]}:***@{host}"
        except ValueError:
            return match.group().partition("://")[0] + "://***"
        pairs = (q.partition("=") for q in parts.query.split("&") if q)
        query = "&".join(k + "=***" if eq else "***" for k, eq, _ in pairs)
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))
    return URL.sub(hide, str(text))


def is_folder_url(data):
    """--data names a served folder (a URL ending in /)?"""
    return (data.startswith(("http://", "https://", "gs://"))
            and urllib.parse.urlsplit(data).path.endswith("/"))


def beside(shard, name):
    """The file `name` beside a shard, addressed as it is: a path, a URL
    (query kept), or pipe:'s command with its .tar word swapped; None where
    it has none."""
    if shard.startswith("pipe:"):
        words = shard.split(" ")
        named = [i for i, w in enumerate(words) if w.endswith(".tar")]
        if not named:
            return None
        head, slash, _ = words[named[-1]].rpartition("/")
        words[named[-1]] = head + slash + name
        return " ".join(words)
    if shard.startswith(REMOTE):
        parts = urllib.parse.urlsplit(shard)
        folder = parts.path.rpartition("/")[0]
        return urllib.parse.urlunsplit(parts._replace(path=f"{folder}/{name}"))
    return os.path.join(os.path.dirname(shard), name)


def read_beside(shard, name):
    """The JSON file `name` beside a shard; None where there is none."""
    where = beside(shard, name)
    if where is None or not where.startswith(REMOTE):
        return where and read_json(where)
    whole = fetch(where)
    return None if whole is None else json.loads(whole)


def served_shards(folder):
    """A folder URL -> its shards' URLs, as its manifest.json names them."""
    manifest = read_beside(folder, "manifest.json")
    names = [s["name"] if isinstance(s, dict) else s for s in (manifest or {}).get("shards", [])]
    if not names:
        why = "no manifest.json there" if manifest is None else "its manifest.json names no shards"
        raise SystemExit(f"--data {masked(folder)}: {why}. Write it with prepare.py shards, or "
                         f"pass a brace pattern: {masked(folder)}shard-{{00000..00099}}.tar")
    return sorted(beside(folder, n) for n in names)


# ---- Files and JSON ----
def read_text(path):
    """A file's text; None where there is none."""
    return pathlib.Path(path).read_text() if os.path.exists(path) else None


def read_json(path):
    """A JSON file's value; None where there is none."""
    return None if (text := read_text(path)) is None else json.loads(text)


def write_json(path, value):
    """value -> path as JSON."""
    with open(path, "w") as f:
        json.dump(value, f, indent=1)


if __name__ == "__main__":
    raise SystemExit("data.py is read by train.py; the offline tools are prepare.py's: "
                     "python prepare.py shards|emoji|precompute --help")
