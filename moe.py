"""moe.py -- DiT-MoE's sparse MLP: router, experts, shared experts, balancing, three dispatches.

A mixture of experts replaces one big MLP by E smaller ones and lets each token use only k of them (Shazeer et
al. 2017; Switch, Fedus et al. 2021; DiT-MoE, Fei et al. 2024):

    router      p = softmax(x W_r^T)                       (T, E)  one distribution per token
    top-k       (w, idx) = topk(p, k),  w <- w / sum(w)    (T, k)  renormalised, as Mixtral: the same scale for
                                                                   any E and k, and an upcycled model starts equal
    output      y = sum_j w_j Expert_idx_j(x) + Shared(x)          shared experts see every token
    balance     L = alpha E sum_i f_i P_i                          f_i: share of the T*k assignments to expert i,
                                                                   P_i: mean router probability of i

L = alpha at uniform routing. It is not the minimum (f = (0.9, 0.1), P = (0.46, 0.54) gives 0.94 alpha), but its
gradient, through P only (f is a count), lowers each expert's probability in proportion to its load: toward balance.
alpha = 0.01 and 2 shared experts are DiT-MoE's values; by default an expert is dense_hidden / (k + shared) wide,
so a token uses as many MLP parameters as the dense model. `--balance bias` is DeepSeek-V3's loss-free balancing
instead: a per-expert bias b on the probabilities picks the top k (the gate weights stay unbiased, so no gradient
is bent), and after each step b_i += gamma sign(mean load - load_i), the loads of the whole global batch.

Three dispatches (`--moe-impl`), equal outputs and gradients: `loop`, the readable reference (per expert, mask its
tokens, run it, add back: DiT-MoE's); `sorted` (CPU default), the T*k assignments sorted by expert once, one slice
per expert, one index_add back; `grouped` (CUDA default), the same rows in a fixed-size buffer, each expert's group
padded to ALIGN rows, all experts' W13 then W2 as ONE grouped GEMM each (F.grouped_mm, torchtitan's design): its
shapes depend on (T, k, E) only, so no host sync and no recompiles. The loop and the sorted slices read counts on the
host and run eagerly under torch.compile.

Expert parallelism (`--ep N`, torchrun): ranks form groups of N, and rank j of a group holds experts [j E/N, (j+1) E/N)
only; the rest is replicated. Per layer: route locally; sort the T*k rows by expert, hence by owning rank; exchange
the counts c (E,) by all_to_all; all_to_all the rows (split sizes: c summed per rank; uneven, no token dropped); run
what arrived through the local experts (sorted or grouped); all_to_all it back (the splits reversed); combine as
above. Autograd runs each all_to_all reversed, sending every row's gradient home. An expert's gradient, which sums
its whole group's tokens, is summed over its world / N copies and divided by the world size: DDP's mean. The balance
loss's f counts all ranks' tokens, so routing does not depend on how the batch is split.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ALIGN = 16  # grouped GEMM: rows per expert group padded to a multiple of this (16-byte aligned for bf16 and fp8)
EXPERT_WEIGHTS = ("w13", "b13", "w2", "b2")  # every expert's tensors, stacked (E, ...): what --ep shards


def dense_hidden(dim):
    """SwiGLU hidden size 2/3 * 4D (rounded up to a multiple of 8): ~ the params of a 4x MLP."""
    return 8 * ((int(2 * 4 * dim / 3) + 7) // 8)


class SwiGLU(nn.Module):
    """SwiGLU MLP (Shazeer 2020): W2 (silu(x W1) * x W3). The dense MLP and the shared experts."""

    def __init__(self, dim, hidden=None):
        super().__init__()
        hidden = hidden or dense_hidden(dim)
        self.w13 = nn.Linear(dim, 2 * hidden)  # W1 and W3 in one matmul
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x):
        a, b = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(a) * b)


def expert(x, w13, b13, w2, b2):
    """One routed expert: a SwiGLU with weights w13 (D, 2H), w2 (H, D) and their biases."""
    a, b = torch.addmm(b13, x, w13).chunk(2, dim=-1)
    return torch.addmm(b2, F.silu(a) * b, w2)


class MoE(nn.Module):
    """Token-choice top-k mixture of SwiGLU experts, plus shared experts. x (..., D) -> (..., D)."""

    def __init__(self, dim, n_experts=8, topk=2, n_shared=2, hidden=None, impl="sorted", alpha=0.01, balance="aux"):
        super().__init__()
        assert 1 <= topk <= n_experts, "--topk must be between 1 and --moe"
        hidden = hidden or max(8, 8 * round(dense_hidden(dim) / (topk + n_shared) / 8))
        self.E, self.k, self.impl, self.alpha, self.hidden = n_experts, topk, impl, alpha, hidden
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(n_experts, dim, 2 * hidden))  # all experts stacked
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.b13 = nn.Parameter(torch.zeros(n_experts, 2 * hidden))
        self.b2 = nn.Parameter(torch.zeros(n_experts, dim))
        self.shared = SwiGLU(dim, n_shared * hidden) if n_shared else None  # = n_shared experts summed
        for i in range(n_experts):  # each expert initialised like an nn.Linear would be
            nn.init.xavier_uniform_(self.w13.data[i].T)
            nn.init.xavier_uniform_(self.w2.data[i].T)
        nn.init.normal_(self.router.weight, std=0.02)
        self.stats, self.balance, self.loads = {}, balance, 0
        self.ep_group, self.ep_copies, self.ep_rank, self.ep_size = None, None, 0, 1  # --ep: see shard_experts
        if balance == "bias":  # DeepSeek-V3's loss-free balancing: a per-expert bias for the top-k choice only
            self.register_buffer("bias", torch.zeros(n_experts))  # (a buffer: saved, resumed, never a gradient)

    def weights(self, e):
        """Expert e's (w13, b13, w2, b2)."""
        return self.w13[e], self.b13[e], self.w2[e], self.b2[e]

    def route(self, x):
        """x (T, D) -> probabilities (T, E), top-k weights (T, k), expert ids (T, k); keeps f, P for the loss."""
        probs = self.router(x).float().softmax(dim=-1)
        if self.balance == "bias":  # the bias picks the experts; the weights stay the unbiased probabilities
            idx = (probs + self.bias).topk(self.k, dim=-1).indices
            w = probs.gather(-1, idx)
        else:
            w, idx = probs.topk(self.k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        self.counts, self.mean_prob = expert_counts(idx, self.E), probs.mean(0)  # (E,) each: the balance loss's f, P
        f = self.counts.float() / idx.numel()                                   # (E,) sums to 1
        with torch.no_grad():  # for log.jsonl: load per expert, router entropy
            ent = -(probs * probs.clamp_min(1e-9).log()).sum(-1).mean()
            self.stats = dict(load=f.detach(), entropy=ent, idx=idx.detach())
        return probs, w.to(x.dtype), idx

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (T, D): every image token of every sample
        _, w, idx = self.route(x)
        if self.impl == "loop" and not self.ep_group:
            y = self.dispatch_loop(x, w, idx)
        else:  # sorted, grouped, --ep: the T*k assignments sorted by expert (so by owning rank), gathered, scattered
            order = idx.flatten().argsort(stable=True)
            token = order // self.k                          # the token each sorted row came from
            # index_select, not x[token]: its backward (index_add) sums repeated rows in a fixed order on a CPU; the
            # backward of x[...] adds them with parallel atomics there, which made runs differ
            experts = self.experts_ep if self.ep_group else self.experts  # (--ep: through the ranks holding them)
            out = experts(x.index_select(0, token), idx.flatten()[order], expert_counts(idx, self.E))
            y = torch.zeros_like(x).index_add_(0, token, out * w.flatten()[order, None])  # gated, summing the k
        if self.shared is not None:
            y = y + self.shared(x)
        return y.view(shape)

    # data-dependent shapes: runs eagerly (a graph break) instead of recompiling. torch.compiler.disable would
    # import dynamo now (slow; sample.py never needs it); torch._disable_dynamo waits for the first call.
    @torch._disable_dynamo
    def dispatch_loop(self, x, w, idx):
        """Reference: for each expert, boolean-mask its tokens, run it, add the weighted result."""
        y = torch.zeros_like(x)
        for e in range(self.E):
            hit = idx == e                       # (T, k) where expert e was chosen
            rows = hit.any(-1)                   # (T,) tokens that use e
            if not rows.any():
                continue
            gate = (w * hit).sum(-1)[rows, None]  # that token's weight for e
            y[rows] = y[rows] + gate * expert(x[rows], *self.weights(e))
        return y

    def experts(self, xs, e, counts):
        """Rows sorted by expert xs (n, D), their experts e (n,), rows per expert counts (E,) -> each row through its
        expert (n, D): as grouped GEMMs, or one slice per expert (CUDA's grouped GEMM is bf16-only: fp32 slices)."""
        if self.impl == "grouped" and self.grouped_ok(xs):
            return self.experts_grouped(xs, e, counts)
        return self.experts_sorted(xs, counts)

    @torch._disable_dynamo  # the slices' sizes are read on the host
    def experts_sorted(self, xs, counts):
        """Rows sorted by expert (n, D), rows per expert (E,) -> each row through its expert: one slice each."""
        counts = counts.tolist()
        out = [expert(chunk, *self.weights(e)) for e, chunk in enumerate(xs.split(counts)) if counts[e]]
        return torch.cat(out) if out else xs * 0  # (no row: still part of the graph, see experts_ep)

    def grouped_ok(self, x):
        """The grouped GEMM runs in any dtype on a CPU, in bf16 only on CUDA."""
        dt = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        return not x.is_cuda or dt == torch.bfloat16

    def experts_grouped(self, xs, e, counts):
        """Rows sorted by expert xs (n, D), their experts e (n,), rows per expert counts (E,) on the device -> each row
        through its expert (n, D): two grouped GEMMs over a fixed-size buffer, no host sync, no data-dependent shape."""
        E, n = len(counts), len(e)                          # (E: the experts this rank holds)
        dt = torch.get_autocast_dtype(xs.device.type) if torch.is_autocast_enabled(xs.device.type) else xs.dtype
        padded = (counts + ALIGN - 1) // ALIGN * ALIGN      # group sizes rounded up
        ends = padded.cumsum(0)                             # where each padded group ends
        dest = ends[e] - padded[e] + torch.arange(n, device=xs.device) - (counts.cumsum(0) - counts)[e]
        rows = n + E * ALIGN                                # > any possible sum of padded groups: fixed
        buf = xs.new_zeros(rows, xs.shape[1], dtype=dt).index_copy(0, dest, xs.to(dt))
        group = torch.searchsorted(ends, torch.arange(rows, device=xs.device), right=True).clamp(max=E - 1)
        used = (torch.arange(rows, device=xs.device) < ends[-1])[:, None]  # rows past the last group: no output
        mm = F.grouped_mm if dt == torch.bfloat16 else grouped_mm_eager
        h = mm(buf, self.w13.to(dt), offs=ends.int()) + self.b13.index_select(0, group).to(dt)  # (rows, 2H)
        a, b = torch.where(used, h, 0).chunk(2, dim=-1)
        out = mm(F.silu(a) * b, self.w2.to(dt), offs=ends.int()) + self.b2.index_select(0, group).to(dt)  # (rows, D)
        return out[dest].to(xs.dtype)                       # back to the sorted rows

    @torch._disable_dynamo  # the exchange's split sizes are read on the host
    def experts_ep(self, xs, e, counts):
        """--ep: each sorted row travels to the rank that holds its expert, through it, and back (see the docstring)."""
        ranks, group = self.ep_size, self.ep_group
        received = torch.empty_like(counts)                 # (ranks * E/ranks,) rows from each rank to each of mine
        exchange(received, counts, group=group)
        send, recv = torch.stack([counts, received]).view(2, ranks, -1).sum(-1).tolist()  # rows to and from each rank
        xs = AllToAll.apply(xs, send, recv, group)          # (sum(recv), D) the rows for my experts
        local = torch.arange(self.E // ranks, device=xs.device).repeat(ranks)  # (E,) my experts, once per rank
        local = local.repeat_interleave(received, output_size=sum(recv))  # each received row's expert here
        by = local.argsort(stable=True)                     # rows by rank -> by expert
        ys = self.experts(xs.index_select(0, by), local[by], received.view(ranks, -1).sum(0))
        # back in the order received, then home; a rank with no rows still joins both exchanges of the backward
        return AllToAll.apply(ys.index_select(0, by.argsort()), recv, send, group)  # (T*k, D) as sorted here


def exchange(out, x, out_splits=None, in_splits=None, group=None):
    """dist.all_to_all_single: the one place rows (and counts) cross ranks, so profile.py can time it."""
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)


class AllToAll(torch.autograd.Function):
    """Rows of x (n, D) to the ranks of `group`, send[j] of them to rank j, recv[j] from it -> (sum(recv), D). Its
    backward is the same exchange reversed: each row's gradient goes back to the rank the row came from."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.sizes = send, recv, group
        out = x.new_empty(sum(recv), x.shape[1])
        exchange(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send, recv, group = ctx.sizes
        return AllToAll.apply(grad, recv, send, group), None, None, None


# torch.compile's shape check of grouped_mm accepts only bf16 (its fast dtype): in fp32 (the CPU) the
# two GEMMs run outside the compiled graph; the shapes stay fixed, so there is still one compile.
grouped_mm_eager = torch._disable_dynamo(F.grouped_mm)


def expert_counts(idx, E):
    """Assignments per expert (E,), computed on the device (torch.bincount reads its max on the host)."""
    return idx.new_zeros(E).scatter_add_(0, idx.flatten(), torch.ones_like(idx).flatten())  # (idx: int64)


def default_impl(device):
    """The dispatch for a device: one grouped GEMM per weight on CUDA, per-expert slices on a CPU."""
    return "grouped" if str(device).startswith("cuda") else "sorted"


def balance_loss(model, world=False):
    """Sum over the MoE layers of `model` of alpha E sum_i f_i P_i (--balance aux; 0 for a dense model). `world`:
    f counts the tokens of all ranks (one all-reduce), so the mean over ranks, which DDP's gradient takes, is the
    global batch's loss whatever its split (P is a mean over equal shares of the tokens). --balance bias: adds f to
    the layer's `loads`, which nudge_biases spends (call it right after the forward: --grad-ckpt routes again)."""
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.stats]
    zero = torch.zeros((), device=next(model.parameters()).device)  # (made there: a copy from the host would wait)
    if not layers:
        return zero
    counts = torch.stack([m.counts for m in layers]).float()  # (layers, E)
    if world:
        dist.all_reduce(counts)
    aux = []
    for m, f in zip(layers, counts / counts.sum(-1, keepdim=True)):
        if m.balance == "bias":
            m.loads = m.loads + f
        else:
            aux.append(m.alpha * m.E * (f * m.mean_prob).sum())
    return sum(aux) if aux else zero


