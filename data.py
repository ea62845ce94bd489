"""data.py -- what the model eats: the built-in shapes, images <-> tensors, WebDataset streaming, offline tools.

    python data.py shards SRC OUT --size 256    # your captioned images -> shards + manifest.json + SHA256SUMS
    python data.py emoji OUT                    # real pictures with real names, offline (Noto Color Emoji)
    python data.py precompute SRC OUT --vae V   # the frozen encoders, once: fp16 latents + text states

  * built-in data a 2-core CPU learns in minutes *and* a program can grade: 3 shapes x 6 colours x 5 positions
    (24,000 images of 32 px in 16 shards, 6 caption templates; 2 more held out for evaluation), so "does the
    picture show what its caption says?" is a number (sample.judge);
  * streaming by hand: shard shuffle -> this rank's and this loader worker's shards -> tar samples -> shuffle
    buffer -> decode -> batches; a bad sample is skipped and counted. The order is a pure function of (seed,
    epoch, rank, worker) and a Position records how far each worker got: that is what makes `--resume` exact;
  * any picture a user brings (transparent, palette, 16-bit, a phone photo stored sideways) becomes upright RGB
    the same way (`to_rgb`); precompute runs the frozen VAE and text encoder (model.py) once instead of per step.
"""
import contextlib
import hashlib
import io
import json
import math
import os
import random
import shutil
import signal
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import webdataset as wds
from PIL import Image, ImageDraw, ImageOps

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
VERSION = 2  # bump when the generator changes, so stale shards are never reused


def render(color, shape, pos, size=32, rng=None):
    """Draw one shape (4x supersampled, then box-filtered) -> PIL RGB image of size x size."""
    rng, S = rng or random.Random(0), 4 * size
    grey = rng.randint(0, 60)
    img = Image.new("RGB", (S, S), (grey, grey, grey))
    fx, fy = POSITIONS[pos]
    cx, cy = (fx + rng.uniform(-0.03, 0.03)) * S, (fy + rng.uniform(-0.03, 0.03)) * S
    r = rng.uniform(0.19, 0.25) * S  # half extent: big enough that corners tell square from circle
    draw, box = ImageDraw.Draw(img), [cx - r, cy - r, cx + r, cy + r]
    if shape == "circle":
        draw.ellipse(box, fill=COLORS[color])
    elif shape == "square":
        draw.rectangle(box, fill=COLORS[color])
    else:  # triangle, apex up
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLORS[color])
    return img.resize((size, size), Image.BOX)


def random_caption(rng):
    """-> (caption, attributes) for a uniformly drawn colour, shape and position."""
    attrs = dict(color=rng.choice(list(COLORS)), shape=rng.choice(SHAPES), position=rng.choice(list(POSITIONS)))
    text = rng.choice(TEMPLATES).format(color=attrs["color"], shape=attrs["shape"], pos=attrs["position"])
    return text, attrs


def heldout_prompts(n_each=1):
    """Every colour x shape x position, worded with templates never used in training."""
    combos = [(c, s, p) for c in COLORS for s in SHAPES for p in POSITIONS]
    return [(HELDOUT_TEMPLATES[(i + k) % len(HELDOUT_TEMPLATES)].format(color=c, shape=s, pos=p),
             dict(color=c, shape=s, position=p)) for k in range(n_each) for i, (c, s, p) in enumerate(combos)]


