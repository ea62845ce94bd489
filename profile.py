"""profile.py -- measure, don't guess: one training step timed by phase, and one flag flipped side by side.

    python profile.py compute                        # fwd / bwd / optimizer ms, images/s, peak memory, MFU
    python profile.py compute --moe 8 --trace        # + a torch.profiler Chrome trace
    python profile.py --compare moe=0,8              # each setting in fresh processes, alternating: a ratio table
    python profile.py --compare dist=ddp,deepspeed,fsdp  # 2 ranks each: weights and optimizer state per rank
    python profile.py --compare ep=1,2 --moe 8       # 2 ranks each: experts split, the all-to-all as its own phase
    python profile.py full --compare data=RAW,PRE --vae V --text-cache 0   # online vs precomputed encoders
    python profile.py suite                          # the one-flag comparisons, sized for this device, a table each
    python profile.py recipe --compare lr=1e-3,2e-3  # train the shapes and the emoji, each value: scores side by side

Every other flag is train.py's (the very same parser and `train_step`), so a comparison is "the default run with
one flag flipped". Each measurement runs in a fresh process, so memory is clean; settings alternate and repeat, so
a noisy neighbour hurts both alike. Results go to <out>/profile/*.json, Chrome traces to *.trace.json (open them in
Perfetto). "Peak memory" is the allocator's peak on CUDA; on a CPU, the growth of the process's peak RSS over its
RSS before the first step (the step's own working memory). MFU = the step's FLOPs (torch's FlopCounterMode on one
training step of the DiT: matmuls and attention, forward and backward; the frozen encoders not counted) / its time /
the GPU's dense bf16 peak (PEAK_TFLOPS, the datasheets'). Attention's masked text keys count as computed.
"""
# Run from the repo root, this file shadows the standard library's `profile`, which `cProfile` imports (and so do
# torch._dynamo and torch.compile). So when it is imported under that name it hands the standard module over:
# sys.modules then holds the real one, which is what `import profile` returns, and nothing heavy is imported.
import contextlib
import functools
import os
import sys

if __name__ == "profile":
    import importlib.util
    import sysconfig
    _spec = importlib.util.spec_from_file_location("profile", os.path.join(sysconfig.get_path("stdlib"), "profile.py"))
    sys.modules["profile"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["profile"])
else:  # run as a script, or imported under another name
    import json
    import random
    import resource
    import shutil
    import statistics
    import subprocess
    import tempfile
    import time

    import torch
    import torch.distributed as dist
    from torch.utils.flop_counter import FlopCounterMode

    import data
    import engine
    import expert_parallel
    import train
    from data import atomic_write, read_json, read_text, write_json
    from model import count_params, device
    from moe import MoE

PHASES = ("forward", "backward", "optimizer")
CLAIMS = ("attn", "moe-impl", "moe", "ep", "compile", "compile-moe", "precision", "full-size", "loader")
COLUMNS = {"step_ms": ("step ms", ".1f"), "img_per_s": ("img/s", ".0f"), "peak_mem_mb": ("peak MB", ".0f"),
           "communication_share": ("communication", ".1%"), "param_mb": ("params MB/rank", ".2f"),
           "opt_state_mb": ("optimizer state MB/rank", ".2f"),
           "achieved_tflops": ("TFLOP/s", ".3g"), "mfu": ("MFU", ".1%"), "loader_img_per_s": ("loader img/s", ".0f")}
ATTENTION_WORDS = ("attention", "fmha", "flash", "cudnn")  # what the kernels' names hold (aten's, cuDNN's)
PEAK_TFLOPS = {"H100": 989, "H200": 989, "A100": 312, "L40S": 362, "RTX 4090": 165}  # dense bf16, datasheets


