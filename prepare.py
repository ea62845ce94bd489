"""prepare.py -- data preparation, offline, before any training: your
captioned pictures -> shards, the emoji set, and the frozen encoders run
once over shards (as nanoGPT's data/*/prepare.py and fast-DiT's
extract_features.py keep this apart from training).

    python prepare.py shards SRC OUT --size 256   # captioned images -> shards
    python prepare.py emoji OUT                   # named pictures, offline
    python prepare.py precompute SRC OUT --vae V  # the frozen encoders, once

A shard is a WebDataset tar: one sample per key, {__key__, jpg, txt,
json}; precompute's hold {latent.npy, text.npy, mask.npy, txt} instead.
Beside the shards, manifest.json names them (a served folder is read
through it) and counts the aspect-ratio buckets; SHA256SUMS checks them
anywhere (`sha256sum -c SHA256SUMS`). train.py reads all of these
through data.py.
"""
import collections
import hashlib
import json
import os
import urllib.parse
import warnings

import numpy as np
import webdataset as wds
from PIL import Image, ImageDraw, ImageFont
from tqdm import tqdm

import data
import model


# ---- Your pictures -> shards ----
def list_images(src):
    """Image folder (sidecar .txt captions) or .csv / .jsonl of path,caption
    -> [(path, caption or None)]."""
    if os.path.isdir(src):
        exts = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
        paths = [os.path.join(src, f) for f in sorted(os.listdir(src)) if f.lower().endswith(exts)]
        caps = [data.read_text(os.path.splitext(p)[0] + ".txt") for p in paths]
        return [(p, c if c is None else c.strip()) for p, c in zip(paths, caps)]
    if not src.endswith((".csv", ".jsonl")):
        raise SystemExit(f"{src}: give an image folder (with .txt captions), a .csv or a "
                         f".jsonl of path,caption")
    import csv
    with open(src, newline="") as f:
        if src.endswith(".csv"):
            rows = list(csv.DictReader(f))
        else:
            rows = [json.loads(line) for line in f if line.strip()]
    # paths relative to the list's folder
    folder = os.path.dirname(os.path.abspath(src))
    return [(os.path.join(folder, r["path"]), r.get("caption")) for r in rows]


def write_shards(src, out, size=256, per_shard=1000, quality=95, multiple=0):
    """Images -> shards {__key__, jpg, txt, json}, manifest.json, SHA256SUMS;
    each cover-cropped to `size` (`multiple`: to its nearest bucket),
    smaller ones skipped."""
    items, skipped, shards = list_images(src), [], []
    sink, n, counts = None, 0, collections.Counter()
    os.makedirs(out, exist_ok=True)
    src_folder = os.path.dirname(os.path.abspath(src))
    for path, caption in tqdm(items, desc=f"shards -> {out}", unit="img"):
        try:
            img = data.to_rgb(data.open_image(path))
            wh = (size, size)
            if multiple:
                wh = data.nearest(data.buckets(size, multiple), *img.size)
            small = img.width < wh[0] or img.height < wh[1]
            why = ("no caption" if caption is None
                   else f"smaller than {wh}: {img.size}" if small else "")
        except Exception as e:
            why = f"unreadable: {e}"
        if why:
            skipped.append(dict(path=path, reason=why))
            continue
        if sink is None or shards[-1]["samples"] == per_shard:
            if sink:
                sink.close()
            shards.append(dict(name=f"shard-{len(shards):05d}.tar", samples=0))
            # mtime 0: the same bytes on every run
            sink = wds.TarWriter(os.path.join(out, shards[-1]["name"] + ".tmp"), mtime=0)
        jpg = data.encoded(data.cover_crop(img, wh), "JPEG", quality=quality)
        counts["%dx%d" % wh] += bool(multiple)
        meta = dict(src=os.path.relpath(path, src_folder), size=img.size)
        sink.write({"__key__": f"{n:09d}", "jpg": jpg, "txt": caption, "json": meta})
        shards[-1]["samples"] += 1
        n += 1
    if sink:
        sink.close()
    for s in shards:
        final = os.path.join(out, s["name"])
        os.replace(final + ".tmp", final)
        with open(final, "rb") as f:
            s["sha256"] = hashlib.file_digest(f, "sha256").hexdigest()
    # check the shards anywhere: sha256sum -c SHA256SUMS
    with open(os.path.join(out, "SHA256SUMS"), "w") as f:
        f.writelines(f"{s['sha256']}  {s['name']}\n" for s in shards)
    manifest = dict(size=size, quality=quality, samples=sum(s["samples"] for s in shards),
                    shards=shards, buckets=+counts, skipped=skipped)
    data.write_json(os.path.join(out, "manifest.json"), manifest)
    print(f"{manifest['samples']} images -> {len(shards)} shards in {out}; {len(skipped)} skipped"
          + "".join(f"\n  bucket {k}: {v}" for k, v in sorted((+counts).items()))
          + "".join(f"\n  skipped {s['path']}: {s['reason']}" for s in skipped))
    return manifest