def make_builtin(root, size=32, n_shards=16, per_shard=1500, seed=0):
    """Write the built-in dataset as WebDataset shards {__key__, png, txt, json} (idempotent)."""
    if os.path.exists(os.path.join(root, "DONE")):
        return tars(root)
    from tqdm import tqdm
    tmp = f"{root}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    for shard in tqdm(range(n_shards), desc=f"generating built-in data -> {root}", unit="shard"):
        rng = random.Random(f"{seed}-{size}-{shard}")  # each shard reproducible on its own
        with wds.TarWriter(os.path.join(tmp, f"shapes-{shard:04d}.tar"), mtime=0) as sink:
            for i in range(per_shard):
                text, a = random_caption(rng)
                png = encoded(render(a["color"], a["shape"], a["position"], size, rng), "PNG")
                sink.write({"__key__": f"{shard:04d}{i:06d}", "png": png, "txt": text, "json": a})
    open(os.path.join(tmp, "DONE"), "w").close()
    try:
        os.replace(tmp, root)  # atomic: a half-written dataset is never seen as done
    except OSError:  # another process finished first, or `root` is something else
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.exists(os.path.join(root, "DONE")):
            raise SystemExit(f"{root} exists but is not a finished built-in dataset: remove it and rerun")
    return make_builtin(root, size, n_shards, per_shard, seed)


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
    """to_rgb, cover-resize (bicubic, antialiased) the short side to `size`, centre-crop: the same crop everywhere."""
    img = to_rgb(img)
    if img.size != (size, size):
        s = size / min(img.size)
        img = img.resize((max(size, round(img.width * s)), max(size, round(img.height * s))), Image.BICUBIC)
        l, t = (img.width - size) // 2, (img.height - size) // 2
        img = img.crop((l, t, l + size, t + size))
    return img


def to_tensor(img, size):
    """PIL image -> (3, size, size) float in [-1, 1] (other sizes go through cover_crop)."""
    return torch.from_numpy(np.asarray(cover_crop(img, size)).copy()).permute(2, 0, 1).float() / 127.5 - 1


def as_uint8(x):
    """Images in [-1, 1], (N, 3, H, W) or (3, H, W) -> uint8: what PNGs and every feature network here take."""
    return ((x.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


def to_pil(x):
    """(3, H, W) tensor, uint8 or in [-1, 1] -> PIL image."""
    return Image.fromarray((x if x.dtype == torch.uint8 else as_uint8(x)).permute(1, 2, 0).cpu().numpy())


def stack_uint8(images, size):
    """PIL images -> uint8 (N, 3, size, size), each cropped by to_tensor as a training image is."""
    return as_uint8(torch.stack([to_tensor(im, size) for im in images]))


# ---- WebDataset streaming: shards -> (rank, worker) split -> samples -> shuffle buffer -> batches -------------------
def tars(folder):
    """The .tar files of a folder, sorted."""
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".tar"))


def resolve_shards(data, image_size):
    """--data value -> sorted list of .tar paths (the built-in set is generated if missing)."""
    if data == BUILTIN:
        return make_builtin(os.path.join("data", f"shapes{image_size}-v{VERSION}"), size=image_size)
    paths = tars(data) if os.path.isdir(data) else sorted(p for p in data.split(",") if p)
    if not paths or not all(os.path.exists(p) for p in paths):
        raise SystemExit(f"--data {data!r}: no .tar shards found; pass a folder of shards, "
                         f"comma-separated .tar paths, or '{BUILTIN}'")
    return paths


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


def decode(s, size):
    """Tar sample -> raw {image (3, size, size), caption} or precomputed {latent, text, mask}; None, with a
    warning, for a bad one (undecodable image, no caption): it is skipped, never a crash."""
    try:
        if "latent.npy" in s:  # written by `python data.py precompute`: the frozen encoders already ran
            arr = {k: torch.from_numpy(np.load(io.BytesIO(s[k + ".npy"]))) for k in ("latent", "text", "mask")}
            if arr["text"].shape[0] != arr["mask"].shape[0]:
                raise ValueError("text.npy and mask.npy disagree in length")
            return arr
        key = next((k for k in ("png", "jpg", "jpeg", "webp") if k in s), None)
        if key is None or "txt" not in s:
            raise ValueError(f"no {'image (png/jpg/jpeg/webp)' if key is None else 'caption (txt)'} in sample")
        return dict(image=to_tensor(open_image(s[key]), size), caption=s["txt"].decode("utf-8"))
    except Exception as e:
        warnings.warn(f"skipping bad sample {s.get('__key__')!r} in {s.get('__url__')}: {e}")


def shuffled(it, bufsize, rng):
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


