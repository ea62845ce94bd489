"""flow.py -- rectified flow in a page: interpolation, time sampling, loss,
Euler sampler, classifier-free guidance.

Check each line against the equations (Liu et al. 2022, "Flow Straight and
Fast"; SD3, Esser et al. 2024):

    t = 0 is data, t = 1 is noise:  z_t = (1 - t) x0 + t eps,  eps ~ N(0, I)
    target velocity:                v* = dz_t/dt = eps - x0
    loss:                           E_t,eps || v_theta(z_t, c, t) - v* ||^2
    sampling from t = 1 to 0:       x <- x + (t_next - t) v
    guidance (Ho & Salimans 2022):  v = v_u + w (v_c - v_u)
      (their w is this w - 1: w = 1 is no guidance)
    time shift (SD3, sec. 5.3.2):   t' = s t / (1 + (s - 1) t)
    contrastive flow matching:      loss - lambda E || v_theta - v*~ ||^2,
      v*~ its neighbour's target: samples 2k and 2k + 1 of the batch
      swap (Stoica et al. 2025, arXiv 2506.05350; lambda = 0.05 there)

The learned paths are close to straight, so a few Euler steps land near
the data (CLAIMS.md grades 1, 2, 4, 8 and 25 steps).

Reflow (the paper's "2-rectified flow"): the paths still bend where the
lines of independent (eps, x0) pairs cross, as v* averages the crossing
directions. Pairs from the trained model, x0 = Euler(eps) (`sample.py
--pairs`), do not cross; training again on them (`train.py --data PAIRS
--init CKPT`, eps the stored noise) straightens the paths: two Euler
steps land where 25 did. The paper's straightness, 0 if straight:

    S = int_0^1 E || (x1 - x0) - v(z_t, t) ||^2 dt
      = int_0^1 E || v ||^2 dt  -  E || x1 - x0 ||^2

(the second form as an Euler path's steps sum to x1 - x0), estimated on
the sampler's own steps, x1 its noise and x0 where it lands.

MeanFlow (Geng, Deng, Bai, Kolter, He 2025, "Mean Flows for One-step
Generative Modeling"): one run, no second stage. The network learns the
average velocity between two times r <= t instead of v at one:

    u(z_t, r, t) = 1 / (t - r) int_r^t v(z_s, s) ds,   u(z_t, t, t) = v
    jump from t to r:               z_r = z_t - (t - r) u(z_t, r, t)
    one step, noise to data:        x0 = z_1 - u(z_1, 0, 1)

Differentiating (t - r) u = int_r^t v ds in t gives the identity it
trains on, with du/dt the total derivative along the path (dz/dt = v,
dr/dt = 0, dt/dt = 1): one Jacobian-vector product along (v, 0, 1):

    u = v - (t - r) du/dt,          du/dt = v d_z u + d_t u
    guidance in the target:         v~ = w_g v + (1 - w_g) u(z_t, t, t | null)
    target (no gradient):           u* = v~ - (t - r) sg(du/dt), along v~
    loss:                           sg(w) || u - u* ||^2,
                                    w = 1 / (|| u - u* ||^2 + c)^p

r = t makes u* = v: the rectified-flow loss (with w_g = 1, p = 0).
The Euler sampler above is the same jump with v in place of u.
"""
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


def shift_t(t, s=1.0):
    """SD3's time shift t' = s t / (1 + (s - 1) t) of training times and the
    sampler's grid: it fixes 0 and 1; s > 1 spends more time near noise.
    At a given t a larger image's coarse structure is easier to read (more
    pixels carry the same signal, while the noise is independent per
    pixel); shifting t toward 1 restores the SNRs the schedule was tuned
    for (SD3: s = 3 at 1024 px)."""
    return t if s == 1 else s * t / (1 + (s - 1) * t)


def sample_t(n, dist="logit-normal", generator=None, device="cpu", shift=1.0):
    """Training times in (0, 1), then shifted: uniform, or logit-normal
    t = sigmoid(n), n ~ N(0, 1) (SD3)."""
    if dist == "uniform":
        t = torch.rand(n, generator=generator, device=device)
    else:
        # more draws in the middle: near t = 0 or 1 the velocity is easy
        # to guess (eps - x0 from an almost clean x0 or almost pure eps),
        # in between it is hardest (SD3 sec. 3.1 and 5.1: best of those tried)
        t = torch.sigmoid(torch.randn(n, generator=generator, device=device))
    return shift_t(t, shift)


