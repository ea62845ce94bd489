"""train.py -- train the MM-DiT with rectified flow. `python train.py` is the whole CPU demo.

Read main() at the bottom first: it is the outline of a run, start() -> train_loop() -> checkpoint_and_stop()
on a stop signal, else final_evaluation() -> end(). The sections above it come in the order a run uses them:
state (one Run dataclass) -> flags -> set-up -> one training step -> checkpoints -> DeepSpeed -> sample grids
-> stop signals. Under torchrun (`--dist ddp|deepspeed`) it is the same file, keyed off the RANK variable, so
plain `python train.py` needs no launcher; the tests and profile.py reuse the very same parser and step.

Resume is exact: a checkpoint holds model, EMA, optimiser, schedule, step, flags, every RNG state and the data
position (epoch, how far each loader worker got); the data order is a pure function of (seed, epoch, rank,
worker), so passing over the consumed samples (read, not decoded) puts the stream exactly where it was.
Faults (README's table): a stop signal checkpoints after the step, or ends the process at once where no step
runs; a non-finite step is skipped on every rank; checkpoints are fsynced and the previous one kept as a
fallback; a full disk warns; a resume with changed flags is refused.
"""
import argparse
import contextlib
import copy
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import data
import flow
import sample
from model import DiT, TextEncoder, count_params, device, load_vae
from moe import balance_loss, default_impl, nudge_biases, routing_loads, routing_stats, upcycle


CKPT, PREV = "ckpt.pt", "ckpt.prev.pt"  # the run folder's latest checkpoint and the one before it
DATA_FLAGS = ("data", "batch_size", "grad_accum", "workers", "seed")  # they define the stream the saved data position points into
TRAJECTORY = DATA_FLAGS + ("steps", "warmup", "lr", "t_dist", "t_shift", "cfg_drop", "ema", "precision", "bias_rate",
                           "text_encoder", "vae", "image_size")  # --resume refuses a change to these unless --override names it
HANDLED_BY_TORCHRUN = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"  # for torchrun --signals-to-handle: its default lacks USR1


# -----------------------------------------------------------------------------------------------
# The run's state: built once by setup(), advanced by every step, saved by a checkpoint
# -----------------------------------------------------------------------------------------------
POSITION = ("epoch", "batch_in_epoch", "workers", "skipped_before", "skipped")  # the data position (per rank)


@dataclass
class Run:
    """Everything a training run holds. The first block is built by setup(); the rest changes as it trains."""
    dev: str                       # "cuda" (this rank's GPU) or "cpu"
    rank: int                      # this process; rank 0 prints, logs, samples and writes the files
    world: int                     # processes in the run
    config: dict                   # DiT(**config): saved, so sample.py rebuilds the model without the flags
    model: torch.nn.Module         # the weights being trained
    ema: torch.nn.Module           # their exponential moving average: samples and evaluation use it
    fwd: object                    # what the step calls: the model, compiled and/or DDP- or DeepSpeed-wrapped
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    gen: torch.Generator           # noise, t and caption drop: seeded alike on every rank
    encoder: TextEncoder           # frozen
    vae: object = None             # frozen model.VAE; None = the model works on pixels
    engine: object = None          # the DeepSpeed engine (--dist deepspeed), else None
    step: int = 0                  # optimizer steps taken
    epoch: int = 0                 # the data position: epoch, its batches consumed, each loader worker's
    batch_in_epoch: int = 0        # {batches, raw, skipped} (data.ShardStream), bad samples skipped in
    workers: dict = field(default_factory=dict)  # finished epochs and in all
    skipped_before: int = 0
    skipped: int = 0
    bad: torch.Tensor = None       # non-finite steps, counted on the device: (total, in a row now, longest run)
    ckpt_step: int = None          # step of the last checkpoint this process wrote (None: none yet)
    ds_tag: str = None             # DeepSpeed: that checkpoint's partition folder
    shards: list = None            # the training data
    judged: bool = False           # built-in shapes: data.judge grades samples
    names: dict = None             # a set of named pictures (python data.py emoji): retrieval scores samples
    real: torch.Tensor = None      # its pictures, uint8 (N, 3, H, W): read once, used by every grid
    log: object = None             # log.jsonl, open on rank 0
    t_start: float = 0.0           # time.time() at start-up; t_enc / t_total: seconds in the frozen encoders
    t_enc: float = 0.0             # vs in whole steps
    t_total: float = 0.0

    def position(self):
        """The data position as a dict (what a checkpoint stores per rank)."""
        return {k: getattr(self, k) for k in POSITION}