def collate(items):
    """Samples -> a batch: images stacked, captions listed; precomputed text padded to the longest."""
    if "image" in items[0]:
        return dict(image=torch.stack([x["image"] for x in items]), caption=[x["caption"] for x in items])
    text, mask = model.pad([x["text"] for x in items], [x["mask"] for x in items])
    return dict(latent=torch.stack([x["latent"] for x in items]), text=text, mask=mask)


class ShardStream(torch.utils.data.IterableDataset):
    """One epoch of one rank's batches: collate()'s dicts, each with where its loader worker stands (`worker`, `batches`
    so far, `raw` tar samples read, bad ones included, `skipped`); `resume` = {worker: those three}: see pass_over."""

    def __init__(self, shards, batch_size, image_size, seed=0, epoch=0, rank=0, world=1, buffer=1000, resume=None):
        super().__init__()
        self.shards, self.B, self.size = list(shards), batch_size, image_size
        self.seed, self.epoch, self.rank, self.world, self.buffer = seed, epoch, rank, world, buffer
        self.resume = resume or {}

    def __iter__(self):
        """This worker's shards -> tar samples -> shuffle buffer -> decode (bad ones skipped) -> batches of B."""
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        mine = worker_shards(self.shards, self.seed, self.epoch, self.rank, self.world, wid, nw)
        rng = random.Random(f"samples-{self.seed}-{self.epoch}-{self.rank}-{wid}")
        self.skipped = 0
        stream = shuffled(read_tars(mine, handler=self.unreadable), self.buffer, rng)
        done = self.resume.get(wid, dict(batches=0, raw=0, skipped=0))
        yield from self.pass_over(stream, done, wid)
        raw, self.skipped, items = done["raw"], done["skipped"], []  # (what pass_over met was counted before)
        for s in stream:
            raw += 1
            item = decode(s, self.size)
            if item is None:
                self.skipped += 1
                continue
            items.append(item)
            if len(items) == self.B:
                done = dict(batches=done["batches"] + 1, raw=raw, skipped=self.skipped)
                yield dict(collate(items), worker=wid, **done)
                items = []
        # the final partial batch is dropped so every step sees the same batch size

    def unreadable(self, exn):
        """read_tars' handler: a truncated or corrupt tar is warned about and counted; the next shard is read."""
        self.skipped += 1
        warnings.warn(f"skipping unreadable shard data: {exn!r}")
        return True

    def pass_over(self, stream, done, wid):
        """Resume: read the worker's `raw` consumed samples *without decoding them*, then yield `batches`
        placeholders, so the DataLoader interleaves the workers exactly as before, at the cost of a tar read."""
        for _ in zip(range(done["raw"]), stream):
            pass
        for _ in range(done["batches"]):
            yield dict(consumed=True, worker=wid)


def make_loader(shards, batch_size, image_size, seed, epoch, rank=0, world=1, workers=1, resume=None):
    """DataLoader over one epoch; batching happens in the stream, so batch_size=None here."""
    ds = ShardStream(shards, batch_size, image_size, seed, epoch, rank, world, resume=resume)
    # an explicit generator keeps DataLoader from drawing its base seed from the global RNG
    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, worker_init_fn=leave_stops_to_rank,
                                       generator=torch.Generator().manual_seed(seed))


def leave_stops_to_rank(worker_id):
    """Workers ignore TERM and USR1 (sent to every process by torchrun, Slurm): one killed would crash its rank."""
    for s in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(s, signal.SIG_IGN)


@dataclass
class Position:
    """Where one rank stands in its data: every checkpoint saves it, so a resume reads on from exactly there."""
    epoch: int = 0                                # epochs finished
    batch_in_epoch: int = 0                       # batches taken from this one
    workers: dict = field(default_factory=dict)   # loader worker -> its {batches, raw, skipped} in this epoch
    skipped_before: int = 0                       # bad samples skipped in the finished epochs
    skipped: int = 0                              # ... and in all


