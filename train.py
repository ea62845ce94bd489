"""train.py -- train the MM-DiT with rectified flow (or MeanFlow's average
velocity, --objective meanflow); `python train.py` is the whole CPU demo.
In nanoGPT's order: the flags, the set-up, one step (train_step: the
method), the loop; then what a first read may skip.

engine.py puts one process, DDP, ZeRO-2 and FSDP2 behind the step's calls;
runfolder.py keeps checkpoints, logs, stop signals and exits.
"""
import argparse
import copy
import dataclasses
import glob
import math
import os
import random
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import data
import evaluate
import expert_parallel
import flow
import moe
import runfolder
import sample
from engine import Engine, FSDPEngine, init_distributed, make_engine
from model import MODELS, DiT, TextEncoder, load_vae, preset, to_device
from runfolder import CKPT, PREV, RESUME_FLAGS, Interrupted, StopSignals


# ---- Flags ----
def get_parser():
    p = argparse.ArgumentParser(description="Train a text-to-image MM-DiT with rectified flow.")
    add = p.add_argument
    # data, encoders
    add("--data", default=data.BUILTIN,
        help="shards: a folder, a.tar,b.tar, a folder URL (.../x/), a brace pattern "
        "(.../shard-{000..099}.tar), gs://..., 'pipe:CMD'; or builtin, builtin-mixed")
    add("--init", help="start from a checkpoint's (EMA) weights (reflow; a dense one's: upcycling)")
    add("--text-encoder", default="minilm",
        help="'minilm' (offline, pip) or a CLIP hub id or folder")
    add("--text-cache", type=int, default=100_000, help="captions whose states stay cached")
    add("--vae", default="none",
        help="'none' (pixels), or a diffusers AutoencoderKL: hub id or folder")
    add("--image-size", type=int, default=32, help="training resolution in pixels")
    # the model
    add("--model", choices=MODELS, help="DiT's sizes; the four flags below override")
    add("--width", type=int, help="transformer width D (default 192)")
    add("--depth", type=int, help="dual-stream layers (default 4)")
    add("--heads", type=int, help="attention heads (default 4)")
    add("--patch", type=int, help="patch size p: (image_size / p)^2 tokens (default 4)")
    add("--attn", choices=["manual", "sdpa", "cudnn"],
        help="softmax(QK^T/sqrt d)V written out, SDPA, or SDPA trying cuDNN first (GPU default)")
    add("--moe", type=int, default=0, help="experts per image-stream MLP; 0: dense")
    add("--topk", type=int, default=2, help="experts each image token is routed to")
    add("--shared-experts", type=int, default=2, help="always-on experts per MoE layer")
    add("--expert-hidden", type=int,
        help="an expert's hidden size (default: dense / (topk + shared))")
    add("--moe-impl", choices=["loop", "sorted", "grouped"],
        help="MoE dispatch (default: sorted on CPU, grouped on CUDA)")
    add("--balance", default="aux", choices=["aux", "bias"],
        help="Switch's balance loss, or DeepSeek-V3's bias")
    add("--bias-rate", type=float, default=0.001,
        help="--balance bias: a bias's move per step (gamma)")
    add("--ep", type=int, default=1,
        help="expert parallelism: ranks hold --moe / this many experts")
    # the optimization
    add("--steps", type=int, default=1000, help="optimizer steps")
    add("--batch-size", type=int, default=64, help="images per micro-batch per rank")
    add("--grad-accum", type=int, default=1,
        help="micro-batches per step: global batch = batch-size x this x ranks")
    add("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    add("--warmup", type=int, default=100, help="linear warm-up steps, then cosine to 0")
    add("--t-dist", default="logit-normal", choices=["uniform", "logit-normal"],
        help="training time distribution")
    add("--t-shift", type=float, default=1.0,
        help="SD3's time shift s of train and sample times (1: none)")
    add("--contrast", type=float, default=0.0,
        help="contrastive flow matching weight lambda (0: off)")
    add("--objective", default="rf", choices=["rf", "meanflow"],
        help="rectified flow's velocity, or MeanFlow's average velocity (one-step samples)")
    add("--mf-share", type=float, default=0.25,
        help="meanflow: share of (r, t) draws with r < t (the rest: r = t, v's target)")
    add("--mf-power", type=float, default=0.5,
        help="meanflow: adaptive loss weight 1 / (loss + c)^p (0: the plain loss; the paper's: 1)")
    add("--mf-guidance", type=float, default=1.5,
        help="meanflow: guidance scale trained into the target (1: none)")
    add("--cfg-drop", type=float, default=0.1,
        help="probability of the null caption (for guidance)")
    add("--ema", type=float, default=0.0, help="EMA decay (0: sample the trained weights)")
    # how it computes
    add("--precision", choices=["fp32", "bf16"],
        help="default: bf16 autocast on CUDA, else fp32")
    add("--compile", choices=["on", "off"],
        help="torch.compile forward and backward (default: on a GPU); pads the text to one length")
    add("--grad-ckpt", action="store_true",
        help="activation checkpointing: recompute blocks in the backward")
    add("--dist", default="none", choices=["none", "ddp", "deepspeed", "fsdp"],
        help="under torchrun: DDP, DeepSpeed ZeRO-2, or FSDP2")
    add("--seed", type=int, default=0, help="seed of data order, noise, t, caption drop")
    add("--workers", type=int,
        help="loader processes (default: 0 on a CPU, else <= 8; a resume keeps its own)")
    add("--retries", type=int, default=data.RETRIES,
        help="reopenings of a remote shard cut part-way, before it is skipped")
    # the run folder
    add("--out", default="out/run", help="run folder: checkpoints, logs, samples/")
    add("--resume", action="store_true",
        help="continue exactly from <out>/ckpt.pt (or ckpt.prev.pt)")
    add("--auto-resume", action="store_true",
        help="resume if <out> holds a checkpoint (requeued jobs)")
    add("--override", action="append", default=[],
        help="--resume: accept these changed flags (e.g. steps,lr); 'world': another rank count")
    add("--max-bad-steps", type=int, default=10,
        help="stop after this many skipped (non-finite) steps in a row")
    add("--log-every", type=int, default=10,
        help="steps between log lines (the only host syncs)")
    add("--sample-every", type=int, default=500,
        help="steps between sample grids (0: only at the end)")
    add("--ckpt-every", type=int, default=500,
        help="steps between checkpoints (and at the end)")
    # the samples
    add("--cfg", type=float,
        help="guidance scale w of the samples (default 2; meanflow: 1, it is trained in)")
    add("--sample-steps", type=int,
        help="Euler steps (meanflow: jumps) of the samples (default 25; meanflow: 1)")
    add("--eval-n", type=int, default=2,
        help="final evaluation: samples per held-out prompt or name (0: none)")
    return p


def get_args(argv=None, parser=None):
    """Parse and check the flags; profile.py passes a `parser` with its own."""
    p = parser or get_parser()
    args = p.parse_args(argv)
    # a flag given wins over --model, which wins over the CPU default
    cpu_size = dict(width=192, depth=4, heads=4, patch=4)
    size = cpu_size | (preset(args.model) if args.model else {})
    for k, v in size.items():
        setattr(args, k, v if getattr(args, k) is None else getattr(args, k))
    # with a VAE, setup() checks the latent side too
    if args.image_size % args.patch:
        fits = [q for q in (1, 2, 4, 8, 16) if args.image_size % q == 0]
        p.error(f"--patch {args.patch} does not divide --image-size {args.image_size}; "
                f"use one of {fits}")
    if args.width % args.heads or (args.width // args.heads) % 2 or args.width % 4:
        p.error(f"--width {args.width} must be a multiple of 4 and of --heads {args.heads} "
                "with an even head size")
    if args.moe and not 1 <= args.topk <= args.moe:
        p.error(f"--topk {args.topk} must be between 1 and --moe {args.moe}")
    if args.init and not os.path.exists(args.init):
        p.error(f"--init {args.init}: no such checkpoint (e.g. out/run/ckpt.pt)")
    if args.grad_accum < 1 or not 0 <= args.cfg_drop <= 1:
        p.error("--grad-accum must be at least 1 and --cfg-drop in [0, 1]")
    if args.contrast and args.batch_size % 2:
        p.error(f"--contrast pairs neighbouring samples: --batch-size {args.batch_size} "
                f"is odd; use {args.batch_size + 1}")
    meanflow = args.objective == "meanflow"
    if meanflow:
        refused = {"--contrast": args.contrast, "--dist fsdp": args.dist == "fsdp",
                   f"--ep {args.ep}": args.ep > 1}
        if names := [k for k, v in refused.items() if v]:
            p.error(f"--objective meanflow does not take {', '.join(names)}: it trains in one "
                    "process or under --dist ddp or deepspeed (with --moe, --grad-accum, "
                    "--compile)")
        if not 0 <= args.mf_share <= 1:
            p.error(f"--mf-share {args.mf_share}: a share, in [0, 1]")
        if args.mf_guidance != 1 and not args.cfg_drop:
            p.error("--mf-guidance needs the null caption trained: --cfg-drop > 0, "
                    "or --mf-guidance 1")
    elif any(getattr(args, k) != p.get_default(k) for k in runfolder.MEANFLOW_FLAGS):
        p.error("--mf-share, --mf-power and --mf-guidance shape MeanFlow's target: "
                "add --objective meanflow")
    args.cfg = args.cfg if args.cfg is not None else (1.0 if meanflow else 2.0)
    args.sample_steps = args.sample_steps or (1 if meanflow else 25)
    if args.dist != "none" and "RANK" not in os.environ:
        p.error(f"--dist {args.dist} needs a launcher: "
                f"torchrun --nproc_per_node N train.py --dist {args.dist} ...")
    if args.ep > 1 and (args.dist != "ddp" or (args.moe or 1) % args.ep
                        or int(os.environ["WORLD_SIZE"]) % args.ep):
        p.error(f"--ep {args.ep} needs --dist ddp (not deepspeed or fsdp) and --moe E, "
                "E and the ranks multiples of it")
    if args.compile == "on" and args.dist == "deepspeed":
        p.error("--compile on: DeepSpeed's engine is not compiled here; "
                "drop the flag, or use --dist ddp or fsdp")
    gpu = torch.cuda.is_available()
    args.attn = args.attn or ("cudnn" if gpu else "sdpa")
    compiles = gpu and args.dist != "deepspeed"
    args.compile = (args.compile or ("on" if compiles else "off")) == "on"
    args.override = [name.strip().lstrip("-").replace("-", "_")
                     for names in args.override for name in names.split(",") if name.strip()]
    if set(args.override) - set(RESUME_FLAGS) - {"world"}:
        p.error(f"--override: {args.override!r}; choose from world,"
                f"{','.join(k.replace('_', '-') for k in RESUME_FLAGS)}")
    found = runfolder.holds_checkpoint(args.out)
    args.resume = args.resume or (args.auto_resume and found)
    # a resume takes its checkpoint's
    if args.workers is None and not args.resume:
        args.workers = data.default_workers()
    if args.resume and not found:
        p.error(f"--resume: no checkpoint at {args.out}/{CKPT}; drop --resume to start fresh")
    return args


# ---- Set-up: the Run, the state a checkpoint saves ----
@dataclasses.dataclass
class Run:
    """Everything a run holds; setup() fills the first block."""
    dev: str  # "cuda" or "cpu"
    rank: int
    world: int
    # DiT(**config): saved, for sample.py
    config: dict
    model: torch.nn.Module
    # what samples use (--ema 0: the model itself)
    ema: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    engine: Engine
    gen: torch.Generator
    encoder: TextEncoder
    vae: object = None  # None: pixels
    step: int = 0
    position: data.Position = dataclasses.field(default_factory=data.Position)
    bad_steps: dict = None  # {total, in_a_row, longest}
    # the last checkpoint written, and its DeepSpeed folder
    ckpt_step: int = None
    deepspeed_tag: str = None
    shards: list = None
    buckets: dict = None  # {(W, H): samples}; None: squares
    # the built-in shapes: evaluate.judge scores samples
    has_judge: bool = False
    # a names set: retrieval scores samples
    names: dict = None
    log: object = None  # rank 0's log.jsonl
    t_start: float = 0.0  # seconds
    # --compile: the text length of every batch
    text_len: int = None


def setup(args, shape=None):
    """Build the Run; profile.py's `shape`: (channels, side, text dim)."""
    dev, rank, local_rank, world = init_distributed(args.dist)
    args.precision = args.precision or ("bf16" if dev == "cuda" else "fp32")
    args.moe_impl = args.moe_impl or moe.default_impl(dev)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    vae = load_vae(args.vae, dev)
    encoder = TextEncoder(args.text_encoder, device=dev, cache_size=args.text_cache)
    size = args.image_size // (vae.factor if vae else 1)
    if vae and (args.image_size % vae.factor or size % args.patch):
        raise SystemExit(
            f"--vae shrinks the pictures {vae.factor} times: pick --image-size "
            f"a multiple of {vae.factor * args.patch} (for --patch {args.patch})")
    config = dict(
        in_channels=vae.channels if vae else 3, image_size=size, patch=args.patch,
        width=args.width, depth=args.depth, heads=args.heads, text_dim=encoder.dim,
        attn=args.attn, moe=args.moe, topk=args.topk, shared_experts=args.shared_experts,
        moe_impl=args.moe_impl, expert_hidden=args.expert_hidden, balance=args.balance)
    if args.objective == "meanflow":
        # (a rectified-flow config has neither key: its checkpoints stand)
        config["meanflow"] = True
        config["time_scale"] = meanflow_time_scale(args)
    if shape:
        config.update(in_channels=shape[0], image_size=shape[1], text_dim=shape[2])
    model = DiT(**config).to(dev)
    model.grad_ckpt = args.grad_ckpt
    # before AdamW (and ZeRO's fp32 copy) take the weights
    if args.init and not args.resume:
        runfolder.init_weights(model, config, args.init, dev, rank)
    ema = copy.deepcopy(model).requires_grad_(False) if args.ema else model
    models = [model, ema] if args.ema else [model]
    # a rank holds 1/ep of the experts (--ep), or 1/world of each weight
    # (FSDP): so of their gradients and AdamW state
    expert_parallel.shard_experts(models, args.ep)
    if args.dist == "fsdp":
        FSDPEngine.shard(models, dev, bf16=args.precision == "bf16")
    # fused: one kernel for the update, which skips a bad step on the device
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=True)

    def lr_lambda(step):
        """Linear warm-up, then a cosine to zero."""
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    gen = torch.Generator(dev).manual_seed(args.seed)
    engine = make_engine(args, model, opt, dev, world, local_rank)
    bad_steps = {k: torch.zeros((), device=dev) for k in ("total", "in_a_row", "longest")}
    return Run(
        dev=dev, rank=rank, world=world, config=config, model=model, ema=ema,
        opt=opt, sched=sched, engine=engine, gen=gen, encoder=encoder, vae=vae,
        bad_steps=bad_steps, text_len=encoder.max_len if args.compile else None)


# ---- One training step ----
def train_step(run, args, micro_batches, mark=None):
    """One optimizer step on this rank's micro-batches [(x0, text, mask,
    noise)], with no host sync (but DeepSpeed's norm, MeanFlow's count):

        t (and r), noise, drops -> flow loss (+ balance loss) -> backward
        -> clip at 1.0 -> AdamW -> schedule -> EMA

    A non-finite loss or gradient norm changes no weight, moment or EMA."""
    # profile.py times the phases
    mark = mark or (lambda phase: None)
    n_micro, bf16 = len(micro_batches), args.precision == "bf16"
    # MoE: the balance loss counts the global batch's loads, as one
    # process would (dense: unused)
    all_reduce = dist.all_reduce if run.world > 1 else None
    draws = this_ranks_draws(run, args, micro_batches)
    loss, balance, per_sample = 0, 0, []
    for i, ((x0, text, mask, _), (captioned, t, r, eps)) in enumerate(zip(micro_batches, draws)):
        # the null caption where dropped: guidance's unconditional model
        text, mask = flow.drop_captions(text, mask, captioned)
        # DDP reduces the gradients in the last micro-batch's backward
        with run.engine.micro_batch(last=i == n_micro - 1):
            with torch.autocast(run.dev, dtype=torch.bfloat16, enabled=bf16):
                loss_i, per_sample_i = objective_loss(
                    run, args, x0, text, mask, captioned, t, r, eps)
                balance_i = moe.balance_loss(run.model, all_reduce)  # dense: 0
            mark("forward")
            # engine.backward divides by --grad-accum: the step's mean
            run.engine.backward(loss_i + balance_i)
            mark("backward")
        # logged: the plain flow loss (without --contrast's term)
        loss = loss + per_sample_i.detach().mean() / n_micro
        balance = balance + balance_i.detach() / n_micro
        per_sample.append(per_sample_i.detach())
    # for the log: the lr this step runs at
    lr = run.opt.param_groups[0]["lr"]
    # clip at 1.0, AdamW; a non-finite loss or norm skips it on every rank
    grad_norm, bad_step = run.engine.step(loss + balance)
    # --balance bias: toward the less-loaded experts (DeepSeek-V3)
    moe.nudge_biases(run.model, args.bias_rate, skip=bad_step)
    # skipped steps count too: the lr stays a function of run.step
    run.sched.step()
    run.step += 1
    if args.ema:
        # warmed up: early on the EMA keeps up with a short run
        decay = min(args.ema, (1 + run.step) / (10 + run.step))
        update_ema(run.ema, run.model, decay, skip=bad_step)
    count_bad_step(run, bad_step)
    mark("optimizer")
    t = torch.cat([t_i for _, t_i, _, _ in draws])
    return dict(loss=loss, balance=balance, t=t, lr=lr, per_sample=torch.cat(per_sample),
                grad_norm=grad_norm, bad_step=bad_step)


def this_ranks_draws(run, args, micro_batches):
    """-> [(captioned (b,), t (b,), r (b,) or None, eps (b, C, H, W))] per
    micro-batch: this rank's rows of the global batch's caption drops,
    times (MeanFlow: two) and noise.

    Every rank draws the whole global batch from one generator and keeps
    its slice, so a run does not depend on how the batch is split over
    ranks (2 ranks x 8 trains as 1 x 16). Micro-batches draw their noise
    in turn: on a CPU the same numbers as one draw (the tests check it);
    on CUDA, untested, its generator may give others."""
    dev, per_rank = run.dev, micro_batches[0][0].shape[0]
    per_micro = per_rank * run.world
    n = per_micro * len(micro_batches)
    # p = --cfg-drop of the null caption (Ho & Salimans 2022)
    captioned = torch.rand(n, generator=run.gen, device=dev) >= args.cfg_drop
    if args.objective == "meanflow":
        t, r = flow.sample_t_r(n, args.mf_share, args.t_dist, run.gen, dev, args.t_shift)
    else:
        t, r = flow.sample_t(n, args.t_dist, run.gen, dev, args.t_shift), None
    lo, hi, draws = run.rank * per_rank, (run.rank + 1) * per_rank, []
    for i, (x0, _, _, noise) in enumerate(micro_batches):
        rows = slice(i * per_micro + lo, i * per_micro + hi)
        eps = torch.randn((per_micro, *x0.shape[1:]), generator=run.gen, device=dev)[lo:hi]
        # reflow trains each picture with the noise it was drawn from
        r_rows = None if r is None else r[rows]
        draws.append((captioned[rows], t[rows], r_rows, eps if noise is None else noise))
    return draws


def objective_loss(run, args, x0, text, mask, captioned, t, r, eps):
    """-> (loss, per-sample loss): rectified flow's (flow.flow_loss), or
    MeanFlow's (flow.meanflow_loss, --objective meanflow)."""
    if args.objective == "meanflow":
        # the target from the unwrapped model: no grad, no sync
        return flow.meanflow_loss(
            run.engine.forward, x0, text, mask, t, r, eps, captioned,
            args.mf_guidance, args.mf_power, target_model=run.model)
    return flow.flow_loss(run.engine.forward, x0, text, mask, t, eps, args.contrast)


@torch.no_grad()
def update_ema(ema, model, decay, skip):
    """EMA <- EMA + (1 - decay)(model - EMA), one fused op over all
    weights (DiT's update_ema, fused); a skipped step adds 0, read on the
    device."""
    ema_params, model_params = list(ema.parameters()), list(model.parameters())
    weight = (~skip).float() * (1 - decay)
    torch._foreach_lerp_(ema_params, model_params, [weight] * len(ema_params))
    # --balance bias: the router's biases are buffers; the EMA routes alike
    for ema_buffer, model_buffer in zip(ema.buffers(), model.buffers()):
        ema_buffer.copy_(model_buffer)


# ---- The loop ----
def start_run(args):
    """Open the run folder, set up, resume or start -> the Run."""
    shards, precomputed = runfolder.open_folder(args)
    run = setup(args)
    run.shards, run.t_start = shards, time.time()
    source = (precomputed or {}).get("source")
    run.has_judge = data.BUILTIN in (args.data, source) or args.data == data.MIXED
    factor = run.vae.factor if run.vae else 1
    run.buckets = data.bucket_shares(shards, args.image_size, args.patch * factor)
    # FSDP: every rank runs the sampling forwards
    if run.rank == 0 or run.engine.splits_weights:
        run.names = evaluate.names_set(data.made_from(args.data), args.image_size)
    else:
        run.names = None
    runfolder.resume_or_record(run, args)
    runfolder.banner(run, args, precomputed)
    return run


def train_loop(args, run, signals):
    """Steps, log lines, grids, checkpoints, to --steps or a stop signal
    -> whether a rank got one."""
    from tqdm import tqdm
    bar = tqdm(total=args.steps, initial=run.step, desc="train", dynamic_ncols=True,
               disable=run.rank != 0)
    n_seen, t_window, stopped = 0, time.time(), False
    # it advances run.position, and ends where a rank has no batch
    stream = data.batches(
        run.shards, args.batch_size, run.buckets or args.image_size,
        args.seed, run.rank, run.world, args.workers, run.position, args.retries)
    # A signal raised in the loader could leave a lock held or the data
    # position half-updated: a first one waits for the step's end.
    signals.defer = True
    try:
        while run.step < args.steps and not stopped:
            micro_batches = [encode_batch(run, next(stream)) for _ in range(args.grad_accum)]
            stats = train_step(run, args, micro_batches)
            n_seen += sum(x0.shape[0] for x0, *_ in micro_batches) * run.world
            if run.step % args.log_every == 0 or run.step == args.steps:
                img_per_s = n_seen / (time.time() - t_window)
                stopped = runfolder.log_step(run, args, stats, signals, img_per_s, bar)
                n_seen, t_window = 0, time.time()
            # one process needs no all-reduce to know it was signalled
            elif run.world == 1:
                stopped = bool(signals.caught)
            bar.update(1)
            if args.sample_every and run.step % args.sample_every == 0 and run.step < args.steps:
                # every rank: --ep gathers the experts
                sample_grid(run, args, expert_parallel.whole_model(run.ema, run.config))
            if run.step % args.ckpt_every == 0 or run.step == args.steps:
                runfolder.save_checkpoint(run, args)
    finally:
        # the workers ignore TERM: at exit, they would be waited for forever
        stream.close()
    bar.close()
    return stopped


def main(argv=None):
    """Train, then evaluate (on a stop signal: checkpoint instead)."""
    args = get_args(argv)
    signals = StopSignals(watch_launcher=args.dist != "none")
    try:
        run = start_run(args)
        if train_loop(args, run, signals):
            name = signals.caught[0] if signals.caught else "a signal sent to another rank"
            # one write: the ranks' lines do not interleave
            print(f"rank {run.rank}: caught {name}, stopping after step {run.step}\n",
                  end="", flush=True)
            # the same signal arriving twice is not a second one
            signals.defer, t0 = True, time.time()
            code = 0 if runfolder.save_checkpoint(run, args) else 1
            if run.rank == 0 and not code:
                print(f"caught {name}: checkpoint written at step {run.step} "
                      f"in {time.time() - t0:.1f} s (--resume)")
        else:
            code = final_evaluation(args, run, signals)
        return runfolder.finish(run, code)
    # start-up, the final samples, or a second signal: leave now
    except Interrupted as e:
        signum = e.args[0]
        print(f"caught {signal.Signals(signum).name}: exiting at once; "
              "the last checkpoint written stands", file=sys.stderr, flush=True)
        # gloo can abort at interpreter exit
        (os._exit if dist.is_initialized() else sys.exit)(128 + signum)
    # late copies of a stop signal are ignored
    finally:
        for s, handler in signals.saved_handlers.items():
            signal.signal(s, signal.SIG_IGN if signals.caught else handler)


# ---- What a first read may skip ----
def encode_batch(run, batch):
    """A loader batch -> (x0, text, mask, noise) on the device, through the
    frozen encoders unless precomputed."""
    if "latent" in batch:
        noise = batch.get("noise")
        noise = None if noise is None else to_device(noise, run.dev).float()
        x0, text, mask = (to_device(batch[k], run.dev) for k in ("latent", "text", "mask"))
        x0, text = x0.float(), text.float()
    else:
        x0 = to_device(batch["image"], run.dev)
        text, mask = run.encoder(batch["caption"])
        noise = None
        x0 = x0 if run.vae is None else run.vae.encode(x0)
    # --compile: one length, one graph (the padding is masked)
    if run.text_len and text.shape[1] < run.text_len:
        more = run.text_len - text.shape[1]
        text, mask = F.pad(text, (0, 0, 0, more)), F.pad(mask, (0, more))
    return x0, text, mask, noise


def meanflow_time_scale(args):
    """t's factor in a MeanFlow model: 1 (model.timestep_embedding says
    why), or that of the checkpoint it resumes or starts from (--init):
    a rectified-flow parent's 1000, so the run starts from what it computes."""
    if args.resume:
        paths = [os.path.join(args.out, name) for name in (CKPT, PREV)]
    else:
        paths = [args.init] if args.init else []
    for path in paths:
        # mmap: the config without reading every tensor
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        # a damaged file (its errors vary): resume falls back to the other
        except Exception:
            continue
        return ckpt["config"].get("time_scale", 1000)
    return 1


def count_bad_step(run, bad_step):
    """Count a bad step in run.bad_steps, on the device."""
    counts, bad = run.bad_steps, bad_step.float()
    counts["total"] = counts["total"] + bad
    counts["in_a_row"] = (counts["in_a_row"] + 1) * bad
    counts["longest"] = torch.maximum(counts["longest"], counts["in_a_row"])


def sample_grid(run, args, ema, final=False):
    """The EMA draws each held-out prompt (or name) once, from fixed noise,
    or at the end --eval-n times, scored."""
    if run.rank != 0 and not run.engine.splits_weights:
        return
    name = "eval.png" if final else f"step_{run.step:06d}.png"
    path = os.path.join(args.out, "samples", name)
    scores, fake, _ = sample.score_heldout(
        ema, run.encoder, run.vae, run.names, path if run.rank == 0 else None,
        args.eval_n if final else 1, args.sample_steps, args.cfg,
        args.seed if final else 1234, args.t_shift, fid=final, judge=run.has_judge,
        size=run.buckets)
    if run.rank == 0:
        minutes = (time.time() - run.t_start) / 60
        key = "eval" if final else "sample_acc"
        run.log.write({"step": run.step, key: scores, "minutes": minutes})
        # buckets: a grid each
        for png in sorted(glob.glob(path[:-len(".png")] + "*.png")):
            run.log.image(png, run.step)
        if final:
            evaluate.print_scores(scores, len(fake), f"{args.sample_steps} steps, cfg {args.cfg}")


def final_evaluation(args, run, signals):
    """After the last checkpoint, the samples' scores -> the exit status."""
    ema = expert_parallel.whole_model(run.ema, run.config)
    # the final save failed (its warning said why)
    if run.ckpt_step != run.step:
        if run.rank == 0:
            print("error: the final checkpoint was not written; "
                  f"the last on disk: step {run.ckpt_step}", file=sys.stderr)
        return 1
    # the checkpoint is written: a signal now just ends the evaluation
    signals.defer = False
    skipped = runfolder.skipped_on_all_ranks(run)
    if run.rank == 0:
        print(f"skipped samples: {skipped} | "
              f"skipped non-finite steps: {int(run.bad_steps['total'])}")
    scored = bool(args.eval_n and (run.has_judge or run.names))
    sample_grid(run, args, ema, final=scored)
    if args.eval_n and not scored and run.rank == 0:
        print(f"no judge for {args.data}: score {args.out}/{CKPT} "
              "with sample.py --eval --real <raw shards>")
    return 0


if __name__ == "__main__":
    main()
