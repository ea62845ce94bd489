"""moe.py -- DiT-MoE's sparse MLP: router, experts, shared experts, balancing, three dispatches.

A mixture of experts replaces one big MLP by E smaller ones and lets each token use only k of them (Shazeer et
al. 2017; Switch, Fedus et al. 2021; DiT-MoE, Fei et al. 2024):

    router      p = softmax(x W_r^T)                       (T, E)  one distribution per token
    top-k       (w, idx) = topk(p, k),  w <- w / sum(w)    (T, k)  renormalised, as Mixtral: the same scale for
                                                                   any E and k, and an upcycled model starts equal
    output      y = sum_j w_j Expert_idx_j(x) + Shared(x)          shared experts see every token
    balance     L = alpha E sum_i f_i P_i                          f_i: share of the T*k assignments to expert i,
                                                                   P_i: mean router probability of i

L = alpha at uniform routing. It is not the minimum (f = (0.9, 0.1), P = (0.46, 0.54) gives 0.93 alpha), but its
gradient, through P only (f is a count), lowers each expert's probability in proportion to its load: toward balance.
alpha = 0.01 and 2 shared experts are DiT-MoE's values; by default an expert is dense_hidden / (k + shared) wide,
so a token uses as many MLP parameters as the dense model. `--balance bias` is DeepSeek-V3's loss-free balancing
instead: a per-expert bias b on the probabilities picks the top k (the gate weights stay unbiased, so no gradient
is bent), and after each step b_i += gamma sign(mean load - load_i), the loads of the whole global batch.

Three dispatches (`--moe-impl`), equal outputs and gradients: `loop`, the readable reference (per expert, mask its
tokens, run it, add back: DiT-MoE's); `sorted` (CPU default), the T*k assignments sorted by expert once, one slice
per expert, one index_add back; `grouped` (CUDA default), the same rows in a fixed-size buffer, each expert's group
padded to ALIGN rows, all experts' W13 then W2 as ONE grouped GEMM each (F.grouped_mm, torchtitan's design): its
shapes depend on (T, k, E) only, so no host sync and no recompiles. Loop and sorted read counts on the host and run
eagerly under torch.compile.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

ALIGN = 16  # grouped GEMM: rows per expert group padded to a multiple of this (16-byte aligned for bf16 and fp8)


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
        self.aux_loss, self.stats, self.balance = None, {}, balance
        if balance == "bias":  # DeepSeek-V3's loss-free balancing: a per-expert bias for the top-k choice only
            self.register_buffer("bias", torch.zeros(n_experts))  # (a buffer: saved, resumed, never a gradient)

    def weights(self, e):
        """Expert e's (w13, b13, w2, b2)."""
        return self.w13[e], self.b13[e], self.w2[e], self.b2[e]

    def route(self, x):
        """x (T, D) -> probabilities (T, E), top-k weights (T, k), expert ids (T, k); sets aux_loss."""
        probs = self.router(x).float().softmax(dim=-1)
        if self.balance == "bias":  # the bias picks the experts; the weights stay the unbiased probabilities
            idx = (probs + self.bias).topk(self.k, dim=-1).indices
            w = probs.gather(-1, idx)
        else:
            w, idx = probs.topk(self.k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        f = expert_counts(idx, self.E).float() / idx.numel()                # (E,) sums to 1
        # Switch balance loss (--balance aux); the bias needs none
        aux = self.alpha * self.E * (f * probs.mean(0)).sum()
        self.aux_loss = aux if self.balance == "aux" else probs.new_zeros(())
        with torch.no_grad():  # for log.jsonl: load per expert, router entropy
            ent = -(probs * probs.clamp_min(1e-9).log()).sum(-1).mean()
            self.stats = dict(load=f.detach(), entropy=ent, idx=idx.detach())
        return probs, w.to(x.dtype), idx

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (T, D): every image token of every sample
        _, w, idx = self.route(x)
        y = getattr(self, f"dispatch_{self.impl}")(x, w, idx)  # loop | sorted | grouped
        if self.shared is not None:
            y = y + self.shared(x)
        return y.view(shape)

    @torch.compiler.disable  # data-dependent shapes: runs eagerly (a graph break) instead of recompiling
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

    @torch.compiler.disable
    def dispatch_sorted(self, x, w, idx):
        """Fast: sort the T*k assignments by expert, one contiguous slice per expert, one scatter."""
        flat = idx.flatten()                               # (T*k,) expert of each assignment
        order = flat.argsort(stable=True)                  # assignments grouped by expert
        token = order // self.k                            # which token each sorted row came from
        xs = x.index_select(0, token)                      # (T*k, D) one gather (see dispatch_grouped)
        counts = torch.bincount(flat, minlength=self.E).tolist()
        out = torch.cat([expert(chunk, *self.weights(e))
                         for e, chunk in enumerate(xs.split(counts)) if counts[e]])
        out = out * w.flatten()[order, None]               # gate weights, in the same order
        return torch.zeros_like(x).index_add_(0, token, out)  # back to token order, summing the k

    def dispatch_grouped(self, x, w, idx):
        """GPU: the sorted rows in a fixed-size buffer, each expert's group padded to ALIGN rows, then
        W13 and W2 of all experts as one grouped GEMM each. No host sync, no data-dependent shape."""
        dt = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        if x.is_cuda and dt != torch.bfloat16:  # CUDA's grouped GEMM is bf16-only: fp32 (e.g. sampling) goes sorted
            return self.dispatch_sorted(x, w, idx)
        E, n = self.E, idx.numel()
        flat = idx.flatten()                                # (T*k,)
        order = flat.argsort(stable=True)
        token, e = order // self.k, flat[order]             # sorted rows: their token and expert
        counts = expert_counts(idx, E)                      # (E,) on the device, never read by the host
        padded = (counts + ALIGN - 1) // ALIGN * ALIGN      # group sizes rounded up
        ends = padded.cumsum(0)                             # where each padded group ends
        dest = ends[e] - padded[e] + torch.arange(n, device=x.device) - (counts.cumsum(0) - counts)[e]
        rows = n + E * ALIGN                                # > any possible sum of padded groups: fixed
        # index_select, not x[token]: its backward (index_add) sums repeated rows in a fixed order on a
        # CPU; the backward of x[...] adds them with parallel atomics there, which made runs differ
        buf = x.new_zeros(rows, x.shape[1], dtype=dt).index_copy(0, dest, x.index_select(0, token).to(dt))
        group = torch.searchsorted(ends, torch.arange(rows, device=x.device), right=True).clamp(max=E - 1)
        used = (torch.arange(rows, device=x.device) < ends[-1])[:, None]  # rows past the last group: no output
        mm = F.grouped_mm if dt == torch.bfloat16 else grouped_mm_eager
        h = mm(buf, self.w13.to(dt), offs=ends.int()) + self.b13.index_select(0, group).to(dt)  # (rows, 2H)
        a, b = torch.where(used, h, 0).chunk(2, dim=-1)
        out = mm(F.silu(a) * b, self.w2.to(dt), offs=ends.int()) + self.b2.index_select(0, group).to(dt)  # (rows, D)
        out = out[dest].to(x.dtype) * w.flatten()[order, None]  # back to the sorted rows, gate weights
        return torch.zeros_like(x).index_add_(0, token, out)


# torch.compile's shape check of grouped_mm accepts only bf16 (its fast dtype): in fp32 (the CPU) the
# two GEMMs run outside the compiled graph; the shapes stay fixed, so there is still one compile.
grouped_mm_eager = torch.compiler.disable(F.grouped_mm)


def expert_counts(idx, E):
    """Assignments per expert (E,), computed on the device (torch.bincount reads its max on the host)."""
    flat = idx.flatten()
    return torch.zeros(E, dtype=torch.long, device=idx.device).scatter_add_(0, flat, torch.ones_like(flat))


def default_impl(device):
    """The dispatch for a device: one grouped GEMM per weight on CUDA, per-expert slices on a CPU."""
    return "grouped" if str(device).startswith("cuda") else "sorted"


def balance_loss(model):
    """Sum of the balance losses of every MoE layer in `model` (0 for a dense model)."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoE) and m.aux_loss is not None]
    return sum(losses) if losses else torch.zeros(())


def count_active(model):
    """Parameters a single image token uses: total minus the (E - k) unused experts of each layer."""
    total = sum(p.numel() for p in model.parameters())
    idle = sum((m.E - m.k) * sum(w.numel() for w in m.weights(0)) for m in model.modules() if isinstance(m, MoE))
    return total - idle


@torch.no_grad()
def upcycle(model, dense_state):
    """Dense checkpoint -> MoE model (DiT-MoE's upcycling): every expert a copy of the dense MLP, the rest copied;
    routers fresh and shared experts at zero output, so the first forward equals the dense model's. Routing breaks
    the symmetry: each expert gets different tokens, hence different gradients. -> tensors copied."""
    state = model.state_dict()
    copied = {k: v for k, v in dense_state.items() if k in state and state[k].shape == v.shape}
    state.update(copied)
    for name, m in model.named_modules():
        if not isinstance(m, MoE):
            continue
        w13, w2 = dense_state[f"{name}.w13.weight"], dense_state[f"{name}.w2.weight"]
        if w2.shape[1] != m.hidden:
            raise SystemExit(f"upcycling needs experts as wide as the dense MLP: pass --expert-hidden {w2.shape[1]}")
        state[f"{name}.w13"] = w13.T.expand(m.E, -1, -1).clone()  # (E, D, 2H)
        state[f"{name}.b13"] = dense_state[f"{name}.w13.bias"].expand(m.E, -1).clone()
        state[f"{name}.w2"] = w2.T.expand(m.E, -1, -1).clone()    # (E, H, D)
        state[f"{name}.b2"] = dense_state[f"{name}.w2.bias"].expand(m.E, -1).clone()
    model.load_state_dict(state)
    return len(copied)


def nudge_biases(model, loads, rate, skip=None):
    """--balance bias, after a step: b_i += rate * sign(mean load - load_i) in every layer (DeepSeek-V3's gamma =
    0.001); loads (layers, E) summed over micro-batches and ranks; no nudge where `skip` (a device bool) is set."""
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.balance == "bias"]
    with torch.no_grad():
        for m, load in zip(layers, loads):
            step = rate * torch.sign(load.mean() - load)
            m.bias.add_(step if skip is None else step * (~skip).float())


def routing_loads(model):
    """(layers, E): the last forward's share of assignments per expert, every MoE layer (device)."""
    return torch.stack([m.stats["load"] for m in model.modules() if isinstance(m, MoE)])


def routing_stats(model):
    """Per MoE layer: load per expert (list), router entropy, experts that got no token."""
    out = []
    for m in model.modules():
        if isinstance(m, MoE) and m.stats:
            load = m.stats["load"].tolist()
            out.append(dict(load=[round(v, 4) for v in load], entropy=round(m.stats["entropy"].item(), 4),
                            unused=sum(v == 0 for v in load)))
    return out