# ---- The emoji set: real named pictures, offline ----
EMOJI_FONT = "/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf"
# code-point ranges of the Unicode emoji charts' groups
EMOJI_CATEGORIES = {
    "animals": [(0x1F400, 0x1F43F), (0x1F54A, 0x1F54A), (0x1F577, 0x1F578),
                (0x1F980, 0x1F9AE), (0x1FAB0, 0x1FABF)],
    "plants": [(0x1F330, 0x1F344), (0x1F490, 0x1F490), (0x1FAB4, 0x1FAB7)],
    "food": [(0x1F32D, 0x1F32F), (0x1F345, 0x1F37F), (0x1F950, 0x1F96F),
             (0x1F9C0, 0x1F9CB), (0x1FAD0, 0x1FADF)],
    "faces": [(0x1F600, 0x1F64F), (0x1F910, 0x1F92F), (0x1F970, 0x1F97A),
              (0x1F9D0, 0x1F9D0), (0x1FAE0, 0x1FAE8)],
}
EMOJI_WORDINGS = ["{name}", "an emoji of the {name}", "a picture of the {name}",
                  "the {name}, drawn as an emoji"]
# the evaluation's wording, never trained on
EMOJI_HELDOUT = "a small icon showing the {name}"


def emoji_glyphs(categories, font=EMOJI_FONT):
    """-> [(code point, name, RGBA image)]: the categories' named emoji
    that the font draws."""
    import unicodedata
    if not os.path.exists(font):
        raise SystemExit(f"{font}: no emoji font; install it (Debian/Ubuntu: apt-get install "
                         f"fonts-noto-color-emoji) or pass --font FILE.ttf")
    # the one size Noto's colour bitmaps come in
    face = ImageFont.truetype(font, 109)

    def draw(ch):
        img = Image.new("RGBA", (160, 160), (0, 0, 0, 0))
        ImageDraw.Draw(img).text((8, 8), ch, font=face, embedded_color=True)
        return img

    if unknown := set(categories) - set(EMOJI_CATEGORIES) - {"all"}:
        raise SystemExit(f"--categories: unknown {sorted(unknown)}; choose from "
                         f"{sorted(EMOJI_CATEGORIES)} or all")
    if "all" in categories:
        ranges = [(0x2000, 0x1FAFF)]
    else:
        ranges = [r for c in categories for r in EMOJI_CATEGORIES[c]]
    # what the font draws for a code point it lacks
    tofu, out = np.asarray(draw(chr(0x10FFFD))), []
    flag_letters_and_skin_tones = {*range(0x1F1E6, 0x1F200), *range(0x1F3FB, 0x1F400)}
    code_points = {cp for a, b in ranges for cp in range(a, b + 1)}
    for cp in sorted(code_points - flag_letters_and_skin_tones):
        ch = chr(cp)
        if unicodedata.category(ch) == "So" and unicodedata.name(ch, ""):
            img = draw(ch)
            if img.getbbox() and not np.array_equal(np.asarray(img), tofu):
                out.append((cp, unicodedata.name(ch).lower(), img))
    return out


def make_emoji(out, categories=("animals", "food"), size=32, font=EMOJI_FONT, glyphs=None):
    """Glyphs (or `glyphs`: [(id, name, RGBA)]) -> OUT/images/,
    OUT/captions.jsonl (every wording), shards, OUT/names.json."""
    glyphs = emoji_glyphs(categories, font) if glyphs is None else glyphs
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    rows, names, images = [], [], []
    for cp, name, img in glyphs:
        img = img.crop(img.getbbox())
        # a 5% margin on each side, as the font's own em box has
        side = round(max(img.size) * 1.1)
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
    data.write_json(os.path.join(out, "names.json"),
               dict(names=names, images=images, heldout=EMOJI_HELDOUT, wordings=EMOJI_WORDINGS,
                    size=size, background=data.BACKGROUND, categories=list(categories)))
    print(f"{len(names)} names x {len(EMOJI_WORDINGS)} wordings -> {out}; "
          f"held-out wording: {EMOJI_HELDOUT!r}")
    return manifest


# ---- The frozen encoders, once: latents and token states ----
def warn_and_go_on(error):
    """read_tars' handler: warn of a bad tar (its URL masked), read on."""
    warnings.warn(data.masked(repr(error)))
    return True