# -----------------------------------------------------------------------------------------------
# Flags
# -----------------------------------------------------------------------------------------------
def get_parser():
    p = argparse.ArgumentParser(description="Train a text-to-image MM-DiT with rectified flow.")
    a = p.add_argument
    a("--data", default=data.BUILTIN, help="folder of WebDataset .tar shards, comma-separated .tar paths, "
      "or 'builtin' (captioned shapes, generated on first use)")
    a("--text-encoder", default="minilm", help="'minilm' (offline, pip package) or a CLIP hub id / local folder")
    a("--text-cache", type=int, default=100_000, help="distinct captions whose encoding is kept on the CPU in fp16, "
      "least recently used dropped first (0 = encode every batch afresh); results are identical either way")
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
    a("--moe-impl", default=None, choices=["loop", "sorted", "grouped"], help="MoE dispatch (equal results): "
      "readable loop, sorted slices (default on CPU) or one grouped GEMM per weight, no host sync (default on CUDA)")
    a("--balance", default="aux", choices=["aux", "bias"], help="MoE load balancing: aux = Switch's balance loss "
      "(DiT-MoE); bias = DeepSeek-V3's loss-free per-expert bias on the top-k choice, nudged after every step")
    a("--bias-rate", type=float, default=0.001, help="--balance bias: how far each step moves a bias (DeepSeek-V3's gamma)")
    a("--expert-hidden", type=int, default=None, help="hidden size of each expert (default: dense / (topk + shared))")
    a("--upcycle", default=None, help="dense checkpoint to start an --moe run from (every expert a copy of its MLP)")
    a("--dist", default="none", choices=["none", "ddp", "deepspeed"], help="none: one process; ddp: PyTorch DDP "
      "under torchrun (gloo on CPU, NCCL on CUDA); deepspeed: ZeRO-2 under torchrun. Global batch = "
      "--batch-size x --grad-accum x world size")
    a("--attn", default="sdpa", choices=["manual", "sdpa"],
      help="manual softmax(QK^T/sqrt d)V or F.scaled_dot_product_attention")
    a("--batch-size", type=int, default=64, help="images per micro-batch per rank; global batch = batch-size x "
      "grad-accum x world size")
    a("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (gradient accumulation): the "
      "global batch of a big run on fewer or smaller GPUs")
    a("--steps", type=int, default=1000, help="optimiser steps")
    a("--lr", type=float, default=2e-3, help="peak AdamW learning rate (README: 1e-3 and 3e-3 did worse in "
      "1,000 steps)")
    a("--warmup", type=int, default=100, help="linear warm-up steps before the cosine decay")
    a("--t-dist", default="logit-normal", choices=["uniform", "logit-normal"], help="training time distribution")
    a("--t-shift", type=float, default=1.0, help="SD3's time shift s of training times and the sampler's grid, "
      "t' = s t / (1 + (s - 1) t); 1 = none. README: ~sqrt(pixels / 256^2), e.g. 2 for 512 px latents")
    a("--grad-ckpt", action="store_true", help="activation checkpointing of every block: its activations are "
      "recomputed in the backward pass instead of kept (less memory, ~1/3 more compute)")
    a("--cfg-drop", type=float, default=0.1, help="probability of dropping a caption (for classifier-free guidance); 1 = "
      "no caption ever: the floor of a caption-following score")
    a("--ema", type=float, default=0.995, help="EMA decay of the weights used for sampling")
    a("--precision", default=None, choices=["fp32", "bf16"], help="default: bf16 autocast on CUDA, fp32 on CPU")
    a("--compile", action="store_true", help="torch.compile the training forward/backward")
    a("--seed", type=int, default=0, help="seed for data order, noise, times and caption drop")
    a("--workers", type=int, default=1, help="data-loader worker processes")
    a("--out", default="out/run", help="run folder: ckpt.pt, args.json, log.jsonl, samples/")
    a("--resume", action="store_true", help="continue exactly from <out>/ckpt.pt")
    a("--auto-resume", action="store_true", help="resume if <out> holds a checkpoint, else start fresh (requeued jobs)")
    a("--override", default="", help="--resume: accept these changed flags (comma-separated, e.g. steps,lr); "
      "without it a resume that changes a flag of the run's trajectory is refused (README: what each costs)")
    a("--max-bad-steps", type=int, default=10, help="stop after this many consecutive steps with a non-finite loss "
      "or gradient norm (each is skipped: no update)")
    a("--log-every", type=int, default=10, help="steps between log.jsonl lines; also the only steps that read "
      "numbers off the device (loss, grad norm, bad steps) and agree on a stop signal")
    a("--sample-every", type=int, default=500, help="steps between EMA sample grids (0 = only at the end)")
    a("--ckpt-every", type=int, default=500, help="steps between checkpoints (and one at the end)")
    a("--cfg", type=float, default=3.0, help="guidance scale w for samples and the final evaluation (README: 3 "
      "suits shapes and real pictures; 5 speckles)")
    a("--sample-steps", type=int, default=25, help="Euler steps for samples and the final evaluation")
    a("--eval-n", type=int, default=2,
      help="final evaluation: samples per held-out colour x shape x position, or per name (0 = skip)")
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
    if args.grad_accum < 1:
        p.error("--grad-accum must be at least 1")
    if not 0 <= args.cfg_drop <= 1:
        p.error("--cfg-drop must be in [0, 1]")
    if args.dist != "none" and "RANK" not in os.environ:
        p.error(f"--dist {args.dist} needs a launcher: torchrun --nproc_per_node N train.py --dist {args.dist} ... "
                "(or sbatch run.slurm)")
    if set(overrides(args)) - set(TRAJECTORY):
        p.error(f"--override: {args.override!r}; choose from {','.join(k.replace('_', '-') for k in TRAJECTORY)}")
    found = any(os.path.exists(os.path.join(args.out, f)) for f in (CKPT, PREV))
    args.resume = args.resume or (args.auto_resume and found)
    if args.resume and not found:
        p.error(f"--resume: no checkpoint at {args.out}/{CKPT}; drop --resume to start fresh")
    return args


def overrides(args):
    """--override steps,lr -> ["steps", "lr"] (flag names as attributes)."""
    return [f.strip().lstrip("-").replace("-", "_") for f in args.override.split(",") if f.strip()]


