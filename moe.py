"""moe.py -- DiT-MoE's sparse MLP: router, experts, balance, three dispatches.

A mixture of experts replaces one big MLP by E smaller ones, of which each
token uses k (Shazeer et al. 2017; Switch, Fedus et al. 2021; DiT-MoE, Fei et
al. 2024):

    router   p = softmax(x W_r^T)                       (T, E)
    top-k    (w, idx) = topk(p, k),  w <- w / sum(w)    (T, k)
    output   y = sum_j w_j Expert_idx_j(x) + Shared(x)
    balance  L = alpha E sum_i f_i P_i

f_i is expert i's share of the T*k assignments, P_i its mean probability.
Renormalised (as Mixtral), w has one scale for any E and k, and an upcycled
model starts equal to its parent. L = alpha at uniform routing, not its
minimum, but its gradient (through P: f is a count) lowers each expert's
probability in proportion to its load. DiT-MoE uses alpha = 0.01 and 2
shared experts. An expert's width defaults to dense_hidden / (k + shared):
a token uses the dense model's MLP params.
`--balance bias` is DeepSeek-V3's loss-free balancing: a per-expert bias b
on p picks the top k; after each step b_i += gamma sign(mean load - load_i),
by the global batch's loads.

Three dispatches (`--moe-impl`), equal in outputs and gradients:
  loop     per expert: mask its tokens, run it, add back (DiT-MoE's)
  sorted   the T*k assignments sorted by expert, one slice per expert,
           one index_add back (CPU default)
  grouped  the sorted rows in a fixed-size buffer, each expert's group
           padded to ALIGN rows, one grouped GEMM per weight (F.grouped_mm,
           torchtitan's; CUDA default): fixed shapes: no host sync, no
           recompiles
`--ep` sends the sorted rows to the ranks holding their experts
(expert_parallel.py).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

# grouped GEMM wants each expert's rows to span a multiple of 16 bytes:
# 16 rows do in fp8 and bf16
ALIGN = 16


def dense_hidden(dim):
    """SwiGLU width 2/3 * 4D, rounded up to a multiple of 8: a 4x MLP's params."""
    return 8 * ((int(2 * 4 * dim / 3) + 7) // 8)


class SwiGLU(nn.Module):
    """W2 (silu(x W1) * x W3) (Shazeer 2020): the dense MLP, the shared experts."""

    def __init__(self, dim, hidden=None):
        super().__init__()
        hidden = hidden or dense_hidden(dim)
        # W1 and W3 in one matmul
        self.w13 = nn.Linear(dim, 2 * hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x):
        a, b = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(a) * b)


def expert(x, w13, b13, w2, b2):
    """One routed expert: a SwiGLU of weights w13 (D, 2H), w2 (H, D), biases."""
    a, b = torch.addmm(b13, x, w13).chunk(2, dim=-1)
    return torch.addmm(b2, F.silu(a) * b, w2)


