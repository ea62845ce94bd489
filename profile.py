"""profile.py -- measure, don't guess: one training step timed by phase, and one flag flipped
side by side.

    python profile.py compute                        # fwd / bwd / optimiser ms, images/s, peak memory
    python profile.py compute --moe 8 --trace        # + a torch.profiler Chrome trace
    python profile.py --compare moe=0,8              # each setting in a fresh process, alternating
    python profile.py --compare moe-impl=loop,sorted --moe 8 --markdown
    python profile.py --compare dist=ddp,deepspeed   # 2 ranks each: optimizer state per rank
    python profile.py full --compare data=RAW,PRE --vae V --text-cache 0   # online vs precomputed encoders

Every other flag is train.py's (the very same parser and `train_step`), so a comparison is "the
default run with one flag flipped". Each measurement runs in a fresh process, so memory is clean;
settings alternate and repeat so that a noisy neighbour hurts both alike. Results are written to
<out>/profile/*.json and Chrome traces to <out>/profile/*.trace.json (open in chrome://tracing or
Perfetto). On CPU, "peak memory" is the growth of the process's peak RSS over its RSS just before
the first step (the step's own working memory); on CUDA it is the allocator's peak.
"""
# This file keeps its name (DESIGN.md). Run from the repo root it shadows the standard library's
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


def get_args(argv=None):
    import train
    p = train.get_parser()
    p.description = "Profile one training step of train.py, or compare two settings of one flag."
    p.add_argument("mode", nargs="?", default="compute", choices=["compute", "full", "dataloader"],
                   help="compute: the model step on a fixed batch; full: the real loop (data wait, frozen encoders, "
                   "forward, backward, optimizer); dataloader: the input pipeline alone vs the model")
    p.add_argument("--loader-batches", type=int, default=50, help="dataloader: batches timed")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak FLOP/s of the device for MFU (GPUs in "
                   "PEAK_TFLOPS are known)")
    p.add_argument("--iters", type=int, default=10, help="timed steps (after the warm-up)")
    p.add_argument("--warmup-iters", type=int, default=3, help="untimed steps first")
    p.add_argument("--trace", action="store_true", help="also write a torch.profiler Chrome trace")
    p.add_argument("--compare", default=None, help="FLAG=A,B[,C]: run each setting of a train.py flag in a fresh "
                   "process (on/off for switches such as compile=off,on; nproc=1,2 for the world size under "
                   "torchrun, 1 thread per process; dist=ddp,deepspeed with 2 ranks each) and print a ratio table")
    p.add_argument("--repeats", type=int, default=3, help="--compare: runs per setting, alternating")
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
    S["encoder"](caps)  # fill the cache
    return dict(image=torch.stack(imgs), caption=caps)


def run_steps(S, args, n, get_batch, times=None):
    """n training steps of train.py; if `times` is given, append each phase's seconds to it."""
    import torch

    import train
    for _ in range(n):
        last = [time.perf_counter()]

        def mark(phase):
            if S["dev"] == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            if times is not None:
                times.setdefault(phase, []).append(now - last[0])
            last[0] = now
        b = get_batch()
        mark("data_wait")
        x0, text, mask = train.encode_batch(S, b)  # frozen VAE + text encoder, or precomputed
        mark("encoders")
        train.train_step(S, args, x0, text, mask, mark)


