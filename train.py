"""train.py -- train the MM-DiT with rectified flow. `python train.py` is the whole CPU demo.

In nanoGPT's order: flags -> set-up (the Run, and the engine: one process, DDP, DeepSpeed ZeRO-2 or FSDP2, chosen
once; the step calls only its forward, micro_batch, backward and step) -> one training step -> the loop, outlined in
main(); after one banner, what a first read may skip: logging, checkpoints, evaluation, signals, exits. Under torchrun
(`--dist ddp|deepspeed|fsdp`) it is the same file, keyed off RANK; profile.py and the tests reuse its parser and step.
Resume is exact: a checkpoint holds every state, RNGs and each rank's data.Position included.
"""
import argparse
import contextlib
import copy
import dataclasses
import glob
import math
import os
import random
import shutil
import signal
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image

import data
import eval
import flow
import moe
import sample
from data import append_json, atomic_write, read_json, write_json
from model import MODELS, DiT, TextEncoder, count_params, device, load_vae, preset

CKPT, PREV = "ckpt.pt", "ckpt.prev.pt"  # the run folder's latest checkpoint and the one before it
model_of = lambda config: {k: v for k, v in config.items() if k not in ("attn", "moe_impl")}  # not how it computes
holds_checkpoint = lambda out: any(os.path.exists(os.path.join(out, f)) for f in (CKPT, PREV))  # a run is there
DATA_FLAGS = ("data", "batch_size", "grad_accum", "workers", "seed")  # they define the stream a Position points into
TRAJECTORY = DATA_FLAGS + ("steps", "warmup", "lr", "t_dist", "t_shift", "contrast", "cfg_drop", "ema", "precision",
                           "bias_rate", "text_encoder", "vae", "image_size")  # --resume refuses changes (--override)


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
    a("--attn", default="sdpa", choices=["manual", "sdpa"], help="softmax(QK^T/sqrt d)V written out, or SDPA")
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
    a("--compile", action="store_true", help="torch.compile the training forward and backward")
    a("--grad-ckpt", action="store_true", help="activation checkpointing: recompute each block in the backward")
    a("--dist", default="none", choices=["none", "ddp", "deepspeed", "fsdp"],
      help="under torchrun: DDP, DeepSpeed ZeRO-2, or FSDP2 (every weight split over the ranks too)")
    a("--seed", type=int, default=0, help="seed of data order, noise, times and caption drop")
    a("--workers", type=int, default=int(torch.cuda.is_available()), help="loader processes (CPU: 0, cores are busy)")
    a("--out", default="out/run", help="run folder: ckpt.pt, args.json, log.jsonl, TensorBoard events, samples/")
    a("--resume", action="store_true", help="continue exactly from <out>/ckpt.pt (unreadable: ckpt.prev.pt)")
    a("--auto-resume", action="store_true", help="resume if <out> holds a checkpoint, else start (requeued jobs)")
    a("--override", default="", help="--resume: accept these changed flags, comma-separated (e.g. steps,lr)")
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
    args.override = [f.strip().lstrip("-").replace("-", "_") for f in args.override.split(",") if f.strip()]
    if set(args.override) - set(TRAJECTORY):
        p.error(f"--override: {args.override!r}; choose from {','.join(k.replace('_', '-') for k in TRAJECTORY)}")
    found = holds_checkpoint(args.out)
    args.resume = args.resume or (args.auto_resume and found)
    if args.resume and not found:
        p.error(f"--resume: no checkpoint at {args.out}/{CKPT}; drop --resume to start fresh")
    return args