def get_parser():
    p = train.get_parser()
    p.description = "Profile one training step of train.py, or compare two settings of one flag."
    a = p.add_argument
    a("mode", nargs="?", default="compute", choices=["compute", "full", "dataloader", "suite", "recipe"],
      help="compute: the model step on a fixed batch; full: the real loop (data wait, frozen encoders, step); "
      "dataloader: the input pipeline alone vs the model; suite: the one-flag comparisons (see CLAIMS), sized for "
      "the device found; recipe: whole training runs on the built-in shapes and the emoji, their scores and times")
    a("--emoji", default="data/emoji", help="recipe: the emoji set (`python data.py emoji DIR` writes it if missing)")
    a("--claims", default="all", help="suite: comma-separated subset of " + ",".join(CLAIMS))
    a("--synthetic", help="random inputs of shape C,SIDE,L,DTEXT instead of built-in images (e.g. 4,64,77,768: "
      "SD-VAE latents of 512 px and CLIP-L text states)")
    a("--loader-batches", type=int, default=50, help="dataloader: batches timed")
    a("--peak-tflops", type=float, help="the device's peak TFLOP/s for MFU (GPUs in PEAK_TFLOPS are known)")
    a("--iters", type=int, default=10, help="timed steps (after the warm-up)")
    a("--warmup-iters", type=int, default=3, help="untimed steps first")
    a("--trace", action="store_true", help="also write a torch.profiler Chrome trace")
    a("--compare", help="FLAG=A,B[,C]: each setting of a train.py flag in fresh processes, then a ratio table; "
      "on/off for switches (compile=off,on); nproc=1,2: ranks under torchrun, 1 thread each; dist=ddp,deepspeed,fsdp, "
      "ep=1,2: 2 ranks each; grad-accum=1,4 keeps the global batch (--batch-size / accum per micro-batch)")
    a("--repeats", type=int, help="--compare: runs per setting, alternating (default 3; suite: 2 on a GPU, 1 on CPU)")
    a("--json", help="write the result JSON here (used by --compare)")
    return p


def get_args(argv=None):
    return train.get_args(argv, parser=get_parser())


