"""expert_parallel.py -- `--ep N`: each rank holds 1/N of every MoE's experts.

Ranks form groups of N; rank j of a group holds experts [j E/N, (j+1) E/N)
of each MoE layer (moe.py), the rest replicated as under DDP. A layer routes
its own tokens and sorts the T*k rows by expert, so by rank; its Exchange
all-to-alls the counts c (E,), then the rows (c summed per rank: uneven, no
token dropped), runs what arrived through its experts and sends the
results back. An expert's gradient, which sums its group's tokens, is
summed over its world / N replicas and divided by the world size: DDP's mean.
"""
import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from moe import MoE

# every expert's tensors, stacked (E, ...): what --ep shards
EXPERT_WEIGHTS = ("w13", "b13", "w2", "b2")


# ---- The exchange: rows to the ranks holding their experts, and back ---------
def all_to_all(out, x, out_splits=None, in_splits=None, group=None):
    """The one place rows (and counts) cross ranks: profile.py times it."""
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)


class AllToAll(torch.autograd.Function):
    """x (n, D): send[j] rows to rank j of `group`, recv[j] from it ->
    (sum(recv), D). The backward, reversed, sends each row's gradient home."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.sizes = send, recv, group
        out = x.new_empty(sum(recv), x.shape[1])
        all_to_all(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send, recv, group = ctx.sizes
        return AllToAll.apply(grad, recv, send, group), None, None, None


@dataclasses.dataclass
class Exchange:
    """This rank's place in --ep: each MoE layer's `exchange`, its dispatch."""
    group: object   # the N ranks that exchange rows
    replicas: object  # the world / N ranks holding these experts (or None)
    rank: int       # j: this rank's place in `group`
    size: int       # N

    @torch._disable_dynamo  # the split sizes are read on the host
    def __call__(self, experts, xs, counts):
        """xs, counts as for MoE.experts -> the same, experts spread over `group`."""
        ranks = self.size
        # (E,): rows from each rank for each of my experts
        received = torch.empty_like(counts)
        all_to_all(received, counts, group=self.group)
        both = torch.stack([counts, received]).view(2, ranks, -1)
        send, recv = both.sum(-1).tolist()  # rows to and from each rank
        xs = AllToAll.apply(xs, send, recv, self.group)  # (sum(recv), D)
        mine = torch.arange(len(counts) // ranks, device=xs.device)
        # each received row's expert, among mine
        row_expert = mine.repeat(ranks).repeat_interleave(
            received, output_size=sum(recv))
        # rows by rank -> by expert
        by_expert = row_expert.argsort(stable=True)
        ys = experts(xs.index_select(0, by_expert), row_expert[by_expert],
                     received.view(ranks, -1).sum(0))
        # back in the order received, then home; a rank with no rows still
        # joins both exchanges of the backward
        ys = ys.index_select(0, by_expert.argsort())
        return AllToAll.apply(ys, recv, send, self.group)


# ---- Who holds which experts; their gradients; whole checkpoints -------------
def shard_experts(models, n):
    """Rank r keeps share j = r mod n of each model's experts (the model,
    its EMA); ranks r - j ... r - j + n - 1 exchange rows. Call before the
    optimizer is built; all ranks build all groups, in order."""
    if n == 1:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group(list(range(g, g + n))) for g in range(0, world, n)]
    if world > n:
        replicas = [dist.new_group(list(range(j, world, n))) for j in range(n)]
    else:
        replicas = [None] * n
    j = rank % n
    exchange = Exchange(groups[rank // n], replicas[j], j, n)
    for model in models:
        for m in [m for m in model.modules() if isinstance(m, MoE)]:
            m.exchange = exchange
            for name in EXPERT_WEIGHTS:
                whole = getattr(m, name)
                part = whole.data.chunk(n)[j].clone()
                setattr(m, name, nn.Parameter(part, requires_grad=whole.requires_grad))


def sharded_layers(model):
    """[(name, layer)] of the MoE layers whose experts --ep split."""
    return [(k, m) for k, m in model.named_modules() if isinstance(m, MoE) and m.exchange]


def sharded_names(model):
    """Names of the expert tensors --ep split (`model` may be compiled or
    wrapped): DDP leaves them to reduce_expert_grads."""
    ep = bool(sharded_layers(model))
    return [k for k, _ in model.named_parameters() if ep and k.rsplit(".", 1)[-1] in EXPERT_WEIGHTS]


def reduce_expert_grads(model, world):
    """After the backward: the held experts' gradients made DDP's mean."""
    for _, m in sharded_layers(model):
        for p in [getattr(m, w) for w in EXPERT_WEIGHTS]:
            # no row reached them: zero, as the whole stack would get
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if m.exchange.replicas:
                dist.all_reduce(p.grad, group=m.exchange.replicas)
            p.grad /= world


def clip_grad_norm_(model, max_norm):
    """torch's clip_grad_norm_ -> the norm (NaN, inf pass), the experts'
    squared norm summed over the group: every rank scales alike."""
    expert_keys = set(sharded_names(model))
    if not expert_keys:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    norm_of = torch.nn.utils.get_total_norm
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    experts_sq = norm_of([g for k, g in grads.items() if k in expert_keys]) ** 2
    _, layer = sharded_layers(model)[0]
    dist.all_reduce(experts_sq, group=layer.exchange.group)
    rest = norm_of([g for k, g in grads.items() if k not in expert_keys])
    norm = (rest ** 2 + experts_sq).sqrt()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    return norm


def reshard(model, state, whole):
    """A state_dict of `model` or of its AdamW (moments by parameter index)
    -> a copy with every expert (whole: all ranks of a group call it), or
    with this rank's share."""
    names = [k for k, _ in model.named_parameters()]
    opt = "param_groups" in state
    if opt:
        moments = {i: dict(s) for i, s in state["state"].items()}
        state = {**state, "state": moments}
    else:
        state = dict(state)
    for prefix, m in sharded_layers(model):
        ep = m.exchange
        for key in [f"{prefix}.{w}".lstrip(".") for w in EXPERT_WEIGHTS]:
            if opt:
                d = state["state"][names.index(key)]
                places = [(d, "exp_avg"), (d, "exp_avg_sq")]
            else:
                places = [(state, key)]
            for d, k in places:
                if whole:
                    parts = [torch.empty_like(d[k]) for _ in range(ep.size)]
                    dist.all_gather(parts, d[k].contiguous(), group=ep.group)
                    d[k] = torch.cat(parts)
                else:
                    d[k] = d[k].chunk(ep.size)[ep.rank].clone()
    return state


def whole_model(model, config):
    """`model` with every expert, to sample with in one process: a new
    type(model)(**config) on rank 0 (all ranks call it), None on the others.
    Without --ep: `model`."""
    if not sharded_names(model):
        return model
    state = reshard(model, model.state_dict(), whole=True)
    if dist.get_rank() != 0:
        return None
    out = type(model)(**config).to(next(model.parameters()).device)
    out.load_state_dict(state)
    return out
