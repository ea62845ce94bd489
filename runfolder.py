"""runfolder.py -- the run folder, stop signals, exits; a first read may skip it.

`--out` holds what rank 0 writes:

  ckpt.pt, ckpt.prev.pt  every state (an exact --resume); the one before
  deepspeed/stepNNNNNN/  ZeRO-2: each rank's optimizer partition
  args.json, log.jsonl   the first flags; a JSON line a logged step
  events.out.tfevents.*  the same for TensorBoard
  samples/               the sample grids
"""
import contextlib
import dataclasses
import json
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
import expert_parallel
import flow
import moe
from data import write_json
from engine import held_bytes, leave_distributed, optimizer_bytes
from model import DiT, count_params

CKPT, PREV = "ckpt.pt", "ckpt.prev.pt"
# what defines the stream a data.Position points into
DATA_FLAGS = ("data", "batch_size", "grad_accum", "workers", "seed")
# what shapes MeanFlow's target (--objective meanflow), and nothing else
MEANFLOW_FLAGS = ("mf_share", "mf_power", "mf_guidance")
# --resume refuses a change to these without --override
RESUME_FLAGS = DATA_FLAGS + (
    "steps", "warmup", "lr", "t_dist", "t_shift", "contrast", "cfg_drop",
    "ema", "precision", "bias_rate", "text_encoder", "vae", "image_size",
    "objective") + MEANFLOW_FLAGS
# resume flags newer than some checkpoints: what those runs did
BEFORE_THE_FLAG = dict(objective="rf", mf_share=0.25, mf_power=1.0, mf_guidance=2.0)


def holds_checkpoint(out):
    return any(os.path.exists(os.path.join(out, f)) for f in (CKPT, PREV))


def model_differences(saved, config):
    """A checkpoint's model config against `config`, less how each computes:
    'width 192 there, 64 here, ...', or '' for the same model."""
    keys = [k for k in {**saved, **config} if k not in ("attn", "moe_impl")]
    return ", ".join(f"{k} {saved.get(k)} there, {config.get(k)} here" for k in keys
                     if saved.get(k) != config.get(k))


# ---- The run folder ----
def open_folder(args):
    """Refuse another run's folder; check the data -> (shards, precompute)."""
    # a fresh run would overwrite its log.jsonl and args.json
    if not args.resume and holds_checkpoint(args.out):
        raise SystemExit(f"{args.out} holds another run's checkpoint: continue it with "
                         "--resume, or pass another --out")
    os.makedirs(os.path.join(args.out, "samples"), exist_ok=True)
    shards = data.resolve_shards(args.data, args.image_size)
    # only the shards keep a URL's password and query token
    args.data = data.masked(args.data)
    # from `prepare.py precompute` or sample.py --pairs
    precomputed = data.read_beside(shards[0], "precompute.json")
    if precomputed and precomputed.get("pairs") and not (args.init or args.resume):
        parent = precomputed["pairs"]
        raise SystemExit(f"{args.data} holds reflow pairs drawn from {parent}: pass "
                         f"--init {parent}")
    keys = ("vae", "text_encoder", "image_size")
    if precomputed and any(precomputed[k] != getattr(args, k) for k in keys):
        vae, encoder, size = (precomputed[k] for k in keys)
        raise SystemExit(f"{args.data} was precomputed with --vae {vae} --text-encoder "
                         f"{encoder} --image-size {size}: pass the same flags")
    return shards, precomputed


def resume_or_record(run, args):
    """--resume: every state from the checkpoint, else args.json; log.jsonl."""
    rank0 = run.rank == 0
    if args.resume:
        name, changed = load_checkpoint(run, args)
    run.log = RunLog(args.out, run.step if args.resume else None) if rank0 else None
    if args.resume and rank0:
        print(f"resumed from {args.out}/{name} at step {run.step}" + "".join(
            f"; {'ranks' if k == 'world' else '--' + k.replace('_', '-')} {a} -> {b}"
            for k, (a, b) in changed.items()))
        run.log.write(dict(resume=dict(step=run.step, checkpoint=name, changed=changed)))
    elif rank0:
        write_json(os.path.join(args.out, "args.json"), vars(args))