# ---- measure: one step of train.py, timed by phase, on a fixed batch or the real loop ----------------------------
def rss_mb():
    """Current resident set size of this process, MB (Linux)."""
    return int(read_text("/proc/self/statm").split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def fixed_batch(args, run):
    """One real built-in batch, encoded once: `compute` then times the model alone."""
    rng, caps, imgs = random.Random(args.seed), [], []
    for _ in range(args.batch_size):  # real images: MoE routing depends on what the tokens show
        cap, a = data.random_caption(rng)
        caps.append(cap)
        imgs.append(data.to_tensor(data.render(a["color"], a["shape"], a["position"], args.image_size, rng),
                                   args.image_size))
    run.encoder(caps)  # fill the cache
    return dict(image=torch.stack(imgs), caption=caps)


def run_steps(run, args, n, get_batch, times=None, collectives=False):
    """n training steps of train.py; if `times` is given, append each phase's seconds to it (--ep's all-to-alls and,
    with `collectives`, FSDP's all-gathers and reduce-scatters: a phase of their own, out of the phase they ran in)."""
    exchanged = [0.0]  # seconds in those collectives since the last mark
    comm = "all_to_all" if args.ep > 1 else "communication" if collectives else None
    # a timed step on a GPU never waits for the device: a host sync inside it raises (the marks' own syncs aside).
    # Unchecked: DeepSpeed reads its gradient norm, --ep its split sizes, the loop and sorted dispatches (and grouped's
    # fp32 fallback) their counts, every step; FSDP's timed collectives wait
    grouped = not args.moe or (args.moe_impl == "grouped" and args.precision == "bf16")
    check = times is not None and run.dev == "cuda" and grouped and not (
        run.engine.partitioned or args.ep > 1 or collectives)
    in_step = [False]  # (only the step is checked: the frozen encoders between its marks may sync)

    def syncs(on):
        if check:
            torch.cuda.set_sync_debug_mode("error" if on else 0)
    for _ in range(n):
        last, step = [time.perf_counter()], {}  # seconds per phase in this step (summed over micro-batches)

        def mark(phase):
            if run.dev == "cuda":
                syncs(False)
                torch.cuda.synchronize()
                syncs(in_step[0])
            now = time.perf_counter()
            step[phase] = step.get(phase, 0.0) + now - last[0] - exchanged[0]
            if comm:
                step[comm] = step.get(comm, 0.0) + exchanged[0]
            last[0], exchanged[0] = now, 0.0
        micro_batches = []
        for _ in range(args.grad_accum):
            batch = get_batch()
            mark("data_wait")
            micro_batches.append(train.encode_batch(run, batch))  # frozen VAE + text encoder, or precomputed
            mark("encoders")
        with timing_exchanges(exchanged, fsdp=collectives):
            in_step[0] = True
            syncs(True)
            try:
                train.train_step(run, args, micro_batches, mark)
            finally:
                in_step[0] = False
                syncs(False)
        for phase, sec in step.items() if times is not None else ():
            times.setdefault(phase, []).append(sec)


@contextlib.contextmanager
def timing_exchanges(seconds, fsdp=False):
    """Within it, every expert_parallel.all_to_all (--ep's all-to-alls, both ways) and, with `fsdp`, every all-gather and
    reduce-scatter FSDP2 issues, adds its seconds to seconds[0] (each waited for: no overlap with compute is left)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    patched = [(expert_parallel, "all_to_all")] + [(dist, "all_gather_single"), (dist, "reduce_scatter_single")] * fsdp
    reals = [getattr(module, name) for module, name in patched]

    def timed(real):
        def call(*a, **k):
            sync()  # (on a GPU the exchange is asynchronous: time it from an idle device to an idle device)
            t0 = time.perf_counter()
            work = real(*a, **k)
            if work is not None:  # (FSDP's are issued async_op=True)
                work.wait()
            sync()
            seconds[0] += time.perf_counter() - t0
            return work
        return call
    for (module, name), real in zip(patched, reals):
        setattr(module, name, timed(real))
    try:
        yield
    finally:
        for (module, name), real in zip(patched, reals):
            setattr(module, name, real)


def measure(args):
    """compute | full | dataloader -> result dict (also written as JSON under <out>/profile/)."""
    shape = [int(v) for v in args.synthetic.split(",")] if args.synthetic else None  # C, side, L, D_text
    run = train.setup(args, shape=shape and (shape[0], shape[1], shape[3]))
    if shape:  # random latents and text states, as precomputed shards would give them (the encoders are skipped)
        g, (C, side, L, D_text), B = torch.Generator().manual_seed(args.seed), shape, args.batch_size
        batch = dict(latent=torch.randn(B, C, side, side, generator=g), text=torch.randn(B, L, D_text, generator=g),
                     mask=torch.ones(B, L, dtype=torch.bool))
    else:
        batch = fixed_batch(args, run)
    get_batch = lambda: batch
    if args.mode == "full":  # the real loop: loader, text encoder (cached), the step
        stream = data.batches(data.resolve_shards(args.data, args.image_size), args.batch_size, args.image_size,
                              args.seed, run.rank, run.world, args.workers, run.position)
        get_batch = lambda: next(stream)
    res = dict(mode=args.mode, flags={k: v for k, v in vars(args).items() if k not in ("compare", "json")},
               device=torch.cuda.get_device_name() if run.dev == "cuda" else "cpu", threads=torch.get_num_threads(),
               world=run.world)
    res["params"], res["active_params"] = count_params(run.model)
    if args.mode == "dataloader":
        res.update(loader_alone(args))
    base = rss_mb()
    run_steps(run, args, args.warmup_iters, get_batch)
    if run.dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = {}
    run_steps(run, args, args.iters, get_batch, times)
    res["peak_mem_mb"] = torch.cuda.max_memory_allocated() / 2 ** 20 if run.dev == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    step = [sum(ts) for ts in zip(*times.values())]
    res.update({f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()})
    res.update(step_ms=1e3 * statistics.median(step), share={k: sum(v) / sum(step) for k, v in times.items()},
               img_per_s=args.batch_size * args.grad_accum * run.world / statistics.median(step))
    if args.mode == "dataloader":
        res["loader_over_model"] = res["loader_img_per_s"] / res["img_per_s"]
    res["opt_state_mb"] = engine.optimizer_bytes(run.opt) / 2 ** 20  # this rank's share (ZeRO)
    res["param_mb"] = engine.held_bytes(run.model.parameters()) / 2 ** 20  # (--ep, FSDP: its share)
    if run.engine.sharded:  # FSDP: more steps, each collective waited for and timed (so none overlaps compute)
        timed = {}
        run_steps(run, args, args.iters, get_batch, timed, collectives=True)
        res["communication_ms"] = 1e3 * statistics.median(timed["communication"])
        res["communication_share"] = sum(timed["communication"]) / sum(sum(v) for v in timed.values())
    elif run.world > 1 and not run.engine.partitioned:  # DDP's: what its all-reduce adds (the steps without it)
        unsynced = {}
        with run.engine.forward.no_sync():  # (replicas drift apart from here on; nothing is saved)
            run_steps(run, args, args.iters, get_batch, unsynced)
        res["communication_ms"] = res["step_ms"] - 1e3 * statistics.median(sum(ts) for ts in zip(*unsynced.values()))
        res["communication_share"] = res["communication_ms"] / res["step_ms"]
    res["flops_per_step"] = flops_per_step(run, args, batch)  # (a real step, after the timed ones)
    res["achieved_tflops"] = res["flops_per_step"] / (res["step_ms"] / 1e3) / 1e12
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in res["device"]), None)
    res["mfu"] = res["achieved_tflops"] / peak if peak else None  # unknown peak (CPUs): none claimed
    os.makedirs(os.path.join(args.out, "profile"), exist_ok=True)
    if args.trace:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (run.dev == "cuda")) as prof:
            run_steps(run, args, 2, get_batch)
        res["trace"] = os.path.join(args.out, "profile", f"{args.mode}.trace.json")
        kernels = prof.key_averages()  # which attention kernel ran (a mask keeps SDPA off flash: model.attention)
        res["attention_kernels"] = sorted({e.key for e in kernels if any(w in e.key.lower() for w in ATTENTION_WORDS)})
        if run.rank == 0:
            prof.export_chrome_trace(res["trace"])
            print(kernels.table(sort_by="self_cpu_time_total", row_limit=12))
            print("attention kernels in the trace: " + ", ".join(res["attention_kernels"]))
    if run.rank == 0:  # rank 0 reports
        write_json(args.json or os.path.join(args.out, "profile", f"{args.mode}.json"), res)
        print_result(res, times)
    if run.world > 1:
        engine.leave_distributed()
    return res


# ---- --compare FLAG=A,B: each setting in fresh processes, alternating, repeated ----------------------------------
def strip(argv, with_value, switches=()):
    """argv without the given options (and the values of those in `with_value`)."""
    values = {i + 1 for i, a in enumerate(argv) if a in with_value}
    return [a for i, a in enumerate(argv) if not (i in values or a.split("=")[0] in with_value or a in switches)]


def flag_args(flag, value):
    """FLAG=value of --compare as train.py flags: a switch is given (on) or not (off); other flags take the value."""
    switch = getattr(train.get_parser()._option_string_actions.get(f"--{flag}"), "nargs", None) == 0
    return ([f"--{flag}"] if value == "on" else []) if switch else [f"--{flag}", value]


def compare(args, argv):
    """Each value of FLAG in fresh processes, alternating -> (medians per value, the printed table)."""
    flag, values = args.compare.split("=", 1)
    values, repeats, me = values.split(","), args.repeats or 3, os.path.abspath(__file__)
    base = strip(argv, {"--compare", "--repeats", "--json"}, {"--trace"})
    runs = {v: [] for v in values}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for v in values:
                out = os.path.join(tmp, f"{v.replace(os.sep, '_')}-{r}.json")  # (a value may be a path)
                extra = flag_args(flag, v)
                if flag == "grad-accum":  # the same global batch: accum x micro-batch = --batch-size
                    extra += ["--batch-size", str(args.batch_size // int(v))]
                ranks, env = "1", dict(os.environ)
                if flag in ("nproc", "dist", "ep"):  # N processes x 1 thread each under torchrun (dist, ep: 2 ranks)
                    ranks = v if flag == "nproc" else "1" if v == "none" else "2"
                    extra = (["--dist", v if flag == "dist" else "ddp"] + extra * (flag == "ep")) * (ranks != "1")
                    env["OMP_NUM_THREADS"] = "1"
                torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", ranks]  # (a free port)
                cmd = [sys.executable, *torchrun * (ranks != "1"), me, *base, *extra, "--json", out]
                print(f"[{r + 1}/{repeats}] --{flag} {v}", file=sys.stderr, flush=True)
                done = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if done.returncode:
                    sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
                runs[v].append(read_json(out))
    rows, text = ratio_table(args, flag, values, runs)
    text.append(f"(median of {repeats} fresh processes each, {args.iters} timed steps per process, device "
                f"{runs[values[0]][0]['device']}, {runs[values[0]][0]['threads']} threads; step = the sum of all "
                f"phases, range in brackets)")
    print("\n".join(text), flush=True)
    os.makedirs(os.path.join(args.out, "profile"), exist_ok=True)
    write_json(os.path.join(args.out, "profile", f"compare_{flag}.json"), dict(flag=flag, runs=runs, medians=rows))
    return rows, "\n".join(text)


# ==== What a first read may skip: FLOP counting, the loader alone, printing, the ratio table, the suite ==========
def flops_per_step(run, args, batch):
    """FLOPs of one more training step of the DiT (frozen encoders not counted), by torch's FlopCounterMode, on the
    eager model with the sorted dispatch: the counter has no formula for grouped_mm (the same useful matmuls)."""
    impls, forward = {m: m.impl for m in run.model.modules() if isinstance(m, MoE)}, run.engine.forward
    for m in impls:
        m.impl = "sorted"
    run.engine.forward = run.model if args.compile else forward
    with FlopCounterMode(display=False) as fc:
        train.train_step(run, args, [train.encode_batch(run, batch)] * args.grad_accum)
    for m, impl in impls.items():
        m.impl = impl
    run.engine.forward = forward
    return fc.get_total_flops()


def loader_alone(args):
    """The input pipeline alone, no model running -> images/s and seconds to the first batch."""
    shards, B = data.resolve_shards(args.data, args.image_size), args.batch_size
    t0, n = time.perf_counter(), 0
    for i, b in enumerate(data.make_loader(shards, B, args.image_size, args.seed, 0, workers=args.workers)):
        if i == 0:
            t0, first = time.perf_counter(), time.perf_counter() - t0
        elif i <= args.loader_batches:
            n += B
        else:
            break
    return dict(loader_img_per_s=n / (time.perf_counter() - t0), loader_first_batch_s=first)


def print_result(res, times):
    """measure()'s result, a few lines for a reader."""
    print(" | ".join(f"{k} {res[k + '_ms']:.1f} ms ({100 * res['share'][k]:.1f}%)" for k in times) + f" | step "
          f"{res['step_ms']:.1f} ms | {res['img_per_s']:.0f} img/s | peak {res['peak_mem_mb']:.0f} MB | "
          f"{res['params'] / 1e6:.2f}M params ({res['active_params'] / 1e6:.2f}M active) | "
          f"{res['achieved_tflops'] * 1e3:.1f} GFLOP/s" + (f" | MFU {100 * res['mfu']:.1f}%" if res["mfu"] else ""))
    if res["mode"] == "dataloader":
        print(f"loader alone {res['loader_img_per_s']:.0f} img/s = {res['loader_over_model']:.1f}x what the model "
              f"consumes; first batch after {res['loader_first_batch_s']:.2f} s")
    if "communication_ms" in res:
        print(f"{res['world']} ranks: communication {res['communication_ms']:.1f} ms "
              f"({100 * res['communication_share']:.1f}% of the step)")


def ratio_table(args, flag, values, runs):
    """Medians per value -> (rows {value: {key: median}}, the table's lines; ratios to the first value)."""
    phases = ("data_wait", "encoders") * (args.mode == "full") + PHASES + ("all_to_all",) * (flag == "ep")
    phases = () if flag == "dist" else phases  # (each engine's phases hold its own communication, unlike ep's)
    columns = {f"{k}_ms": (f"{k} ms", ".1f") for k in phases} | {  # result key -> (heading, format); those measured
        k: c for k, c in COLUMNS.items() if runs[values[0]][0].get(k) is not None}

    def median(rs, k):  # (a run with --ep 1 has no all_to_all phase: 0 ms; DeepSpeed's communication is not measured)
        measured = [r[k] for r in rs if r.get(k) is not None]
        return statistics.median(measured) if measured else 0.0 if k.endswith("_ms") else None
    rows = {v: {k: median(rs, k) for k in columns} for v, rs in runs.items()}
    ref = rows[values[0]]
    head = [f"--{flag}"] + [name for name, _ in columns.values()] + [f"step ÷ {values[0]}", f"mem ÷ {values[0]}"]
    lines = []
    for v, row in rows.items():
        cells = {k: "–" if row[k] is None else format(row[k], fmt) for k, (_, fmt) in columns.items()}
        cells["step_ms"] += " (%.0f–%.0f)" % tuple(f(r["step_ms"] for r in runs[v]) for f in (min, max))  # range
        lines.append([v, *cells.values(), f"{row['step_ms'] / ref['step_ms']:.2f}×",
                      f"{row['peak_mem_mb'] / max(ref['peak_mem_mb'], 1e-9):.2f}×"])
    text = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(l) + " |" for l in lines]
    for v in values[1:] if flag == "nproc" else []:  # scaling efficiency: N ranks' images/s over N times one rank's
        comm = statistics.median(r["communication_share"] for r in runs[v])
        eff = rows[v]["img_per_s"] / (int(v) * ref["img_per_s"]) * int(values[0])
        text.append(f"{v} processes: scaling efficiency {100 * eff:.1f}% vs {values[0]}; communication "
                    f"{100 * comm:.1f}% of the step (step time minus the same steps under DDP no_sync)")
    for v in values[1:] if flag == "data" and args.mode == "full" else []:  # is the whole gain the encoders' time?
        share = ref["encoders_ms"] / ref["step_ms"]  # from the table's own medians, so readers can check it
        text.append(f"--data {v}: {ref['step_ms'] / rows[v]['step_ms']:.2f}x the images/s of {values[0]}; the "
                    f"frozen encoders were {100 * share:.1f}% of its step, so 1 / (1 - share) predicts "
                    f"{1 / (1 - share):.2f}x")
    return rows, text


