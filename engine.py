"""engine.py -- how a step's gradients are made and applied: one process, DDP, DeepSpeed ZeRO-2 or FSDP2.

train.py chooses one engine at set-up (`--dist`) and its step calls only this interface, never asking which:
  forward                 the model as the step calls it (compiled by --compile but under DeepSpeed; DDP-wrapped)
  micro_batch(last)       a context for one micro-batch (gradients are synchronised in the last one's backward)
  backward(loss)          add this micro-batch's gradients (1 / --grad-accum of the step's loss)
  step(loss)              clip at 1.0, update, clear -> (gradient norm, bad step): a non-finite one changes nothing
  whole_state / own_state a state dict as a checkpoint keeps it (whole) and back (this rank's part)
How they differ: DDP all-reduces the gradients (each rank holds everything); ZeRO-2 partitions the optimizer state and
gradients; FSDP2 (ZeRO-3) partitions the weights too. `--ep` (moe.py) splits the experts over DDP's ranks.
"""
import contextlib
import os
import sys

import torch
import torch.distributed as dist

import moe
from model import device


class Engine:
    """One process, or DDP (`--dist ddp`: each rank's gradients averaged in the backward). `forward` is what the step
    calls: the model, compiled (`--compile`) and/or DDP-wrapped; EMA, samples and checkpoints use the plain model."""
    partitioned = False  # True: the optimizer state is split over the ranks (checkpointed as a folder per rank)
    sharded = False      # True: so is every weight; all ranks run each forward together (sampling too)

    def __init__(self, args, model, opt, dev, world, local_rank):
        self.model, self.opt, self.world, self.grad_accum = model, opt, world, args.grad_accum
        self.forward = torch.compile(model) if args.compile else model
        if world > 1 and not self.sharded:  # compile, then wrap. Every weight gets a gradient in every step (an
            # expert no token reached is a row of its layer's stacked weights), so DDP need not search for unused ones
            self.forward._ddp_params_and_buffers_to_ignore = moe.ep_sharded_names(self.forward)  # (see moe.py)
            self.forward = torch.nn.parallel.DistributedDataParallel(
                self.forward, device_ids=[local_rank] if dev == "cuda" else None)

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
    def shard(models, dev, bf16=False):
        """Before the optimizer is built: each block, then the rest (embeddings, final layer), of each model. bf16:
        the trained model's blocks (nearly all its weights) are gathered in bf16, half the bytes, and compute in it,
        fp32 in and out; their gradients are reduce-scattered in fp32 and AdamW updates the fp32 shards. The rest,
        and an --ema copy, which only samples, are gathered as they are kept (--ema 0: the model samples, in bf16)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = torch.distributed.device_mesh.init_device_mesh(dev, (dist.get_world_size(),))
        half = MixedPrecisionPolicy(torch.bfloat16, torch.float32, output_dtype=torch.float32)
        for m in models:
            for module in [*m.blocks, m]:  # (the root too: between steps no rank holds anything whole)
                bf16_here = bf16 and m is models[0] and module is not m
                fully_shard(module, mesh=mesh, reshard_after_forward=True,
                            mp_policy=half if bf16_here else MixedPrecisionPolicy())
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


def init_distributed(dist_flag):
    """-> (device, rank, local rank, world size); under torchrun (`--dist ...`) also the process group. RANK numbers
    the processes of the whole job (rank 0 writes the files), LOCAL_RANK those of one node (it picks the GPU)."""
    dev = device()
    if dist_flag == "none":  # plain `python train.py`
        return dev, 0, 0, 1
    rank, local_rank, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))  # (torchrun's)
    if dev == "cuda":
        torch.cuda.set_device(local_rank)  # "cuda" now means this process's own GPU
    dist.init_process_group("nccl" if dev == "cuda" else "gloo")
    return dev, rank, local_rank, world


def make_engine(args, model, opt, dev, world, local_rank):
    """The engine `--dist` names, around this model and its optimizer."""
    return dict(deepspeed=DeepSpeedEngine, fsdp=FSDPEngine).get(args.dist, Engine)(args, model, opt, dev, world,
                                                                                   local_rank)


# ==== What a first read may skip: the bytes each rank holds, a clean exit ===========================================
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