# ---- The engine: how a step's gradients are made and applied; chosen once, then the step never asks which ---------
class Engine:
    """One process, or DDP (`--dist ddp`: each rank's gradients averaged in the backward). `forward` is what the step
    calls: the model, compiled (`--compile`) and/or DDP-wrapped; EMA, samples and checkpoints use the plain model."""
    partitioned = False  # True: the optimizer state is split over the ranks (checkpointed as a folder per rank)
    sharded = False      # True: so is every weight; all ranks run each forward together (sampling too)

    def __init__(self, args, model, opt, dev, world, local_rank):
        self.model, self.opt, self.world, self.grad_accum = model, opt, world, args.grad_accum
        self.forward = torch.compile(model) if args.compile else model
        if world > 1 and not self.sharded:  # compile, then wrap; DDP finds idle experts' unused parameters (not --ep's)
            self.forward._ddp_params_and_buffers_to_ignore = moe.ep_sharded_names(self.forward)  # (see moe.py)
            self.forward = torch.nn.parallel.DistributedDataParallel(
                self.forward, device_ids=[local_rank] if dev == "cuda" else None,
                find_unused_parameters=args.moe > 0 and args.ep == 1)

    def micro_batch(self, last):
        """Context for one micro-batch's forward and backward: DDP all-reduces only in the last one's backward."""
        ddp = isinstance(self.forward, torch.nn.parallel.DistributedDataParallel)
        return self.forward.no_sync() if ddp and not last else contextlib.nullcontext()

    def backward(self, loss):
        """Add the gradients of this micro-batch's share (1 / --grad-accum) of the step's loss."""
        (loss / self.grad_accum).backward()

    def step(self, loss):
        """Clip at 1.0, update on the device, clear the gradients -> (gradient norm, bad step): a non-finite loss or
        gradient norm skips the whole update (fused AdamW's found_inf), alike on every rank (as are the gradients)."""
        grad_norm = self.clip()  # (NaN/inf pass through)
        bad_step = ~torch.isfinite(loss) | ~torch.isfinite(grad_norm)
        self.opt.found_inf = bad_step.float()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return grad_norm, bad_step

    def clip(self):
        """Clip the gradients' global norm at 1.0 -> that norm (--ep: each expert's gradient first made DDP's mean)."""
        moe.reduce_expert_grads(self.model, self.world)
        return moe.clip_grad_norm_(self.model, 1.0)

    def whole_state(self, state):
        """A state dict of the model or of its AdamW as a checkpoint keeps it: whole (all ranks call it)."""
        return moe.reshard(self.model, state, whole=True)  # (--ep: every expert, gathered)

    def own_state(self, state):
        """The inverse, on resume: a whole state dict -> the part of it this rank holds."""
        return moe.reshard(self.model, state, whole=False)


class DeepSpeedEngine(Engine):
    """DeepSpeed ZeRO-2 (`--dist deepspeed`): optimizer states and gradients partitioned over ranks, weights replicated.
    Our AdamW is passed in (nothing is JIT-built); it clips at 1.0 as the others do; its config is this dict."""
    partitioned = True

    def __init__(self, args, model, opt, dev, world, local_rank):
        import deepspeed
        config = {"train_micro_batch_size_per_gpu": args.batch_size, "gradient_accumulation_steps": args.grad_accum,
                  "gradient_clipping": 1.0, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
                  "bf16": {"enabled": args.precision == "bf16"}, "steps_per_print": 10 ** 9}
        self.model, self.opt = model, opt
        self.forward = self.ds = deepspeed.initialize(model=model, optimizer=opt, config=config)[0]

    def backward(self, loss):
        self.ds.backward(loss)  # (it divides by --grad-accum itself)
        if not self.ds.is_gradient_accumulation_boundary():
            self.ds.step()  # (it counts the micro-batches in its step(): one call each)

    def step(self, loss):
        self.ds.step()  # the last micro-batch's: reduce-scatter, clip, update its partition (skips inf/NaN)
        grad_norm = torch.tensor(float(self.ds.get_global_grad_norm() or 0.0), device=loss.device)  # (a host read)
        return grad_norm, ~torch.isfinite(loss) | ~torch.isfinite(grad_norm)