def claims(gpu):
    """[(key, title, profile.py arguments)]: GPU sizes for one H100-class GPU; CPU sizes run the very same code
    tiny. `ep` runs 2 ranks: on a GPU only where there are 2."""
    if gpu:
        base = "--width 384 --depth 6 --heads 6 --patch 2 --image-size 32 --batch-size 64".split()
        attn = [("~1k", "--image-size 64 --batch-size 32"), ("~4k", "--image-size 128 --batch-size 8")]
        full = "--width 768 --depth 12 --heads 12 --patch 2 --batch-size 32 --synthetic 4,64,77,768"
        full_title = "The full-size B/2 model (width 768, depth 12, 12 heads, patch 2) on 4x64x64 latents, CLIP-L"
        precision, loader = "bf16", 8  # (loader worker processes)
    else:
        base = "--width 128 --depth 2 --heads 4 --patch 4 --image-size 32 --batch-size 32".split()
        attn = [("64", "--patch 4"), ("256", "--patch 2 --batch-size 8")]
        full = "--width 96 --depth 2 --heads 2 --patch 2 --batch-size 4 --synthetic 4,16,77,768"
        full_title = "The full-size model's inputs (4-channel latents, CLIP-L-sized text) at CPU size: width 96"
        precision, loader = "fp32", 1
    over = lambda extra: strip(base, {a for a in extra if a.startswith("--")}) + extra  # base, these flags replaced
    attn_values = "manual,sdpa,cudnn" if gpu else "manual,sdpa"  # (on a CPU cudnn is sdpa)
    return [("attn", f"Attention: {attn_values.replace(',', ' vs ')} at {n} image tokens",
             over(f"{size} --compare attn={attn_values}".split())) for n, size in attn] + [
        ("moe-impl", "MoE dispatch: loop vs sorted vs grouped (8 experts, top-2, 2 shared)",
         base + ["--moe", "8", "--compare", "moe-impl=loop,sorted,grouped"]),
        ("moe", "Dense vs 8 experts at equal active parameters per token", base + ["--compare", "moe=0,8"]),
        ("compile", "torch.compile, dense", base + ["--compare", "compile=off,on"]),
        ("compile-moe", "torch.compile, 8 experts (the device's default dispatch)",
         base + ["--moe", "8", "--compare", "compile=off,on"]),
        ("precision", "fp32 vs bf16 autocast", base + ["--compare", "precision=fp32,bf16"]),
        ("full-size", full_title, full.split() + ["--compare", f"precision={precision}"]),
        ("loader", "Data loader vs the model (built-in shapes, one process)",
         ["dataloader"] + base + ["--compare", f"workers={loader}"])] + [
        ("ep", "Expert parallelism: 8 experts on each of 2 ranks, or 4 each (--ep 2)",
         base + ["--moe", "8", "--compare", "ep=1,2"])] * (not gpu or torch.cuda.device_count() > 1)  # (a GPU a rank)


