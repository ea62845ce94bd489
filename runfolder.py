"""runfolder.py -- the run folder and the run's life around the step: checkpoints, logs, stop signals, exits.

`--out` (out/run) holds what a run writes, rank 0 alone:
  ckpt.pt, ckpt.prev.pt   every state (model, EMA, AdamW, schedule, step, flags, RNGs, each rank's data.Position),
                          written to a temporary name then renamed; the one before kept: `--resume` continues exactly
  deepspeed/stepNNNNNN/   ZeRO-2 only: each rank's optimizer partition (ckpt.pt names the tag it belongs with)
  args.json, log.jsonl    the flags a run started with; a strict-JSON line per logged step, grid, resume, evaluation
  events.out.tfevents.*   the same numbers and grids for TensorBoard (`tensorboard --logdir out`)
  samples/                the sample grids (train.py's sample_grid)
A stop signal (Slurm's USR1 before the time limit, TERM) ends the run after a step, with one checkpoint (StopSignals).
"""
import dataclasses
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
import flow
import moe
from data import append_json, atomic_write, read_json, write_json
from engine import held_bytes, leave_distributed, optimizer_bytes
from model import DiT, count_params

CKPT, PREV = "ckpt.pt", "ckpt.prev.pt"  # the run folder's latest checkpoint and the one before it
model_of = lambda config: {k: v for k, v in config.items() if k not in ("attn", "moe_impl")}  # not how it computes
holds_checkpoint = lambda out: any(os.path.exists(os.path.join(out, f)) for f in (CKPT, PREV))  # a run is there
DATA_FLAGS = ("data", "batch_size", "grad_accum", "workers", "seed")  # they define the stream a Position points into
TRAJECTORY = DATA_FLAGS + ("steps", "warmup", "lr", "t_dist", "t_shift", "contrast", "cfg_drop", "ema", "precision",
                           "bias_rate", "text_encoder", "vae", "image_size")  # --resume refuses changes (--override)


def open_folder(args):
    """A fresh run refuses a folder holding another run; the data is found and checked -> (shards, precompute.json)."""
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
    return shards, pre


def resume_or_record(run, args):
    """--resume: every state from the checkpoint; else args.json. Rank 0 opens log.jsonl (appended on a resume)."""
    master = run.rank == 0
    if args.resume:
        name, changed = load_checkpoint(run, args)
    run.log = RunLog(args.out, run.step if args.resume else None) if master else None
    if args.resume and master:
        print(f"resumed from {args.out}/{name} at step {run.step}" +
              "".join(f"; {'ranks' if k == 'world' else '--' + k.replace('_', '-')} {a} -> {b}"
                      for k, (a, b) in changed.items()))
        run.log.write(dict(resume=dict(step=run.step, checkpoint=name, changed=changed)))
    elif master:  # args.json keeps the flags the run started with; log.jsonl records each resume
        write_json(os.path.join(args.out, "args.json"), vars(args))


def banner(run, args, pre):
    """Rank 0's first line: the model's size, the encoders, the data, the device and how the batch is split."""
    (total, active), batch = count_params(run.model), run.world * args.grad_accum * args.batch_size
    held = held_bytes(run.model.parameters()) / 2 ** 20  # (FSDP: this rank's shards)
    if run.rank == 0:
        print(f"model: {total / 1e6:.2f}M parameters ({active / 1e6:.2f}M active per image token) | text encoder "
              f"{args.text_encoder} (dim {run.encoder.dim}, frozen) | vae {args.vae} | {len(run.shards)} "
              f"{'precomputed ' if pre else ''}shards | device {run.dev} {args.precision}"
              + (f" | {run.world} ranks x " + (f"{args.grad_accum} micro-batches x " if args.grad_accum > 1 else "") +
                 f"{args.batch_size} = global batch {batch}" if batch > args.batch_size else "")
              + (f" | each rank holds {args.moe // args.ep} of {args.moe} experts per layer" if args.ep > 1 else "")
              + (f" | FSDP: each rank holds 1/{run.world} of every weight, here {held:.2f} MB + {2 * held:.2f} MB of "
                 f"AdamW moments" + (f" + {held:.2f} MB of EMA" if args.ema else "") if run.engine.sharded else "")
              + "".join(f" | bucket {w}x{h}: {n} samples" for (w, h), n in (run.buckets or {}).items()))