class FSDPEngine(Engine):
    """FSDP2 (`--dist fsdp`, ZeRO-3): shard() splits every tensor of the model (and of its EMA) along dim 0 over the
    ranks, one block at a time: a block's whole weights are all-gathered just before it runs (in the forward, and
    again in the backward) and freed after; its gradients are reduce-scattered (averaged) to their shards, where
    AdamW updates them. A rank holds 1/N of the weights, gradients and moments, plus one block's whole weights (and
    with --grad-accum > 1, the whole gradients until the last micro-batch). The tensors are DTensors (a shard that
    knows its whole), so the step is one process's: clip all-reduces the norm."""
    sharded = True

    @staticmethod
    def shard(models, dev):
        """Before the optimizer is built: each block, then the rest (embeddings, final layer), of each model."""
        from torch.distributed.fsdp import fully_shard
        mesh = torch.distributed.device_mesh.init_device_mesh(dev, (dist.get_world_size(),))
        for m in models:  # bf16: autocast, as in DDP (fp32 weights gathered, bf16 matmuls, fp32 gradients reduced)
            for module in [*m.blocks, m]:  # (the root too: between steps no rank holds anything whole)
                fully_shard(module, mesh=mesh, reshard_after_forward=True)
        # (--moe: each weight holds all experts stacked, so an expert no token reached on one rank still has its
        # (zero) rows in a gradient: every rank reduce-scatters the same tensors, and none waits for another)

    def micro_batch(self, last):
        """Reduce-scatter in the last micro-batch's backward only; before, the whole gradients accumulate."""
        self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def clip(self):
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0).full_tensor()  # (the same on all ranks)

    def whole_state(self, state):
        """Each shard made whole one tensor at a time and kept on rank 0 only, on the CPU: no second copy anywhere."""
        if isinstance(state, dict):
            return {k: self.whole_state(v) for k, v in state.items()}
        if not hasattr(state, "full_tensor"):  # a plain tensor (buffers, AdamW's step) or a number
            return state
        whole = state.full_tensor()
        return whole.cpu() if dist.get_rank() == 0 else None

    def own_state(self, state):
        """Each whole tensor cut to this rank's shard of its parameter (no communication); buffers stay whole."""
        from torch.distributed.tensor import distribute_tensor
        params = dict(self.model.named_parameters())
        cut = lambda v, p: distribute_tensor(v, p.device_mesh, p.placements, src_data_rank=None)
        if "param_groups" not in state:  # the model's (or its EMA's), by name
            return {k: cut(v, params[k]) if k in params else v for k, v in state.items()}
        by_index = list(params.values())  # AdamW's moments, by parameter index (as in one process)
        return {**state, "state": {i: {k: v if k == "step" else cut(v, by_index[i]) for k, v in moments.items()}
                                   for i, moments in state["state"].items()}}


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
    judged: bool = False           # built-in shapes: eval.judge grades samples
    names: dict = None             # a names set (python data.py emoji): retrieval scores samples
    log: object = None             # log.jsonl, open on rank 0
    t_start: float = 0.0           # time.time() at start-up


def init_weights(model, config, path, dev, rank):
    """--init: a checkpoint's EMA weights into a new run's model: the same model (reflow), or an --moe model from a
    dense one (DiT-MoE's upcycling, moe.upcycle); any other model is refused, naming what differs."""
    parent = torch.load(path, map_location=dev, weights_only=True)
    DiT.check_layout(parent, path)
    if config["moe"] and not parent["config"]["moe"]:
        copied = moe.upcycle(model, parent["ema"])
        said = f"upcycled from {path}: {copied} tensors copied, every expert = the dense MLP, routers fresh"
    else:
        if differ := {k: (v, config[k]) for k, v in model_of(parent["config"]).items() if config[k] != v}:
            raise SystemExit(f"--init {path}: another model (" + ", ".join(f"{k} {a} there, {b} here" for k, (a, b)
                             in differ.items()) + "): pass its flags (its args.json), or --moe E to upcycle a dense "
                             "one")
        model.load_weights(parent["ema"], path)
        said = f"initialised from {path}: its EMA weights"
    if rank == 0:
        print(said)


def setup(args, shape=None):
    """Device, process group, seeds, encoder, model, EMA, optimizer, schedule, engine -> the Run (profile: `shape`)."""
    dev, rank, local_rank, world = device(), 0, 0, 1
    if args.dist != "none":  # torchrun sets these; plain `python train.py` never gets here
        rank, local_rank, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
        if dev == "cuda":
            torch.cuda.set_device(local_rank)  # "cuda" now means this process's own GPU
        dist.init_process_group("nccl" if dev == "cuda" else "gloo")
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
        init_weights(model, config, args.init, dev, rank)
    ema = copy.deepcopy(model).requires_grad_(False) if args.ema else model
    copies = [model, ema] if args.ema else [model]
    moe.shard_experts(copies, args.ep)  # --ep: each rank keeps 1 / ep of the experts, so of their AdamW state
    if args.dist == "fsdp":  # each rank keeps 1 / world of every weight, so of its gradient and AdamW state
        FSDPEngine.shard(copies, dev)
    # fused AdamW (CPU, CUDA, MPS): one kernel for the whole update, which also skips a bad step on the device
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=True)

    def lr_lambda(step):  # linear warm-up, then cosine to zero
        if step < args.warmup:
            return (step + 1) / args.warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    # noise, t, caption drop: every rank draws the global batch's and keeps its slice (a run is split-independent)
    gen = torch.Generator(dev).manual_seed(args.seed)
    engine = dict(deepspeed=DeepSpeedEngine, fsdp=FSDPEngine).get(args.dist, Engine)(args, model, opt, dev, world,
                                                                                     local_rank)
    return Run(dev=dev, rank=rank, world=world, config=config, model=model, ema=ema, opt=opt, sched=sched,
               engine=engine, gen=gen, encoder=encoder, vae=vae,
               bad_steps={k: torch.zeros((), device=dev) for k in ("total", "in_a_row", "longest")})