@functools.cache  # (one git call a run, not a row)
def provenance():
    """-> (commit, machine) as a CLAIMS.md row names them: the short hash (-dirty: with uncommitted changes), and the
    GPU's or CPU's model with the cores and the torch version."""
    git = lambda *a: subprocess.run(["git", *a], cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True,
                                    text=True).stdout.strip()
    commit = (git("rev-parse", "--short", "HEAD") or "?") + "-dirty" * bool(git("status", "--porcelain", "-uno"))
    info = (read_text("/proc/cpuinfo") or "").splitlines()  # (Linux)
    cpu = next((l.split(":", 1)[1].strip() for l in info if l.startswith("model name")), "CPU")
    name = torch.cuda.get_device_name() if device() == "cuda" else f"{cpu}, {torch.get_num_threads()} threads"
    return commit, f"{name}, torch {torch.__version__}"


def claims_row(claim, measured, command):
    """One row of CLAIMS.md: | claim | measured | command | commit | machine |."""
    return f"| {claim} | {measured} | `{command}` | " + " | ".join(provenance()) + " |"


def suite(args):
    """Run every claim (or --claims): each prints its ratio table as it goes, then one CLAIMS.md row per claim (also
    written to <out>/profile/suite.md). A claim that fails is reported and the others still run."""
    gpu = device() == "cuda"
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if gpu and k in torch.cuda.get_device_name()),
                                    None)
    repeats, chosen = args.repeats or (2 if gpu else 1), CLAIMS if args.claims == "all" else args.claims.split(",")
    if set(chosen) - set(CLAIMS):
        sys.exit(f"--claims {args.claims}: choose from {','.join(CLAIMS)}")
    common = ["--iters", str(args.iters), "--warmup-iters", str(args.warmup_iters), "--repeats", str(repeats),
              "--out", args.out] + (["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else [])
    md = [f"## profile.py suite: {provenance()[1]}", "",
          f"{'MFU against ' + str(peak) + ' TFLOP/s (dense bf16 peak)' if peak else 'peak FLOP/s unknown: no MFU'}; "
          f"{repeats} fresh process(es) per setting, {args.warmup_iters} warm-up + {args.iters} timed steps; "
          f"medians, each setting's ratio to the first.", "", "| claim | measured | command | commit | machine |",
          "|---|---|---|---|---|"]
    for key, title, argv in claims(gpu):
        if key not in chosen:
            continue
        cmd = ["compute"] * (argv[0] != "dataloader") + argv + common
        print(f"### {title}\n`python profile.py {' '.join(cmd)}`", flush=True)
        try:
            rows, values = compare(get_args(cmd), cmd)[0], cmd[cmd.index("--compare") + 1].split("=")[1].split(",")
            ref = rows[values[0]]
            measured = "; ".join(f"{v}: step {r['step_ms']:.1f} ms ({r['step_ms'] / ref['step_ms']:.2f}×), peak "
                                 f"{r['peak_mem_mb']:.0f} MB ({r['peak_mem_mb'] / max(ref['peak_mem_mb'], 1e-9):.2f}×)"
                                 + (f", {r['img_per_s']:.0f} img/s" if r.get("img_per_s") else "")
                                 + (f", MFU {r['mfu']:.1%}" if r.get("mfu") else "") for v, r in rows.items())
        except SystemExit as e:  # one failing setting (a kernel this GPU lacks) must not lose the rest
            measured = f"failed: {str(e)[-300:]}".replace("\n", " ").replace("|", "/")
        md.append(claims_row(title, measured, "python profile.py " + " ".join(cmd)))
    print("\n".join(md), flush=True)  # (each claim's ratio table was printed as it ran)
    os.makedirs(os.path.join(args.out, "profile"), exist_ok=True)
    atomic_write(os.path.join(args.out, "profile", "suite.md"), lambda f: f.write(("\n".join(md) + "\n").encode()))
    return md


def recipe(args, argv):
    """Whole `train.py` runs with these flags (each --compare value in turn) on the built-in shapes and on the emoji
    set -> a CLAIMS.md row per run: its final scores and wall time (data, start-up and evaluation included), so a
    change of defaults is seen on both kinds of data at once. Runs go to <out>/recipe/; the rows also to recipe.md."""
    here = os.path.dirname(os.path.abspath(__file__))
    if not os.path.exists(os.path.join(args.emoji, "names.json")):  # (data.py says so if the font is missing)
        subprocess.run([sys.executable, os.path.join(here, "data.py"), "emoji", args.emoji], check=True)
    flag, values = args.compare.split("=", 1) if args.compare else ("", "defaults")
    base = strip(argv, {"--compare", "--emoji", "--out", "--json", "--data"}, {"recipe"})
    md = ["| claim | measured | command | commit | machine |", "|---|---|---|---|---|"]
    for v in values.split(","):
        extra = flag_args(flag, v) if flag else []
        for name, where in (("shapes", data.BUILTIN), ("emoji", args.emoji)):
            out = os.path.join(args.out, "recipe", f"{name}{'_' + v if flag else ''}".replace(os.sep, "_"))
            flags = base + extra + ["--data", where, "--out", out]
            shutil.rmtree(out, ignore_errors=True)  # (the recipe's own folder: each row a fresh run)
            print("recipe: python train.py " + " ".join(flags), flush=True)
            start = time.time()
            subprocess.run([sys.executable, os.path.join(here, "train.py"), *flags], check=True)
            minutes = (time.time() - start) / 60
            with open(os.path.join(out, "log.jsonl")) as f:
                final = [json.loads(line) for line in f if '"eval"' in line][-1]["eval"]
            scores = (f"all three {final['all']:.1%}" if name == "shapes" else f"top-1 {final['top1']:.1%}, top-5 "
                      f"{final['top5']:.1%}, sharpness {final['sharpness']:.2f}")
            md.append(claims_row(f"{' '.join(base + extra) or 'defaults'}, {name}", f"{scores}, {minutes:.1f} min",
                                 "python train.py " + " ".join(flags)))
    print("\n".join(md), flush=True)
    atomic_write(os.path.join(args.out, "recipe", "recipe.md"), lambda f: f.write(("\n".join(md) + "\n").encode()))
    return md


if __name__ == "__main__":
    args = get_args()
    if args.mode == "recipe":
        recipe(args, sys.argv[1:])
    elif args.mode == "suite":
        suite(args)
    elif args.compare:
        compare(args, sys.argv[1:])
    else:
        measure(args)