def banner(run, args, precomputed):
    """Rank 0's first line: model, encoders, data, device, batch."""
    total, active = count_params(run.model)
    batch = run.world * args.grad_accum * args.batch_size
    # MB; FSDP: this rank's shards
    held = held_bytes(run.model.parameters()) / 2 ** 20
    if run.rank != 0:
        return
    parts = [
        f"model: {total / 1e6:.2f}M parameters ({active / 1e6:.2f}M active per image token)",
        f"text encoder {args.text_encoder} (dim {run.encoder.dim}, frozen)",
        f"vae {args.vae}",
        f"{len(run.shards)} {'precomputed ' if precomputed else ''}shards",
        f"device {run.dev} {args.precision}"]
    if batch > args.batch_size:
        accum = f"{args.grad_accum} micro-batches x " if args.grad_accum > 1 else ""
        parts.append(f"{run.world} ranks x {accum}{args.batch_size} = global batch {batch}")
    if args.ep > 1:
        parts.append(f"each rank holds {args.moe // args.ep} of {args.moe} experts per layer")
    if run.engine.splits_weights:
        ema = f" + {held:.2f} MB of EMA" if args.ema else ""
        parts.append(f"FSDP: each rank holds 1/{run.world} of every weight, here "
                     f"{held:.2f} MB + {2 * held:.2f} MB of AdamW moments{ema}")
    parts += [f"bucket {w}x{h}: {n} samples" for (w, h), n in (run.buckets or {}).items()]
    print(" | ".join(parts))


# ---- Checkpoints ----
def atomic_write(path, write, keep=None):
    """write(f) to `path` (the old to `keep`): a crash leaves the old file
    or the new, never a torn one."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            # the bytes are on disk before a name points at them
            os.fsync(f.fileno())
        if keep and os.path.exists(path):
            os.replace(path, keep)
        os.replace(tmp, path)
        # and so are the renames
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def write_checkpoint(run, args, ckpt, tag):
    """Rank 0: ckpt.pt, atomically, the one before kept -> False on an OSError."""
    prev = os.path.join(args.out, PREV)
    try:
        atomic_write(os.path.join(args.out, CKPT), lambda f: torch.save(ckpt, f),
                     keep=prev if run.ckpt_step is not None else None)
    except OSError as e:
        last = "none yet" if run.ckpt_step is None else f"step {run.ckpt_step}"
        print(f"warning: checkpoint of step {run.step} not written ({e}); the next save "
              f"retries (last written: {last})", file=sys.stderr)
        return False
    # old partitions go once ckpt.pt names the new one (ckpt.prev.pt: its own)
    if tag:
        folder = os.path.join(args.out, "deepspeed")
        steps = {d for d in os.listdir(folder) if d.startswith("step")}
        for old in steps - {tag, run.deepspeed_tag}:
            shutil.rmtree(os.path.join(folder, old), ignore_errors=True)
    return True


def save_checkpoint(run, args):
    """All ranks: rank 0 writes every state whole -> False on every rank on an OSError."""
    tag = f"step{run.step:06d}" if run.engine.optimizer_partitions else None
    if tag:
        folder = os.path.join(args.out, "deepspeed")
        run.engine.ds.save_checkpoint(folder, tag=tag, save_latest=False)
    positions = [dataclasses.asdict(run.position)] * run.world
    if run.world > 1:
        dist.all_gather_object(positions, positions[0])
    model = run.engine.whole_state(run.model.state_dict())
    # --ema 0: the same tensors, saved once
    ema = run.engine.whole_state(run.ema.state_dict()) if args.ema else model
    opt = None if tag else run.engine.whole_state(run.opt.state_dict())
    ckpt = dict(
        model=model, ema=ema, opt=opt, deepspeed_tag=tag,
        sched=run.sched.state_dict(), step=run.step, args=vars(args),
        config=run.config, layout=DiT.LAYOUT,
        rng=dict(torch=torch.get_rng_state(), python=random.getstate(), gen=run.gen.get_state()),
        bad_steps={k: v.cpu() for k, v in run.bad_steps.items()},
        data=positions, buckets=run.buckets and list(run.buckets))
    # every rank learns the outcome; none waits on a rank 0 that raised
    written = [False]
    try:
        written[0] = run.rank != 0 or write_checkpoint(run, args, ckpt, tag)
    finally:
        if run.world > 1:
            dist.broadcast_object_list(written, 0)
    if written[0]:
        run.ckpt_step, run.deepspeed_tag = run.step, tag
    return written[0]


def read_checkpoint(out, rank=0):
    """-> (name, checkpoint): ckpt.pt, else ckpt.prev.pt; mmap'd."""
    errors = []
    for name in (CKPT, PREV):
        try:
            path = os.path.join(out, name)
            ckpt = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            if not isinstance(ckpt, dict) or not {"model", "step", "args", "data"} <= set(ckpt):
                raise ValueError("not a train.py checkpoint")
        except Exception as e:
            # a damaged file: torch.load's errors vary
            errors.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            continue
        # moved aside, a damaged ckpt.pt never becomes ckpt.prev.pt
        if errors and rank == 0:
            print(f"warning: {out}/{errors[0]}; resuming from {name} (step {ckpt['step']})",
                  file=sys.stderr)
            if os.path.exists(os.path.join(out, CKPT)):
                os.replace(os.path.join(out, CKPT), os.path.join(out, "ckpt.bad.pt"))
        return name, ckpt
    raise SystemExit(f"--resume: no readable checkpoint in {out} ({'; '.join(errors)}): move "
                     f"them away and start afresh, or put a good one at {out}/{CKPT}")