# ---- Checkpoints: written whole and atomically by rank 0, read back into every rank's part ---------------------------
def write_checkpoint(run, args, ckpt, tag):
    """Rank 0: ckpt.pt written atomically, the one before kept as ckpt.prev.pt -> False on an OSError (warned)."""
    prev = os.path.join(args.out, PREV)  # (a fresh run starts only in a folder with neither: open_folder)
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
    if args.workers is None:  # not given: the checkpoint's, so that its data stream goes on (another machine's default
        args.workers = ckpt["args"]["workers"]  # would change it)
    world_from = len(ckpt["data"])  # (one data.Position a rank)
    resized = world_from != run.world
    kept = new_world(run, args, ckpt, name) if resized or "world" in args.override else False
    changed = {k: (v, getattr(args, k)) for k in TRAJECTORY if (v := ckpt["args"].get(k)) != getattr(args, k)}
    refused = {k: v for k, v in changed.items() if k not in args.override + ["grad_accum"] * kept}
    if refused:
        raise SystemExit("--resume: these flags differ from the checkpoint's, which would change the run:\n" + "".join(
            f"  --{k.replace('_', '-')}: {a!r} in the checkpoint, {b!r} now\n" for k, (a, b) in refused.items()) +
            f"Pass the checkpoint's values, or accept the change with --override "
            f"{','.join(k.replace('_', '-') for k in refused)} (README, faults: what each costs)")
    if model_of(ckpt["config"]) != model_of(run.config):
        raise SystemExit(f"--resume: the checkpoint's model {ckpt['config']} differs from the flags' {run.config}; "
                         f"pass the original run's flags (saved in {args.out}/args.json)")
    tag, saved = ckpt["deepspeed_tag"], ckpt["args"]["dist"]
    if (tag is not None) != run.engine.partitioned:  # (ZeRO's partitions: one file a rank)
        raise SystemExit(f"--resume: {args.out}/{name} was written by {world_from} ranks with --dist {saved}: "
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
    run.step, run.ckpt_step = ckpt["step"], ckpt["step"]
    if resized:  # another split of the data over the ranks: the epoch it was in starts again under it (the batches'
        was = data.Position(**ckpt["data"][0])  # count goes on: the buckets' sequence continues)
        run.position = data.Position(epoch=was.epoch, batches_before=was.batches_before + was.batch_in_epoch,
                                     skipped_before=was.skipped_before, skipped=was.skipped_before)
    else:
        run.position = data.Position(**ckpt["data"][run.rank])
    run.deepspeed_tag, run.bad_steps = tag, {k: v.to(run.dev) for k, v in ckpt["bad_steps"].items()}
    if changed.keys() & {"lr", "steps", "warmup"}:  # --override: the new schedule from this step on (the lr jumps)
        run.sched.base_lrs = [args.lr] * len(run.sched.base_lrs)
        for g in run.opt.param_groups:
            g["lr"] = args.lr * run.sched.lr_lambdas[0](run.sched.last_epoch)
    if changed.keys() & set(DATA_FLAGS) and not resized:  # the saved position means nothing in another stream
        skipped = run.position.skipped
        run.position = data.Position(epoch=run.position.epoch + 1, skipped_before=skipped, skipped=skipped)
    return name, changed | ({"world": (world_from, run.world)} if resized else {})


def new_world(run, args, ckpt, name):
    """--override world: a whole checkpoint (one process, DDP, FSDP) goes on on another number of ranks: every tensor
    loads as on the same number (whole_state / own_state), and --grad-accum keeps its global batch where that divides
    (else the change is said), on this resume and each later one (a requeued job comes back with its first flags).
    ZeRO-2's per-rank partitions and --ep's are refused. -> whether --grad-accum was set here."""
    saved, world_from = ckpt["args"], len(ckpt["data"])
    where = f"--resume: {args.out}/{name} was written by {world_from} ranks"
    if world_from != run.world and (ckpt["deepspeed_tag"] is not None or run.engine.partitioned):
        raise SystemExit(f"{where} with --dist deepspeed, whose optimizer state is a partition a rank: resume it on "
                         f"{world_from} ranks; a run that may change its size trains with --dist fsdp (or ddp)")
    if world_from != run.world and max(saved["ep"], args.ep) > 1:
        raise SystemExit(f"{where} (--ep {saved['ep']}), this run has {run.world} with --ep {args.ep}: expert "
                         f"parallelism resumes on {world_from} ranks; a run that may change its size uses --dist fsdp")
    if "world" not in args.override:
        raise SystemExit(f"{where}, this run has {run.world}: resume on {world_from} ranks, or continue on "
                         f"{run.world} with --override world (every state loads whole; the epoch starts again)")
    global_batch = saved["batch_size"] * saved["grad_accum"] * world_from
    accum, left = divmod(global_batch, args.batch_size * run.world)
    kept = bool(accum and not left) and not run.engine.partitioned  # (DeepSpeed's is fixed when it starts)
    if kept:
        args.grad_accum = run.engine.grad_accum = accum
    said = (f"--grad-accum {accum} keeps the global batch at {global_batch}" if kept else
            f"the global batch changes from {global_batch} to {args.batch_size * args.grad_accum * run.world}: "
            f"no --grad-accum keeps it at --batch-size {args.batch_size} on {run.world} ranks")
    if run.rank == 0 and (world_from != run.world or args.grad_accum != saved["grad_accum"]):
        print(f"--override world: {world_from} -> {run.world} ranks; {said}" +
              "; the epoch it was in starts again" * (world_from != run.world))
    return kept


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


# ---- Logs: log.jsonl and TensorBoard ---------------------------------------------------------------------------------
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


# ---- Stop signals and exits ------------------------------------------------------------------------------------------
class Interrupted(BaseException):
    """StopSignals' way out where no step is waited for (args[0]: the signal); no `except Exception` catches it."""


class StopSignals:
    """SIGUSR1 (Slurm's warning before the time limit), SIGTERM (scancel, requeue, torchrun). While `defer` is set the
    first is only noted: after this step (one process) or at the next log step (where the ranks agree) every rank
    checkpoints and exits 0. Anywhere else, or at a second signal, Interrupted is raised at once; a repeat within
    `same_event` s is the same event (Slurm signals every process; torchrun forwards). Under a launcher a thread
    watches it too: a rank whose launcher died (torchrun dies of an unhandled USR1) stops, no orphan trains on."""

    def __init__(self, watch_launcher=False, same_event=10.0):  # (torchrun forwards within milliseconds; 10 s
        # keeps a loaded machine's late copy one event, and a person's deliberate second signal rarely comes sooner)
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

