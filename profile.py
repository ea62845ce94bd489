"""profile.py -- measure, don't guess: one training step timed by phase, and one flag flipped
side by side.

    python profile.py compute                        # fwd / bwd / optimiser ms, images/s, peak memory
    python profile.py compute --moe 8 --trace        # + a torch.profiler Chrome trace
    python profile.py --compare moe=0,8              # each setting in a fresh process, alternating
    python profile.py --compare moe-impl=loop,sorted --moe 8 --markdown
    python profile.py --compare dist=ddp,deepspeed   # 2 ranks each: optimizer state per rank
    python profile.py full --compare data=RAW,PRE --vae V --text-cache 0   # online vs precomputed encoders
    python profile.py suite                          # every README claim on this device: markdown tables

Every other flag is train.py's (the very same parser and `train_step`), so a comparison is "the
default run with one flag flipped". Each measurement runs in a fresh process, so memory is clean;
settings alternate and repeat so that a noisy neighbour hurts both alike. Results are written to
<out>/profile/*.json and Chrome traces to <out>/profile/*.trace.json (open in chrome://tracing or
Perfetto). On CPU, "peak memory" is the growth of the process's peak RSS over its RSS just before
the first step (the step's own working memory); on CUDA it is the allocator's peak.
"""
# This file keeps its name (the README's commands use it). Run from the repo root it shadows the standard library's
# `profile`, which `cProfile` imports (and torch._dynamo, hence torch.compile, imports cProfile).
# So when it is imported under that name, it hands the standard module over: sys.modules then
# holds the real one, which is what `import profile` returns. Nothing heavy runs at import time.
import sys

if __name__ == "profile":
    import importlib.util
    import os
    import sysconfig
    _spec = importlib.util.spec_from_file_location(
        "profile", os.path.join(sysconfig.get_paths()["stdlib"], "profile.py"))
    sys.modules["profile"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["profile"])

import json
import os
import random
import statistics
import subprocess
import tempfile
import time

PHASES = ("forward", "backward", "optimizer")
CLAIMS = ("attn", "moe-impl", "moe", "compile", "compile-moe", "precision", "full-size", "loader")


def get_args(argv=None):
    import train
    p = train.get_parser()
    p.description = "Profile one training step of train.py, or compare two settings of one flag."
    p.add_argument("mode", nargs="?", default="compute", choices=["compute", "full", "dataloader", "suite"],
                   help="compute: the model step on a fixed batch; full: the real loop (data wait, frozen encoders, "
                   "forward, backward, optimizer); dataloader: the input pipeline alone vs the model; suite: every "
                   "one-flag comparison of the README, sized for the device found (tiny on a CPU)")
    p.add_argument("--claims", default="all", help="suite: comma-separated subset of " + ",".join(CLAIMS))
    p.add_argument("--synthetic", default=None, help="compute on random inputs of shape C,SIDE,L,DTEXT instead of "
                   "built-in images (e.g. 4,64,77,768: SD-VAE latents of 512 px and CLIP-L text states)")
    p.add_argument("--loader-batches", type=int, default=50, help="dataloader: batches timed")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak FLOP/s of the device for MFU (GPUs in "
                   "PEAK_TFLOPS are known)")
    p.add_argument("--iters", type=int, default=10, help="timed steps (after the warm-up)")
    p.add_argument("--warmup-iters", type=int, default=3, help="untimed steps first")
    p.add_argument("--trace", action="store_true", help="also write a torch.profiler Chrome trace")
    p.add_argument("--compare", default=None, help="FLAG=A,B[,C]: run each setting of a train.py flag in a fresh "
                   "process (on/off for switches such as compile=off,on; nproc=1,2 for the world size under "
                   "torchrun, 1 thread per process; dist=ddp,deepspeed with 2 ranks each; grad-accum=1,4 keeps the global batch: "
                   "--batch-size / accum per micro-batch) and print a ratio table")
    p.add_argument("--repeats", type=int, default=None, help="--compare: runs per setting, alternating (default 3; "
                   "suite: 2 on a GPU, 1 on a CPU)")
    p.add_argument("--markdown", action="store_true", help="--compare: print the table as Markdown")
    p.add_argument("--json", default=None, help="write the result JSON here (used by --compare)")
    return train.get_args(argv, parser=p)