def start(args):
    """Run folder (a fresh run refuses one holding another run), data check, set-up, resume or args.json, log.jsonl,
    the banner -> the Run."""
    if not args.resume and holds_checkpoint(args.out):  # (a fresh run would overwrite its log.jsonl and args.json;
        # until our first save, a --resume would continue that run under our flags)
        raise SystemExit(f"{args.out} holds another run's checkpoint: continue it with --resume, or pass another --out")
    os.makedirs(os.path.join(args.out, "samples"), exist_ok=True)
    shards = data.resolve_shards(args.data, args.image_size)
    pre = read_json(os.path.join(os.path.dirname(shards[0]), "precompute.json"))  # `data.py precompute`d?
    if pre and pre.get("pairs") and not (args.init or args.resume):  # (reflow: flow.py)
        raise SystemExit(f"{args.data} holds reflow pairs drawn from {pre['pairs']}: train on them from that model, "
                         f"--init {pre['pairs']}")
    if pre and (pre["vae"], pre["text_encoder"], pre["image_size"]) != (args.vae, args.text_encoder, args.image_size):
        raise SystemExit(f"{args.data} was precomputed with --vae {pre['vae']} --text-encoder {pre['text_encoder']} "
                         f"--image-size {pre['image_size']}: pass the same flags (they are needed for sampling)")
    run = setup(args)
    run.shards, run.t_start = shards, time.time()
    run.judged = data.BUILTIN in (args.data, (pre or {}).get("source")) or args.data == data.MIXED  # (it knows these)
    run.buckets = data.bucket_shares(shards, args.image_size, args.patch * (run.vae.factor if run.vae else 1))
    master = run.rank == 0  # only rank 0 prints, logs, scores samples and writes files
    draws = master or run.engine.sharded  # (FSDP: every rank runs the sampling forwards)
    run.names = eval.names_set(data.source(args.data), args.image_size) if draws else None  # retrieval scores
    if args.resume:
        name, changed = load_checkpoint(run, args)
    run.log = RunLog(args.out, run.step if args.resume else None) if master else None
    if args.resume and master:
        print(f"resumed from {args.out}/{name} at step {run.step}" +
              "".join(f"; --{k.replace('_', '-')} {a} -> {b}" for k, (a, b) in changed.items()))
        run.log.write(dict(resume=dict(step=run.step, checkpoint=name, changed=changed)))
    elif master:  # args.json keeps the flags the run started with; log.jsonl records each resume
        write_json(os.path.join(args.out, "args.json"), vars(args))
    (total, active), batch = count_params(run.model), run.world * args.grad_accum * args.batch_size
    held = held_bytes(run.model.parameters()) / 2 ** 20  # (FSDP: this rank's shards)
    if master:
        print(f"model: {total / 1e6:.2f}M parameters ({active / 1e6:.2f}M active per image token) | text encoder "
              f"{args.text_encoder} (dim {run.encoder.dim}, frozen) | vae {args.vae} | {len(shards)} "
              f"{'precomputed ' if pre else ''}shards | device {run.dev} {args.precision}"
              + (f" | {run.world} ranks x " + (f"{args.grad_accum} micro-batches x " if args.grad_accum > 1 else "") +
                 f"{args.batch_size} = global batch {batch}" if batch > args.batch_size else "")
              + (f" | each rank holds {args.moe // args.ep} of {args.moe} experts per layer" if args.ep > 1 else "")
              + (f" | FSDP: each rank holds 1/{run.world} of every weight, here {held:.2f} MB + {2 * held:.2f} MB of "
                 f"AdamW moments" + (f" + {held:.2f} MB of EMA" if args.ema else "") if run.engine.sharded else "")
              + "".join(f" | bucket {w}x{h}: {n} samples" for (w, h), n in (run.buckets or {}).items()))
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
                balance_i = moe.balance_loss(run.model, run.world > 1).to(loss_i.device)  # (0 for a dense model)
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


