"""train.py -- train the MM-DiT with rectified flow. `python train.py` is the whole CPU demo.

Reads in execution order: flags -> device -> data, frozen text encoder, model, EMA, optimiser,
schedule -> (resume) -> the loop (batch -> encode captions -> drop 10% of them -> flow loss ->
AdamW step -> EMA) with logging, sample grids and atomic checkpoints -> final judged accuracy.

Distributed runs are the same file under torchrun (`--dist ddp` or `--dist deepspeed`), keyed off
the RANK variable torchrun sets, so plain `python train.py` needs no launcher. Everything lives in
functions and runs only under __main__, so the tests and profile.py reuse the very same parser
and step. Resume is exact: the checkpoint holds model, EMA, optimiser,
schedule, step, flags, every RNG state and the data position (epoch, batch within the epoch); the
data order is a pure function of (seed, epoch, rank, worker), so skipping the consumed batches of
the current epoch puts the stream exactly where it was.
"""
import argparse
import copy
import json
import math
import os
import random
import shutil
import signal
import sys
import time

import torch
import torch.distributed as dist

import data
import flow
from model import DiT, count_params
from moe import balance_loss, routing_stats, upcycle


# -----------------------------------------------------------------------------------------------
# Flags
# -----------------------------------------------------------------------------------------------
def get_parser():
    p = argparse.ArgumentParser(description="Train a text-to-image MM-DiT with rectified flow.")
    a = p.add_argument
    a("--data", default=data.BUILTIN, help="folder of WebDataset .tar shards, comma-separated .tar paths, "
      "or 'builtin' (captioned shapes, generated on first use)")
    a("--text-encoder", default="minilm", help="'minilm' (offline, pip package) or a CLIP hub id / local folder")
    a("--text-cache", type=int, default=100_000, help="distinct captions whose encoding is kept (0 = encode every "
      "batch afresh: the online cost profile.py compares against)")
    a("--vae", default="none", help="'none' = train on pixels; else a diffusers AutoencoderKL hub id or local "
      "folder (e.g. stabilityai/sd-vae-ft-mse): frozen, the model learns its latents")
    a("--image-size", type=int, default=32, help="training resolution in pixels")
    a("--width", type=int, default=192, help="transformer width D")
    a("--depth", type=int, default=4, help="number of dual-stream layers")
    a("--heads", type=int, default=4, help="attention heads (width must divide by it)")
    a("--patch", type=int, default=4, help="patch size p: image tokens N = (image_size / p)^2")
    a("--moe", type=int, default=0, help="experts per image-stream MLP (DiT-MoE); 0 = dense")
    a("--topk", type=int, default=2, help="experts each image token is routed to")
    a("--shared-experts", type=int, default=2, help="always-on shared experts per MoE layer (DiT-MoE uses 2)")
    a("--moe-impl", default="sorted", choices=["loop", "sorted"], help="MoE dispatch: readable loop or sorted slices")
    a("--expert-hidden", type=int, default=None, help="hidden size of each expert (default: dense / (topk + shared))")
    a("--upcycle", default=None, help="dense checkpoint to start an --moe run from (every expert a copy of its MLP)")
    a("--dist", default="none", choices=["none", "ddp", "deepspeed"], help="none: one process; ddp: PyTorch DDP "
      "under torchrun (gloo on CPU, NCCL on CUDA); deepspeed: ZeRO-2 under torchrun. Global batch = "
      "--batch-size x world size")
    a("--attn", default="sdpa", choices=["manual", "sdpa"],
      help="manual softmax(QK^T/sqrt d)V or F.scaled_dot_product_attention")
    a("--batch-size", type=int, default=64, help="images per step (per rank)")
    a("--steps", type=int, default=1500, help="optimiser steps")
    a("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    a("--warmup", type=int, default=100, help="linear warm-up steps before the cosine decay")
    a("--t-dist", default="logit-normal", choices=["uniform", "logit-normal"], help="training time distribution")
    a("--cfg-drop", type=float, default=0.1, help="probability of dropping a caption (for classifier-free guidance)")
    a("--ema", type=float, default=0.995, help="EMA decay of the weights used for sampling")
    a("--precision", default=None, choices=["fp32", "bf16"], help="default: bf16 autocast on CUDA, fp32 on CPU")
    a("--compile", action="store_true", help="torch.compile the training forward/backward")
    a("--seed", type=int, default=0, help="seed for data order, noise, times and caption drop")
    a("--workers", type=int, default=1, help="data-loader worker processes")
    a("--out", default="out/run", help="run folder: ckpt.pt, args.json, log.jsonl, samples/")
    a("--resume", action="store_true", help="continue exactly from <out>/ckpt.pt")
    a("--auto-resume", action="store_true", help="resume if <out>/ckpt.pt exists, else start fresh (requeued jobs)")
    a("--log-every", type=int, default=10, help="steps between log.jsonl lines")
    a("--sample-every", type=int, default=500, help="steps between EMA sample grids (0 = only at the end)")
    a("--ckpt-every", type=int, default=500, help="steps between checkpoints (and one at the end)")
    a("--cfg", type=float, default=5.0, help="guidance scale w for samples and the final evaluation")
    a("--sample-steps", type=int, default=25, help="Euler steps for samples and the final evaluation")
    a("--eval-n", type=int, default=2,
      help="final evaluation: samples per held-out colour x shape x position (0 = skip)")
    return p


def get_args(argv=None, parser=None):
    """Parse and check the flags; `parser` lets profile.py add its own to the very same set."""
    p = parser or get_parser()
    args = p.parse_args(argv)
    if args.image_size % args.patch:  # (with a VAE, setup() checks the latent size too)
        ok = [q for q in (1, 2, 4, 8, 16) if args.image_size % q == 0]
        p.error(f"--patch {args.patch} does not divide --image-size {args.image_size}; use one of {ok}")
    if args.width % args.heads or (args.width // args.heads) % 2 or args.width % 4:
        p.error(f"--width {args.width} must be a multiple of 4 and of --heads {args.heads} with an even head size")
    if args.moe and not 1 <= args.topk <= args.moe:
        p.error(f"--topk {args.topk} must be between 1 and --moe {args.moe}")
    if args.upcycle and not (args.moe and os.path.exists(args.upcycle)):
        p.error("--upcycle needs --moe E and an existing dense checkpoint (e.g. out/run/ckpt.pt)")
    if not 0 <= args.cfg_drop < 1:
        p.error("--cfg-drop must be in [0, 1)")
    if args.dist != "none" and "RANK" not in os.environ:
        p.error(f"--dist {args.dist} needs a launcher: torchrun --nproc_per_node N train.py --dist {args.dist} ... "
                "(or sbatch run.slurm)")
    args.resume = args.resume or (args.auto_resume and os.path.exists(os.path.join(args.out, "ckpt.pt")))
    if args.resume and not os.path.exists(os.path.join(args.out, "ckpt.pt")):
        p.error(f"--resume: no checkpoint at {args.out}/ckpt.pt; drop --resume to start fresh")
    return args


# -----------------------------------------------------------------------------------------------
# Set-up
# -----------------------------------------------------------------------------------------------
def setup(args):
    """Device, process group, seeds, encoder, model, EMA, optimiser, schedule -> a dict the loop uses."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rank, local_rank, world = 0, 0, 1
    if args.dist != "none":  # torchrun sets these; plain `python train.py` never gets here
        rank, local_rank, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
        if dev == "cuda":
            torch.cuda.set_device(local_rank)  # "cuda" now means this process's own GPU
        dist.init_process_group("nccl" if dev == "cuda" else "gloo")
    if args.precision is None:
        args.precision = "bf16" if dev == "cuda" else "fp32"
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    vae = data.load_vae(args.vae, dev)  # frozen; None = pixel space
    encoder = data.TextEncoder(args.text_encoder, device=dev, cache_size=args.text_cache)
    size = args.image_size // (vae.factor if vae else 1)  # the model sees latents of this side
    if vae and (args.image_size % vae.factor or size % args.patch):
        raise SystemExit(f"--vae shrinks {args.image_size} px by {vae.factor} to {args.image_size / vae.factor:g}: "
                         f"pick --image-size a multiple of {vae.factor * args.patch} (for --patch {args.patch})")
    config = dict(in_channels=vae.channels if vae else 3, image_size=size, patch=args.patch, width=args.width,
                  depth=args.depth, heads=args.heads, text_dim=encoder.dim, attn=args.attn, moe=args.moe,
                  topk=args.topk, shared_experts=args.shared_experts, moe_impl=args.moe_impl,
                  expert_hidden=args.expert_hidden)
    model = DiT(**config).to(dev)
    ema = copy.deepcopy(model).requires_grad_(False)
    try:  # fused AdamW: one kernel for the whole update where this torch build has it
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    def lr_lambda(step):  # linear warm-up, then cosine to zero
        if step < args.warmup:
            return (step + 1) / args.warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    # noise, t and caption drop: the same seed on every rank, which draws for the global batch and
    # keeps its own slice, so a run does not depend on how its batch is split over ranks
    gen = torch.Generator(dev).manual_seed(args.seed)
    fwd = torch.compile(model) if args.compile else model  # EMA, samples, ckpts use the plain module
    engine = None
    if args.dist == "deepspeed":
        engine = deepspeed_engine(args, model, opt, rank)
        fwd = engine  # engine(...) runs the model; engine.backward/step do the rest
    elif world > 1:  # compile first, then wrap; the balance loss leaves idle experts unused -> find them
        fwd = torch.nn.parallel.DistributedDataParallel(fwd, device_ids=[local_rank] if dev == "cuda" else None,
                                                        find_unused_parameters=args.moe > 0)
    return dict(dev=dev, rank=rank, world=world, engine=engine, encoder=encoder, vae=vae, config=config, model=model,
                fwd=fwd, ema=ema, opt=opt, sched=sched, gen=gen, step=0, epoch=0, batch_in_epoch=0, skipped_before=0,
                skipped=0)


def deepspeed_engine(args, model, opt, rank):
    """DeepSpeed ZeRO stage 2: optimizer states and gradients partitioned over ranks, parameters
    replicated. Our torch AdamW is passed in (no fused_adam JIT build); clipping as in the others."""
    try:
        import deepspeed
    except ImportError as e:
        raise SystemExit("--dist deepspeed needs DeepSpeed: pip install -r requirements.txt") from e
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions"))
    config = {"train_micro_batch_size_per_gpu": args.batch_size, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
              "bf16": {"enabled": args.precision == "bf16"}, "steps_per_print": 10 ** 9}
    if rank == 0:
        print("deepspeed config:", json.dumps(config))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


# -----------------------------------------------------------------------------------------------
# One training step
# -----------------------------------------------------------------------------------------------
def drop_captions(text, mask, p, gen, rank=0, world=1):
    """Replace each caption by the null caption (zeros, all-False mask) with probability p
    (drawn for the global batch, this rank's slice kept)."""
    n = text.shape[0]
    keep = (torch.rand(n * world, generator=gen, device=text.device) >= p)[rank * n:(rank + 1) * n]
    return text * keep[:, None, None], mask & keep[:, None]


def train_step(S, args, x0, text, mask, mark=None):
    """Flow loss (+ MoE balance loss) -> backward -> clip at 1.0 -> AdamW -> schedule -> EMA.
    `mark(phase)`, if given, is called as each phase ends (profile.py times them with it)."""
    mark = mark or (lambda phase: None)
    text, mask = drop_captions(text, mask, args.cfg_drop, S["gen"], S["rank"], S["world"])
    with torch.autocast(S["dev"], dtype=torch.bfloat16, enabled=args.precision == "bf16"):
        loss, t, per_sample = flow.flow_loss(S["fwd"], x0, text, mask, args.t_dist, S["gen"], S["rank"], S["world"])
        balance = balance_loss(S["model"])  # 0 for a dense model
    mark("forward")
    if S["engine"] is not None:  # DeepSpeed: reduce-scatter gradients, clip, step its partition
        S["engine"].backward(loss + balance)
        mark("backward")
        S["engine"].step()
        grad_norm = torch.tensor(float(S["engine"].get_global_grad_norm() or 0.0))
    else:
        S["opt"].zero_grad(set_to_none=True)
        (loss + balance).backward()  # DDP averages the gradients over ranks during this call
        mark("backward")
        grad_norm = torch.nn.utils.clip_grad_norm_(S["model"].parameters(), 1.0)
        S["opt"].step()
    S["sched"].step()
    S["step"] += 1
    decay = min(args.ema, (1 + S["step"]) / (10 + S["step"]))  # short runs: let EMA catch up early
    with torch.no_grad():
        for pe, pm in zip(S["ema"].parameters(), S["model"].parameters()):
            pe.lerp_(pm, 1 - decay)
    mark("optimizer")
    return dict(loss=loss.item(), balance=float(balance.detach()), t=t, per_sample=per_sample.detach(),
                grad_norm=grad_norm.item())


def encode_batch(S, b):
    """A loader batch -> (x0, text tokens, mask) on the device: raw images and captions go through
    the frozen VAE and text encoder; precomputed shards (`python data.py precompute`) skip both."""
    if "latent" in b:
        return b["latent"].to(S["dev"]).float(), b["text"].to(S["dev"]).float(), b["mask"].to(S["dev"])
    x0 = b["image"].to(S["dev"], non_blocking=True)
    text, mask, _ = S["encoder"](b["caption"])  # cached per distinct caption
    return (x0 if S["vae"] is None else S["vae"].encode(x0)), text, mask


def batches(args, S, shards):
    """Endless loader batches (dicts, see data.collate), starting at the saved data position; updates it.
    Bad samples: S["skipped_before"] counts finished epochs, S["skipped"] adds the current one
    (re-reading an epoch on resume recounts it from zero, so nothing is counted twice)."""
    while True:
        per_worker = {}
        for i, b in enumerate(data.make_loader(shards, args.batch_size, args.image_size, args.seed, S["epoch"],
                                               S["rank"], S["world"], workers=args.workers)):
            per_worker[b["worker"]] = b["skipped"]
            S["skipped"] = S["skipped_before"] + sum(per_worker.values())
            if i < S["batch_in_epoch"]:  # resume: these were consumed before the checkpoint
                continue
            S["batch_in_epoch"] = i + 1
            yield b
        S["skipped_before"] = S["skipped"]
        S["epoch"], S["batch_in_epoch"] = S["epoch"] + 1, 0


# -----------------------------------------------------------------------------------------------
# Checkpoints (atomic) and samples
# -----------------------------------------------------------------------------------------------
def save_checkpoint(S, args):
    """Every rank calls this (each rank's data position is gathered); rank 0 writes the file.
    DeepSpeed (ZeRO-2 partitions the optimizer state): each rank writes its part to <out>/deepspeed/<tag>
    first; ckpt.pt names the tag and still holds model + EMA, consolidated, for sample.py."""
    tag, ds = (f"step{S['step']:06d}" if S["engine"] is not None else None), os.path.join(args.out, "deepspeed")
    if tag:
        S["engine"].save_checkpoint(ds, tag=tag, save_latest=False)
        dist.barrier()  # every rank's part is on disk before ckpt.pt may name the tag
    positions = [{k: S[k] for k in ("epoch", "batch_in_epoch", "skipped_before", "skipped")}] * S["world"]
    if S["world"] > 1:
        dist.all_gather_object(positions, positions[0])
    if S["rank"] != 0:
        return
    opt = S["opt"].state_dict() if tag is None else None  # (DeepSpeed's is in the tag folder)
    ckpt = dict(model=S["model"].state_dict(), ema=S["ema"].state_dict(), opt=opt, deepspeed_tag=tag,
                sched=S["sched"].state_dict(), step=S["step"], args=vars(args), config=S["config"],
                rng=dict(torch=torch.get_rng_state(), python=random.getstate(), gen=S["gen"].get_state()),
                data=positions)  # one data position per rank
    path = os.path.join(args.out, "ckpt.pt")
    torch.save(ckpt, path + ".tmp")
    os.replace(path + ".tmp", path)  # a crash mid-write never leaves a broken ckpt.pt
    if tag:  # older tags go only now, so a crash never leaves ckpt.pt naming a deleted one
        for old in {d for d in os.listdir(ds) if d.startswith("step")} - {tag}:
            shutil.rmtree(os.path.join(ds, old), ignore_errors=True)


def load_checkpoint(S, args):
    ckpt = torch.load(os.path.join(args.out, "ckpt.pt"), map_location=S["dev"], weights_only=True)
    if ckpt["config"] != S["config"]:
        raise SystemExit(f"--resume: the checkpoint's model {ckpt['config']} differs from the flags' {S['config']}; "
                         f"pass the original run's flags (saved in {args.out}/args.json)")
    if len(ckpt["data"]) != S["world"]:  # (ZeRO's partitions need it too)
        raise SystemExit(f"--resume: the checkpoint was written by {len(ckpt['data'])} ranks; resume with as many")
    tag, was = ckpt.get("deepspeed_tag"), ckpt["args"]["dist"]
    if (tag is None) != (S["engine"] is None):  # torch's AdamW state dict vs ZeRO's partitions
        raise SystemExit(f"--resume: {args.out}/ckpt.pt was written by --dist {was}, whose optimizer state "
                         f"--dist {args.dist} cannot read; resume with --dist {was}")
    for k in ("model", "ema", "sched") + (("opt",) if tag is None else ()):
        S[k].load_state_dict(ckpt[k])  # (LambdaLR's load leaves the optimizer's lr alone)
    if tag is not None:  # weights, fp32 partition, AdamW moments and the lr the schedule had set
        S["engine"].load_checkpoint(os.path.join(args.out, "deepspeed"), tag=tag, load_optimizer_states=True,
                                    load_lr_scheduler_states=False)
    torch.set_rng_state(ckpt["rng"]["torch"])
    random.setstate(ckpt["rng"]["python"])
    S["gen"].set_state(ckpt["rng"]["gen"])
    S["step"] = ckpt["step"]
    S.update(ckpt["data"][S["rank"]])


def sample_grid(S, args, path, n_each=1, seed=1234):
    """EMA samples of every held-out colour x shape x position, n_each times (fixed noise) -> the
    judge's accuracy on them (None on other data); the first of each go to a PNG grid, one row per colour."""
    prompts = data.heldout_prompts(n_each)
    c = S["config"]
    x = flow.generate(S["ema"], S["encoder"], [p for p, _ in prompts], args.sample_steps, args.cfg,
                      seed=seed, shape=(c["in_channels"], c["image_size"], c["image_size"]), device=S["dev"])
    images = [data.to_pil(im) for im in (x if S["vae"] is None else S["vae"].decode(x))]
    data.save_grid(images[:len(images) // n_each], path, nrow=len(data.SHAPES) * len(data.POSITIONS))
    return data.grade(images, [a for _, a in prompts]) if S["judged"] else None


# -----------------------------------------------------------------------------------------------
# The loop
# -----------------------------------------------------------------------------------------------
def main(argv=None):
    args = get_args(argv)
    os.makedirs(os.path.join(args.out, "samples"), exist_ok=True)
    shards = data.resolve_shards(args.data, args.image_size)
    pre = data.precomputed_meta(os.path.dirname(shards[0]))  # written by `python data.py precompute`?
    if pre and [pre[k] for k in ("vae", "text_encoder", "image_size")] != [args.vae, args.text_encoder, args.image_size]:
        raise SystemExit(f"{args.data} was precomputed with --vae {pre['vae']} --text-encoder {pre['text_encoder']} "
                         f"--image-size {pre['image_size']}: pass the same flags (they are needed for sampling)")
    S = setup(args)
    S["judged"] = args.data == data.BUILTIN or (pre or {}).get("source") == data.BUILTIN  # the judge knows only these
    master = S["rank"] == 0  # only rank 0 prints, logs, samples and writes files
    say = print if master else (lambda *a, **k: None)
    if args.resume:
        load_checkpoint(S, args)
        say(f"resumed from {args.out}/ckpt.pt at step {S['step']}")
    elif args.upcycle:  # the dense run's EMA weights seed the model, its EMA and every expert
        n = upcycle(S["model"], torch.load(args.upcycle, map_location=S["dev"], weights_only=True)["ema"])
        S["ema"].load_state_dict(S["model"].state_dict())
        say(f"upcycled from {args.upcycle}: {n} tensors copied, every expert = the dense MLP, routers fresh")
    if master:
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=1)
    total, active = count_params(S["model"])
    say(f"model: {total / 1e6:.2f}M parameters ({active / 1e6:.2f}M active per image token) | text encoder "
          f"{args.text_encoder} (dim {S['encoder'].dim}, frozen) | vae {args.vae} | {len(shards)} "
          f"{'precomputed ' if pre else ''}shards | device {S['dev']} {args.precision}"
        + (f" | {S['world']} ranks x {args.batch_size} = global batch {S['world'] * args.batch_size}"
           if S["world"] > 1 else ""))
    from tqdm import tqdm
    bar = tqdm(total=args.steps, initial=S["step"], desc="train", dynamic_ncols=True, disable=not master)
    log = open(os.path.join(args.out, "log.jsonl"), "a" if args.resume else "w") if master else None
    t_enc = t_total = 0.0  # time in the frozen encoders (VAE + text) vs the whole step
    n_seen, t_window = 0, time.time()
    # pre-emption: Slurm sends SIGUSR1 before the time limit (#SBATCH --signal) and SIGTERM on
    # scancel/requeue; finish the step, write a checkpoint, leave. --auto-resume picks it up.
    caught = []
    old = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in (signal.SIGUSR1, signal.SIGTERM)}
    for b in batches(args, S, shards):
        if S["step"] >= args.steps:  # (a resumed run that was already done)
            break
        t0 = time.perf_counter()
        x0, text, mask = encode_batch(S, b)
        t1 = time.perf_counter()
        st = train_step(S, args, x0, text, mask)
        t_enc, t_total = t_enc + t1 - t0, t_total + time.perf_counter() - t0
        n_seen += x0.shape[0] * S["world"]
        logging_step = S["step"] % args.log_every == 0 or S["step"] == args.steps
        if logging_step and S["world"] > 1:  # log the global batch's loss, not just rank 0's share
            mean = torch.tensor([st["loss"]], device=S["dev"])
            dist.all_reduce(mean)
            st["loss"] = mean.item() / S["world"]
        if master and logging_step:
            ips = n_seen / (time.time() - t_window)
            n_seen, t_window = 0, time.time()
            rec = dict(step=S["step"], loss=st["loss"], loss_t_bins=flow.loss_per_bin(st["t"], st["per_sample"]),
                       lr=S["sched"].get_last_lr()[0], grad_norm=st["grad_norm"], img_per_s=ips,
                       encoder_share=t_enc / t_total, skipped=S["skipped"], epoch=S["epoch"])
            if args.moe:  # balance loss on its own, and per layer: load per expert, entropy, unused
                rec.update(balance_loss=st["balance"], routing=routing_stats(S["model"]))
            log.write(json.dumps(rec) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{st['loss']:.4f}", img_s=f"{ips:.0f}")
        bar.update(1)
        if master and args.sample_every and S["step"] % args.sample_every == 0 and S["step"] < args.steps:
            acc = sample_grid(S, args, os.path.join(args.out, "samples", f"step_{S['step']:06d}.png"))
            log.write(json.dumps(dict(step=S["step"], sample_acc=acc)) + "\n")
        if S["step"] % args.ckpt_every == 0 or S["step"] == args.steps:
            save_checkpoint(S, args)
        if S["step"] >= args.steps or stop_now(S, caught):  # before the next batch is fetched, so the
            break                                            # saved data position is exact
    bar.close()
    for s, handler in old.items():
        signal.signal(s, handler)
    if caught:
        save_checkpoint(S, args)
        say(f"caught {signal.Signals(caught[0]).name}: checkpoint written at step {S['step']}; "
            f"continue with --resume (or --auto-resume)")
    elif master:
        print(f"frozen encoders' share of step time: {100 * t_enc / max(t_total, 1e-9):.2f}% | "
              f"skipped samples: {S['skipped']}")
        sample_grid(S, args, os.path.join(args.out, "samples", f"step_{S['step']:06d}.png"))
        if args.eval_n and not S["judged"]:
            print(f"no judge for {args.data}: score the checkpoint with sample.py --eval --real <raw shards>")
        elif args.eval_n:  # the final grade: every held-out prompt eval_n times, noise from --seed
            acc = sample_grid(S, args, os.path.join(args.out, "samples", "eval.png"), args.eval_n, args.seed)
            log.write(json.dumps(dict(step=S["step"], eval=acc)) + "\n")
            print(f"caption accuracy of EMA samples ({args.eval_n * len(data.heldout_prompts(1))} held-out prompts, "
                  f"{args.sample_steps} steps, cfg {args.cfg}): " + " ".join(f"{k} {100 * v:.1f}%" for k, v in acc.items()))
    if log:
        log.close()
    if args.dist != "none":
        finish_distributed(S)  # does not return
    return S


def stop_now(S, caught):
    """Did this process, or any rank, receive a pre-emption signal? (All ranks stop together.)"""
    if S["world"] == 1:
        return bool(caught)  # no tensor, no device sync in the hot loop
    flag = torch.tensor([float(bool(caught))], device=S["dev"])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() and not caught:
        caught.append(signal.SIGTERM)  # another rank was told: stop here too
    return bool(flag.item())


def finish_distributed(S):
    """Check that the replicas agree, then leave cleanly."""
    flat = torch.cat([p.detach().flatten() for p in S["model"].parameters()])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    same, opt_bytes = [None] * S["world"], [None] * S["world"]
    dist.all_gather_object(same, torch.equal(flat, ref))
    mine = sum(v.numel() * v.element_size() for st in S["opt"].state.values() for v in st.values() if torch.is_tensor(v))
    dist.all_gather_object(opt_bytes, mine)  # ZeRO-2: each rank holds only its partition
    if S["rank"] == 0:  # rank 0 has written the checkpoint; use sample.py on it
        print(f"parameters identical on all {S['world']} ranks: {all(same)}")
        print(f"optimizer state bytes per rank: {opt_bytes}")
    leave_distributed()


def leave_distributed():
    """barrier -> destroy -> flush -> os._exit(0): gloo can abort at interpreter exit after the
    work is done ("terminate called without an active exception"); this order never did here."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