def count_params(model):
    """(total, active) parameters: every one (with --ep, the experts other ranks hold too), and those a single image
    token uses: the total minus the (E - k) unused experts of each layer."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    one = lambda m: sum(w.numel() for w in m.weights(0))  # one expert
    total = sum(p.numel() for p in model.parameters()) + sum((m.E - len(m.w13)) * one(m) for m in layers)
    return total, total - sum((m.E - m.k) * one(m) for m in layers)


@torch.no_grad()
def upcycle(model, dense_state):
    """Dense checkpoint -> MoE model (DiT-MoE's upcycling): every expert a copy of the dense MLP, the rest copied;
    routers fresh and shared experts at zero output, so the first forward equals the dense model's. Routing breaks
    the symmetry: each expert gets different tokens, hence different gradients. -> tensors copied."""
    state, moes = model.state_dict(), {k: m for k, m in model.named_modules() if isinstance(m, MoE)}
    mlps = {f"{k}.{w}.{p}" for k in moes for w in ("w13", "w2") for p in ("weight", "bias")}  # become the experts
    if unknown := sorted(set(dense_state) - set(state) - mlps):
        raise SystemExit(f"--init: not a dense checkpoint of this model.py (tensors {', '.join(unknown[:3])} ...)")
    copied = {k: v for k, v in dense_state.items() if k in state and state[k].shape == v.shape}
    state.update(copied)
    for name, m in moes.items():
        w13, w2 = dense_state[f"{name}.w13.weight"], dense_state[f"{name}.w2.weight"]
        if w2.shape[1] != m.hidden:
            raise SystemExit(f"upcycling needs experts as wide as the dense MLP: pass --expert-hidden {w2.shape[1]}")
        state[f"{name}.w13"] = w13.T.expand(m.E, -1, -1).clone()  # (E, D, 2H)
        state[f"{name}.b13"] = dense_state[f"{name}.w13.bias"].expand(m.E, -1).clone()
        state[f"{name}.w2"] = w2.T.expand(m.E, -1, -1).clone()    # (E, H, D)
        state[f"{name}.b2"] = dense_state[f"{name}.w2.bias"].expand(m.E, -1).clone()
    model.load_state_dict(state)
    return len(copied)


def nudge_biases(model, rate, skip=None):
    """--balance bias, after a step: b_i += rate * sign(mean load - load_i) in every layer (DeepSeek-V3's gamma =
    0.001), by its loads summed over micro-batches (and ranks); no nudge where `skip` (a device bool) is set."""
    with torch.no_grad():
        for m in [m for m in model.modules() if isinstance(m, MoE) and m.balance == "bias"]:
            step = rate * torch.sign(m.loads.mean() - m.loads)
            m.bias.add_(step if skip is None else step * (~skip).float())
            m.loads = 0


def routing_stats(model):
    """Per MoE layer: load per expert (list), router entropy, experts that got no token."""
    return [dict(load=[round(v, 4) for v in load], entropy=round(m.stats["entropy"].item(), 4), unused=load.count(0))
            for m in model.modules() if isinstance(m, MoE) and m.stats for load in [m.stats["load"].tolist()]]


# ---- Expert parallelism (--ep N): who holds which experts, their gradients, whole checkpoints ------------------------
def shard_experts(models, n):
    """Rank r keeps experts [j E/n, (j+1) E/n) of every MoE layer of each model (the model, its EMA), j = r mod n.
    Ranks r - j ... r - j + n - 1 exchange tokens (ep_group); the world / n ranks of one j hold the same experts
    (ep_copies). Call before the optimizer is built; every rank builds every group, in the same order."""
    if n == 1:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group(list(range(g, g + n))) for g in range(0, world, n)]
    copies = [dist.new_group(list(range(j, world, n))) for j in range(n)] if world > n else [None] * n
    j = rank % n
    for m in [m for model in models for m in model.modules() if isinstance(m, MoE)]:
        m.ep_group, m.ep_copies, m.ep_rank, m.ep_size = groups[rank // n], copies[j], j, n
        for name in EXPERT_WEIGHTS:
            whole = getattr(m, name)
            setattr(m, name, nn.Parameter(whole.data.chunk(n)[j].clone(), requires_grad=whole.requires_grad))


def ep_sharded_names(model):
    """Names of the expert tensors --ep split over ranks (none without it; `model` may be compiled or wrapped): DDP
    leaves them to reduce_expert_grads. (A name ending in w13, b13, w2, b2 is an MoE's; SwiGLU's end in .weight.)"""
    ep = any(isinstance(m, MoE) and m.ep_group for m in model.modules())
    return [k for k, _ in model.named_parameters() if ep and k.rsplit(".", 1)[-1] in EXPERT_WEIGHTS]


def reduce_expert_grads(model, world):
    """After the backward: each held expert's gradient summed over the ranks holding copies, divided by `world`."""
    for m in [m for m in model.modules() if isinstance(m, MoE) and m.ep_group]:
        for p in [getattr(m, w) for w in EXPERT_WEIGHTS]:
            if p.grad is None:  # no row reached this rank's experts: a zero gradient, as the whole stack would get
                p.grad = torch.zeros_like(p)
            if m.ep_copies:
                dist.all_reduce(p.grad, group=m.ep_copies)
            p.grad /= world


def clip_grad_norm_(model, max_norm):
    """torch's clip_grad_norm_ over the whole model: with --ep the held experts' share of the squared norm is summed
    over the group, so every rank finds the same norm and scales its gradients alike. -> the norm (NaN, inf pass)."""
    sharded = set(ep_sharded_names(model))
    if not sharded:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    sharded_sq = torch.nn.utils.get_total_norm([g for k, g in grads.items() if k in sharded]) ** 2
    dist.all_reduce(sharded_sq, group=next(m for m in model.modules() if isinstance(m, MoE)).ep_group)
    norm = (torch.nn.utils.get_total_norm([g for k, g in grads.items() if k not in sharded]) ** 2 + sharded_sq).sqrt()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    return norm


def reshard(model, state, whole):
    """A state_dict of `model` or of its optimizer (AdamW moments, by parameter index) -> a copy with every expert
    (whole: all ranks of the group call it; rank order is expert order) or with this rank's share (not whole)."""
    names, opt = [k for k, _ in model.named_parameters()], "param_groups" in state
    state = {**state, "state": {i: dict(s) for i, s in state["state"].items()}} if opt else dict(state)
    for prefix, m in [(k, m) for k, m in model.named_modules() if isinstance(m, MoE) and m.ep_group]:
        for key in [f"{prefix}.{w}".lstrip(".") for w in EXPERT_WEIGHTS]:
            for d, k in [(state["state"][names.index(key)], k) for k in ("exp_avg", "exp_avg_sq")] if opt else [
                    (state, key)]:
                if whole:
                    parts = [torch.empty_like(d[k]) for _ in range(m.ep_size)]
                    dist.all_gather(parts, d[k].contiguous(), group=m.ep_group)
                    d[k] = torch.cat(parts)
                else:
                    d[k] = d[k].chunk(m.ep_size)[m.ep_rank].clone()
    return state


def gathered(model, config):
    """`model` with every expert, to sample with in one process: all ranks send their experts, and rank 0 (which
    samples) gets a new type(model)(**config) (no --ep) holding them; the others get None. Without --ep: `model`."""
    if not ep_sharded_names(model):
        return model
    state = reshard(model, model.state_dict(), whole=True)
    if dist.get_rank() != 0:  # (no whole copy on the ranks that do not sample: --ep is there to save that memory)
        return None
    out = type(model)(**config).to(next(model.parameters()).device)
    out.load_state_dict(state)
    return out