def load_checkpoint(run, args):
    """Every state, the flags checked first -> (file, {flag: (saved, now)})."""
    name, ckpt = read_checkpoint(args.out, run.rank)
    path = f"{args.out}/{name}"
    DiT.check_layout(ckpt, path)
    # not given: the run's (another machine's default changes the stream)
    if args.workers is None:
        args.workers = ckpt["args"]["workers"]
    saved_world = len(ckpt["data"])  # a data.Position a rank
    resized = saved_world != run.world
    batch_kept = new_world(run, args, ckpt, name) if resized or "world" in args.override else False
    saved = {**BEFORE_THE_FLAG, **ckpt["args"]}
    # MeanFlow's flags shape nothing a rectified-flow run computes
    unused = MEANFLOW_FLAGS if saved["objective"] == args.objective == "rf" else ()
    changed = {k: (v, getattr(args, k)) for k in RESUME_FLAGS
               if k not in unused and (v := saved.get(k)) != getattr(args, k)}
    allowed = args.override + ["grad_accum"] * batch_kept
    refused = {k: v for k, v in changed.items() if k not in allowed}
    if refused:
        lines = "".join(f"  --{k.replace('_', '-')}: {a!r} in the checkpoint, {b!r} now\n"
                        for k, (a, b) in refused.items())
        names = ",".join(k.replace("_", "-") for k in refused)
        raise SystemExit(
            f"--resume: flags differ from the checkpoint's:\n{lines}Pass its values, or "
            f"--override {names} (README, faults: what each costs)")
    if differ := model_differences(ckpt["config"], run.config):
        raise SystemExit(f"--resume: the checkpoint holds another model ({differ}); pass "
                         f"its flags ({args.out}/args.json)")
    tag, dist_flag = ckpt["deepspeed_tag"], ckpt["args"]["dist"]
    if (tag is not None) != run.engine.optimizer_partitions:
        raise SystemExit(f"--resume: {path} was written with --dist {dist_flag}: resume "
                         f"with --dist {dist_flag} on {saved_world} ranks")
    for k in ("model", "ema") if args.ema else ("model",):
        getattr(run, k).load_weights(run.engine.own_state(ckpt[k]), path)
    run.sched.load_state_dict(ckpt["sched"])
    if tag is None:
        run.opt.load_state_dict(run.engine.own_state(ckpt["opt"]))
    else:
        # its weights and moments; the lr is the schedule's
        run.engine.ds.load_checkpoint(os.path.join(args.out, "deepspeed"), tag=tag,
                                      load_lr_scheduler_states=False)
    torch.set_rng_state(ckpt["rng"]["torch"])
    random.setstate(ckpt["rng"]["python"])
    run.gen.set_state(ckpt["rng"]["gen"])
    run.step, run.ckpt_step = ckpt["step"], ckpt["step"]
    if resized:
        # split anew: the epoch restarts; the batch count (buckets' order) goes on
        old = data.Position(**ckpt["data"][0])
        # the old ranks' counts, on rank 0: the log sums the ranks'
        before = sum(p["skipped_before"] for p in ckpt["data"]) if run.rank == 0 else 0
        faults = {k: sum(p.get(k, 0) for p in ckpt["data"]) * (run.rank == 0)
                  for k in ("retries", "unreachable")}
        run.position = data.Position(
            epoch=old.epoch, batches_before=old.batches_before + old.batch_in_epoch,
            skipped_before=before, skipped=before, **faults)
    else:
        run.position = data.Position(**ckpt["data"][run.rank])
    run.deepspeed_tag = tag
    run.bad_steps = {k: v.to(run.dev) for k, v in ckpt["bad_steps"].items()}
    # --override: the new schedule from this step on (the lr jumps)
    if changed.keys() & {"lr", "steps", "warmup"}:
        run.sched.base_lrs = [args.lr] * len(run.sched.base_lrs)
        for g in run.opt.param_groups:
            g["lr"] = args.lr * run.sched.lr_lambdas[0](run.sched.last_epoch)
    # another stream: the saved position is void there
    if changed.keys() & set(DATA_FLAGS) and not resized:
        old = run.position
        run.position = data.Position(
            epoch=old.epoch + 1, skipped_before=old.skipped, skipped=old.skipped,
            retries=old.retries, unreachable=old.unreachable)
    return name, changed | ({"world": (saved_world, run.world)} if resized else {})


