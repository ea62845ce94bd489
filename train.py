"""train.py -- train the MM-DiT with rectified flow. `python train.py` is the whole CPU demo.

In nanoGPT's order: flags -> set-up (the Run: model, EMA, AdamW, schedule, and the engine that makes and applies the
gradients) -> one training step -> the loop, outlined in main(); after one banner, a batch onto the device (through
the frozen encoders), the sample grids and the final evaluation. The same file runs under torchrun (`--dist ddp`,
`deepspeed`, `fsdp`); what a first read skips lives in two files named for it: engine.py (one process, DDP, DeepSpeed
ZeRO-2, FSDP2, behind the interface the step calls) and runfolder.py (checkpoints, log.jsonl and TensorBoard, stop
signals, exits). profile.py and the tests reuse this file's parser and step. Resume is exact: a checkpoint holds every
state, RNGs and each rank's data.Position included.
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
from runfolder import CKPT, TRAJECTORY, Interrupted, StopSignals, end, holds_checkpoint, log_step, save_checkpoint


# ---- Flags ----------------------------------------------------------------------------------------------------------
def get_parser():
    p = argparse.ArgumentParser(description="Train a text-to-image MM-DiT with rectified flow.")
    a = p.add_argument
    a("--data", default=data.BUILTIN, help="shards (a folder or a.tar,b.tar), 'builtin' or 'builtin-mixed' (5 aspects)")
    a("--init", help="a checkpoint whose (EMA) weights a new run starts from: the same model (reflow on its "
      "sample.py --pairs), or a dense one for an --moe run (upcycled: every expert a copy of its MLP)")
    a("--text-encoder", default="minilm", help="'minilm' (offline, a pip package) or a CLIP hub id or folder")
    a("--text-cache", type=int, default=100_000, help="distinct captions whose states stay cached (CPU, fp16)")
    a("--vae", default="none", help="'none' = pixels, or a frozen diffusers AutoencoderKL: hub id or folder")
    a("--image-size", type=int, default=32, help="training resolution in pixels")
    a("--model", choices=MODELS, help="DiT's sizes S/B/L/XL with patch 2/4/8 (e.g. S/2); the four flags below override")
    a("--width", type=int, help="transformer width D (default 192)")
    a("--depth", type=int, help="number of dual-stream layers (default 4)")
    a("--heads", type=int, help="attention heads, width a multiple of it (default 4)")
    a("--patch", type=int, help="patch size p: image tokens N = (image_size / p)^2 (default 4)")
    a("--attn", choices=["manual", "sdpa", "cudnn"], help="softmax(QK^T/sqrt d)V written out, SDPA, or SDPA with "
      "cuDNN's fused kernel first (default on a GPU; model.attention)")
    a("--moe", type=int, default=0, help="experts per image-stream MLP (DiT-MoE); 0 = dense")
    a("--topk", type=int, default=2, help="experts each image token is routed to")
    a("--shared-experts", type=int, default=2, help="always-on shared experts per MoE layer (DiT-MoE uses 2)")
    a("--expert-hidden", type=int, default=None, help="hidden size of an expert (default: dense / (topk + shared))")
    a("--moe-impl", choices=["loop", "sorted", "grouped"], help="MoE dispatch (CPU default sorted, CUDA grouped)")
    a("--balance", default="aux", choices=["aux", "bias"], help="Switch's balance loss, or DeepSeek-V3's bias")
    a("--bias-rate", type=float, default=0.001, help="--balance bias: how far a step moves a bias (gamma)")
    a("--ep", type=int, default=1, help="expert parallelism (torchrun): each rank holds --moe / this many experts")
    a("--steps", type=int, default=1000, help="optimizer steps")
    a("--batch-size", type=int, default=64, help="images per micro-batch per rank")
    a("--grad-accum", type=int, default=1, help="micro-batches per step: global batch = batch-size x this x ranks")
    a("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    a("--warmup", type=int, default=100, help="linear warm-up steps before the cosine decay to zero")
    a("--t-dist", default="logit-normal", choices=["uniform", "logit-normal"], help="training time distribution")
    a("--t-shift", type=float, default=1.0, help="SD3's time shift s of training and sampling times; 1 = none")
    a("--contrast", type=float, default=0.0, help="contrastive flow matching weight lambda (0 = plain flow matching)")
    a("--cfg-drop", type=float, default=0.1, help="probability of training on the null caption (for guidance)")
    a("--ema", type=float, default=0.0, help="EMA decay of the weights samples use (0: the trained weights, no copy)")
    a("--precision", choices=["fp32", "bf16"], help="default: bf16 autocast on CUDA, fp32 on CPU")
    a("--compile", choices=["on", "off"], help="torch.compile the training forward and backward (default: on with a "
      "GPU, off on a CPU); the text is then padded to one length, so that each picture size compiles once")
    a("--grad-ckpt", action="store_true", help="activation checkpointing: recompute each block in the backward")
    a("--dist", default="none", choices=["none", "ddp", "deepspeed", "fsdp"],
      help="under torchrun: DDP, DeepSpeed ZeRO-2, or FSDP2 (every weight split over the ranks too)")
    a("--seed", type=int, default=0, help="seed of data order, noise, times and caption drop")
    a("--workers", type=int, help="loader processes (default: 0 on a CPU, whose cores run the model; on a GPU this "
      "process's share of the cores, at most 8; a resumed run keeps its checkpoint's)")
    a("--out", default="out/run", help="run folder: ckpt.pt, args.json, log.jsonl, TensorBoard events, samples/")
    a("--resume", action="store_true", help="continue exactly from <out>/ckpt.pt (unreadable: ckpt.prev.pt)")
    a("--auto-resume", action="store_true", help="resume if <out> holds a checkpoint, else start (requeued jobs)")
    a("--override", action="append", default=[], help="--resume: accept these changed flags, comma-separated (e.g. "
      "steps,lr; may be repeated); 'world': another number of ranks (--grad-accum then keeps the global batch)")
    a("--max-bad-steps", type=int, default=10, help="stop after this many non-finite (skipped) steps in a row")
    a("--log-every", type=int, default=10, help="steps between log lines: the only steps that read the device")
    a("--sample-every", type=int, default=500, help="steps between the EMA's sample grids (0 = only at the end)")
    a("--ckpt-every", type=int, default=500, help="steps between checkpoints (and one at the end)")
    a("--cfg", type=float, default=2.0, help="guidance scale w of sample grids and the final evaluation")
    a("--sample-steps", type=int, default=25, help="Euler steps of sample grids and the final evaluation")
    a("--eval-n", type=int, default=2,
      help="final evaluation: samples per colour x shape x position, or per name (0 = none)")
    return p


def get_args(argv=None, parser=None):
    """Parse and check the flags; `parser` lets profile.py add its own to the very same set."""
    p = parser or get_parser()
    args = p.parse_args(argv)
    size = dict(width=192, depth=4, heads=4, patch=4) | (preset(args.model) if args.model else {})
    for k, v in size.items():  # a flag given explicitly wins over --model, which wins over the CPU default
        setattr(args, k, v if getattr(args, k) is None else getattr(args, k))
    if args.image_size % args.patch:  # (with a VAE, setup() checks the latent size too)
        ok = [q for q in (1, 2, 4, 8, 16) if args.image_size % q == 0]
        p.error(f"--patch {args.patch} does not divide --image-size {args.image_size}; use one of {ok}")
    if args.width % args.heads or (args.width // args.heads) % 2 or args.width % 4:
        p.error(f"--width {args.width} must be a multiple of 4 and of --heads {args.heads} with an even head size")
    if args.moe and not 1 <= args.topk <= args.moe:
        p.error(f"--topk {args.topk} must be between 1 and --moe {args.moe}")
    if args.init and not os.path.exists(args.init):
        p.error(f"--init {args.init}: no such checkpoint (e.g. out/run/ckpt.pt)")
    if args.grad_accum < 1 or not 0 <= args.cfg_drop <= 1:
        p.error("--grad-accum must be at least 1 and --cfg-drop in [0, 1]")
    if args.dist != "none" and "RANK" not in os.environ:
        p.error(f"--dist {args.dist} needs a launcher: torchrun --nproc_per_node N train.py --dist {args.dist} ...")
    if args.ep > 1 and (args.dist != "ddp" or (args.moe or 1) % args.ep or int(os.environ["WORLD_SIZE"]) % args.ep):
        p.error(f"--ep {args.ep} needs --dist ddp (not deepspeed or fsdp) and --moe E, E and the ranks multiples of it")
    if args.compile == "on" and args.dist == "deepspeed":
        p.error("--compile on: DeepSpeed's engine is not compiled here; drop the flag, or use --dist ddp or fsdp")
    args.attn = args.attn or ("cudnn" if torch.cuda.is_available() else "sdpa")  # (the same numbers, kernels apart)
    args.compile = (args.compile or ("on" if torch.cuda.is_available() and args.dist != "deepspeed" else "off")) == "on"
    args.override = [f.strip().lstrip("-").replace("-", "_") for o in args.override for f in o.split(",") if f.strip()]
    if set(args.override) - set(TRAJECTORY) - {"world"}:
        p.error(f"--override: {args.override!r}; choose from world,"
                f"{','.join(k.replace('_', '-') for k in TRAJECTORY)}")
    found = holds_checkpoint(args.out)
    args.resume = args.resume or (args.auto_resume and found)
    if args.workers is None and not args.resume:  # (a resume takes its checkpoint's: runfolder.load_checkpoint)
        args.workers = data.default_workers()
    if args.resume and not found:
        p.error(f"--resume: no checkpoint at {args.out}/{CKPT}; drop --resume to start fresh")
    return args


# ---- Set-up: the run's state, built once, advanced by every step, saved by every checkpoint -------------------------
@dataclasses.dataclass
class Run:
    """Everything a training run holds. setup() builds the first block; the rest changes as it trains."""
    dev: str                       # "cuda" (this rank's GPU) or "cpu"
    rank: int                      # this process; rank 0 prints, logs, scores samples and writes the files
    world: int                     # processes in the run
    config: dict                   # DiT(**config): saved, so sample.py rebuilds the model without the flags
    model: torch.nn.Module         # the weights being trained
    ema: torch.nn.Module           # their exponential moving average, samples use it (--ema 0: the model itself)
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    engine: Engine                 # one process, DDP, DeepSpeed or FSDP: what the step calls for its gradients
    gen: torch.Generator           # noise, t and caption drop: seeded alike on every rank
    encoder: TextEncoder           # frozen
    vae: object = None             # frozen model.VAE; None = the model works on pixels
    step: int = 0                  # optimizer steps taken
    position: data.Position = dataclasses.field(default_factory=data.Position)  # this rank's place in its data
    bad_steps: dict = None         # non-finite loss or gradient norm, skipped: {total, in_a_row, longest} on the device
    ckpt_step: int = None          # step of the last checkpoint this process wrote (None: none yet)
    deepspeed_tag: str = None      # DeepSpeed: that checkpoint's partition folder
    shards: list = None            # the training data
    buckets: dict = None           # its aspect-ratio buckets {(W, H): samples}; None: square pictures
    judged: bool = False           # built-in shapes: evaluate.judge grades samples
    names: dict = None             # a names set (python data.py emoji): retrieval scores samples
    log: object = None             # log.jsonl, open on rank 0
    t_start: float = 0.0           # time.time() at start-up
    text_len: int = None           # --compile: every batch's text padded to this many tokens (one graph a bucket)


def setup(args, shape=None):
    """Device, process group, seeds, encoder, model, EMA, optimizer, schedule, engine -> the Run (profile: `shape`)."""
    dev, rank, local_rank, world = init_distributed(args.dist)  # (torchrun's process group, if --dist)
    args.precision = args.precision or ("bf16" if dev == "cuda" else "fp32")
    args.moe_impl = args.moe_impl or moe.default_impl(dev)  # the GPU's grouped GEMM, the CPU's per-expert slices
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # (GPUs: TF32 matmuls)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    vae = load_vae(args.vae, dev)  # frozen; None = pixel space
    encoder = TextEncoder(args.text_encoder, device=dev, cache_size=args.text_cache)
    size = args.image_size // (vae.factor if vae else 1)  # the model sees latents of this side
    if vae and (args.image_size % vae.factor or size % args.patch):
        raise SystemExit(f"--vae shrinks the pictures {vae.factor} times: pick --image-size a multiple of "
                         f"{vae.factor * args.patch} (for --patch {args.patch})")
    config = dict(in_channels=vae.channels if vae else 3, image_size=size, patch=args.patch, width=args.width,
                  depth=args.depth, heads=args.heads, text_dim=encoder.dim, attn=args.attn, moe=args.moe,
                  topk=args.topk, shared_experts=args.shared_experts, moe_impl=args.moe_impl,
                  expert_hidden=args.expert_hidden, balance=args.balance)
    if shape:
        config.update(in_channels=shape[0], image_size=shape[1], text_dim=shape[2])
    model = DiT(**config).to(dev)
    model.grad_ckpt = args.grad_ckpt  # (how it computes, not what: not part of the config)
    if args.init and not args.resume:  # before the optimizer (and ZeRO's fp32 master copy) take the weights
        runfolder.init_weights(model, config, args.init, dev, rank)
    ema = copy.deepcopy(model).requires_grad_(False) if args.ema else model
    copies = [model, ema] if args.ema else [model]
    expert_parallel.shard_experts(copies, args.ep)  # --ep: each rank keeps 1 / ep of the experts, so of their AdamW state
    if args.dist == "fsdp":  # each rank keeps 1 / world of every weight, so of its gradient and AdamW state
        FSDPEngine.shard(copies, dev, bf16=args.precision == "bf16")
    # fused AdamW (CPU, CUDA, MPS): one kernel for the whole update, which also skips a bad step on the device
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=True)

    def lr_lambda(step):  # linear warm-up, then cosine to zero
        if step < args.warmup:
            return (step + 1) / args.warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    # noise, t, caption drop: every rank draws the global batch's and keeps its slice (a run is split-independent)
    gen = torch.Generator(dev).manual_seed(args.seed)
    engine = make_engine(args, model, opt, dev, world, local_rank)  # the step calls only its interface
    return Run(dev=dev, rank=rank, world=world, config=config, model=model, ema=ema, opt=opt, sched=sched,
               engine=engine, gen=gen, encoder=encoder, vae=vae, text_len=encoder.max_len if args.compile else None,
               bad_steps={k: torch.zeros((), device=dev) for k in ("total", "in_a_row", "longest")})


def start(args):
    """The run folder (checked), set-up, then a resume or a fresh start, the banner -> the Run."""
    shards, pre = runfolder.open_folder(args)  # a folder holding another run is refused before anything is written
    run = setup(args)
    run.shards, run.t_start = shards, time.time()
    run.judged = data.BUILTIN in (args.data, (pre or {}).get("source")) or args.data == data.MIXED  # (it knows these)
    run.buckets = data.bucket_shares(shards, args.image_size, args.patch * (run.vae.factor if run.vae else 1))
    draws = run.rank == 0 or run.engine.sharded  # (FSDP: every rank runs the sampling forwards)
    run.names = evaluate.names_set(data.source(args.data), args.image_size) if draws else None  # retrieval scores
    runfolder.resume_or_record(run, args)  # every state from the checkpoint, or args.json; log.jsonl
    runfolder.banner(run, args, pre)
    return run


# ---- One training step ----------------------------------------------------------------------------------------------
def train_step(run, args, micro_batches, mark=None):
    """One optimizer step over this rank's micro-batches [(x0, text, mask, noise)]: times, noise (unless a reflow pair
    brings its own) and caption drops drawn for the global batch (every rank draws all and keeps its slice, so a run
    does not depend on how the batch is split) -> flow loss (+ MoE balance loss) -> backward -> clip at 1.0 -> AdamW ->
    schedule -> EMA, with no host sync (but DeepSpeed's norm). A non-finite loss or gradient norm changes no weight,
    moment or EMA; it takes its step number."""
    mark = mark or (lambda phase: None)  # (profile.py times the phases)
    dev, per_rank = run.dev, micro_batches[0][0].shape[0]  # images in one micro-batch of one rank
    per_micro = per_rank * run.world                        # ... of all ranks
    global_batch = per_micro * len(micro_batches)
    keep = torch.rand(global_batch, generator=run.gen, device=dev) >= args.cfg_drop  # False: the null caption
    t_all = flow.sample_t(global_batch, args.t_dist, run.gen, dev, args.t_shift)
    loss, balance, t, per_sample = 0, 0, [], []
    for i, (x0, text, mask, noise) in enumerate(micro_batches):
        mine = slice(i * per_micro + run.rank * per_rank, i * per_micro + (run.rank + 1) * per_rank)
        text, mask = flow.drop_captions(text, mask, keep[mine])
        eps = torch.randn((per_micro, *x0.shape[1:]), generator=run.gen, device=dev)  # (this bucket's shape)
        eps = eps[run.rank * per_rank:(run.rank + 1) * per_rank] if noise is None else noise  # reflow: its pair's
        with run.engine.micro_batch(last=i == len(micro_batches) - 1):
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                loss_i, per_i = flow.flow_loss(run.engine.forward, x0, text, mask, t_all[mine], eps, args.contrast)
                balance_i = moe.balance_loss(run.model, dist.all_reduce if run.world > 1 else None)  # (0 for a dense model)
            mark("forward")
            run.engine.backward(loss_i + balance_i)
            mark("backward")
        loss = loss + per_i.detach().mean() / len(micro_batches)  # (for the log: the plain flow loss)
        balance = balance + balance_i.detach() / len(micro_batches)
        t.append(t_all[mine])
        per_sample.append(per_i.detach())
    grad_norm, bad_step = run.engine.step(loss + balance)  # clip, update (not on a bad step), clear the gradients
    moe.nudge_biases(run.model, args.bias_rate, skip=bad_step)  # --balance bias: by the loads of the global batch
    run.sched.step()
    run.step += 1
    decay = min(args.ema, (1 + run.step) / (10 + run.step))  # short runs: let EMA catch up early
    if args.ema:  # EMA <- EMA + (1 - decay)(model - EMA), not on a bad step (--ema 0: the EMA is the model itself)
        with torch.no_grad():  # all tensors in one fused op (FSDP: the shards, no communication)
            ema = list(run.ema.parameters())
            torch._foreach_lerp_(ema, list(run.model.parameters()), [(~bad_step).float() * (1 - decay)] * len(ema))
            for be, bm in zip(run.ema.buffers(), run.model.buffers()):  # (--balance bias: the EMA routes alike)
                be.copy_(bm)
    count_bad_step(run, bad_step)
    mark("optimizer")
    return dict(loss=loss, balance=balance, t=torch.cat(t), per_sample=torch.cat(per_sample), grad_norm=grad_norm,
                bad_step=bad_step)


# ---- The loop -------------------------------------------------------------------------------------------------------
def train_loop(args, run, signals):
    """batch -> encode -> step -> log / grid / checkpoint, to --steps or a stop signal (-> True: some rank got one)."""
    from tqdm import tqdm
    bar = tqdm(total=args.steps, initial=run.step, desc="train", dynamic_ncols=True, disable=run.rank != 0)
    n_seen, t_window, stopped = 0, time.time(), False
    stream = data.batches(run.shards, args.batch_size, run.buckets or args.image_size, args.seed, run.rank, run.world,
                          args.workers, run.position)  # (which it keeps up to date; it exits where a rank has no batch)
    # a first signal is acted on between steps, never while the loader runs: raised there, it could leave one of the
    # loader's locks held (the close would then hang) or its data position half-updated. A second one raises at once.
    signals.defer = True
    try:
        while run.step < args.steps and not stopped:  # (before a batch is fetched: the saved data position is exact)
            micro_batches = [encode_batch(run, next(stream)) for _ in range(args.grad_accum)]
            out = train_step(run, args, micro_batches)
            n_seen += sum(x0.shape[0] for x0, *_ in micro_batches) * run.world
            if run.step % args.log_every == 0 or run.step == args.steps:  # the only steps that read the device
                stopped = log_step(run, args, out, signals, n_seen / (time.time() - t_window), bar)
                n_seen, t_window = 0, time.time()
            elif run.world == 1:  # (one process needs no all-reduce to know it was signalled)
                stopped = bool(signals.caught)
            bar.update(1)
            if args.sample_every and run.step % args.sample_every == 0 and run.step < args.steps:
                sample_grid(run, args, expert_parallel.gathered(run.ema, run.config))  # (all ranks: --ep gathers the experts)
            if run.step % args.ckpt_every == 0 or run.step == args.steps:
                save_checkpoint(run, args)
    finally:  # stop the loader's workers now: they ignore TERM, so at exit multiprocessing would wait for them forever
        stream.close()
    bar.close()
    return stopped


def main(argv=None):
    """flags -> start-up -> the loop -> a checkpoint and exit on a stop signal, else the final evaluation."""
    args = get_args(argv)
    signals = StopSignals(watch_launcher=args.dist != "none")  # from here on a stop signal ends the run cleanly
    try:
        run = start(args)                                  # run folder, set-up, resume, the banner
        if train_loop(args, run, signals):                 # steps, log lines, sample grids, checkpoints
            name = signals.caught[0] if signals.caught else "a signal sent to another rank"
            print(f"rank {run.rank}: caught {name}, stopping after step {run.step}\n", end="", flush=True)  # one write
            signals.defer, t0 = True, time.time()  # (the same signal arriving twice is not a second one)
            code = 0 if save_checkpoint(run, args) else 1  # every rank writes one checkpoint
            if run.rank == 0 and not code:  # (how long it took: the warning a run of this size needs)
                print(f"caught {name}: checkpoint written at step {run.step} in {time.time() - t0:.1f} s (--resume)")
        else:
            code = final_evaluation(args, run, signals)    # every held-out prompt or name, scored
        return end(run, code)
    except Interrupted as e:  # start-up, final samples, or a second signal: leave now, nothing half-written
        signum = e.args[0]
        print(f"caught {signal.Signals(signum).name}: exiting at once; the last checkpoint written stands",
              file=sys.stderr, flush=True)
        (os._exit if dist.is_initialized() else sys.exit)(128 + signum)  # (gloo can abort at interpreter exit)
    finally:  # (the tests call main() again in one process); after a stop, late copies of the signal are ignored
        for s, handler in signals.old.items():
            signal.signal(s, signal.SIG_IGN if signals.caught else handler)


# ==== What a first read may skip: a batch onto the device, bad-step counts, sample grids, the final evaluation ===
def encode_batch(run, batch):
    """A loader batch -> (x0, text, mask, noise) on the device, through the frozen VAE and text encoder (or
    precomputed); noise: a reflow pair's, else None (the step draws it)."""
    if "latent" in batch:  # (copies from the loader's pinned memory: the host does not wait for them)
        noise = None if batch.get("noise") is None else to_device(batch["noise"], run.dev).float()
        x0, text, mask = (to_device(batch[k], run.dev) for k in ("latent", "text", "mask"))
        x0, text = x0.float(), text.float()
    else:
        x0, (text, mask), noise = to_device(batch["image"], run.dev), run.encoder(batch["caption"]), None  # (cached)
        x0 = x0 if run.vae is None else run.vae.encode(x0)
    if run.text_len and text.shape[1] < run.text_len:  # --compile: one length, one graph (the padding is masked)
        more = run.text_len - text.shape[1]
        text, mask = F.pad(text, (0, 0, 0, more)), F.pad(mask, (0, more))
    return x0, text, mask, noise


def count_bad_step(run, bad_step):
    """run.bad_steps after a step, on the device: the total, the run in a row ending here, the longest such run."""
    counts, bad = run.bad_steps, bad_step.float()
    counts["total"], counts["in_a_row"] = counts["total"] + bad, (counts["in_a_row"] + 1) * bad
    counts["longest"] = torch.maximum(counts["longest"], counts["in_a_row"])


def sample_grid(run, args, ema, final=False):
    """Rank 0: the whole EMA draws each held-out prompt (or name) once (fixed noise), or at the end --eval-n times.
    FSDP: every rank runs the same forwards (each gathers the blocks from all) and rank 0 alone writes and scores."""
    if run.rank != 0 and not run.engine.sharded:
        return
    path = os.path.join(args.out, "samples", "eval.png" if final else f"step_{run.step:06d}.png")
    scores, fake, _ = sample.score_heldout(ema, run.encoder, run.vae, run.names, path if run.rank == 0 else None,
                                           args.eval_n if final else 1, args.sample_steps, args.cfg,
                                           args.seed if final else 1234, args.t_shift, fid=final, judge=run.judged,
                                           size=run.buckets)
    if run.rank == 0:
        minutes = (time.time() - run.t_start) / 60
        run.log.write({"step": run.step, "eval" if final else "sample_acc": scores, "minutes": minutes})
        for png in sorted(glob.glob(path[:-len(".png")] + "*.png")):  # (buckets: one grid each)
            run.log.image(png, run.step)
        if final:
            evaluate.print_scores(scores, len(fake), f"{args.sample_steps} steps, cfg {args.cfg}")


def final_evaluation(args, run, signals):
    """Rank 0 (FSDP: all), after the last checkpoint: every held-out prompt or name --eval-n times, scored. -> exit
    status (the ranks agree: they know whether the last checkpoint was written)."""
    ema = expert_parallel.gathered(run.ema, run.config)  # (--ep: all ranks send their experts)
    if run.ckpt_step != run.step:  # the final save failed (its warning says why)
        if run.rank == 0:
            print(f"error: the final checkpoint was not written; the last on disk: step {run.ckpt_step}",
                  file=sys.stderr)
        return 1
    signals.defer = False  # the last checkpoint is written: a signal during the evaluation just ends it
    if run.rank == 0:
        print(f"skipped samples: {run.position.skipped} | skipped non-finite steps: {int(run.bad_steps['total'])}")
    scored = bool(args.eval_n and (run.judged or run.names))  # else nothing to score with: a last grid
    sample_grid(run, args, ema, final=scored)
    if args.eval_n and not scored and run.rank == 0:
        print(f"no judge for {args.data}: score {args.out}/{CKPT} with sample.py --eval --real <raw shards>")
    return 0


if __name__ == "__main__":
    main()