# ---- The layer: route, dispatch, combine -------------------------------------
class MoE(nn.Module):
    """Token-choice top-k SwiGLU experts plus shared ones: (..., D) -> (..., D)."""

    def __init__(self, dim, n_experts=8, topk=2, n_shared=2, hidden=None,
                 impl="sorted", alpha=0.01, balance="aux"):
        super().__init__()
        assert 1 <= topk <= n_experts, "--topk must be between 1 and --moe"
        hidden = hidden or max(8, 8 * round(dense_hidden(dim) / (topk + n_shared) / 8))
        self.E, self.k, self.impl = n_experts, topk, impl
        self.alpha, self.hidden = alpha, hidden
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(n_experts, dim, 2 * hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.b13 = nn.Parameter(torch.zeros(n_experts, 2 * hidden))
        self.b2 = nn.Parameter(torch.zeros(n_experts, dim))
        # n_shared experts summed: a SwiGLU n_shared times as wide
        self.shared = SwiGLU(dim, n_shared * hidden) if n_shared else None
        # xavier, as DiT initialises every nn.Linear
        for i in range(n_experts):
            nn.init.xavier_uniform_(self.w13.data[i].T)
            nn.init.xavier_uniform_(self.w2.data[i].T)
        nn.init.normal_(self.router.weight, std=0.02)
        self.stats, self.balance, self.loads = {}, balance, 0
        # --ep: an expert_parallel.Exchange; None in one process
        self.exchange = None
        if balance == "bias":
            # a buffer: saved and resumed, never a gradient
            self.register_buffer("bias", torch.zeros(n_experts))

    def weights(self, e):
        """Expert e's (w13, b13, w2, b2)."""
        return self.w13[e], self.b13[e], self.w2[e], self.b2[e]

    def route(self, x):
        """x (T, D) -> p (T, E), gate weights w (T, k), experts idx (T, k)."""
        probs = self.router(x).float().softmax(dim=-1)
        if self.balance == "bias":
            # the bias picks the experts; the weights stay unbiased
            idx = (probs + self.bias).topk(self.k, dim=-1).indices
            w = probs.gather(-1, idx)
        else:
            w, idx = probs.topk(self.k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        # the balance loss's f (as counts) and P
        self.counts = expert_counts(idx, self.E)
        self.mean_prob = probs.mean(0)
        f = self.counts.float() / idx.numel()
        # log.jsonl's load per expert and router entropy
        with torch.no_grad():
            ent = -(probs * probs.clamp_min(1e-9).log()).sum(-1).mean()
            self.stats = dict(load=f.detach(), entropy=ent, idx=idx.detach())
        return probs, w.to(x.dtype), idx

    def forward(self, x):
        shape = x.shape
        # (T, D): every image token of every sample
        x = x.reshape(-1, shape[-1])
        _, w, idx = self.route(x)
        if self.impl == "loop" and self.exchange is None:
            y = self.dispatch_loop(x, w, idx)
        else:
            # the T*k assignments sorted by expert (so by rank, under --ep)
            order = idx.flatten().argsort(stable=True)
            token = order // self.k  # (T*k,) each sorted row's token
            # index_select, not x[token]: on a CPU its backward sums repeated
            # rows in a fixed order; x[token]'s parallel atomics vary by run
            rows, e = x.index_select(0, token), idx.flatten()[order]
            counts = expert_counts(idx, self.E)
            if self.exchange is None:
                out = self.experts(rows, e, counts)
            else:
                out = self.exchange(self.experts, rows, counts)
            # gated, summing each token's k rows
            y = torch.zeros_like(x).index_add_(
                0, token, out * w.flatten()[order, None])
        if self.shared is not None:
            y = y + self.shared(x)
        return y.view(shape)

    # Data-dependent shapes: eager (a graph break), not recompiled. Unlike
    # torch.compiler.disable, this imports dynamo at the first call only.
    @torch._disable_dynamo
    def dispatch_loop(self, x, w, idx):
        """Per expert: mask its tokens, run it, add the gated result."""
        y = torch.zeros_like(x)
        for e in range(self.E):
            hit = idx == e  # (T, k)
            uses = hit.any(-1)  # (T,) the tokens that chose e
            if not uses.any():
                continue
            gate = (w * hit).sum(-1)[uses, None]
            y[uses] = y[uses] + gate * expert(x[uses], *self.weights(e))
        return y

    def experts(self, xs, e, counts):
        """Rows sorted by expert xs (n, D), their experts e (n,), rows per
        expert counts (E,) -> each row through its expert (n, D)."""
        if self.impl == "grouped" and self.grouped_ok(xs):
            return self.experts_grouped(xs, e, counts)
        return self.experts_sorted(xs, counts)

    @torch._disable_dynamo  # the slices' sizes are read on the host
    def experts_sorted(self, xs, counts):
        """As experts: one slice per expert."""
        counts = counts.tolist()
        out = [expert(chunk, *self.weights(e))
               for e, chunk in enumerate(xs.split(counts)) if counts[e]]
        # no row: still in the graph (--ep's backward joins)
        return torch.cat(out) if out else xs * 0

    def grouped_ok(self, x):
        """CUDA's grouped GEMM is bf16-only (fp32 takes slices); a CPU's isn't."""
        autocast = torch.is_autocast_enabled("cuda")
        dt = torch.get_autocast_dtype("cuda") if autocast else x.dtype
        return not x.is_cuda or dt == torch.bfloat16

    def experts_grouped(self, xs, e, counts):
        """As experts: two grouped GEMMs over a fixed-size buffer, no host sync."""
        # E: the experts this rank holds
        E, n, dev = len(counts), len(e), xs.device
        autocast = torch.is_autocast_enabled(dev.type)
        dt = torch.get_autocast_dtype(dev.type) if autocast else xs.dtype
        padded = (counts + ALIGN - 1) // ALIGN * ALIGN
        ends = padded.cumsum(0)
        # sorted row i, the (i - starts[e])-th of expert e's, goes to slot[i]
        starts = counts.cumsum(0) - counts
        slot = ends[e] - padded[e] + torch.arange(n, device=dev) - starts[e]
        # more rows than the padded groups can fill: a fixed shape
        size = n + E * ALIGN
        buf = xs.new_zeros(size, xs.shape[1], dtype=dt)
        buf = buf.index_copy(0, slot, xs.to(dt))
        at = torch.arange(size, device=dev)
        row_expert = torch.searchsorted(ends, at, right=True).clamp(max=E - 1)
        # rows past the last group give no output
        filled = (at < ends[-1])[:, None]
        mm = F.grouped_mm if dt == torch.bfloat16 else grouped_mm_eager
        h = mm(buf, self.w13.to(dt), offs=ends.int())
        h = h + self.b13.index_select(0, row_expert).to(dt)  # (size, 2H)
        a, b = torch.where(filled, h, 0).chunk(2, dim=-1)
        out = mm(F.silu(a) * b, self.w2.to(dt), offs=ends.int())
        out = out + self.b2.index_select(0, row_expert).to(dt)  # (size, D)
        return out[slot].to(xs.dtype)


# torch.compile's grouped_mm takes bf16 only: fp32 (a CPU) runs the GEMMs
# outside the graph, whose shapes stay fixed.
grouped_mm_eager = torch._disable_dynamo(F.grouped_mm)


def expert_counts(idx, E):
    """Assignments per expert (E,), on the device (bincount reads the host)."""
    ones = torch.ones_like(idx).flatten()
    return idx.new_zeros(E).scatter_add_(0, idx.flatten(), ones)


def default_impl(device):
    """Grouped GEMMs on CUDA, per-expert slices on a CPU."""
    return "grouped" if str(device).startswith("cuda") else "sorted"


# ---- Balance, parameter counts, upcycling ------------------------------------
def balance_loss(model, all_reduce=None):
    """Sum over the MoE layers of alpha E sum_i f_i P_i (0 if dense).

    all_reduce (dist.all_reduce under torchrun) sums f's counts over ranks:
    DDP's mean is the global batch's loss for any split. --balance bias
    adds f to `loads` for nudge_biases instead: call it right after the
    forward (--grad-ckpt routes again)."""
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.stats]
    # made on the device: a copy from the host would wait
    zero = torch.zeros((), device=next(model.parameters()).device)
    if not layers:
        return zero
    counts = torch.stack([m.counts for m in layers]).float()  # (layers, E)
    if all_reduce:
        all_reduce(counts)
    aux = []
    for m, f in zip(layers, counts / counts.sum(-1, keepdim=True)):
        if m.balance == "bias":
            m.loads = m.loads + f
        else:
            aux.append(m.alpha * m.E * (f * m.mean_prob).sum())
    return sum(aux) if aux else zero


def nudge_biases(model, rate, skip=None):
    """--balance bias, after a step: b_i += rate sign(mean load - load_i),
    loads summed over micro-batches and ranks (DeepSeek-V3: rate 0.001);
    none where `skip` (a device bool) is set."""
    with torch.no_grad():
        for m in model.modules():
            if not (isinstance(m, MoE) and m.balance == "bias"):
                continue
            step = rate * torch.sign(m.loads.mean() - m.loads)
            m.bias.add_(step if skip is None else step * (~skip).float())
            m.loads = 0


def routing_stats(model):
    """Per MoE layer: load per expert, router entropy, experts left unused."""
    stats = []
    for m in model.modules():
        if isinstance(m, MoE) and m.stats:
            load = m.stats["load"].tolist()
            entropy = round(m.stats["entropy"].item(), 4)
            rounded = [round(v, 4) for v in load]
            stats.append(dict(load=rounded, entropy=entropy, unused=load.count(0)))
    return stats


def count_params(model):
    """(total, active): all parameters (--ep: all ranks' experts), and those
    one image token uses (less E - k experts a layer)."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    def one_expert(m):
        return sum(w.numel() for w in m.weights(0))
    total = sum(p.numel() for p in model.parameters())
    total += sum((m.E - len(m.w13)) * one_expert(m) for m in layers)
    return total, total - sum((m.E - m.k) * one_expert(m) for m in layers)


@torch.no_grad()
def upcycle(model, dense_state):
    """Dense checkpoint -> MoE model (DiT-MoE's upcycling) -> tensors copied.

    Every expert a copy of the dense MLP, routers fresh, shared experts at
    zero output: the first forward is the dense model's. Routing breaks the
    symmetry: other tokens, other gradients."""
    state = model.state_dict()
    moes = {k: m for k, m in model.named_modules() if isinstance(m, MoE)}
    # they become the experts
    mlps = {f"{k}.{w}.{p}" for k in moes
            for w in ("w13", "w2") for p in ("weight", "bias")}
    if unknown := sorted(set(dense_state) - set(state) - mlps):
        raise SystemExit("--init: not a dense checkpoint of this model.py "
                         f"(tensors {', '.join(unknown[:3])} ...)")
    copied = {k: v for k, v in dense_state.items()
              if k in state and state[k].shape == v.shape}
    state.update(copied)
    for name, m in moes.items():
        w13 = dense_state[f"{name}.w13.weight"]
        w2 = dense_state[f"{name}.w2.weight"]
        if w2.shape[1] != m.hidden:
            raise SystemExit("upcycling needs experts as wide as the dense "
                             f"MLP: pass --expert-hidden {w2.shape[1]}")
        b13 = dense_state[f"{name}.w13.bias"]
        b2 = dense_state[f"{name}.w2.bias"]
        state[f"{name}.w13"] = w13.T.expand(m.E, -1, -1).clone()  # (E, D, 2H)
        state[f"{name}.b13"] = b13.expand(m.E, -1).clone()
        state[f"{name}.w2"] = w2.T.expand(m.E, -1, -1).clone()  # (E, H, D)
        state[f"{name}.b2"] = b2.expand(m.E, -1).clone()
    model.load_state_dict(state)
    return len(copied)