# -----------------------------------------------------------------------------------------------
# compute: forward / backward / optimiser of train.py's own step, on a real built-in batch
# -----------------------------------------------------------------------------------------------
def rss_mb():
    """Current resident set size of this process, MB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


PEAK_TFLOPS = {"H100": 989, "H200": 989, "A100": 312, "L40S": 362, "RTX 4090": 165}  # dense bf16, datasheets


def fixed_batch(args, S):
    """One real built-in batch, encoded once: `compute` then times the model alone."""
    import torch

    import data
    rng = random.Random(args.seed)
    caps, imgs = [], []
    for _ in range(args.batch_size):  # real images: MoE routing depends on what the tokens show
        cap, a = data.random_caption(rng)
        caps.append(cap)
        imgs.append(data.to_tensor(data.render(a["color"], a["shape"], a["position"], args.image_size, rng),
                                   args.image_size))
    S.encoder(caps)  # fill the cache
    return dict(image=torch.stack(imgs), caption=caps)


def run_steps(S, args, n, get_batch, times=None):
    """n training steps of train.py; if `times` is given, append each phase's seconds to it."""
    import torch

    import train
    for _ in range(n):
        last, step = [time.perf_counter()], {}  # seconds per phase in this step (summed over micro-batches)

        def mark(phase):
            if S.dev == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            step[phase] = step.get(phase, 0.0) + now - last[0]
            last[0] = now
        micro = []
        for _ in range(args.grad_accum):
            b = get_batch()
            mark("data_wait")
            micro.append(train.encode_batch(S, b))  # frozen VAE + text encoder, or precomputed
            mark("encoders")
        train.train_step(S, args, micro, mark)
        for phase, sec in step.items():
            if times is not None:
                times.setdefault(phase, []).append(sec)