# -----------------------------------------------------------------------------------------------
# Set-up
# -----------------------------------------------------------------------------------------------
def setup(args, shape=None):
    """Device, process group, seeds, encoder, model, EMA, optimiser, schedule -> the Run the loop uses.
    `shape` = (channels, side, text dim) of the model's inputs, where profile.py times synthetic ones."""
    dev = device()
    rank, local_rank, world = 0, 0, 1
    if args.dist != "none":  # torchrun sets these; plain `python train.py` never gets here
        rank, local_rank, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
        if dev == "cuda":
            torch.cuda.set_device(local_rank)  # "cuda" now means this process's own GPU
        dist.init_process_group("nccl" if dev == "cuda" else "gloo")
        if rank == 0 and "SIGUSR1" not in os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", ""):
            print(f"warning: torchrun dies on SIGUSR1 (Slurm's time-limit warning) and orphans the ranks unless "
                  f"started with --signals-to-handle {HANDLED_BY_TORCHRUN} (run.slurm passes it)")
    if args.precision is None:
        args.precision = "bf16" if dev == "cuda" else "fp32"
    args.moe_impl = args.moe_impl or default_impl(dev)  # the GPU's grouped GEMM, the CPU's per-expert slices
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    vae = load_vae(args.vae, dev)  # frozen; None = pixel space
    encoder = TextEncoder(args.text_encoder, device=dev, cache_size=args.text_cache)
    size = args.image_size // (vae.factor if vae else 1)  # the model sees latents of this side
    if vae and (args.image_size % vae.factor or size % args.patch):
        raise SystemExit(f"--vae shrinks {args.image_size} px by {vae.factor} to {args.image_size / vae.factor:g}: "
                         f"pick --image-size a multiple of {vae.factor * args.patch} (for --patch {args.patch})")
    config = dict(in_channels=vae.channels if vae else 3, image_size=size, patch=args.patch, width=args.width,
                  depth=args.depth, heads=args.heads, text_dim=encoder.dim, attn=args.attn, moe=args.moe,
                  topk=args.topk, shared_experts=args.shared_experts, moe_impl=args.moe_impl,
                  expert_hidden=args.expert_hidden, balance=args.balance)
    if shape:
        config.update(in_channels=shape[0], image_size=shape[1], text_dim=shape[2])
    model = DiT(**config).to(dev)
    model.grad_ckpt = args.grad_ckpt  # (how it computes, not what: not part of the config)
    if args.upcycle and not args.resume:  # before the optimizer (and ZeRO's fp32 master copy) take the weights
        n = upcycle(model, torch.load(args.upcycle, map_location=dev, weights_only=True)["ema"])
        if rank == 0:
            print(f"upcycled from {args.upcycle}: {n} tensors copied, every expert = the dense MLP, routers fresh")
    ema = copy.deepcopy(model).requires_grad_(False)
    # fused AdamW (CPU, CUDA, MPS): one kernel for the whole update, which also skips a bad step on the device
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=True)

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
    return Run(dev=dev, rank=rank, world=world, config=config, model=model, ema=ema, fwd=fwd, opt=opt, sched=sched,
               gen=gen, encoder=encoder, vae=vae, engine=engine, bad=torch.zeros(3, device=dev))


# -----------------------------------------------------------------------------------------------
# One training step
# -----------------------------------------------------------------------------------------------
def drop_captions(text, mask, keep):
    """The null caption (zeros, all-False mask) where keep (B,) is False: classifier-free guidance."""
    return text * keep[:, None, None], mask & keep[:, None]


def train_step(S, args, micro, mark=None):
    """One optimizer step over this rank's --grad-accum micro-batches [(x0, text, mask)]: flow loss (+ MoE
    balance loss) -> backward per micro-batch -> clip at 1.0 -> AdamW -> schedule -> EMA. No host sync: on a
    GPU the host queues the next step while this one runs. A non-finite loss or gradient norm changes no
    weight, moment or EMA (fused AdamW's `found_inf`, as under GradScaler; ZeRO skips its own update) but
    takes its step number; S.bad counts them on the device. `mark(phase)` lets profile.py time the phases."""
    mark = mark or (lambda phase: None)
    n, N, W, r, dev = micro[0][0].shape[0], len(micro), S.world, S.rank, S.dev
    keep = torch.rand(n * N * W, generator=S.gen, device=dev) >= args.cfg_drop  # (global batch,)
    t_all = flow.sample_t(n * N * W, args.t_dist, S.gen, dev, args.t_shift)
    eps_all = torch.randn((n * N * W, *micro[0][0].shape[1:]), generator=S.gen, device=dev)
    if S.engine is None:
        S.opt.zero_grad(set_to_none=True)
    loss, balance, t, per_sample = 0, 0, [], []
    loads = 0 if args.moe and args.balance == "bias" else None  # (layers, E) summed over micro-batches
    for i, (x0, text, mask) in enumerate(micro):
        mine = slice((i * W + r) * n, (i * W + r + 1) * n)  # micro-batch i of rank r in the global batch
        text, mask = drop_captions(text, mask, keep[mine])
        quiet = S.engine is None and W > 1 and i < N - 1  # DDP: all-reduce only the last micro-batch's backward
        with S.fwd.no_sync() if quiet else contextlib.nullcontext():
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                loss_i, per_i = flow.flow_loss(S.fwd, x0, text, mask, t_all[mine], eps_all[mine])
                balance_i = balance_loss(S.model).to(loss_i.device)  # 0 for a dense model
            if loads is not None:  # (read now: --grad-ckpt's recomputation in the backward routes again)
                loads = loads + routing_loads(S.model)
            mark("forward")
            if S.engine is not None:  # DeepSpeed divides by its gradient_accumulation_steps itself
                S.engine.backward(loss_i + balance_i)
            else:  # DDP averages the gradients over ranks during the last backward
                ((loss_i + balance_i) / N).backward()
            mark("backward")
        if S.engine is not None:  # reduce-scatter, clip, step its partition: only at the last micro-batch
            S.engine.step()  # (it checks the global gradient norm itself: inf/NaN -> no update; it syncs)
        loss, balance = loss + loss_i.detach() / N, balance + balance_i.detach() / N
        t.append(t_all[mine])
        per_sample.append(per_i.detach())
    if S.engine is not None:
        grad_norm = torch.tensor(float(S.engine.get_global_grad_norm() or 0.0), device=dev)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(S.model.parameters(), 1.0)  # (NaN/inf pass through)
    # under DDP the gradients, hence their norm, are the same on every rank: every rank decides alike
    bad = ~torch.isfinite(loss + balance) | ~torch.isfinite(grad_norm)
    if S.engine is None:
        S.opt.found_inf = bad.float()  # fused AdamW: a nonzero found_inf skips the whole update on the device
        S.opt.step()
    if loads is not None:  # every rank nudges its biases by the loads of the whole global batch
        if W > 1:
            dist.all_reduce(loads)
        nudge_biases(S.model, loads, args.bias_rate, skip=bad)
    S.sched.step()
    S.step += 1
    decay = min(args.ema, (1 + S.step) / (10 + S.step))  # short runs: let EMA catch up early
    with torch.no_grad():  # EMA <- EMA + (1 - decay)(model - EMA), all tensors in one fused op; not on a bad step
        ema = list(S.ema.parameters())
        torch._foreach_lerp_(ema, list(S.model.parameters()), [(~bad).float() * (1 - decay)] * len(ema))
        for be, bm in zip(S.ema.buffers(), S.model.buffers()):  # (--balance bias: the EMA routes alike)
            be.copy_(bm)
    run = (S.bad[1] + 1) * bad.float()
    S.bad = torch.stack([S.bad[0] + bad.float(), run, torch.maximum(S.bad[2], run)])
    mark("optimizer")
    return dict(loss=loss, balance=balance, t=torch.cat(t), per_sample=torch.cat(per_sample), grad_norm=grad_norm,
                bad=bad)