def encode_batch(run, batch):
    """A loader batch -> (x0, text, mask, noise) on the device, through the frozen VAE and text encoder (or
    precomputed); noise: a reflow pair's, else None (the step draws it)."""
    if "latent" in batch:
        noise = None if batch.get("noise") is None else batch["noise"].to(run.dev).float()
        return batch["latent"].to(run.dev).float(), batch["text"].to(run.dev).float(), batch["mask"].to(run.dev), noise
    x0, (text, mask) = batch["image"].to(run.dev, non_blocking=True), run.encoder(batch["caption"])  # (cached)
    return (x0 if run.vae is None else run.vae.encode(x0)), text, mask, None


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
                sample_grid(run, args, moe.gathered(run.ema, run.config))  # (all ranks: --ep gathers the experts)
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


# ==== What a first read may skip: logging, checkpoints, evaluation, stop signals, exits ==============================
def count_bad_step(run, bad_step):
    """run.bad_steps after a step, on the device: the total, the run in a row ending here, the longest such run."""
    counts, bad = run.bad_steps, bad_step.float()
    counts["total"], counts["in_a_row"] = counts["total"] + bad, (counts["in_a_row"] + 1) * bad
    counts["longest"] = torch.maximum(counts["longest"], counts["in_a_row"])


def scalars(x, tag=""):
    """A log record's numbers -> [(tag, number)], nested dicts and lists flattened into tags like 'eval/all'."""
    if isinstance(x, (dict, list)):
        items = x.items() if isinstance(x, dict) else enumerate(x)
        return [pair for k, v in items for pair in scalars(v, f"{tag}/{k}" if tag else str(k))]
    return [(tag, x)] if isinstance(x, (int, float)) and not isinstance(x, bool) else []


class RunLog:
    """Rank 0's record of a run: log.jsonl (a strict-JSON line per record) and, where tensorboard is installed, its
    numbers as TensorBoard scalars and the grids as images, in the run folder (`tensorboard --logdir out`: every run
    side by side). A resumed run hides the events after its checkpoint's step (purge_step): no step is drawn twice."""

    def __init__(self, out, resumed_at=None):
        self.jsonl = open(os.path.join(out, "log.jsonl"), "w" if resumed_at is None else "a")
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(out, purge_step=None if resumed_at is None else resumed_at + 1)
        except ImportError:  # (a user's own environment: the run is the same without the curves)
            self.tb = print("no TensorBoard curves: pip install tensorboard (log.jsonl has the numbers)")

    def write(self, rec):
        """One record; its numbers under their keys ('loss', 'eval/all', 'routing/0/load/3') at its step."""
        append_json(self.jsonl, rec)
        for tag, value in scalars({k: v for k, v in rec.items() if k != "step"}) if self.tb and "step" in rec else []:
            self.tb.add_scalar(tag, value, rec["step"])

    def image(self, png, step):
        """A sample grid (PNG) at its step: 'grid' (buckets: 'grid_12x22' ...), or 'eval' at the end."""
        if self.tb:
            self.tb.add_image(os.path.basename(png)[:-len(".png")].replace(f"step_{step:06d}", "grid"),
                              np.asarray(Image.open(png).convert("RGB")), step, dataformats="HWC")

    def close(self):
        self.jsonl.close()
        if self.tb:
            self.tb.close()