def precompute(src, out, vae="none", text_encoder="minilm", image_size=32, batch_size=32,
               device=None):
    """Raw shards -> shards {latent.npy, text.npy (fp16), mask.npy, txt},
    one per shard; a rerun skips the finished ones."""
    device = device or model.device()
    meta = dict(vae=vae, text_encoder=text_encoder, image_size=image_size,
                source=data.masked(src))
    shards = data.resolve_shards(src, image_size)
    old = data.read_json(os.path.join(out, "precompute.json"))
    if data.bucket_shares(shards, image_size, 1):
        raise SystemExit(f"{data.masked(src)}: several aspect ratios; precompute writes one "
                         f"square size: train on these shards")
    if old not in (None, meta):
        raise SystemExit(f"{out} holds shards precomputed with {old}; resume with those "
                         f"flags, or write a new folder")
    # a one-off pass caches nothing
    enc = model.TextEncoder(text_encoder, device, cache_size=0)
    ae = model.load_vae(vae, device)
    os.makedirs(out, exist_ok=True)
    # train.py checks its flags against this
    data.write_json(os.path.join(out, "precompute.json"), meta)
    todo = [s for s in shards if not os.path.exists(os.path.join(out, shard_name(s)))]
    skipped = 0
    print(f"{len(shards) - len(todo)} of {len(shards)} shards already done")
    for shard in tqdm(todo, desc=f"precompute -> {out}", unit="shard"):
        dst = os.path.join(out, shard_name(shard))
        # a shard under its own name is finished
        with wds.TarWriter(dst + ".tmp", mtime=0) as sink:
            samples = list(data.read_tars([shard], warn_and_go_on, retries=data.RETRIES))
            for i in range(0, len(samples), batch_size):
                part = [(s, data.decode(s, [(image_size, image_size)]))
                        for s in samples[i:i + batch_size]]
                ok = [(s, x) for s, x in part if x is not None]
                skipped += len(part) - len(ok)
                if not ok:
                    continue
                b = data.collate([x for _, x in ok])
                x = b["image"] if ae is None else ae.encode(b["image"])
                text, mask = enc(b["caption"])
                for j, (s, _) in enumerate(ok):
                    n = int(mask[j].sum())
                    sink.write({"__key__": s["__key__"], "latent.npy": x[j].cpu().half().numpy(),
                                "text.npy": text[j, :n].cpu().half().numpy(),
                                "mask.npy": mask[j, :n].cpu().numpy(), "txt": b["caption"][j]})
        os.replace(dst + ".tmp", dst)
    print(f"{len(shards)} shards in {out}; bad samples skipped: {skipped}")


def shard_name(shard):
    """A shard's file name, however it is addressed."""
    if shard.startswith("pipe:"):
        shard = next((w for w in reversed(shard.split(" ")) if w.endswith(".tar")), shard)
    elif shard.startswith(data.REMOTE):
        shard = urllib.parse.urlsplit(shard).path
    return shard.rpartition("/")[2]


# ---- The command line ----
def get_parser():
    """prepare.py's command line."""
    import argparse
    p = argparse.ArgumentParser(
        description="Data preparation, offline: shards, the emoji set, precompute.")
    sub = p.add_subparsers(dest="command", required=True, help="each has --help")

    s = sub.add_parser("shards", help="captioned images -> shards, manifest.json, SHA256SUMS")
    a = s.add_argument
    a("src", help="image folder (+ .txt captions), or a .csv/.jsonl of path,caption")
    a("out", help="output folder")
    a("--size", type=int, default=256, help="square side in pixels; smaller images skipped")
    a("--per-shard", type=int, default=1000, help="images per shard")
    a("--quality", type=int, default=95, help="JPEG quality")
    a("--buckets", type=int, default=0, metavar="M",
      help="keep aspect ratios: 5 buckets 1:2..2:1 of ~size^2 pixels, sides multiples of M "
           "(patch x VAE factor)")
    s.set_defaults(run=lambda args: write_shards(
        args.src, args.out, args.size, args.per_shard, args.quality, args.buckets))

    e = sub.add_parser("emoji", help="Noto Color Emoji -> images, captions, shards, names.json")
    a = e.add_argument
    a("out", help="output folder")
    a("--categories", default="animals,food",
      help=f"comma-separated {','.join(EMOJI_CATEGORIES)} or all")
    a("--size", type=int, default=32, help="square side in pixels")
    a("--font", default=EMOJI_FONT, help="a colour emoji font with 109-px bitmaps")
    e.set_defaults(run=lambda args: make_emoji(
        args.out, args.categories.split(","), args.size, args.font))

    c = sub.add_parser("precompute", help="raw shards -> fp16 latents, text states, masks")
    a = c.add_argument
    a("src", help="raw shards, as train.py's --data")
    a("out", help="output folder (rerun to resume)")
    a("--vae", default="none", help="as train.py's ('none': pixels)")
    a("--text-encoder", default="minilm", help="as train.py's")
    a("--image-size", type=int, default=32, help="as train.py's")
    a("--batch-size", type=int, default=32, help="images per encoder call")
    c.set_defaults(run=lambda args: precompute(
        args.src, args.out, args.vae, args.text_encoder, args.image_size, args.batch_size))
    return p


if __name__ == "__main__":
    a = get_parser().parse_args()
    a.run(a)