def new_world(run, args, ckpt, name):
    """--override world: another number of ranks -> whether the global batch is kept."""
    saved, saved_world = ckpt["args"], len(ckpt["data"])
    resized = saved_world != run.world
    where = f"--resume: {args.out}/{name} was written by {saved_world} ranks"
    if resized and (ckpt["deepspeed_tag"] is not None or run.engine.optimizer_partitions):
        raise SystemExit(f"{where} with --dist {saved['dist']}; ZeRO-2 resumes only its own "
                         f"checkpoints, on as many ranks: resume with --dist {saved['dist']} on "
                         f"{saved_world} ranks; a run that may change its size trains with "
                         "--dist fsdp")
    if resized and max(saved["ep"], args.ep) > 1:
        raise SystemExit(f"{where} (--ep {saved['ep']}), this run has {run.world}: expert "
                         f"parallelism resumes on {saved_world} ranks; a resizable run uses "
                         "--dist fsdp")
    if "world" not in args.override:
        raise SystemExit(f"{where}, this run has {run.world}: resume on {saved_world} ranks, or "
                         f"continue on {run.world} with --override world (the epoch starts again)")
    global_batch = saved["batch_size"] * saved["grad_accum"] * saved_world
    accum, left = divmod(global_batch, args.batch_size * run.world)
    # DeepSpeed fixes --grad-accum at its start
    batch_kept = bool(accum and not left) and not run.engine.optimizer_partitions
    if batch_kept:
        args.grad_accum = run.engine.grad_accum = accum
    new_batch = args.batch_size * args.grad_accum * run.world
    batch_note = (
        f"--grad-accum {accum} keeps the global batch at {global_batch}" if batch_kept else
        f"the global batch changes from {global_batch} to {new_batch}: no --grad-accum keeps "
        f"it at --batch-size {args.batch_size} on {run.world} ranks")
    if run.rank == 0 and (resized or args.grad_accum != saved["grad_accum"]):
        print(f"--override world: {saved_world} -> {run.world} ranks; {batch_note}"
              + "; its epoch starts again" * resized)
    return batch_kept