def log_step(run, args, out, signals, img_per_s, bar):
    """All ranks: the global loss and whether any was signalled (-> True: stop), the log line, a stop on bad steps."""
    flags = torch.stack([out["loss"], out["balance"], torch.full((), float(bool(signals.caught)), device=run.dev)])
    if run.world > 1:
        dist.all_reduce(flags)  # sum: the global mean losses, any rank's signal
    loss_sum, balance_sum, stop = flags.float().tolist()
    total, in_a_row, longest = (int(run.bad_steps[k]) for k in ("total", "in_a_row", "longest"))  # (alike on all ranks)
    if run.rank == 0:  # (only rank 0 logs: the other ranks read nothing more)
        rec = dict(step=run.step, loss=loss_sum / run.world, loss_t_bins=flow.loss_per_bin(out["t"], out["per_sample"]),
                   lr=run.sched.get_last_lr()[0], grad_norm=out["grad_norm"].item(), img_per_s=img_per_s,
                   skipped=run.position.skipped, epoch=run.position.epoch, bad_steps=total)
        if in_a_row:  # this step's update was skipped
            rec["bad_step"] = True
        if args.moe:  # balance loss on its own, and per layer: load per expert, entropy, unused
            rec.update(balance_loss=balance_sum / run.world, routing=moe.routing_stats(run.model))
        run.log.write(rec)
        bar.set_postfix(loss=f"{rec['loss']:.4f}", img_s=f"{img_per_s:.0f}", bad=total)
    if longest >= args.max_bad_steps:
        end(run, 1, f"stopping at step {run.step}: {longest} steps in a row had a non-finite loss or gradient norm "
                    f"(each skipped: no weight changed). The last checkpoint is {args.out}/{CKPT} at step "
                    f"{run.ckpt_step}: check the data, or resume from it with a lower --lr (--override lr)")
    return stop > 0


def write_checkpoint(run, args, ckpt, tag):
    """Rank 0: ckpt.pt written atomically, the one before kept as ckpt.prev.pt -> False on an OSError (warned)."""
    prev = os.path.join(args.out, PREV)  # (a fresh run starts only in a folder with neither: see start)
    try:
        atomic_write(os.path.join(args.out, CKPT), lambda f: torch.save(ckpt, f),
                          keep=prev if run.ckpt_step is not None else None)
    except OSError as e:
        print(f"warning: checkpoint of step {run.step} not written ({e}); training goes on and the next save "
              f"retries; the last one written is step {run.ckpt_step}", file=sys.stderr)
        return False
    if tag:  # older partition folders go only now that ckpt.pt names the new one (ckpt.prev.pt: run.deepspeed_tag)
        folder = os.path.join(args.out, "deepspeed")
        for old in {d for d in os.listdir(folder) if d.startswith("step")} - {tag, run.deepspeed_tag}:
            shutil.rmtree(os.path.join(folder, old), ignore_errors=True)
    return True


def save_checkpoint(run, args):
    """Every rank calls it; rank 0 writes <out>/ckpt.pt atomically (the whole model: --ep gathers the experts, FSDP
    the shards), the one before kept as ckpt.prev.pt. -> False on every rank if an OSError (disk full) stopped it:
    warned, nothing half-written."""
    tag = f"step{run.step:06d}" if run.engine.partitioned else None  # DeepSpeed: each rank's optimizer partition
    if tag:  # goes to <out>/deepspeed/<tag> first (an OSError there ends the run; the last ckpt.pt stands)
        run.engine.ds.save_checkpoint(os.path.join(args.out, "deepspeed"), tag=tag, save_latest=False)
    positions = [dataclasses.asdict(run.position)] * run.world
    if run.world > 1:  # (after every partition is on disk: ckpt.pt names only complete tags)
        dist.all_gather_object(positions, positions[0])
    model = run.engine.whole_state(run.model.state_dict())
    ema = run.engine.whole_state(run.ema.state_dict()) if args.ema else model  # (--ema 0: the same tensors, saved once)
    opt = None if tag else run.engine.whole_state(run.opt.state_dict())
    ckpt = dict(model=model, ema=ema, opt=opt,  # (DeepSpeed: its optimizer state is in its tag folder)
                deepspeed_tag=tag, sched=run.sched.state_dict(), step=run.step, args=vars(args), config=run.config,
                layout=DiT.LAYOUT,
                rng=dict(torch=torch.get_rng_state(), python=random.getstate(), gen=run.gen.get_state()),
                bad_steps={k: v.cpu() for k, v in run.bad_steps.items()}, data=positions,
                buckets=run.buckets and list(run.buckets))
    written = [False]
    try:
        written[0] = run.rank != 0 or write_checkpoint(run, args, ckpt, tag)
    finally:  # (every rank knows whether the run has this checkpoint; none waits for a rank 0 that raised)
        if run.world > 1:
            dist.broadcast_object_list(written, 0)
    if written[0]:
        run.ckpt_step, run.deepspeed_tag = run.step, tag
    return written[0]


