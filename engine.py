"""engine.py -- how a step's gradients are made and applied.

train.py picks one engine by `--dist`; its step calls only this interface:

  forward             the model as the step calls it (compiled, wrapped)
  micro_batch(last)   a context for one micro-batch
  backward(loss)      add this micro-batch's gradients
  step(loss)          clip at 1.0, update, clear -> (grad norm, bad step)
  whole_state(state)  a state dict whole, as a checkpoint keeps it
  own_state(state)    back: this rank's part of it

DDP all-reduces the gradients; DeepSpeed ZeRO-2 partitions the optimizer
state and gradients; FSDP2 (ZeRO-3) the weights too. `--ep` splits the
experts over DDP's ranks: expert_parallel.py.
"""
import contextlib
import os
import sys

import torch
import torch.distributed as dist

import expert_parallel
from model import device


class Engine:
    """One process, or DDP (`--dist ddp`). EMA, samples and checkpoints use
    the plain model."""
    # ZeRO-2: each rank holds (and saves, in deepspeed/) its own
    # partition of the optimizer state
    optimizer_partitions = False
    # FSDP: each rank holds 1/world of every weight (and of its AdamW
    # state), so all ranks run every forward together
    splits_weights = False

    def __init__(self, args, model, opt, dev, world, local_rank):
        self.model, self.opt, self.world, self.grad_accum = model, opt, world, args.grad_accum
        self.forward = torch.compile(model) if args.compile else model
        # compile, then wrap. Experts are stacked, so every weight gets a
        # gradient each step: DDP need not search for unused ones
        if world > 1 and not self.splits_weights:
            ignored = expert_parallel.sharded_names(self.forward)
            self.forward._ddp_params_and_buffers_to_ignore = ignored
            ids = [local_rank] if dev == "cuda" else None
            self.forward = torch.nn.parallel.DistributedDataParallel(self.forward, device_ids=ids)

    def micro_batch(self, last):
        """DDP all-reduces in the last micro-batch's backward only."""
        ddp = isinstance(self.forward, torch.nn.parallel.DistributedDataParallel)
        if ddp and not last:
            return self.forward.no_sync()
        return contextlib.nullcontext()

    def backward(self, loss):
        """Add the gradients of 1 / --grad-accum of the step's loss."""
        (loss / self.grad_accum).backward()

    def step(self, loss):
        """A non-finite loss or norm skips the update (fused AdamW's
        found_inf), alike on every rank."""
        grad_norm = self.clip()  # NaN, inf pass through
        bad_step = ~torch.isfinite(loss) | ~torch.isfinite(grad_norm)
        self.opt.found_inf = bad_step.float()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return grad_norm, bad_step

    def clip(self):
        """Clip the gradients' global norm at 1.0 -> that norm."""
        expert_parallel.reduce_expert_grads(self.model, self.world)
        return expert_parallel.clip_grad_norm_(self.model, 1.0)

    def whole_state(self, state):
        # --ep: every expert, gathered (all ranks call it)
        return expert_parallel.reshard(self.model, state, whole=True)

    def own_state(self, state):
        return expert_parallel.reshard(self.model, state, whole=False)


class DeepSpeedEngine(Engine):
    """DeepSpeed ZeRO-2 (`--dist deepspeed`) around our AdamW."""
    optimizer_partitions = True

    def __init__(self, args, model, opt, dev, world, local_rank):
        import deepspeed
        config = {
            "train_micro_batch_size_per_gpu": args.batch_size,
            "gradient_accumulation_steps": args.grad_accum,
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 2},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": args.precision == "bf16"},
            "steps_per_print": 10 ** 9,
        }
        self.model, self.opt = model, opt
        ds = deepspeed.initialize(model=model, optimizer=opt, config=config)
        self.forward = self.ds = ds[0]

    def backward(self, loss):
        # it divides by --grad-accum, and counts micro-batches in step()
        self.ds.backward(loss)
        if not self.ds.is_gradient_accumulation_boundary():
            self.ds.step()

    def step(self, loss):
        # reduce-scatter, clip, update its partition (skips inf, NaN)
        self.ds.step()
        norm = float(self.ds.get_global_grad_norm() or 0.0)  # a host read
        grad_norm = torch.tensor(norm, device=loss.device)
        return grad_norm, ~torch.isfinite(loss) | ~torch.isfinite(grad_norm)