def init_weights(model, config, path, dev, rank):
    """--init: a checkpoint's EMA weights into the same model (reflow), or
    a dense one's upcycled into an --moe one."""
    parent = torch.load(path, map_location=dev, weights_only=True)
    DiT.check_layout(parent, path)
    if config["moe"] and not parent["config"]["moe"]:
        copied = moe.upcycle(model, parent["ema"])
        note = (f"upcycled from {path}: {copied} tensors copied, every expert = the dense "
                "MLP, routers fresh")
    else:
        # rectified flow -> MeanFlow: the same model plus the interval's
        # branch, which stays at its zero init
        new_branch = config.get("meanflow") and not parent["config"].get("meanflow")
        parent_config = parent["config"]
        if new_branch:
            parent_config = dict(parent_config, meanflow=True, time_scale=config["time_scale"])
        if differ := model_differences(parent_config, config):
            raise SystemExit(f"--init {path}: another model ({differ}): pass its flags (its "
                             "args.json), or --moe E to upcycle a dense one")
        state = parent["ema"]
        if new_branch:
            interval = {k: v for k, v in model.state_dict().items() if k.startswith("interval")}
            state = {**state, **interval}
        model.load_weights(state, path)
        note = f"initialised from {path}: its EMA weights"
    if rank == 0:
        print(note)


# ---- Logs ----
def append_json(f, rec):
    """One JSON line to an open file, flushed; NaN and inf become null."""
    def finite(x):
        if isinstance(x, float):
            return x if math.isfinite(x) else None
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        return [finite(v) for v in x] if isinstance(x, (list, tuple)) else x
    if f:
        f.write(json.dumps(finite(rec), allow_nan=False) + "\n")
        f.flush()


def scalars(x, tag=""):
    """A record's numbers -> [(tag, number)], nesting flattened: 'eval/all'."""
    if isinstance(x, (dict, list)):
        items = x.items() if isinstance(x, dict) else enumerate(x)
        return [pair for k, v in items for pair in scalars(v, f"{tag}/{k}" if tag else str(k))]
    number = isinstance(x, (int, float)) and not isinstance(x, bool)
    return [(tag, x)] if number else []


class RunLog:
    """Rank 0's log.jsonl and TensorBoard events; a resume hides those past
    its checkpoint's step."""

    def __init__(self, out, resumed_at=None):
        self.jsonl = open(os.path.join(out, "log.jsonl"), "w" if resumed_at is None else "a")
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(out, purge_step=None if resumed_at is None else resumed_at + 1)
        except ImportError:
            print("no TensorBoard: pip install tensorboard (log.jsonl has the numbers)")
            self.tb = None

    def write(self, record):
        """One record; its numbers at its step ('routing/0/load/3')."""
        append_json(self.jsonl, record)
        if not (self.tb and "step" in record):
            return
        for tag, value in scalars({k: v for k, v in record.items() if k != "step"}):
            self.tb.add_scalar(tag, value, record["step"])

    def image(self, png, step):
        """A sample grid at its step: 'grid' ('grid_12x22' ...) or 'eval'."""
        if self.tb:
            tag = os.path.basename(png)[:-len(".png")].replace(f"step_{step:06d}", "grid")
            pixels = np.asarray(Image.open(png).convert("RGB"))
            self.tb.add_image(tag, pixels, step, dataformats="HWC")

    def close(self):
        self.jsonl.close()
        if self.tb:
            self.tb.close()


def log_step(run, args, out, signals, img_per_s, bar):
    """All ranks: the global loss, rank 0's log line, a stop on bad steps
    -> whether any rank was signalled."""
    signalled = float(bool(signals.caught))
    sums = torch.stack([out["loss"], out["balance"], torch.full((), signalled, device=run.dev)])
    if run.world > 1:
        dist.all_reduce(sums)
    loss_sum, balance_sum, stop = sums.float().tolist()
    total, in_a_row, longest = (int(run.bad_steps[k]) for k in ("total", "in_a_row", "longest"))
    skipped = skipped_on_all_ranks(run)
    retries, unreachable = shard_faults_on_all_ranks(run)
    if run.rank == 0:
        record = dict(
            step=run.step, loss=loss_sum / run.world,
            loss_t_bins=flow.loss_per_bin(out["t"], out["per_sample"]),
            lr=out["lr"], grad_norm=out["grad_norm"].item(),
            img_per_s=img_per_s, skipped=skipped, retries=retries,
            unreachable_shards=unreachable, epoch=run.position.epoch, bad_steps=total)
        # this step's update was skipped
        if in_a_row:
            record["bad_step"] = True
        if args.moe:
            record.update(balance_loss=balance_sum / run.world,
                          routing=moe.routing_stats(run.model))
        run.log.write(record)
        bar.set_postfix(loss=f"{record['loss']:.4f}", img_s=f"{img_per_s:.0f}", bad=total)
    if longest >= args.max_bad_steps:
        finish(run, 1, f"stopping at step {run.step}: {longest} steps in a row had a non-finite "
               f"loss or gradient norm; the last checkpoint is {args.out}/{CKPT} at step "
               f"{run.ckpt_step}: check the data, or resume at a lower --lr (--override lr)")
    return stop > 0