def read_checkpoint(out, rank=0):
    """-> (name, checkpoint): ckpt.pt, else ckpt.prev.pt; rank 0 renames an unreadable ckpt.pt to ckpt.bad.pt, so it
    never becomes the previous one (every rank reads the same: rank 0 renames only after it failed to read). Mapped
    from the file, not read: each tensor is read only as it is loaded into its place (FSDP: one at a time, its shard
    kept)."""
    errors = []
    for name in (CKPT, PREV):
        try:
            ckpt = torch.load(os.path.join(out, name), map_location="cpu", mmap=True, weights_only=True)
            if not isinstance(ckpt, dict) or not {"model", "step", "args", "data"} <= set(ckpt):
                raise ValueError("not a train.py checkpoint")
        except Exception as e:  # torch.load raises many kinds on a damaged file
            errors.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            continue
        if errors and rank == 0:
            print(f"warning: {out}/{errors[0]}; resuming from {name} (step {ckpt['step']}) instead", file=sys.stderr)
            if os.path.exists(os.path.join(out, CKPT)):
                os.replace(os.path.join(out, CKPT), os.path.join(out, "ckpt.bad.pt"))
        return name, ckpt
    raise SystemExit(f"--resume: no readable checkpoint in {out} ({'; '.join(errors)}). Move the damaged files "
                     f"away and start afresh without --resume/--auto-resume, or put a good checkpoint at {out}/{CKPT}")


def load_checkpoint(run, args):
    """Resume every model, optimizer, RNG and data state, the flags checked first -> (file, {flag: (saved, now)})."""
    name, ckpt = read_checkpoint(args.out, run.rank)
    DiT.check_layout(ckpt, f"{args.out}/{name}")
    changed = {k: (v, getattr(args, k)) for k in TRAJECTORY if (v := ckpt["args"].get(k)) != getattr(args, k)}
    refused = {k: v for k, v in changed.items() if k not in args.override}
    if refused:
        raise SystemExit("--resume: these flags differ from the checkpoint's, which would change the run:\n" + "".join(
            f"  --{k.replace('_', '-')}: {a!r} in the checkpoint, {b!r} now\n" for k, (a, b) in refused.items()) +
            f"Pass the checkpoint's values, or accept the change with --override "
            f"{','.join(k.replace('_', '-') for k in refused)} (README: what each costs)")
    if model_of(ckpt["config"]) != model_of(run.config):
        raise SystemExit(f"--resume: the checkpoint's model {ckpt['config']} differs from the flags' {run.config}; "
                         f"pass the original run's flags (saved in {args.out}/args.json)")
    tag, saved = ckpt["deepspeed_tag"], ckpt["args"]["dist"]
    if len(ckpt["data"]) != run.world or (tag is not None) != run.engine.partitioned:  # (ZeRO's partitions need both)
        raise SystemExit(f"--resume: {args.out}/{name} was written by {len(ckpt['data'])} ranks with --dist {saved}: "
                         f"resume with --dist {saved} on as many ranks (its optimizer state needs both)")
    for k in ("model", "ema") if args.ema else ("model",):  # (--ema 0: the EMA is the model)
        getattr(run, k).load_weights(run.engine.own_state(ckpt[k]), f"{args.out}/{name}")
    run.sched.load_state_dict(ckpt["sched"])
    if tag is None:
        run.opt.load_state_dict(run.engine.own_state(ckpt["opt"]))
    else:  # DeepSpeed: weights, fp32 partition, AdamW moments (the lr is the schedule's)
        run.engine.ds.load_checkpoint(os.path.join(args.out, "deepspeed"), tag=tag, load_lr_scheduler_states=False)
    torch.set_rng_state(ckpt["rng"]["torch"])
    random.setstate(ckpt["rng"]["python"])
    run.gen.set_state(ckpt["rng"]["gen"])
    run.position, run.step, run.ckpt_step = data.Position(**ckpt["data"][run.rank]), ckpt["step"], ckpt["step"]
    run.deepspeed_tag, run.bad_steps = tag, {k: v.to(run.dev) for k, v in ckpt["bad_steps"].items()}
    if changed.keys() & {"lr", "steps", "warmup"}:  # --override: the new schedule from this step on (the lr jumps)
        run.sched.base_lrs = [args.lr] * len(run.sched.base_lrs)
        for g in run.opt.param_groups:
            g["lr"] = args.lr * run.sched.lr_lambdas[0](run.sched.last_epoch)
    if changed.keys() & set(DATA_FLAGS):  # the saved position means nothing in another stream: the next epoch
        skipped = run.position.skipped
        run.position = data.Position(epoch=run.position.epoch + 1, skipped_before=skipped, skipped=skipped)
    return name, changed


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
            eval.print_scores(scores, len(fake), f"{args.sample_steps} steps, cfg {args.cfg}")