def flops_per_step(S, args, batch):
    """FLOPs of one training step of the DiT (frozen encoders not counted), by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    import train
    from moe import MoE
    state = {k: getattr(S, k).state_dict() for k in ("model", "ema", "opt", "sched")}
    micro = [train.encode_batch(S, batch)] * args.grad_accum
    # the counter has no formula for grouped_mm (it counts 0): count the same matmuls of the sorted
    # dispatch instead (useful FLOPs, without the padding rows), on the eager model
    impls, fwd, bad = {m: m.impl for m in S.model.modules() if isinstance(m, MoE)}, S.fwd, S.bad
    for m in impls:
        m.impl = "sorted"
    S.fwd = S.model if args.compile else fwd
    with FlopCounterMode(display=False) as fc:
        train.train_step(S, args, micro)
    for k, v in state.items():  # that step was only counted: undo it
        getattr(S, k).load_state_dict(v)
    for m, impl in impls.items():
        m.impl = impl
    S.step, S.fwd, S.bad = S.step - 1, fwd, bad
    return fc.get_total_flops()


def measure(args):
    """compute | full | dataloader -> result dict (also written as JSON under <out>/profile/)."""
    import resource

    import torch

    import data
    import train
    from model import count_params
    shape = [int(v) for v in args.synthetic.split(",")] if args.synthetic else None  # C, side, L, D_text
    S = train.setup(args, shape=shape and (shape[0], shape[1], shape[3]))
    dev, B = S.dev, args.batch_size
    if shape:  # random latents and text states, as precomputed shards would give them (encoders skipped)
        g = torch.Generator().manual_seed(args.seed)
        batch = dict(latent=torch.randn(B, shape[0], shape[1], shape[1], generator=g), mask=torch.ones(B, shape[2], dtype=torch.bool),
                     text=torch.randn(B, shape[2], shape[3], generator=g))
    else:
        batch = fixed_batch(args, S)
    res = dict(mode=args.mode, flags={k: v for k, v in vars(args).items() if k not in ("compare", "json", "markdown")},
               device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", threads=torch.get_num_threads())
    res["params"], res["active_params"] = count_params(S.model)
    if args.mode == "full":  # the real loop: loader, text encoder (cached), the step
        shards = data.resolve_shards(args.data, args.image_size)
        it = train.batches(args, S, shards)
        get_batch = lambda: next(it)
    else:
        get_batch = lambda: batch
    if args.mode == "dataloader":  # the input pipeline alone, no model running
        shards = data.resolve_shards(args.data, args.image_size)
        t0, n = time.perf_counter(), 0
        for i, b in enumerate(data.make_loader(shards, B, args.image_size, args.seed, 0, workers=args.workers)):
            if i == 0:
                t0, first = time.perf_counter(), time.perf_counter() - t0
            elif i <= args.loader_batches:
                n += B
            else:
                break
        res.update(loader_img_per_s=n / (time.perf_counter() - t0), loader_first_batch_s=first)
    base = rss_mb()
    run_steps(S, args, args.warmup_iters, get_batch)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = {}
    run_steps(S, args, args.iters, get_batch, times)
    res["peak_mem_mb"] = torch.cuda.max_memory_allocated() / 2 ** 20 if dev == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    step = [sum(ts) for ts in zip(*times.values())]
    res.update({f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()})
    res.update(step_ms=1e3 * statistics.median(step),
               img_per_s=B * args.grad_accum * S.world / statistics.median(step),
               share={k: sum(v) / sum(step) for k, v in times.items()}, world=S.world)
    if args.mode == "dataloader":
        res["loader_over_model"] = res["loader_img_per_s"] / res["img_per_s"]
    res["flops_per_step"] = flops_per_step(S, args, batch)
    res["opt_state_mb"] = train.optimizer_bytes(S.opt) / 2 ** 20  # this rank's share (ZeRO)
    if S.world > 1 and S.engine is None:  # DDP communication = what the all-reduce adds: the same steps without it
        quiet = {}
        with S.fwd.no_sync():  # (replicas drift apart from here on; nothing is saved)
            run_steps(S, args, args.iters, get_batch, quiet)
        alone = statistics.median(sum(ts) for ts in zip(*quiet.values()))
        res["communication_ms"] = res["step_ms"] - 1e3 * alone
        res["communication_share"] = res["communication_ms"] / res["step_ms"]
    res["achieved_tflops"] = res["flops_per_step"] / (res["step_ms"] / 1e3) / 1e12
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in res["device"]), None)
    res["mfu"] = res["achieved_tflops"] / peak if peak else None  # unknown peak (CPUs): none claimed
    os.makedirs(os.path.join(args.out, "profile"), exist_ok=True)
    if args.trace:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
        with profile(activities=acts) as prof:
            run_steps(S, args, 2, get_batch)
        res["trace"] = os.path.join(args.out, "profile", f"{args.mode}.trace.json")
        if S.rank == 0:
            prof.export_chrome_trace(res["trace"])
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    if S.rank:  # rank 0 reports
        train.leave_distributed()
    with open(args.json or os.path.join(args.out, "profile", f"{args.mode}.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(" | ".join(f"{k} {v:.1f} ms ({100 * res['share'][k]:.1f}%)" for k, v in
                     ((k, res[k + "_ms"]) for k in times)) + f" | step {res['step_ms']:.1f} ms")
    print(f"{res['img_per_s']:.0f} img/s | peak {res['peak_mem_mb']:.0f} MB | {res['params'] / 1e6:.2f}M params "
          f"({res['active_params'] / 1e6:.2f}M active) | {res['achieved_tflops'] * 1e3:.1f} GFLOP/s achieved"
          + (f" | MFU {100 * res['mfu']:.1f}%" if res["mfu"] else ""))
    if args.mode == "dataloader":
        print(f"loader alone {res['loader_img_per_s']:.0f} img/s = {res['loader_over_model']:.1f}x what the model "
              f"consumes; first batch after {res['loader_first_batch_s']:.2f} s")
    if "communication_ms" in res:
        print(f"{S.world} ranks: communication {res['communication_ms']:.1f} ms "
              f"({100 * res['communication_share']:.1f}% of the step)")
    if S.world > 1:
        train.leave_distributed()
    return res


# -----------------------------------------------------------------------------------------------
# --compare FLAG=A,B: fresh processes, alternating, repeated; a ratio table
# -----------------------------------------------------------------------------------------------
def strip(argv, with_value, switches=()):
    """argv without the given options (and the values of those in `with_value`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in with_value:
            skip = True
        elif a.split("=")[0] not in with_value and a not in switches:
            out.append(a)
    return out


def compare(args, argv):
    """Each value of FLAG in fresh processes, alternating -> (medians per value, the printed table)."""
    flag, values = args.compare.split("=", 1)
    values, repeats = values.split(","), args.repeats or 3
    base = strip(argv, {"--compare", "--repeats", "--json"}, {"--markdown", "--trace"})
    runs = {v: [] for v in values}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for v in values:
                extra = [] if v == "off" else [f"--{flag}"] if v == "on" else [f"--{flag}", v]
                if flag == "grad-accum":  # the same global batch: accum x micro-batch = --batch-size
                    extra += ["--batch-size", str(args.batch_size // int(v))]
                out = os.path.join(tmp, f"{v.replace(os.sep, '_')}-{r}.json")  # (a value may be a path)
                cmd = [sys.executable, os.path.abspath(__file__), *base, *extra, "--json", out]
                env = dict(os.environ)
                if flag in ("nproc", "dist"):  # N processes x 1 thread each under torchrun (dist: 2 ranks)
                    env["OMP_NUM_THREADS"] = "1"
                    n, mode = (v, "ddp") if flag == "nproc" else ("1" if v == "none" else "2", v)
                    cmd = [sys.executable, os.path.abspath(__file__), *base, "--json", out] if n == "1" else [
                        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", n, "--master_port",
                        str(29500 + r), os.path.abspath(__file__), *base, "--dist", mode, "--json", out]
                print(f"[{r + 1}/{repeats}] --{flag} {v}", file=sys.stderr, flush=True)
                done = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if done.returncode:
                    sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
                runs[v].append(json.load(open(out)))
    phases = ("data_wait", "encoders") * (args.mode == "full") + PHASES
    first = runs[values[0]][0]
    keys = [k + "_ms" for k in phases] + ["step_ms", "img_per_s", "peak_mem_mb", "opt_state_mb", "achieved_tflops"]
    keys += ["mfu"] * (first["mfu"] is not None) + ["loader_img_per_s"] * (args.mode == "dataloader")
    rows = {v: {k: statistics.median(r[k] for r in rs) for k in keys} for v, rs in runs.items()}
    ref = rows[values[0]]
    head = ([f"--{flag}"] + [k.replace("_ms", " ms") for k in keys[:len(phases) + 1]] +
            ["img/s", "peak MB", "optimizer state MB/rank", "TFLOP/s"] + ["MFU"] * ("mfu" in keys) +
            ["loader img/s"] * (args.mode == "dataloader") + [f"step ÷ {values[0]}", f"mem ÷ {values[0]}"])
    lines = []
    for v, row in rows.items():
        lo, hi = (f(r["step_ms"] for r in runs[v]) for f in (min, max))
        lines.append([v] + [f"{row[k]:.1f}" for k in keys[:len(phases)]] + [
                     f"{row['step_ms']:.1f} ({lo:.0f}–{hi:.0f})", f"{row['img_per_s']:.0f}", f"{row['peak_mem_mb']:.0f}",
                     f"{row['opt_state_mb']:.2f}", f"{row['achieved_tflops']:.3g}"] +
                     ([f"{100 * row['mfu']:.1f}%"] if "mfu" in keys else []) +
                     ([f"{row['loader_img_per_s']:.0f}"] if args.mode == "dataloader" else []) + [f"{row['step_ms'] / ref['step_ms']:.2f}×",
                     f"{row['peak_mem_mb'] / max(ref['peak_mem_mb'], 1e-9):.2f}×"])
    if args.markdown:
        text = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(l) + " |" for l in lines]
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
        text = ["  ".join(str(x).rjust(w) for x, w in zip(l, widths)) for l in [head] + lines]
    if flag == "nproc":  # scaling efficiency: N ranks' images/s over N times one rank's
        for v in values[1:]:
            comm = statistics.median(r["communication_share"] for r in runs[v])
            eff = rows[v]["img_per_s"] / (int(v) * rows[values[0]]["img_per_s"]) * int(values[0])
            text.append(f"{v} processes: scaling efficiency {100 * eff:.1f}% vs {values[0]}; communication "
                        f"{100 * comm:.1f}% of the step (step time minus the same steps under DDP no_sync)")
    if flag == "data" and args.mode == "full":  # online vs precomputed: is the whole gain the encoders' time?
        share = ref["encoders_ms"] / ref["step_ms"]  # from the table's own medians, so readers can check it
        for v in values[1:]:
            text.append(f"--data {v}: {ref['step_ms'] / rows[v]['step_ms']:.2f}x the images/s of {values[0]}; the "
                        f"frozen encoders were {100 * share:.1f}% of its step, so 1 / (1 - share) predicts "
                        f"{1 / (1 - share):.2f}x")
    text.append(f"(median of {repeats} fresh processes each, {args.iters} timed steps per process, device "
                f"{first['device']}, {first['threads']} threads; step = the sum of all phases, range in brackets)")
    print("\n".join(text), flush=True)
    os.makedirs(os.path.join(args.out, "profile"), exist_ok=True)
    with open(os.path.join(args.out, "profile", f"compare_{flag}.json"), "w") as f:
        json.dump(dict(flag=flag, runs=runs, medians=rows), f, indent=1)
    return rows, "\n".join(text)


# -----------------------------------------------------------------------------------------------
# suite: every one-flag claim of the README at sizes that suit the device found, one table each
# -----------------------------------------------------------------------------------------------
def claims(gpu):
    """[(key, title, profile.py arguments)]: GPU sizes fill ~8 minutes of one H100-class GPU; CPU sizes
    run the very same code tiny (~5 minutes on 2 cores)."""
    if gpu:
        base = "--width 384 --depth 6 --heads 6 --patch 2 --image-size 32 --batch-size 64".split()
        attn = [("~1k", "--image-size 64 --batch-size 32"), ("~4k", "--image-size 128 --batch-size 8")]
        full = "--width 768 --depth 12 --heads 12 --patch 2 --batch-size 32 --synthetic 4,64,77,768 --compare precision=bf16"
        full_title = "The seed's full-size model (width 768, depth 12, 12 heads, patch 2) on 4x64x64 latents, CLIP-L text"
        loader = 8  # loader worker processes
    else:
        base = "--width 128 --depth 2 --heads 4 --patch 4 --image-size 32 --batch-size 32".split()
        attn = [("64", "--patch 4"), ("256", "--patch 2 --batch-size 8")]
        full = "--width 96 --depth 2 --heads 2 --patch 2 --batch-size 4 --synthetic 4,16,77,768 --compare precision=fp32"
        full_title = "The full-size model's inputs (4-channel latents, CLIP-L-sized text) at CPU size: width 96, 4x16x16"
        loader = 1
    over = lambda extra: strip(base, {a for a in extra if a.startswith("--")}) + extra  # base, these flags replaced
    out = [("attn", f"Attention: manual vs SDPA at {n} image tokens", over(size.split() + ["--compare", "attn=manual,sdpa"]))
           for n, size in attn]
    out += [("moe-impl", "MoE dispatch: loop vs sorted vs grouped (8 experts, top-2, 2 shared)",
             base + ["--moe", "8", "--compare", "moe-impl=loop,sorted,grouped"]),
            ("moe", "Dense vs 8 experts at equal active parameters per token", base + ["--compare", "moe=0,8"]),
            ("compile", "torch.compile, dense", base + ["--compare", "compile=off,on"]),
            ("compile-moe", "torch.compile, 8 experts (the device's default dispatch)",
             base + ["--moe", "8", "--compare", "compile=off,on"]),
            ("precision", "fp32 vs bf16 autocast", base + ["--compare", "precision=fp32,bf16"]),
            ("full-size", full_title, full.split()),
            ("loader", "Data loader vs the model (built-in shapes, one process)",
             ["dataloader"] + base + ["--compare", f"workers={loader}"])]
    return out


def suite(args):
    """Run every claim (or --claims), print a header and one markdown table per claim; also written
    to <out>/profile/suite.md. A claim that fails is reported and the others still run."""
    import torch

    from model import device
    gpu = device() == "cuda"
    name = torch.cuda.get_device_name() if gpu else f"CPU ({torch.get_num_threads()} threads)"
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    repeats, chosen = args.repeats or (2 if gpu else 1), CLAIMS if args.claims == "all" else args.claims.split(",")
    if set(chosen) - set(CLAIMS):
        sys.exit(f"--claims {args.claims}: choose from {','.join(CLAIMS)}")
    common = ["--iters", str(args.iters), "--warmup-iters", str(args.warmup_iters), "--repeats", str(repeats),
              "--out", args.out, "--markdown"] + (["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else [])
    md = [f"## profile.py suite: {name}", "",
          f"torch {torch.__version__}, CUDA {torch.version.cuda if gpu else 'none'}, "
          f"{'MFU against ' + str(peak) + ' TFLOP/s (dense bf16 peak)' if peak else 'peak FLOP/s unknown: no MFU'}; "
          f"{repeats} fresh process(es) per setting, {args.warmup_iters} warm-up + {args.iters} timed steps. "
          f"Command: `python profile.py suite`.", ""]
    print("\n".join(md), flush=True)
    for key, title, argv in claims(gpu):
        if key not in chosen:
            continue
        cmd = ["compute"] * (argv[0] != "dataloader") + argv + common
        head = [f"### {title}", "", "`python profile.py " + " ".join(a for a in cmd if a != "--markdown") + "`", ""]
        print("\n".join(head), flush=True)
        try:
            table = compare(get_args(cmd), cmd)[1]
        except SystemExit as e:  # one failing setting (a kernel this GPU lacks) must not lose the rest
            table = f"failed: {str(e)[-1500:]}"
            print(table, flush=True)
        md += head + [table, ""]
        print(flush=True)
    os.makedirs(os.path.join(args.out, "profile"), exist_ok=True)
    with open(os.path.join(args.out, "profile", "suite.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return md


if __name__ == "__main__":
    args = get_args()
    suite(args) if args.mode == "suite" else compare(args, sys.argv[1:]) if args.compare else measure(args)