def interpolate(x0, eps, t):
    """z_t = (1 - t) x0 + t eps, with t broadcast over (B, C, H, W).

    A straight line from x0 to eps at constant speed: its velocity
    dz_t/dt = eps - x0 is the same at every t, the target of the loss."""
    # (B,) -> (B, 1, 1, 1): one time per sample
    t = t.view(-1, *([1] * (x0.dim() - 1)))
    return (1 - t) * x0 + t * eps


def flow_loss(model, x0, text, mask, t, eps, contrast=0.0):
    """-> (loss, per-sample flow loss (B,)) for data x0 at times t (B,),
    noise eps. contrast = lambda > 0 also pushes each prediction v away
    from its neighbour's target b (contrastive flow matching), samples
    2k and 2k + 1 paired (B even):

        || v - a ||^2 - lambda || v - b ||^2
            = (1 - lambda) || v - (a - lambda b) / (1 - lambda) ||^2 + const,

    a regression onto its own target a, moved away from (usually) another
    caption's.
    Pairs never straddle an even cut, so any split of the global batch
    into even micro-batches and ranks gives the same pairs. The
    per-sample loss (logged) is the plain one."""
    # in fp32: under bf16 autocast the output is bf16, too coarse for a
    # loss whose squared errors shrink as training goes
    v = model(interpolate(x0, eps, t), t, text, mask).float()
    target = eps - x0
    dims = tuple(range(1, x0.dim()))
    # the mean over pixels: the loss does not grow with the picture size
    per_sample = ((v - target) ** 2).mean(dim=dims)
    if not contrast:
        return per_sample.mean(), per_sample
    if x0.shape[0] % 2:
        raise ValueError(f"contrastive flow matching pairs samples: a batch of "
                         f"{x0.shape[0]} is odd; use an even --batch-size")
    # 0 <-> 1, 2 <-> 3, ...: batches are shuffled, so usually another caption's
    swapped = target.unflatten(0, (-1, 2)).flip(1).flatten(0, 1)
    other = ((v - swapped) ** 2).mean(dim=dims)
    return per_sample.mean() - contrast * other.mean(), per_sample


def loss_per_bin(t, per_sample, bins=4):
    """Mean loss in each of `bins` equal t-intervals (None if empty)."""
    bin_of = (t * bins).long().clamp(max=bins - 1)
    return [per_sample[bin_of == b].mean().item() if (bin_of == b).any() else None
            for b in range(bins)]


@torch.no_grad()
def euler(velocity, x, steps, shift=1.0):
    """Integrate dx/dt = velocity(x, t, t_next) from t = 1 (noise) to 0
    (data) in `steps` Euler steps, on the shifted grid the model was
    trained for -> (x at t = 0, the path's straightness S (B,)), means
    over pixels:

        S = sum_k (t_k - t_k+1) ||v_k||^2 - ||x1 - x0||^2"""
    # equal steps in the shifted time: the grid the model trained on
    ts = shift_t(torch.linspace(1, 0, steps + 1, device=x.device), shift)
    x1, energy = x, 0
    for t, t_next in zip(ts[:-1], ts[1:]):
        # a MeanFlow model's v: its average velocity from t to t_next
        v = velocity(x, t.expand(x.shape[0]), t_next.expand(x.shape[0]))
        # t_next < t: a step against the velocity, from noise toward data
        x = x + (t_next - t) * v
        energy = energy + (t - t_next) * v.pow(2).flatten(1).mean(1)
    return x, energy - (x1 - x).pow(2).flatten(1).mean(1)


def cfg_velocity(model, text, mask, null_text, null_mask, w):
    """Guided velocity v_u + w (v_c - v_u): w = 1 is the captioned model
    alone; w > 1 moves further from the uncaptioned one, toward what the
    caption adds (sharper, more on-caption, less varied). A MeanFlow model
    gives u(x, r, t); rectified flow's ignores r."""
    # both halves in one batched forward: one pass of 2B, not two of B
    def velocity(x, t, r):
        if w == 1:
            # MeanFlow's one step is one forward: its guidance is trained in
            return model(x, t, text, mask, r).float()
        both = model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([text, null_text]),
                     torch.cat([mask, null_mask]), torch.cat([r, r]))
        # in fp32: w > 1 magnifies the two halves' bf16 rounding
        v_c, v_u = both.float().chunk(2)
        return v_u + w * (v_c - v_u)
    return velocity


def null_caption(text, mask):
    """'No caption': all-zero token states, an all-False mask (same shapes).

    The model then sees no text key and a zero text mean: the same null
    input in training (drop_captions) and in sampling."""
    return torch.zeros_like(text), torch.zeros_like(mask)