def final_evaluation(args, run, signals):
    """Rank 0 (FSDP: all), after the last checkpoint: every held-out prompt or name --eval-n times, scored. -> exit
    status (the ranks agree: they know whether the last checkpoint was written)."""
    ema = moe.gathered(run.ema, run.config)  # (--ep: all ranks send their experts)
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


class Interrupted(BaseException):
    """StopSignals' way out where no step is waited for (args[0]: the signal); no `except Exception` catches it."""


class StopSignals:
    """SIGUSR1 (Slurm's warning before the time limit), SIGTERM (scancel, requeue, torchrun). While `defer` is set the
    first is only noted: after this step (one process) or at the next log step (where the ranks agree) every rank
    checkpoints and exits 0. Anywhere else, or at a second signal, Interrupted is raised at once; a repeat within
    `same_event` s is the same event (Slurm signals every process; torchrun forwards). Under a launcher a thread
    watches it too: a rank whose launcher died (torchrun dies of an unhandled USR1) stops, no orphan trains on."""

    def __init__(self, watch_launcher=False, same_event=2.0):
        self.caught, self.defer, self.pid, self.first, self.same_event = [], False, os.getpid(), None, same_event
        self.old = {s: signal.signal(s, self.handle) for s in (signal.SIGUSR1, signal.SIGTERM)}
        if watch_launcher:
            threading.Thread(target=self.watch, args=(os.getppid(),), daemon=True).start()

    def watch(self, launcher):
        """A stop once the parent process is gone; never an abort: a checkpoint may be under way when it goes."""
        while os.getppid() == launcher:
            time.sleep(0.5)
        self.caught.append(f"the death of its launcher (pid {launcher})")

    def handle(self, signum, frame):
        if os.getpid() != self.pid:  # a forked data-loader worker: the main process decides
            return
        now = time.monotonic()
        again = self.first is not None and now - self.first > self.same_event
        self.first = self.first or now
        self.caught.append(signal.Signals(signum).name)
        if not self.defer or again:
            raise Interrupted(signum)


def end(run, code, error=None):
    """Close the log; under torchrun check that the replicas agree (unless every rank stops on an `error`) and leave
    the process group. -> the Run (the tests read it), or SystemExit(error or code)."""
    if run.log:
        run.log.close()
    if dist.is_initialized() and not error:
        same = None  # (FSDP: each rank holds other parts of the weights)
        if not run.engine.sharded:  # the same weights as rank 0? (--ep: each rank's own experts differ)
            own_experts = moe.ep_sharded_names(run.model)
            flat = torch.cat([p.detach().flatten() for k, p in run.model.named_parameters() if k not in own_experts])
            dist.broadcast(ref := flat.clone(), 0)
            same = torch.equal(flat, ref)
        per_rank = [None] * run.world  # with the bytes of weights and optimizer state (ZeRO-2, FSDP: split) it holds
        dist.all_gather_object(per_rank, (same, held_bytes(run.model.parameters()), optimizer_bytes(run.opt)))
        if run.rank == 0:
            if not run.engine.sharded:
                print(f"parameters identical on all {run.world} ranks: {all(same for same, _, _ in per_rank)}")
            print(f"parameter bytes per rank: {[n for _, n, _ in per_rank]}")
            print(f"optimizer state bytes per rank: {[n for _, _, n in per_rank]}")
    if dist.is_initialized():
        if error and run.rank == 0:
            print(error, file=sys.stderr, flush=True)
        leave_distributed(code)
    if code:
        raise SystemExit(error or code)
    return run


def held_bytes(tensors):
    """Bytes of these tensors this process holds: of an FSDP shard (a DTensor, numel() its whole's), the local part."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


def optimizer_bytes(opt):
    """Bytes of optimizer state this process holds (AdamW: two moments per parameter; ZeRO-2, FSDP: its share)."""
    return held_bytes(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v))


def leave_distributed(code=0):
    """barrier -> destroy -> flush -> os._exit(code): gloo can abort at interpreter exit."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