def encode_batch(S, b):
    """A loader batch -> (x0, text tokens, mask) on the device: raw images and captions go through
    the frozen VAE and text encoder; precomputed shards (`python data.py precompute`) skip both."""
    if "latent" in b:
        return b["latent"].to(S.dev).float(), b["text"].to(S.dev).float(), b["mask"].to(S.dev)
    x0 = b["image"].to(S.dev, non_blocking=True)
    text, mask = S.encoder(b["caption"])  # cached per distinct caption
    return (x0 if S.vae is None else S.vae.encode(x0)), text, mask


def batches(args, S, shards):
    """Endless loader batches (data.collate's dicts) from the saved data position, which it keeps up to date
    (S.epoch, S.batch_in_epoch, S.workers: data.ShardStream); S.skipped counts bad samples."""
    while True:
        for i, b in enumerate(data.make_loader(shards, args.batch_size, args.image_size, args.seed, S.epoch,
                                               S.rank, S.world, args.workers, resume=dict(S.workers))):
            if (i < S.batch_in_epoch) != ("consumed" in b):  # placeholders stand where consumed batches stood
                raise RuntimeError(f"resume: epoch {S.epoch} item {i} is not where the checkpoint put it")
            if i < S.batch_in_epoch:
                continue
            S.workers[b["worker"]] = {k: b[k] for k in ("batches", "raw", "skipped")}
            S.skipped = S.skipped_before + sum(w["skipped"] for w in S.workers.values())
            S.batch_in_epoch = i + 1
            yield b
        if S.batch_in_epoch == 0:  # a whole epoch without one full batch: waiting longer cannot help
            raise SystemExit(data.no_batch_message(shards, args.batch_size, args.seed, S.epoch, S.rank,
                                                   S.world, args.workers))
        S.skipped_before = S.skipped
        S.epoch, S.batch_in_epoch, S.workers = S.epoch + 1, 0, {}


# -----------------------------------------------------------------------------------------------
# Checkpoints: atomic and fsynced, the previous one kept; an unreadable one falls back to it
# -----------------------------------------------------------------------------------------------
def save_checkpoint(S, args):
    """Every rank calls this (the data positions are gathered); rank 0 writes <out>/ckpt.pt, the one before
    kept as ckpt.prev.pt. -> False where an OSError (disk full, I/O) stopped it: a warning, nothing half-
    written, the next save tries again. DeepSpeed: each rank's partition first goes to <out>/deepspeed/<tag>."""
    tag = deepspeed_save(S, args) if S.engine is not None else None
    if tag is False:
        return False
    positions = [S.position()] * S.world
    if S.world > 1:
        dist.all_gather_object(positions, positions[0])
    if S.rank != 0:
        return True
    for k in ("model", "ema"):  # bad steps change nothing, so this cannot happen; never write one that would
        if not all(v.isfinite().all() for v in getattr(S, k).state_dict().values() if v.is_floating_point()):  # poison a resume
            raise SystemExit(f"non-finite {k} weights at step {S.step}: not saved; {args.out}/{CKPT} is untouched")
    opt = S.opt.state_dict() if tag is None else None  # (DeepSpeed's is in the tag folder)
    ckpt = dict(model=S.model.state_dict(), ema=S.ema.state_dict(), opt=opt, deepspeed_tag=tag,
                sched=S.sched.state_dict(), step=S.step, args=vars(args), config=S.config,
                rng=dict(torch=torch.get_rng_state(), python=random.getstate(), gen=S.gen.get_state()),
                bad=S.bad.cpu(),  # non-finite steps: total, in a row now, longest run
                data=positions)  # one data position per rank
    keep = os.path.join(args.out, PREV)
    if S.ckpt_step is None and os.path.exists(keep):  # another run's, left in this folder: never a fallback
        os.remove(keep)
    try:
        data.atomic_write(os.path.join(args.out, CKPT), lambda f: torch.save(ckpt, f),
                          keep=keep if S.ckpt_step is not None else None)
    except OSError as e:
        print(f"warning: checkpoint of step {S.step} not written ({e}); training goes on and the next save "
              f"retries; the last one written is step {S.ckpt_step}", file=sys.stderr)
        return False
    if tag:
        deepspeed_prune(args, keep={tag, S.ds_tag})
    S.ckpt_step, S.ds_tag = S.step, tag
    return True