class FSDPEngine(Engine):
    """FSDP2 (`--dist fsdp`, ZeRO-3): every tensor split along dim 0.

    A block's weights are all-gathered just before it runs (forward and
    backward), then freed; its gradients reduce-scattered to the DTensor
    shards AdamW updates as in one process."""
    splits_weights = True

    @staticmethod
    def shard(models, dev, bf16=False):
        """Before the optimizer is built: each block, then the root. bf16:
        the trained model's blocks gather and compute in bf16, reduce in
        fp32 to fp32 shards; the rest and the EMA as kept."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        world = dist.get_world_size()
        mesh = torch.distributed.device_mesh.init_device_mesh(dev, (world,))
        half = MixedPrecisionPolicy(torch.bfloat16, torch.float32, output_dtype=torch.float32)
        # --moe: experts are stacked tensors, so all ranks reduce-scatter the same ones
        for m in models:
            # the root too: between steps no rank holds anything whole
            for module in [*m.blocks, m]:
                bf16_here = bf16 and m is models[0] and module is not m
                policy = half if bf16_here else MixedPrecisionPolicy()
                fully_shard(module, mesh=mesh, reshard_after_forward=True, mp_policy=policy)

    def micro_batch(self, last):
        """Until the last micro-batch, the whole gradients accumulate."""
        self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def clip(self):
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0).full_tensor()

    def whole_state(self, state):
        """Each shard made whole, a tensor at a time, onto rank 0's CPU."""
        if isinstance(state, dict):
            return {k: self.whole_state(v) for k, v in state.items()}
        if not hasattr(state, "full_tensor"):  # a buffer, a number
            return state
        whole = state.full_tensor()
        return whole.cpu() if dist.get_rank() == 0 else None

    def own_state(self, state):
        """Each whole tensor cut to this rank's shard; buffers stay whole."""
        from torch.distributed.tensor import distribute_tensor
        params = dict(self.model.named_parameters())

        def cut(v, p):
            return distribute_tensor(v, p.device_mesh, p.placements, src_data_rank=None)
        if "param_groups" not in state:  # a model's, by name
            return {k: cut(v, params[k]) if k in params else v for k, v in state.items()}
        # AdamW's moments, by parameter index
        by_index = list(params.values())
        moments = {i: {k: v if k == "step" else cut(v, by_index[i]) for k, v in st.items()}
                   for i, st in state["state"].items()}
        return {**state, "state": moments}


def init_distributed(dist_flag):
    """-> (device, rank, local rank, world size); under torchrun, also the
    process group. RANK numbers the job's processes, LOCAL_RANK a node's."""
    dev = device()
    if dist_flag == "none":
        return dev, 0, 0, 1
    rank, local_rank, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    if dev == "cuda":
        # "cuda": this process's own GPU
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if dev == "cuda" else "gloo")
    return dev, rank, local_rank, world


def make_engine(args, model, opt, dev, world, local_rank):
    """The engine `--dist` names, around `model` and `opt`."""
    engines = dict(deepspeed=DeepSpeedEngine, fsdp=FSDPEngine)
    return engines.get(args.dist, Engine)(args, model, opt, dev, world, local_rank)


# ==== A first read may skip: bytes held, a clean exit =========================
def held_bytes(tensors):
    """Bytes of these tensors this process holds (an FSDP shard's own part)."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


def optimizer_bytes(opt):
    """Bytes of optimizer state this process holds (ZeRO-2, FSDP: a share)."""
    return held_bytes(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v))


def leave_distributed(code=0):
    """barrier, destroy, flush, os._exit(code): gloo can abort at exit."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