def batches(shards, batch_size, image_size, seed, rank, world, workers, pos):
    """One rank's endless batches, epoch after epoch, from Position `pos` on, which they keep up to date."""
    while True:
        loader = make_loader(shards, batch_size, image_size, seed, pos.epoch, rank, world, workers,
                             resume=dict(pos.workers))
        for i, b in enumerate(loader):
            if (i < pos.batch_in_epoch) != ("consumed" in b):  # placeholders stand where consumed batches stood
                raise RuntimeError(f"resume: epoch {pos.epoch} item {i} is not where the checkpoint put it")
            if i < pos.batch_in_epoch:
                continue
            pos.workers[b["worker"]] = {k: b[k] for k in ("batches", "raw", "skipped")}
            pos.skipped = pos.skipped_before + sum(w["skipped"] for w in pos.workers.values())
            pos.batch_in_epoch = i + 1
            yield b
        if pos.batch_in_epoch == 0:  # a whole epoch without one full batch: waiting longer cannot help
            raise SystemExit(no_batch_message(shards, batch_size, seed, pos.epoch, rank, world, workers))
        pos.skipped_before = pos.skipped
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


# ==== What a first read may skip: files written whole, the offline tools (converter, emoji, precompute), the CLI ====
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
    if os.path.exists(path):
        with open(path) as f:
            return f.read()


def read_json(path):
    """A JSON file's value; None where there is no such file."""
    text = read_text(path)
    return None if text is None else json.loads(text)


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