def flops_per_step(S, args, batch):
    """FLOPs of one training step of the DiT (frozen encoders not counted), by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    import train
    state = {k: v.state_dict() for k, v in S.items() if k in ("model", "ema", "opt", "sched")}
    x0, text, mask = train.encode_batch(S, batch)
    with FlopCounterMode(display=False) as fc:
        train.train_step(S, args, x0, text, mask)
    for k, v in state.items():  # that step was only counted: undo it
        S[k].load_state_dict(v)
    S["step"] -= 1
    return fc.get_total_flops()


def measure(args):
    """compute | full | dataloader -> result dict (also written as JSON under <out>/profile/)."""
    import resource

    import torch

    import data
    import train
    from model import count_params
    S = train.setup(args)
    dev, B = S["dev"], args.batch_size
    batch = fixed_batch(args, S)
    res = dict(mode=args.mode, flags={k: v for k, v in vars(args).items() if k not in ("compare", "json", "markdown")},
               device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", threads=torch.get_num_threads())
    res["params"], res["active_params"] = count_params(S["model"])
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
    res.update(step_ms=1e3 * statistics.median(step), img_per_s=B * S["world"] / statistics.median(step),
               share={k: sum(v) / sum(step) for k, v in times.items()}, world=S["world"])
    if args.mode == "dataloader":
        res["loader_over_model"] = res["loader_img_per_s"] / res["img_per_s"]
    res["flops_per_step"] = flops_per_step(S, args, batch)
    res["opt_state_mb"] = sum(v.numel() * v.element_size() for st in S["opt"].state.values()
                              for v in st.values() if torch.is_tensor(v)) / 2 ** 20  # this rank's share (ZeRO)
    if S["world"] > 1 and S["engine"] is None:  # DDP communication = what the all-reduce adds: the same steps without it
        quiet = {}
        with S["fwd"].no_sync():  # (replicas drift apart from here on; nothing is saved)
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
        if S["rank"] == 0:
            prof.export_chrome_trace(res["trace"])
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    if S["rank"]:  # rank 0 reports
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
        print(f"{S['world']} ranks: communication {res['communication_ms']:.1f} ms "
              f"({100 * res['communication_share']:.1f}% of the step)")
    if S["world"] > 1:
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
    flag, values = args.compare.split("=", 1)
    values = values.split(",")
    base = strip(argv, {"--compare", "--repeats", "--json"}, {"--markdown", "--trace"})
    runs = {v: [] for v in values}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for v in values:
                extra = [] if v == "off" else [f"--{flag}"] if v == "on" else [f"--{flag}", v]
                out = os.path.join(tmp, f"{v.replace(os.sep, '_')}-{r}.json")  # (a value may be a path)
                cmd = [sys.executable, os.path.abspath(__file__), *base, *extra, "--json", out]
                env = dict(os.environ)
                if flag in ("nproc", "dist"):  # N processes x 1 thread each under torchrun (dist: 2 ranks)
                    env["OMP_NUM_THREADS"] = "1"
                    n, mode = (v, "ddp") if flag == "nproc" else ("1" if v == "none" else "2", v)
                    cmd = [sys.executable, os.path.abspath(__file__), *base, "--json", out] if n == "1" else [
                        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", n, "--master_port",
                        str(29500 + r), os.path.abspath(__file__), *base, "--dist", mode, "--json", out]
                print(f"[{r + 1}/{args.repeats}] --{flag} {v}", flush=True)
                done = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if done.returncode:
                    sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
                runs[v].append(json.load(open(out)))
    phases = ("data_wait", "encoders") * (args.mode == "full") + PHASES
    keys = [k + "_ms" for k in phases] + ["step_ms", "img_per_s", "peak_mem_mb", "opt_state_mb"]
    rows = {v: {k: statistics.median(r[k] for r in rs) for k in keys} for v, rs in runs.items()}
    ref = rows[values[0]]
    head = ([f"--{flag}"] + [k.replace("_ms", " ms") for k in keys[:len(phases) + 1]] +
            ["img/s", "peak MB", "optimizer state MB/rank", f"step ÷ {values[0]}", f"mem ÷ {values[0]}"])
    lines = []
    for v, row in rows.items():
        lo, hi = (f(r["step_ms"] for r in runs[v]) for f in (min, max))
        lines.append([v] + [f"{row[k]:.1f}" for k in keys[:len(phases)]] + [
                     f"{row['step_ms']:.1f} ({lo:.0f}–{hi:.0f})", f"{row['img_per_s']:.0f}",
                     f"{row['peak_mem_mb']:.0f}", f"{row['opt_state_mb']:.2f}", f"{row['step_ms'] / ref['step_ms']:.2f}×",
                     f"{row['peak_mem_mb'] / max(ref['peak_mem_mb'], 1e-9):.2f}×"])
    if args.markdown:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        print("\n".join("| " + " | ".join(l) + " |" for l in lines))
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
        for l in [head] + lines:
            print("  ".join(str(x).rjust(w) for x, w in zip(l, widths)))
    if flag == "nproc":  # scaling efficiency: N ranks' images/s over N times one rank's
        for v in values[1:]:
            comm = statistics.median(r["communication_share"] for r in runs[v])
            eff = rows[v]["img_per_s"] / (int(v) * rows[values[0]]["img_per_s"]) * int(values[0])
            print(f"{v} processes: scaling efficiency {100 * eff:.1f}% vs {values[0]}; communication "
                  f"{100 * comm:.1f}% of the step (step time minus the same steps under DDP no_sync)")
    if flag == "data" and args.mode == "full":  # online vs precomputed: is the whole gain the encoders' time?
        share = ref["encoders_ms"] / ref["step_ms"]  # from the table's own medians, so readers can check it
        for v in values[1:]:
            print(f"--data {v}: {ref['step_ms'] / rows[v]['step_ms']:.2f}x the images/s of {values[0]}; the frozen "
                  f"encoders were {100 * share:.1f}% of its step, so 1 / (1 - share) predicts {1 / (1 - share):.2f}x")
    dev = runs[values[0]][0]["device"]
    print(f"(median of {args.repeats} fresh processes each, {args.iters} timed steps per process, device {dev}, "
          f"{runs[values[0]][0]['threads']} threads; step = the sum of all phases, range in brackets)")
    os.makedirs(os.path.join(args.out, "profile"), exist_ok=True)
    with open(os.path.join(args.out, "profile", f"compare_{flag}.json"), "w") as f:
        json.dump(dict(flag=flag, runs=runs, medians=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    args = get_args()
    compare(args, sys.argv[1:]) if args.compare else measure(args)