def read_checkpoint(out, dev):
    """-> (file name, checkpoint): ckpt.pt, or ckpt.prev.pt where ckpt.pt is missing or unreadable; an
    unreadable ckpt.pt becomes ckpt.bad.pt, so it never pushes the good one out at the next save."""
    errors = []
    for name in (CKPT, PREV):
        try:
            ckpt = torch.load(os.path.join(out, name), map_location=dev, weights_only=True)
            if not isinstance(ckpt, dict) or not {"model", "step", "args", "data"} <= set(ckpt):
                raise ValueError("not a train.py checkpoint")
        except Exception as e:  # torch.load raises many kinds on a damaged file
            errors.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            continue
        if errors:
            print(f"warning: {out}/{errors[0]}; resuming from {name} (step {ckpt['step']}) instead", file=sys.stderr)
            if os.path.exists(os.path.join(out, CKPT)):
                os.replace(os.path.join(out, CKPT), os.path.join(out, "ckpt.bad.pt"))
        return name, ckpt
    raise SystemExit(f"--resume: no readable checkpoint in {out} ({'; '.join(errors)}). Move the damaged files "
                     f"away and start afresh without --resume/--auto-resume, or put a good checkpoint at {out}/{CKPT}")


def load_checkpoint(S, args):
    """Resume: every model/optimizer/RNG/data state of the checkpoint; flags are checked first. -> (file, changed flags)."""
    picked = [None, None]  # rank 0 picks the file (so also a fallback) and every rank reads that one
    if S.rank == 0:
        try:
            name, ckpt = read_checkpoint(args.out, S.dev)
            picked[0] = name
        except SystemExit as e:
            picked[1] = str(e)
    if S.world > 1:
        dist.broadcast_object_list(picked, 0)
    if picked[1]:
        raise SystemExit(picked[1])
    if S.rank != 0:
        name = picked[0]
        ckpt = torch.load(os.path.join(args.out, name), map_location=S.dev, weights_only=True)
    was = {k: ckpt["args"].get(k, get_parser().get_default(k)) for k in TRAJECTORY}  # (flags newer than the file: default)
    changed = {k: (was[k], getattr(args, k)) for k in TRAJECTORY if was[k] != getattr(args, k)}
    refused = {k: v for k, v in changed.items() if k not in overrides(args)}
    if refused:
        raise SystemExit("--resume: these flags differ from the checkpoint's, which would change the run:\n" +
                         "".join(f"  --{k.replace('_', '-')}: {a!r} in the checkpoint, {b!r} now\n" for k, (a, b) in refused.items()) +
                         f"Pass the checkpoint's values, or accept the change with --override "
                         f"{','.join(k.replace('_', '-') for k in refused)} (README: what each costs)")
    how = ("attn", "moe_impl")  # how the model computes, not what: free to change on resume
    was = dict(dict(balance="aux"), **ckpt["config"])  # (written before --balance existed: aux)
    if {k: v for k, v in was.items() if k not in how} != {k: v for k, v in S.config.items() if k not in how}:
        raise SystemExit(f"--resume: the checkpoint's model {ckpt['config']} differs from the flags' {S.config}; "
                         f"pass the original run's flags (saved in {args.out}/args.json)")
    if len(ckpt["data"]) != S.world:  # (ZeRO's partitions need it too)
        raise SystemExit(f"--resume: the checkpoint was written by {len(ckpt['data'])} ranks; resume with as many")
    tag, was = ckpt.get("deepspeed_tag"), ckpt["args"]["dist"]
    if (tag is None) != (S.engine is None):  # torch's AdamW state dict vs ZeRO's partitions
        raise SystemExit(f"--resume: {args.out}/{name} was written by --dist {was}, whose optimizer state "
                         f"--dist {args.dist} cannot read; resume with --dist {was}")
    for k in ("model", "ema", "sched") + (("opt",) if tag is None else ()):
        getattr(S, k).load_state_dict(ckpt[k])  # (LambdaLR's load leaves the optimizer's lr alone)
    if tag is not None:
        deepspeed_load(S, args, tag)
    torch.set_rng_state(ckpt["rng"]["torch"])
    random.setstate(ckpt["rng"]["python"])
    S.gen.set_state(ckpt["rng"]["gen"])
    for k, v in ckpt["data"][S.rank].items():
        setattr(S, k, v)
    S.step = S.ckpt_step = ckpt["step"]
    S.ds_tag = tag
    S.bad = ckpt["bad"].to(S.dev) if torch.is_tensor(ckpt.get("bad")) else S.bad  # (older files: 0)
    old_format = "workers" not in ckpt["data"][S.rank]  # an older train.py's: its epoch cannot be replayed
    if old_format and S.rank == 0:
        print(f"warning: {args.out}/{name} has no per-worker data position (older train.py): next epoch", file=sys.stderr)
    if changed.keys() & {"lr", "steps", "warmup"}:  # --override: the new schedule from this step on (the lr jumps)
        S.sched.base_lrs = [args.lr] * len(S.sched.base_lrs)
        for g in S.opt.param_groups:
            g["lr"] = args.lr * S.sched.lr_lambdas[0](S.sched.last_epoch)
    if old_format or changed.keys() & set(DATA_FLAGS):  # the saved position means nothing in another stream
        S.epoch, S.batch_in_epoch, S.workers, S.skipped_before = S.epoch + 1, 0, {}, S.skipped
    return name, changed


# -----------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-2 (--dist deepspeed): what differs from DDP, apart from the step's engine.backward/step
# -----------------------------------------------------------------------------------------------
def deepspeed_engine(args, model, opt, rank):
    """DeepSpeed ZeRO stage 2: optimizer states and gradients partitioned over ranks, parameters
    replicated. Our torch AdamW is passed in (no fused_adam JIT build); clipping as in the others."""
    try:
        import deepspeed
    except ImportError as e:
        raise SystemExit("--dist deepspeed needs DeepSpeed: pip install -r requirements.txt") from e
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions"))
    config = {"train_micro_batch_size_per_gpu": args.batch_size, "gradient_accumulation_steps": args.grad_accum,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
              "bf16": {"enabled": args.precision == "bf16"}, "steps_per_print": 10 ** 9}
    if rank == 0:
        print("deepspeed config:", json.dumps(config))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def deepspeed_save(S, args):
    """Every rank writes its optimizer partition to <out>/deepspeed/<tag>; ckpt.pt may name the tag only
    once all are on disk. -> the tag, or False where any rank could not write (an OSError: a warning)."""
    tag, ok = f"step{S.step:06d}", torch.ones(1, device=S.dev)
    try:
        S.engine.save_checkpoint(os.path.join(args.out, "deepspeed"), tag=tag, save_latest=False)
    except OSError as e:
        print(f"warning: rank {S.rank}: DeepSpeed partition {tag} not written ({e})", file=sys.stderr)
        ok.zero_()
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return tag if ok.item() else False