def skipped_on_all_ranks(run):
    """All ranks: the bad samples skipped so far, summed."""
    skipped = torch.tensor(run.position.skipped, device=run.dev)
    if run.world > 1:
        dist.all_reduce(skipped)
    return int(skipped)


def shard_faults_on_all_ranks(run):
    """All ranks: shards reopened and given up, summed -> (retries, unreachable)."""
    faults = torch.tensor([run.position.retries, run.position.unreachable], device=run.dev)
    if run.world > 1:
        dist.all_reduce(faults)
    return faults.tolist()


# ---- Stop signals and exits ----
class Interrupted(BaseException):
    """StopSignals' exit at once (args[0]: the signal), past `except Exception`."""


class StopSignals:
    """SIGUSR1 (Slurm's time-limit warning), SIGTERM (scancel, requeue,
    torchrun). With `defer` set the first is noted: every rank checkpoints
    and exits 0 after this step (several ranks: the next log step); else,
    or at a second signal, Interrupted. A repeat within `same_event` s is
    one event (Slurm signals each process, torchrun forwards). A rank
    whose launcher died stops."""

    # 10 s: a loaded machine's late copy comes sooner, a person's second later
    def __init__(self, watch_launcher=False, same_event=10.0):
        self.caught, self.defer = [], False
        self.pid, self.first_at = os.getpid(), None
        self.same_event = same_event
        stops = (signal.SIGUSR1, signal.SIGTERM)
        self.saved_handlers = {s: signal.signal(s, self.handle) for s in stops}
        if watch_launcher:
            threading.Thread(target=self.watch, args=(os.getppid(),), daemon=True).start()

    def watch(self, launcher):
        """A stop, not an abort: a checkpoint may be under way."""
        while os.getppid() == launcher:
            time.sleep(0.5)
        self.caught.append(f"the death of its launcher (pid {launcher})")

    def handle(self, signum, frame):
        # a forked data-loader worker: the main process decides
        if os.getpid() != self.pid:
            return
        now = time.monotonic()
        second = self.first_at is not None and now - self.first_at > self.same_event
        self.first_at = self.first_at or now
        self.caught.append(signal.Signals(signum).name)
        if not self.defer or second:
            raise Interrupted(signum)


def finish(run, code, error=None):
    """Close the log; check that the ranks agree (unless on an `error`),
    leave -> the Run, or SystemExit(error or code)."""
    if run.log:
        run.log.close()
    if dist.is_initialized() and not error:
        # FSDP: the ranks hold different shards
        same = None
        if not run.engine.splits_weights:
            # rank 0's weights? (--ep: not its own experts)
            own_experts = expert_parallel.sharded_names(run.model)
            flat = torch.cat([p.detach().flatten() for k, p in run.model.named_parameters()
                              if k not in own_experts])
            dist.broadcast(rank0s := flat.clone(), 0)
            same = torch.equal(flat, rank0s)
        # and the bytes it holds (ZeRO-2, FSDP: a share)
        per_rank = [None] * run.world
        held = (same, held_bytes(run.model.parameters()), optimizer_bytes(run.opt))
        dist.all_gather_object(per_rank, held)
        if run.rank == 0:
            if not run.engine.splits_weights:
                agree = all(same for same, _, _ in per_rank)
                print(f"parameters identical on all {run.world} ranks: {agree}")
            print(f"parameter bytes per rank: {[n for _, n, _ in per_rank]}")
            print(f"optimizer state bytes per rank: {[n for _, _, n in per_rank]}")
    if dist.is_initialized():
        if error and run.rank == 0:
            print(error, file=sys.stderr, flush=True)
        leave_distributed(code)
    if code:
        raise SystemExit(error or code)
    return run