def drop_captions(text, mask, captioned):
    """The null caption where captioned (B,) is False (train.py's --cfg-drop)."""
    return text * captioned[:, None, None], mask & captioned[:, None]


@torch.no_grad()
def generate(model, encode, captions, noise, steps=25, cfg=2.0, shift=1.0):
    """Captions, noise (B, C, H, W) at t = 1 -> (samples at t = 0, S (B,))."""
    text, mask = encode(captions)  # (B, L, D_text), (B, L)
    null_text, null_mask = null_caption(text, mask)
    velocity = cfg_velocity(model, text, mask, null_text, null_mask, cfg)
    return euler(velocity, noise, steps, shift)


# ---- MeanFlow: one step from one run ---------------------------------
# Its paper's choices: r != t in a quarter of the draws, p = 1, c = 1e-3
C_WEIGHT = 1e-3


def sample_t_r(n, share, dist="logit-normal", generator=None, device="cpu", shift=1.0):
    """-> (t, r) (n,): in a `share` of pairs two time draws, t the later
    and r the earlier; in the rest r = t, t drawn as sample_t draws it."""
    a = sample_t(n, dist, generator, device, shift)
    b = sample_t(n, dist, generator, device, shift)
    apart = torch.rand(n, generator=generator, device=device) < share
    t = torch.where(apart, torch.maximum(a, b), a)
    return t, torch.where(apart, torch.minimum(a, b), a)


@torch.no_grad()
def time_derivative(model, z, r, t, v, text, mask):
    """du/dt = v d_z u + d_t u at (z, r, t) (B, ...): the network's change
    along the path, one forward-mode JVP along the tangent (v, 0, 1)."""
    def u(z, t):
        return model(z, t, text, mask, r)
    # forward mode computes u and du/dt in one pass (reverse mode would
    # need a backward per output). SDPA's fused kernels have no
    # forward-mode rule (pytorch#128971), its math backend has. Under
    # --precision bf16 this runs in bf16, as the forward does
    with sdpa_kernel([SDPBackend.MATH]):
        return torch.func.jvp(u, (z, t), (v, torch.ones_like(t)))[1].float()


@torch.no_grad()
def guided_velocity(model, z, t, v, text, mask, captioned, guidance):
    """v~ = w_g v + (1 - w_g) u(z_t, t, t | null) on captioned rows: the
    guided field's velocity, its unguided half the network's own (its
    null-caption output at r = t); the null-caption rows keep v, as the
    unguided field is the one they learn."""
    if guidance == 1:
        return v
    null_text, null_mask = null_caption(text, mask)
    v_null = model(z, t, null_text, null_mask, t).float()
    # (B,) -> (B, 1, 1, 1)
    captioned = captioned.view(-1, *([1] * (v.dim() - 1)))
    return torch.where(captioned, guidance * v + (1 - guidance) * v_null, v)


def meanflow_loss(model, x0, text, mask, t, r, eps, captioned=None, guidance=1.0,
                  power=1.0, target_model=None):
    """-> (loss, per-sample || u - u* ||^2 (B,)) at times r <= t (B,).

    target_model: the network that makes the target, without gradients
    (train.py: the model unwrapped, as DDP's wrapper would sync). Counting
    the r < t rows reads the device (a host sync)."""
    target_model = target_model or model
    z = interpolate(x0, eps, t)
    v_guided = guided_velocity(target_model, z, t, eps - x0, text, mask, captioned, guidance)
    target = v_guided
    # at r = t the JVP's term is 0: only the r < t rows need it
    apart = r < t
    if apart.any():
        du_dt = time_derivative(target_model, z[apart], r[apart], t[apart], v_guided[apart],
                                text[apart], mask[apart])
        gap = (t - r)[apart].view(-1, *([1] * (x0.dim() - 1)))
        target = v_guided.clone()
        target[apart] = v_guided[apart] - gap * du_dt
    u = model(z, t, text, mask, r).float()
    dims = tuple(range(1, x0.dim()))
    # the mean over pixels, as flow_loss
    per_sample = ((u - target) ** 2).mean(dim=dims)
    # the paper's adaptive weight on its squared norm, the sum over pixels
    # (so c per pixel is c / pixels): p = 1 makes the loss ~ log || u - u* ||^2,
    # so the few large errors (early, or at large t - r) do not drown the rest
    weight = (per_sample.detach() + C_WEIGHT / x0[0].numel()) ** -power
    return (weight * per_sample).mean(), per_sample