def deepspeed_prune(args, keep):
    """Delete older partition folders, only after ckpt.pt names the new one: the previous checkpoint's
    stays, so neither ckpt.pt nor ckpt.prev.pt ever names a deleted folder."""
    ds = os.path.join(args.out, "deepspeed")
    for old in {d for d in os.listdir(ds) if d.startswith("step")} - keep:
        shutil.rmtree(os.path.join(ds, old), ignore_errors=True)


def deepspeed_load(S, args, tag):
    """Weights, the fp32 partition, AdamW moments and the lr the schedule had set, from <out>/deepspeed/<tag>."""
    S.engine.load_checkpoint(os.path.join(args.out, "deepspeed"), tag=tag, load_optimizer_states=True,
                             load_lr_scheduler_states=False)


# -----------------------------------------------------------------------------------------------
# Samples during training: grids and their scores
# -----------------------------------------------------------------------------------------------
def sample_grid(S, args, path, n_each=1, seed=1234, fid=False):
    """EMA samples of every held-out prompt (or name), n_each times, fixed noise -> a PNG grid, and the judge's
    accuracy (built-in data) or the retrieval scores (named pictures, `python data.py emoji`), else None."""
    names, c = S.names, S.config
    if names:  # every name in its held-out wording
        want = torch.arange(len(names["names"])).repeat_interleave(n_each)
        prompts = [(names["heldout"].format(name=names["names"][i]), None) for i in want]
    else:
        prompts = data.heldout_prompts(n_each)
    chunks = []
    for i in range(0, len(prompts), 256):  # in batches of 256 with noise from seed + i, as sample.py --eval draws
        x = flow.generate(S.ema, S.encoder, [p for p, _ in prompts[i:i + 256]], args.sample_steps, args.cfg,
                          seed=seed + i, shape=(c["in_channels"], c["image_size"], c["image_size"]), device=S.dev,
                          shift=args.t_shift)
        chunks.append((x if S.vae is None else S.vae.decode(x)).cpu())
    x = torch.cat(chunks)
    images = None if names else [data.to_pil(im) for im in x]
    try:
        if names:
            sample.names_grid(data.as_uint8(x), want, S.real, path)
        else:
            data.save_grid(images[:len(images) // n_each], path, nrow=len(data.SHAPES) * len(data.POSITIONS))
    except OSError as e:  # a full disk must not end a training run over a picture
        print(f"warning: sample grid {path} not written ({e}); training goes on", file=sys.stderr)
    if names:
        return sample.score_names(data.as_uint8(x), want, names, S.real, fid)
    return data.grade(images, [a for _, a in prompts]) if S.judged else None


def redraw_curves(args):
    """<out>/loss.png from log.jsonl (sample.plot_run), next to every grid: people read curves, not JSON."""
    try:
        sample.plot_run(args.out)
    except OSError as e:  # a full disk must not end a training run over a picture
        print(f"warning: {args.out}/loss.png not written ({e}); training goes on", file=sys.stderr)


# -----------------------------------------------------------------------------------------------
# Stop signals: finish the step, checkpoint, exit 0; or, where that is not possible, exit at once
# -----------------------------------------------------------------------------------------------
class Interrupted(BaseException):
    """StopSignals' way out where a step cannot be waited for: a BaseException, so no `except Exception` eats it."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """SIGUSR1 (Slurm's warning before the time limit) and SIGTERM (scancel, requeue, torchrun stopping).
    While `defer` is set (inside the loop) the first is only noted: after this step (one process) or at the
    next log step (where the ranks agree) every rank checkpoints and exits 0. Anywhere else, or at a second
    signal, it raises Interrupted at once, so `timeout`, `kill` and `scancel` never wait on a stuck run. A
    repeat within `same_event` seconds is one event arriving twice (Slurm signals every process of a step,
    and torchrun forwards it to the ranks too)."""

    def __init__(self, same_event=2.0):
        self.caught, self.defer, self.pid, self.first, self.same_event = [], False, os.getpid(), None, same_event
        self.old = {s: signal.signal(s, self.handle) for s in (signal.SIGUSR1, signal.SIGTERM)}

    def handle(self, signum, frame):
        if os.getpid() != self.pid:  # a forked data-loader worker: the main process decides
            return
        now = time.monotonic()
        again = self.first is not None and now - self.first > self.same_event
        self.first = self.first or now
        self.caught.append(signum)
        if not self.defer or again:
            raise Interrupted(signum)

    def restore(self):
        for s, handler in self.old.items():
            signal.signal(s, handler)


# -----------------------------------------------------------------------------------------------
# The run, in reading order: main() is its outline
# -----------------------------------------------------------------------------------------------
def main(argv=None):
    """flags -> start-up -> the loop -> a checkpoint and exit on a stop signal, else the final evaluation."""
    args = get_args(argv)
    signals = StopSignals()  # from here on a stop signal ends the process cleanly (see StopSignals)
    try:
        S = start(args)                                    # run folder, set-up, resume, the banner
        stopped = train_loop(args, S, signals)             # steps, log lines, sample grids, checkpoints
        if stopped:
            code = checkpoint_and_stop(args, S, signals)   # a stop signal: one more checkpoint, exit 0
        else:
            code = final_evaluation(args, S, signals)      # rank 0: every held-out prompt, scored
        return end(args, S, code)
    except Interrupted as e:  # start-up, final samples, or a second signal: leave now, nothing half-written
        print(f"caught {e}: exiting at once; the last checkpoint written stands", file=sys.stderr, flush=True)
        if dist.is_initialized():
            os._exit(128 + e.signum)
        raise SystemExit(128 + e.signum)
    finally:
        signals.restore()


def start(args):
    """Run folder, data check, set-up, resume or args.json, log.jsonl, the banner -> the Run."""
    os.makedirs(os.path.join(args.out, "samples"), exist_ok=True)
    shards = data.resolve_shards(args.data, args.image_size)
    pre = data.precomputed_meta(os.path.dirname(shards[0]))  # written by `python data.py precompute`?
    if pre and [pre[k] for k in ("vae", "text_encoder", "image_size")] != [args.vae, args.text_encoder, args.image_size]:
        raise SystemExit(f"{args.data} was precomputed with --vae {pre['vae']} --text-encoder {pre['text_encoder']} "
                         f"--image-size {pre['image_size']}: pass the same flags (they are needed for sampling)")
    S = setup(args)
    S.shards, S.t_start = shards, time.time()
    S.judged = args.data == data.BUILTIN or (pre or {}).get("source") == data.BUILTIN  # the judge knows only these
    S.names = None if pre else data.names_set(args.data)  # a set of named pictures: retrieval scores
    S.real = sample.real_names(S.names, args.image_size) if S.names and S.rank == 0 else None  # (rank 0 samples)
    master = S.rank == 0  # only rank 0 prints, logs, samples and writes files
    S.log = open(os.path.join(args.out, "log.jsonl"), "a" if args.resume else "w") if master else None
    if args.resume:
        name, changed = load_checkpoint(S, args)
        if master:
            print(f"resumed from {args.out}/{name} at step {S.step}" +
                  "".join(f"; --{k.replace('_', '-')} {a} -> {b}" for k, (a, b) in changed.items()))
            write_log(S.log, dict(resume=dict(step=S.step, checkpoint=name, changed=changed)))
    elif master:  # args.json keeps the flags the run started with; log.jsonl records each resume
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=1)
    total, active = count_params(S.model)
    batch = S.world * args.grad_accum * args.batch_size
    if master:
        print(f"model: {total / 1e6:.2f}M parameters ({active / 1e6:.2f}M active per image token) | text encoder "
              f"{args.text_encoder} (dim {S.encoder.dim}, frozen) | vae {args.vae} | {len(shards)} "
              f"{'precomputed ' if pre else ''}shards | device {S.dev} {args.precision}"
              + (f" | {S.world} ranks x " + (f"{args.grad_accum} micro-batches x " if args.grad_accum > 1 else "") +
                 f"{args.batch_size} = global batch {batch}" if batch > args.batch_size else ""))
    return S


def train_loop(args, S, signals):
    """batch -> encode -> step -> log / samples / checkpoint, until --steps, a stop signal (-> True: this
    or another rank was sent one) or too many bad steps."""
    from tqdm import tqdm
    master = S.rank == 0
    bar = tqdm(total=args.steps, initial=S.step, desc="train", dynamic_ncols=True, disable=not master)
    n_seen, t_window = 0, time.time()
    stream, stopped = batches(args, S, S.shards), False
    try:
        signals.defer = S.world > 1  # one process: a signal while it waits for data stops it at once
        b = first_batch(S, stream) if S.step < args.steps else None
        while b is not None:
            signals.defer = True  # from here the step finishes before a signal is acted on
            t0 = time.perf_counter()
            micro = [encode_batch(S, b)] + [encode_batch(S, next(stream)) for _ in range(args.grad_accum - 1)]
            t1 = time.perf_counter()
            st = train_step(S, args, micro)
            S.t_enc, S.t_total = S.t_enc + t1 - t0, S.t_total + time.perf_counter() - t0
            n_seen += sum(x0.shape[0] for x0, _, _ in micro) * S.world
            if S.step % args.log_every == 0 or S.step == args.steps:  # the only steps that read the device
                stopped = log_step(S, args, st, signals, n_seen / (time.time() - t_window), bar)
                n_seen, t_window = 0, time.time()
            elif S.world == 1:  # (one process needs no all-reduce to know it was signalled)
                stopped = bool(signals.caught)
            bar.update(1)
            if master and args.sample_every and S.step % args.sample_every == 0 and S.step < args.steps:
                acc = sample_grid(S, args, os.path.join(args.out, "samples", f"step_{S.step:06d}.png"))
                write_log(S.log, dict(step=S.step, sample_acc=acc, minutes=(time.time() - S.t_start) / 60))
                redraw_curves(args)
            if S.step % args.ckpt_every == 0 or S.step == args.steps:
                save_checkpoint(S, args)
            if S.step >= args.steps or stopped:  # before the next batch is fetched, so the saved
                break                             # data position is exact
            signals.defer = S.world > 1
            b = next(stream)
    except Interrupted:
        if signals.defer or S.world > 1:  # (defer set: it was a second signal)
            raise
        stopped = True  # one process, waiting for data: the last step is complete, so it checkpoints
    bar.close()
    return stopped


def log_step(S, args, st, signals, img_per_s, bar):
    """A log step: one all-reduce gives every rank the global loss and whether any rank was signalled;
    the log line; too many non-finite steps in a row stop every rank. -> True: stop now."""
    flags = torch.stack([st["loss"].float(), torch.full((), float(bool(signals.caught)), device=S.dev)])
    if S.world > 1:
        dist.all_reduce(flags)  # sum: the global mean loss, any rank's signal
    loss_sum, stop = flags.tolist()
    total, in_a_row, longest = (int(v) for v in S.bad.tolist())  # the same on every rank (see train_step)
    if S.rank == 0:  # (only rank 0 logs: the other ranks read nothing more)
        rec = dict(step=S.step, loss=loss_sum / S.world, loss_t_bins=flow.loss_per_bin(st["t"], st["per_sample"]),
                   lr=S.sched.get_last_lr()[0], grad_norm=st["grad_norm"].item(), img_per_s=img_per_s,
                   encoder_share=S.t_enc / max(S.t_total, 1e-9), skipped=S.skipped, epoch=S.epoch, bad_steps=total)
        if in_a_row:  # this step's update was skipped
            rec["bad_step"] = True
        if args.moe:  # balance loss on its own, and per layer: load per expert, entropy, unused
            rec.update(balance_loss=st["balance"].item(), routing=routing_stats(S.model))
        write_log(S.log, rec)
        bar.set_postfix(loss=f"{rec['loss']:.4f}", img_s=f"{img_per_s:.0f}", bad=total)
    if longest >= args.max_bad_steps:
        fail(S, f"stopping at step {S.step}: {longest} steps in a row had a non-finite loss or gradient norm and "
                f"were skipped. The last checkpoint is {args.out}/{CKPT} at step {S.ckpt_step} (a skipped step "
                f"changes no weight): check the data, or resume from it with a lower --lr (--override lr)")
    return stop > 0


def checkpoint_and_stop(args, S, signals):
    """A stop signal reached this or another rank: every rank writes one checkpoint. -> exit status."""
    name = signal.Signals(signals.caught[0]).name if signals.caught else "a signal sent to another rank"
    print(f"rank {S.rank}: caught {name}, stopping after step {S.step}", flush=True)
    signals.defer = True  # (a second signal still ends it at once)
    if not save_checkpoint(S, args):
        return 1
    if S.rank == 0:
        print(f"caught {name}: checkpoint written at step {S.step}; continue with --resume (or --auto-resume)")
    return 0


def final_evaluation(args, S, signals):
    """Rank 0, after the last checkpoint: a last grid, then every held-out prompt (built-in data) or every
    name (a named-picture set) --eval-n times in wording never trained on, scored. -> exit status."""
    if S.rank != 0:
        return 0
    if S.ckpt_step != S.step:  # the final save failed (its warning says why)
        print(f"error: the checkpoint of the final step {S.step} could not be written; the last one on disk is "
              f"step {S.ckpt_step}", file=sys.stderr)
        return 1
    signals.defer = False  # the last checkpoint is written: a signal during the evaluation just ends it
    print(f"frozen encoders' share of step time: {100 * S.t_enc / max(S.t_total, 1e-9):.2f}% | "
          f"skipped samples: {S.skipped} | skipped non-finite steps: {int(S.bad[0])}")
    sample_grid(S, args, os.path.join(args.out, "samples", f"step_{S.step:06d}.png"))
    if args.eval_n and not (S.judged or S.names):
        print(f"no judge for {args.data}: score the checkpoint with sample.py --eval --real <raw shards>")
    elif args.eval_n:  # noise from --seed
        acc = sample_grid(S, args, os.path.join(args.out, "samples", "eval.png"), args.eval_n, args.seed, fid=True)
        write_log(S.log, dict(step=S.step, eval=acc, minutes=(time.time() - S.t_start) / 60))
        if S.names:
            sample.print_names(acc, args.eval_n * len(S.names["names"]), f"{args.sample_steps} steps, cfg {args.cfg}")
        else:
            print(f"caption accuracy of EMA samples ({args.eval_n * len(data.heldout_prompts(1))} held-out prompts, "
                  f"{args.sample_steps} steps, cfg {args.cfg}): " + " ".join(f"{k} {100 * v:.1f}%" for k, v in acc.items()))
    redraw_curves(args)  # with the final scores
    return 0


def end(args, S, code):
    """Close the log; under torchrun check the replicas agree and leave the process group. -> S (tests)."""
    if S.log:
        S.log.close()
    if args.dist != "none":
        finish_distributed(S, code)  # does not return
    if code:
        raise SystemExit(code)
    return S


def first_batch(S, stream):
    """Every rank fetches its first batch before any step; where one cannot, all stop with the reasons
    (instead of the others waiting forever in an all-reduce)."""
    try:
        b, why = next(stream), None
    except (SystemExit, Exception) as e:  # batches() exits on an epoch without a batch
        b, why = None, str(e)
    whys = [why]
    if S.world > 1:
        whys = [None] * S.world
        dist.all_gather_object(whys, why)
    if any(whys):
        fail(S, "no training batch: " + "\n".join(dict.fromkeys(w for w in whys if w)))
    return b


def write_log(log, rec):
    """One JSON line; NaN and inf become null (json.dumps would write bare NaN, which is not JSON)."""
    def safe(x):
        if isinstance(x, float):
            return x if math.isfinite(x) else None
        if isinstance(x, dict):
            return {k: safe(v) for k, v in x.items()}
        return [safe(v) for v in x] if isinstance(x, (list, tuple)) else x
    if log:
        log.write(json.dumps(safe(rec), allow_nan=False) + "\n")
        log.flush()


def fail(S, msg):
    """Every rank calls this at the same point: the message, then exit status 1 on every rank."""
    if S.log:
        S.log.close()
    if S.world == 1:
        raise SystemExit(msg)
    if S.rank == 0:
        print(msg, file=sys.stderr, flush=True)
    leave_distributed(1)


def finish_distributed(S, code=0):
    """Check that the replicas agree, then leave cleanly."""
    flat = torch.cat([p.detach().flatten() for p in S.model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    same, opt_bytes = [None] * S.world, [None] * S.world
    dist.all_gather_object(same, torch.equal(flat, ref))
    dist.all_gather_object(opt_bytes, optimizer_bytes(S.opt))  # ZeRO-2: each rank holds only its partition
    if S.rank == 0:  # rank 0 has written the checkpoint; use sample.py on it
        print(f"parameters identical on all {S.world} ranks: {all(same)}")
        print(f"optimizer state bytes per rank: {opt_bytes}")
    leave_distributed(code)


def optimizer_bytes(opt):
    """Bytes of optimizer state this process holds (AdamW: two moments per parameter; ZeRO-2: its partition)."""
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v))


def leave_distributed(code=0):
    """barrier -> destroy -> flush -> os._exit: gloo can abort at interpreter exit; this order never did."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