def write_shards(src, out, size=256, per_shard=1000, quality=95):
    """Images -> WebDataset shards {__key__, jpg, txt, json} (cover_crop to `size`), manifest.json (sha256, counts,
    skips) and SHA256SUMS; smaller images are skipped, never upsampled (the seed's LAION rule), and corrupt ones."""
    from tqdm import tqdm
    items, skipped, shards, sink, n = list_images(src), [], [], None, 0
    os.makedirs(out, exist_ok=True)
    for path, caption in tqdm(items, desc=f"shards -> {out}", unit="img"):
        try:
            img = open_image(path)
            small = min(img.size) < size
            why = "no caption" if caption is None else f"smaller than {size}: {img.size}" if small else ""
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
        jpg = encoded(cover_crop(img, size), "JPEG", quality=quality)
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
                    skipped=skipped)
    write_json(os.path.join(out, "manifest.json"), manifest)
    print(f"{manifest['samples']} images -> {len(shards)} shards in {out}; {len(skipped)} skipped"
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
    from PIL import ImageFont
    if not os.path.exists(font):
        raise SystemExit(f"{font}: no emoji font; install it (Debian/Ubuntu: apt-get install fonts-noto-color-emoji)"
                         f" or pass --font FILE.ttf")
    face = ImageFont.truetype(font, 109)  # the one size Noto's colour bitmaps come in

    def draw(ch):
        img = Image.new("RGBA", (160, 160), (0, 0, 0, 0))
        ImageDraw.Draw(img).text((8, 8), ch, font=face, embedded_color=True)
        return img

    unknown = set(categories) - set(EMOJI_CATEGORIES) - {"all"}
    if unknown:
        raise SystemExit(f"--categories: unknown {sorted(unknown)}; choose from {sorted(EMOJI_CATEGORIES)} or all")
    ranges = [(0x2000, 0x1FAFF)] if "all" in categories else [r for c in categories for r in EMOJI_CATEGORIES[c]]
    tofu, out = np.asarray(draw(chr(0x10FFFD))), []  # what the font draws for a code point it lacks
    for cp in sorted({cp for a, b in ranges for cp in range(a, b + 1)}):
        ch = chr(cp)
        if unicodedata.category(ch) != "So" or not unicodedata.name(ch, "") or 0x1F1E6 <= cp <= 0x1F1FF \
                or 0x1F3FB <= cp <= 0x1F3FF:
            continue
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


def names_set(folder, size):
    """A names set (`python data.py emoji` writes names.json beside its shards) with its one real picture per name,
    prepared as the converter prepares it, as uint8 (N, 3, size, size) under "real"; None for other data."""
    names = read_json(os.path.join(folder, "names.json")) if os.path.isdir(folder) else None  # (also 'builtin')
    if names is None:
        return None
    real = stack_uint8([open_image(os.path.join(folder, p)) for p in names["images"]], size)
    return dict(names, root=folder, real=real)


def precompute(src, out, vae="none", text_encoder="minilm", image_size=32, batch_size=32, device=None):
    """Raw shards -> shards of {latent.npy, text.npy (fp16; real tokens), mask.npy, txt}, one per input shard, same
    order. Resumable: a finished shard exists under its final name (written to .tmp, then renamed) and is skipped."""
    from tqdm import tqdm
    device = device or model.device()
    meta = dict(vae=vae, text_encoder=text_encoder, image_size=image_size, source=src)
    old = read_json(os.path.join(out, "precompute.json"))
    if old not in (None, meta):  # resuming must not mix encodings
        raise SystemExit(f"{out} holds shards precomputed with {old}; resume with those flags, or write to a new "
                         f"folder")
    # cache_size=0: a one-off pass keeps nothing (each caption's states are the same bits either way)
    enc = model.TextEncoder(text_encoder, device, cache_size=0)
    shards, ae = resolve_shards(src, image_size), model.load_vae(vae, device)
    os.makedirs(out, exist_ok=True)
    write_json(os.path.join(out, "precompute.json"), meta)  # train.py checks its flags against this
    todo = [s for s in shards if not os.path.exists(os.path.join(out, os.path.basename(s)))]
    print(f"{len(shards) - len(todo)} of {len(shards)} shards already done")
    skipped = 0
    for shard in tqdm(todo, desc=f"precompute -> {out}", unit="shard"):
        dst = os.path.join(out, os.path.basename(shard))
        with wds.TarWriter(dst + ".tmp", mtime=0) as sink:
            samples = list(read_tars([shard], handler=lambda e: warnings.warn(repr(e)) or True))
            for i in range(0, len(samples), batch_size):
                part = [(s, decode(s, image_size)) for s in samples[i:i + batch_size]]
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


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(description="The offline tools: shard converter, emoji set, precompute.")
    sub = p.add_subparsers(dest="command", required=True, help="shards | emoji | precompute (each has --help)")
    s = sub.add_parser("shards", help="image folder / CSV / JSONL -> WebDataset shards + manifest.json + SHA256SUMS")
    s.add_argument("src", help="image folder with sidecar .txt captions, or a .csv/.jsonl with path,caption")
    s.add_argument("out", help="output folder for shard-XXXXX.tar, manifest.json and SHA256SUMS")
    s.add_argument("--size", type=int, default=256, help="square side in pixels (smaller images are skipped)")
    s.add_argument("--per-shard", type=int, default=1000, help="images per shard")
    s.add_argument("--quality", type=int, default=95, help="JPEG quality")
    e = sub.add_parser("emoji", help="the Noto Color Emoji font -> images + captions + shards + names.json")
    e.add_argument("out", help="output folder (images/, captions.jsonl, shard-XXXXX.tar, manifest.json, names.json)")
    e.add_argument("--categories", default="animals,food", help=f"comma-separated {','.join(EMOJI_CATEGORIES)} or all")
    e.add_argument("--size", type=int, default=32, help="square side in pixels of the shards' images")
    e.add_argument("--font", default=EMOJI_FONT, help="a colour emoji font with 109-px bitmaps (Noto Color Emoji)")
    c = sub.add_parser("precompute", help="raw shards -> shards of fp16 latents + text states + mask")
    c.add_argument("src", help="raw shard folder (or 'builtin')")
    c.add_argument("out", help="output folder (finished shards are skipped, so rerun to resume)")
    c.add_argument("--vae", default="none", help="as train.py --vae: 'none' keeps pixels, else hub id / folder")
    c.add_argument("--text-encoder", default="minilm", help="as train.py --text-encoder")
    c.add_argument("--image-size", type=int, default=32, help="pixels, as train.py --image-size")
    c.add_argument("--batch-size", type=int, default=32, help="images per encoder call")
    a = p.parse_args()
    if a.command == "shards":
        write_shards(a.src, a.out, a.size, a.per_shard, a.quality)
    elif a.command == "emoji":
        make_emoji(a.out, a.categories.split(","), a.size, a.font)
    else:
        precompute(a.src, a.out, a.vae, a.text_encoder, a.image_size, a.batch_size)
