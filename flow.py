"""flow.py -- rectified flow in a page: interpolation, time sampling, loss, Euler sampler, CFG.

Check each line against the equations (Liu et al. 2022, "Flow Straight and Fast"; Esser et al.
2024, SD3, for the logit-normal time distribution):

    t = 0 is data, t = 1 is noise:   z_t = (1 - t) x0 + t eps,   eps ~ N(0, I)
    target velocity:                 v* = dz_t/dt = eps - x0
    loss:                            E_t,eps || v_theta(z_t, c, t) - v* ||^2
    sampling:                        integrate dx/dt = v from t = 1 to t = 0:  x <- x + (t_next - t) v
    classifier-free guidance:        v = v_u + w (v_c - v_u)          (Ho & Salimans 2022)
    time shift (SD3, sec. 5.3.2):    t' = s t / (1 + (s - 1) t)       for training times and the sampler's grid
    contrastive flow matching:       loss - lambda E || v_theta - v*~ ||^2, v*~ another sample's target
                                     (Stoica et al. 2025, arXiv 2506.05350; lambda = 0.05 there)

Because the learned paths are close to straight, a handful of Euler steps already lands near the
data (CLAIMS.md grades the default run at 1, 2, 4, 8 and 25 steps).

Reflow (the paper's second half, "2-rectified flow"): the trained flow's paths still bend where
the straight lines of independent (eps, x0) pairs cross, since v* averages the crossing
directions. Drawing pairs from the trained model itself, x0 = Euler(eps) (`sample.py --pairs`),
gives a coupling whose lines do not cross (one x0 per eps); training again on those fixed pairs
(`train.py --data PAIRS --init CKPT`: the same loss, eps the stored noise) makes the paths
straighter, so that one or two Euler steps land where 25 did. The straightness of a sampler's
paths, 0 for a straight one (the paper's S):

    S = int_0^1 E || (x1 - x0) - v(z_t, t) ||^2 dt  =  int_0^1 E || v ||^2 dt  -  E || x1 - x0 ||^2

(the second form: along an Euler path the steps' sum is x1 - x0), estimated on the sampler's own
steps, x1 = its noise and x0 = where it lands.
"""
import torch


def shift_t(t, s=1.0):
    """SD3's resolution-dependent time shift t' = s t / (1 + (s - 1) t): fixes 0 and 1, s = 1 is the
    identity, s > 1 spends more time near noise. Why: a larger image holds more pixels that see the
    same noise, so at a given t its coarse structure is still easy to read off; shifting t toward 1
    restores the signal-to-noise ratios the schedule was tuned for (SD3 used s = 3 at 1024 px)."""
    return t if s == 1 else s * t / (1 + (s - 1) * t)


def sample_t(n, dist="logit-normal", generator=None, device="cpu", shift=1.0):
    """Training times in (0, 1): uniform, or logit-normal t = sigmoid(n), n ~ N(0, 1) (SD3); then shifted."""
    if dist == "uniform":
        return shift_t(torch.rand(n, generator=generator, device=device), shift)
    return shift_t(torch.sigmoid(torch.randn(n, generator=generator, device=device)), shift)


def interpolate(x0, eps, t):
    """z_t = (1 - t) x0 + t eps, with t broadcast over (B, C, H, W)."""
    t = t.view(-1, *([1] * (x0.dim() - 1)))
    return (1 - t) * x0 + t * eps


def flow_loss(model, x0, text, mask, t, eps, contrast=0.0):
    """-> (loss, per-sample flow loss (B,)) for clean inputs x0 at times t (B,) with noise eps (B, ...).
    contrast = lambda > 0 also pushes each prediction away from another sample's target, the previous one in the batch
    (contrastive flow matching):
    || v - a ||^2 - lambda || v - b ||^2 = (1 - lambda) || v - (a - lambda b) / (1 - lambda) ||^2 + const, so the model
    regresses onto its own target moved away from another caption's. The per-sample loss (logged) is the plain one."""
    v = model(interpolate(x0, eps, t), t, text, mask).float()
    target = eps - x0  # (B, C, H, W)
    dims = tuple(range(1, x0.dim()))
    per_sample = ((v - target) ** 2).mean(dim=dims)
    if not contrast:
        return per_sample.mean(), per_sample
    other = ((v - target.roll(1, dims=0)) ** 2).mean(dim=dims)  # sample i-1's target: batches are shuffled
    return per_sample.mean() - contrast * other.mean(), per_sample


def loss_per_bin(t, per_sample, bins=4):
    """Mean loss in each of `bins` equal t-intervals (None where a bin is empty), for logging."""
    idx = (t * bins).long().clamp(max=bins - 1)
    return [per_sample[idx == b].mean().item() if (idx == b).any() else None for b in range(bins)]


@torch.no_grad()
def euler(velocity, x, steps, shift=1.0):
    """Integrate dx/dt = velocity(x, t) from t = 1 (noise) to t = 0 (data) in `steps` Euler steps, on
    the grid the model was trained for (the training run's time shift) -> (x at t = 0, the path's
    straightness S (B,): sum_k (t_k - t_k+1) ||v_k||^2 - ||x1 - x0||^2, means over the pixels)."""
    ts = shift_t(torch.linspace(1, 0, steps + 1, device=x.device), shift)
    x1, energy = x, 0
    for t, t_next in zip(ts[:-1], ts[1:]):
        v = velocity(x, t.expand(x.shape[0]))
        x = x + (t_next - t) * v
        energy = energy + (t - t_next) * v.pow(2).flatten(1).mean(1)
    return x, energy - (x1 - x).pow(2).flatten(1).mean(1)


def cfg_velocity(model, text, mask, null_text, null_mask, w):
    """Guided velocity field: conditional and unconditional halves in one batched forward."""
    def velocity(x, t):
        both = model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([text, null_text]),
                     torch.cat([mask, null_mask])).float()
        v_c, v_u = both.chunk(2)
        return v_u + w * (v_c - v_u)
    return velocity


def null_caption(text, mask):
    """The 'no caption' input: all-zero token states with an all-False mask (same shapes)."""
    return torch.zeros_like(text), torch.zeros_like(mask)


def drop_captions(text, mask, keep):
    """Training for guidance: the null caption where keep (B,) is False (train.py drops with p = --cfg-drop)."""
    return text * keep[:, None, None], mask & keep[:, None]


@torch.no_grad()
def generate(model, encode, captions, noise, steps=25, cfg=2.0, shift=1.0):
    """Captions and their noise (B, C, H, W) at t = 1 -> (samples at t = 0, straightness (B,))."""
    text, mask = encode(captions)  # (B, L, D_text), (B, L)
    null_text, null_mask = null_caption(text, mask)
    return euler(cfg_velocity(model, text, mask, null_text, null_mask, cfg), noise, steps, shift)
