"""profile.py -- train.py's step timed by phase, and one flag's settings side by side.

    python profile.py compute --trace      # ms per phase, img/s, memory, MFU
    python profile.py --compare moe=0,8    # a ratio table
    python profile.py dataloader --compare data=builtin,loopback  # over HTTP
    python profile.py suite                # every claim
    python profile.py recipe               # shapes and emoji scores

Other flags are train.py's. Settings run in fresh processes (clean memory),
alternating (noise hits all alike). Results: <out>/profile/*.json.

    peak memory = allocator peak (CUDA), peak RSS - RSS at step 1 (CPU)
    MFU = DiT FLOPs per step / step time / the GPU's dense bf16 peak
"""
# This file shadows the stdlib `profile` (imported by cProfile, so torch.compile):
# imported as `profile`, it loads the real one.
import contextlib
import functools
import os
import sys

if __name__ == "profile":
    import importlib.util
    import sysconfig
    _stdlib = os.path.join(sysconfig.get_path("stdlib"), "profile.py")
    _spec = importlib.util.spec_from_file_location("profile", _stdlib)
    sys.modules["profile"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["profile"])
else:
    import itertools
    import json
    import random
    import resource
    import shutil
    import statistics
    import subprocess
    import tempfile
    import threading
    import time

    import torch
    import torch.distributed as dist
    from torch.utils.flop_counter import FlopCounterMode

    import data
    import engine
    import expert_parallel
    import train
    from data import read_json, read_text, write_json
    from model import count_params, device
    from moe import MoE
    from runfolder import atomic_write

HERE = os.path.dirname(os.path.abspath(__file__))
PHASES = ("forward", "backward", "optimizer")
CLAIMS = ("attn", "moe-impl", "moe", "ep", "compile", "compile-moe",
          "precision", "full-size", "loader")
CLAIMS_HEAD = ["| claim | measured | command | commit | machine |", "|---|---|---|---|---|"]
# result key -> (heading, format)
COLUMNS = {"step_ms": ("step ms", ".1f"), "img_per_s": ("img/s", ".0f"),
           "peak_mem_mb": ("peak MiB", ".0f"), "communication_share": ("communication", ".1%"),
           "param_mb": ("params MiB/rank", ".2f"),
           "opt_state_mb": ("optimizer state MiB/rank", ".2f"),
           "achieved_tflops": ("TFLOP/s", ".3g"), "mfu": ("MFU", ".1%"),
           "loader_img_per_s": ("loader img/s", ".0f")}
ATTENTION_WORDS = ("attention", "fmha", "flash", "cudnn")
# dense bf16 TFLOP/s (datasheets)
PEAK_TFLOPS = {"H100": 989, "H200": 989, "A100": 312, "L40S": 362, "RTX 4090": 165}


def peak_tflops(args, device_name):
    """--peak-tflops, else the table's entry for this device; None: unknown."""
    return args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in device_name), None)


# ---- Flags ----
def get_parser():
    p = train.get_parser()
    p.description = "Time train.py's step by phase, or compare settings of one flag."
    add = p.add_argument
    add("mode", nargs="?", default="compute",
        choices=["compute", "full", "dataloader", "suite", "recipe"],
        help="compute: a fixed batch; full: the real loop; dataloader: also the loader "
        "alone; suite: the claims; recipe: shapes and emoji runs")
    add("--emoji", default="data/emoji", help="recipe: the emoji set (`prepare.py emoji DIR`)")
    add("--claims", default="all", help="suite: a subset of " + ",".join(CLAIMS))
    add("--synthetic", help="random inputs C,SIDE,L,DTEXT (4,64,77,768: SD-VAE 512 px, CLIP-L)")
    add("--loader-batches", type=int, default=50, help="dataloader: batches timed")
    add("--peak-tflops", type=float, help="peak TFLOP/s for MFU (default: PEAK_TFLOPS)")
    add("--iters", type=int, default=10, help="timed steps")
    add("--warmup-iters", type=int, default=3, help="untimed steps first")
    add("--trace", action="store_true", help="write a Chrome trace")
    add("--compare", help="FLAG=A,B[,C]: a train.py flag's settings (switches: off,on); "
        "nproc=1,2: 1-thread ranks; dist, ep: 2 ranks; grad-accum keeps the batch; "
        "data=FOLDER,loopback: also over HTTP")
    add("--repeats", type=int, help="runs per setting (3; suite: 2 on GPU, 1 on CPU)")
    add("--json", help="result JSON path")
    return p


def get_args(argv=None):
    return train.get_args(argv, parser=get_parser())


# ---- Measure ----
def fixed_batch(args, run):
    """A real built-in batch: MoE routing depends on content."""
    rng, captions, images = random.Random(args.seed), [], []
    for _ in range(args.batch_size):
        caption, a = data.random_caption(rng)
        captions.append(caption)
        image = data.render(a["color"], a["shape"], a["position"], args.image_size, rng)
        images.append(data.to_tensor(image, args.image_size))
    run.encoder(captions)
    return dict(image=torch.stack(images), caption=captions)


def run_steps(run, args, n, batches, times=None, collectives=False):
    """n steps on next(batches); phase seconds into `times`."""
    # collectives' seconds since the last mark
    exchanged = [0.0]
    comm = "all_to_all" if args.ep > 1 else "communication" if collectives else None
    # A host sync in a timed GPU step raises, save where every step has one
    grouped = not args.moe or (args.moe_impl == "grouped" and args.precision == "bf16")
    check = times is not None and run.dev == "cuda" and grouped and not (
        run.engine.optimizer_partitions or args.ep > 1 or collectives)
    # only the step: the encoders may sync
    in_step = [False]

    def syncs(on):
        if check:
            torch.cuda.set_sync_debug_mode("error" if on else 0)

    for _ in range(n):
        # summed over micro-batches
        last, step = [time.perf_counter()], {}

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
            batch = next(batches)
            mark("data_wait")
            micro_batches.append(train.encode_batch(run, batch))
            mark("encoders")
        with timed_collectives(exchanged, fsdp=collectives):
            in_step[0] = True
            syncs(True)
            try:
                train.train_step(run, args, micro_batches, mark)
            finally:
                in_step[0] = False
                syncs(False)
        for phase, seconds in step.items() if times is not None else ():
            times.setdefault(phase, []).append(seconds)


@contextlib.contextmanager
def timed_collectives(seconds, fsdp=False):
    """--ep's all-to-alls (FSDP2's too) add their seconds to seconds[0]."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fsdp_calls = [(dist, "all_gather_single"), (dist, "reduce_scatter_single")]
    targets = [(expert_parallel, "all_to_all")] + fsdp_calls * fsdp
    patched = [(m, name, getattr(m, name)) for m, name in targets]

    def timed(real):
        def call(*a, **k):
            # waited for, from an idle GPU: no overlap is timed
            sync()
            t0 = time.perf_counter()
            work = real(*a, **k)
            # FSDP's are async_op=True
            if work is not None:
                work.wait()
            sync()
            seconds[0] += time.perf_counter() - t0
            return work
        return call

    for module, name, real in patched:
        setattr(module, name, timed(real))
    try:
        yield
    finally:
        for module, name, real in patched:
            setattr(module, name, real)


def measure(args):
    """compute | full | dataloader -> the result, also as JSON."""
    shape = [int(v) for v in args.synthetic.split(",")] if args.synthetic else None
    run = train.setup(args, shape=shape and (shape[0], shape[1], shape[3]))
    if shape:
        # as from precomputed shards
        g = torch.Generator().manual_seed(args.seed)
        (C, side, L, D_text), B = shape, args.batch_size
        batch = dict(latent=torch.randn(B, C, side, side, generator=g),
                     text=torch.randn(B, L, D_text, generator=g),
                     mask=torch.ones(B, L, dtype=torch.bool))
    else:
        batch = fixed_batch(args, run)
    batches = itertools.repeat(batch)
    if args.mode == "full":
        shards = data.resolve_shards(args.data, args.image_size)
        batches = data.batches(shards, args.batch_size, args.image_size, args.seed,
                               run.rank, run.world, args.workers, run.position)
    flags = {k: v for k, v in vars(args).items() if k not in ("compare", "json")}
    res = dict(mode=args.mode, flags=flags,
               device=torch.cuda.get_device_name() if run.dev == "cuda" else "cpu",
               threads=torch.get_num_threads(), world=run.world)
    res["params"], res["active_params"] = count_params(run.model)
    if args.mode == "dataloader":
        res.update(loader_alone(args))
    pages = int(read_text("/proc/self/statm").split()[1])
    rss_before = pages * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    run_steps(run, args, args.warmup_iters, batches)
    if run.dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = {}
    run_steps(run, args, args.iters, batches, times)
    if run.dev == "cuda":
        res["peak_mem_mb"] = torch.cuda.max_memory_allocated() / 2 ** 20
    else:
        max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
        res["peak_mem_mb"] = max_rss / 1024 - rss_before
    step = [sum(ts) for ts in zip(*times.values())]
    for k, v in times.items():
        res[f"{k}_ms"] = 1e3 * statistics.median(v)
    images = args.batch_size * args.grad_accum * run.world
    res.update(step_ms=1e3 * statistics.median(step),
               share={k: sum(v) / sum(step) for k, v in times.items()},
               img_per_s=images / statistics.median(step))
    if args.mode == "dataloader":
        res["loader_over_model"] = res["loader_img_per_s"] / res["img_per_s"]
    # this rank's share (ZeRO, FSDP, --ep)
    res["opt_state_mb"] = engine.optimizer_bytes(run.opt) / 2 ** 20
    res["param_mb"] = engine.held_bytes(run.model.parameters()) / 2 ** 20
    if run.engine.splits_weights:
        # FSDP: more steps, each collective timed
        timed = {}
        run_steps(run, args, args.iters, batches, timed, collectives=True)
        comm = timed["communication"]
        res["communication_ms"] = 1e3 * statistics.median(comm)
        res["communication_share"] = sum(comm) / sum(sum(v) for v in timed.values())
    elif run.world > 1 and not run.engine.optimizer_partitions:
        # DDP: vs the same steps unsynced (replicas drift; none saved)
        unsynced = {}
        with run.engine.forward.no_sync():
            run_steps(run, args, args.iters, batches, unsynced)
        alone = statistics.median(sum(ts) for ts in zip(*unsynced.values()))
        res["communication_ms"] = res["step_ms"] - 1e3 * alone
        res["communication_share"] = res["communication_ms"] / res["step_ms"]
    res["flops_per_step"] = flops_per_step(run, args, batch)
    res["achieved_tflops"] = res["flops_per_step"] / (res["step_ms"] / 1e3) / 1e12
    peak = peak_tflops(args, res["device"])
    res["mfu"] = res["achieved_tflops"] / peak if peak else None
    os.makedirs(os.path.join(args.out, "profile"), exist_ok=True)
    if args.trace:
        # which attention kernels ran: a mask keeps SDPA off flash
        from torch.profiler import ProfilerActivity, profile
        cuda = [ProfilerActivity.CUDA] * (run.dev == "cuda")
        with profile(activities=[ProfilerActivity.CPU] + cuda) as prof:
            run_steps(run, args, 2, batches)
        res["trace"] = os.path.join(args.out, "profile", f"{args.mode}.trace.json")
        kernels = prof.key_averages()
        res["attention_kernels"] = sorted(
            {e.key for e in kernels if any(w in e.key.lower() for w in ATTENTION_WORDS)})
        if run.rank == 0:
            prof.export_chrome_trace(res["trace"])
            print(kernels.table(sort_by="self_cpu_time_total", row_limit=12))
            print("attention kernels in the trace: " + ", ".join(res["attention_kernels"]))
    if run.rank == 0:
        path = os.path.join(args.out, "profile", f"{args.mode}.json")
        write_json(args.json or path, res)
        print_result(res, times)
    if run.world > 1:
        engine.leave_distributed()
    return res


# ---- --compare ----
def without_flags(argv, with_value, switches=()):
    """argv less `with_value` options, their values and `switches`."""
    values = {i + 1 for i, a in enumerate(argv) if a in with_value}
    return [a for i, a in enumerate(argv)
            if not (i in values or a.split("=")[0] in with_value or a in switches)]


def flag_args(flag, value):
    """FLAG=value as train.py flags; a switch is on or left out."""
    options = train.get_parser()._option_string_actions
    if getattr(options.get(f"--{flag}"), "nargs", None) == 0:
        return [f"--{flag}"] if value == "on" else []
    return [f"--{flag}", value]


def setting_command(args, flag, value, base, out):
    """-> (command, env) measuring FLAG=value into `out`."""
    extra = flag_args(flag, value)
    if flag == "grad-accum":
        # accum x micro-batch = --batch-size
        extra += ["--batch-size", str(args.batch_size // int(value))]
    ranks, env = "1", dict(os.environ)
    if flag in ("nproc", "dist", "ep"):
        ranks = value if flag == "nproc" else "1" if value == "none" else "2"
        engine_flag = ["--dist", value if flag == "dist" else "ddp"]
        extra = (engine_flag + extra * (flag == "ep")) * (ranks != "1")
        env["OMP_NUM_THREADS"] = "1"
    # --standalone: a free port
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", ranks]
    me = os.path.abspath(__file__)
    return [sys.executable, *torchrun * (ranks != "1"), me, *base, *extra, "--json", out], env


def compare(args, argv):
    """--compare FLAG=A,B -> (medians, table)."""
    flag, values = args.compare.split("=", 1)
    values, repeats = values.split(","), args.repeats or 3
    base = without_flags(argv, {"--compare", "--repeats", "--json"}, {"--trace"})
    runs = {v: [] for v in values}
    with tempfile.TemporaryDirectory() as tmp, loopback(args, flag, values) as served:
        for r, v in itertools.product(range(repeats), values):
            # a value may be a path
            out = os.path.join(tmp, f"{v.replace(os.sep, '_')}-{r}.json")
            cmd, env = setting_command(args, flag, served.get(v, v), base, out)
            print(f"[{r + 1}/{repeats}] --{flag} {v}", file=sys.stderr, flush=True)
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if done.returncode:
                sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
            runs[v].append(read_json(out))
    rows, text = ratio_table(args, flag, values, runs)
    run0 = runs[values[0]][0]
    text.append(f"(medians of {repeats} processes x {args.iters} steps, {run0['device']}, "
                f"{run0['threads']} threads; step = all phases (min–max))")
    print("\n".join(text), flush=True)
    os.makedirs(os.path.join(args.out, "profile"), exist_ok=True)
    write_json(os.path.join(args.out, "profile", f"compare_{flag}.json"),
               dict(flag=flag, runs=runs, medians=rows))
    return rows, "\n".join(text)


@contextlib.contextmanager
def loopback(args, flag, values):
    """data=FOLDER,loopback: FOLDER's shards over HTTP -> {"loopback": URLs}."""
    if flag != "data" or "loopback" not in values:
        yield {}
        return
    import http.server
    shards = data.resolve_shards(values[0], args.image_size)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a):
            pass
    handler = functools.partial(Quiet, directory=os.path.dirname(shards[0]))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        # each shard's URL: older folders have no manifest.json
        yield {"loopback": ",".join(base + os.path.basename(s) for s in shards)}
    finally:
        server.shutdown()
        server.server_close()


# ---- FLOPs, printing, suite, recipe ----
def flops_per_step(run, args, batch):
    """One more step's FLOPs (masked text keys count): eager, sorted dispatch (no
    FlopCounterMode formula for grouped_mm: the same matmuls)."""
    impls = {m: m.impl for m in run.model.modules() if isinstance(m, MoE)}
    forward = run.engine.forward
    for m in impls:
        m.impl = "sorted"
    run.engine.forward = run.model if args.compile else forward
    try:
        with FlopCounterMode(display=False) as counter:
            train.train_step(run, args, [train.encode_batch(run, batch)] * args.grad_accum)
    finally:
        for m, impl in impls.items():
            m.impl = impl
        run.engine.forward = forward
    return counter.get_total_flops()


def loader_alone(args):
    """The loader alone -> images/s, seconds to the first batch."""
    shards, B = data.resolve_shards(args.data, args.image_size), args.batch_size
    t0, n, first = time.perf_counter(), 0, None
    loader = data.make_loader(shards, B, args.image_size, args.seed, 0, workers=args.workers)
    for i, _ in enumerate(loader):
        if i == 0:
            t0, first = time.perf_counter(), time.perf_counter() - t0
        elif i <= args.loader_batches:
            n += B
        else:
            break
    # the first batch is not timed: it holds the start-up
    if not n:
        raise SystemExit(f"dataloader: {args.data} gave {0 if first is None else 1} batch(es) "
                         f"of --batch-size {B}; timing needs 2: lower it or add data")
    return dict(loader_img_per_s=n / (time.perf_counter() - t0), loader_first_batch_s=first)


def print_result(res, times):
    """Print measure()'s result."""
    cells = [f"{k} {res[k + '_ms']:.1f} ms ({100 * res['share'][k]:.1f}%)" for k in times]
    cells += [f"step {res['step_ms']:.1f} ms", f"{res['img_per_s']:.0f} img/s",
              f"peak {res['peak_mem_mb']:.0f} MiB",
              f"{res['params'] / 1e6:.2f}M params ({res['active_params'] / 1e6:.2f}M active)",
              f"{res['achieved_tflops'] * 1e3:.1f} GFLOP/s"]
    if res["mfu"]:
        cells.append(f"MFU {100 * res['mfu']:.1f}%")
    print(" | ".join(cells))
    if res["mode"] == "dataloader":
        print(f"loader alone {res['loader_img_per_s']:.0f} img/s = {res['loader_over_model']:.1f}x "
              f"what the model consumes; first batch after {res['loader_first_batch_s']:.2f} s")
    if "communication_ms" in res:
        print(f"{res['world']} ranks: communication {res['communication_ms']:.1f} ms "
              f"({100 * res['communication_share']:.1f}% of the step)")


def ratio_table(args, flag, values, runs):
    """-> ({value: {key: median}}, the table's lines)."""
    phases = ("data_wait", "encoders") * (args.mode == "full") + PHASES
    phases += ("all_to_all",) * (flag == "ep")
    if flag == "dist":
        # its phases hold the communication, unlike --ep's
        phases = ()
    measured = runs[values[0]][0]
    columns = {f"{k}_ms": (f"{k} ms", ".1f") for k in phases} | {
        k: c for k, c in COLUMNS.items() if measured.get(k) is not None}

    def median(rs, k):
        # --ep 1: no all_to_all (0 ms); DeepSpeed: no communication (None)
        got = [r[k] for r in rs if r.get(k) is not None]
        return statistics.median(got) if got else 0.0 if k.endswith("_ms") else None

    rows = {v: {k: median(rs, k) for k in columns} for v, rs in runs.items()}
    ref, first = rows[values[0]], values[0]
    head = [f"--{flag}", *(name for name, _ in columns.values()),
            f"step ÷ {first}", f"mem ÷ {first}"]
    text = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v, row in rows.items():
        cells = {k: "–" if row[k] is None else format(row[k], fmt)
                 for k, (_, fmt) in columns.items()}
        steps = [r["step_ms"] for r in runs[v]]
        cells["step_ms"] += " (%.0f–%.0f)" % (min(steps), max(steps))
        step = row["step_ms"] / ref["step_ms"]
        mem = row["peak_mem_mb"] / max(ref["peak_mem_mb"], 1e-9)
        line = [v, *cells.values(), f"{step:.2f}×", f"{mem:.2f}×"]
        text.append("| " + " | ".join(line) + " |")
    for v in values[1:] if flag == "nproc" else []:
        comm = statistics.median(r["communication_share"] for r in runs[v])
        eff = rows[v]["img_per_s"] / (int(v) * ref["img_per_s"]) * int(first)
        text.append(f"{v} processes: scaling efficiency {100 * eff:.1f}% vs {first}; "
                    f"communication {100 * comm:.1f}% of the step (vs DDP no_sync)")
    # precomputed data: is all the gain the encoders' time?
    precomputed = flag == "data" and args.mode == "full" and "loopback" not in values
    for v in values[1:] if precomputed else []:
        share = ref["encoders_ms"] / ref["step_ms"]
        text.append(f"--data {v}: {ref['step_ms'] / rows[v]['step_ms']:.2f}x {first}'s img/s; "
                    f"encoders were {100 * share:.1f}% of its step: 1 / (1 - share) predicts "
                    f"{1 / (1 - share):.2f}x")
    return rows, text


def claims(gpu):
    """[(key, title, profile.py arguments)] for one H100-class GPU, or tiny."""
    if gpu:
        base = "--width 384 --depth 6 --heads 6 --patch 2 --image-size 32 --batch-size 64"
        attn = [("~1k", "--image-size 64 --batch-size 32"),
                ("~4k", "--image-size 128 --batch-size 8")]
        full = "--width 768 --depth 12 --heads 12 --patch 2 --batch-size 32 --synthetic 4,64,77,768"
        full_title = "The full-size B/2 model on 4x64x64 latents, CLIP-L"
        precision, loader = "bf16", 8
    else:
        base = "--width 128 --depth 2 --heads 4 --patch 4 --image-size 32 --batch-size 32"
        attn = [("64", "--patch 4"), ("256", "--patch 2 --batch-size 8")]
        full = "--width 96 --depth 2 --heads 2 --patch 2 --batch-size 4 --synthetic 4,16,77,768"
        full_title = "Full-size inputs (4-channel latents, CLIP-L text), width 96"
        precision, loader = "fp32", 1
    base = base.split()
    moe8 = base + ["--moe", "8"]
    # on a CPU cudnn is sdpa
    attn_values = "manual,sdpa,cudnn" if gpu else "manual,sdpa"
    versus = attn_values.replace(",", " vs ")
    rows = []
    for n, size in attn:
        # `size`'s flags replace base's
        named = {a for a in size.split() if a.startswith("--")}
        rows.append(("attn", f"Attention: {versus} at {n} image tokens",
                     without_flags(base, named) + size.split(), f"attn={attn_values}"))
    rows += [
        ("moe-impl", "MoE dispatch (8 experts, top-2, 2 shared)",
         moe8, "moe-impl=loop,sorted,grouped"),
        ("moe", "Dense vs 8 experts, equal active parameters per token", base, "moe=0,8"),
        ("compile", "torch.compile, dense", base, "compile=off,on"),
        ("compile-moe", "torch.compile, 8 experts (default dispatch)", moe8,
         "compile=off,on"),
        ("precision", "fp32 vs bf16 autocast", base, "precision=fp32,bf16"),
        ("full-size", full_title, full.split(), f"precision={precision}"),
        ("loader", "Data loader vs model (built-in shapes, one process)",
         ["dataloader"] + base, f"workers={loader}")]
    # 2 ranks, a GPU each
    if not gpu or torch.cuda.device_count() > 1:
        rows.append(("ep", "Expert parallelism: 8 experts on each of 2 ranks, or 4 each (--ep 2)",
                     moe8, "ep=1,2"))
    return [(key, title, flags + ["--compare", setting]) for key, title, flags, setting in rows]


@functools.cache
def provenance():
    """-> (commit, machine) for a CLAIMS.md row."""
    def git(*a):
        return subprocess.run(["git", *a], cwd=HERE, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "?"
    commit += "-dirty" * bool(git("status", "--porcelain", "-uno"))
    info = (read_text("/proc/cpuinfo") or "").splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in info
                if line.startswith("model name")), "CPU")
    if device() == "cuda":
        name = torch.cuda.get_device_name()
    else:
        name = f"{cpu}, {torch.get_num_threads()} threads"
    return commit, f"{name}, torch {torch.__version__}"


def claims_row(claim, measured, command):
    """A CLAIMS.md row."""
    return f"| {claim} | {measured} | `{command}` | " + " | ".join(provenance()) + " |"


def write_md(path, lines):
    atomic_write(path, lambda f: f.write(("\n".join(lines) + "\n").encode()))


def summary(value, row, ref):
    """A CLAIMS.md cell: medians, ratios to `ref`'s."""
    step = row["step_ms"] / ref["step_ms"]
    mem = row["peak_mem_mb"] / max(ref["peak_mem_mb"], 1e-9)
    return (f"{value}: step {row['step_ms']:.1f} ms ({step:.2f}×), "
            f"peak {row['peak_mem_mb']:.0f} MiB ({mem:.2f}×)"
            + (f", {row['img_per_s']:.0f} img/s" if row.get("img_per_s") else "")
            + (f", MFU {row['mfu']:.1%}" if row.get("mfu") else ""))


def suite(args):
    """Each claim's ratio table, then its CLAIMS.md row."""
    gpu = device() == "cuda"
    peak = peak_tflops(args, torch.cuda.get_device_name() if gpu else "")
    repeats = args.repeats or (2 if gpu else 1)
    chosen = CLAIMS if args.claims == "all" else args.claims.split(",")
    if set(chosen) - set(CLAIMS):
        sys.exit(f"--claims {args.claims}: choose from {','.join(CLAIMS)}")
    common = ["--iters", str(args.iters), "--warmup-iters", str(args.warmup_iters),
              "--repeats", str(repeats), "--out", args.out]
    if args.peak_tflops:
        common += ["--peak-tflops", str(args.peak_tflops)]
    mfu = f"MFU against {peak} TFLOP/s (dense bf16 peak)" if peak else "peak FLOP/s unknown: no MFU"
    md = [f"## profile.py suite: {provenance()[1]}", "",
          f"{mfu}; {repeats} process(es) per setting, {args.warmup_iters} warm-up + "
          f"{args.iters} timed steps; medians, ratios to the first.", "",
          *CLAIMS_HEAD]
    for key, title, argv in claims(gpu):
        if key not in chosen:
            continue
        cmd = ["compute"] * (argv[0] != "dataloader") + argv + common
        command = "python profile.py " + " ".join(cmd)
        print(f"### {title}\n`{command}`", flush=True)
        # a failing claim (a kernel this GPU lacks) stops no other
        try:
            rows = compare(get_args(cmd), cmd)[0]
            setting = cmd[cmd.index("--compare") + 1]
            ref = rows[setting.split("=")[1].split(",")[0]]
            measured = "; ".join(summary(v, r, ref) for v, r in rows.items())
        except SystemExit as e:
            measured = f"failed: {str(e)[-300:]}".replace("\n", " ").replace("|", "/")
        md.append(claims_row(title, measured, command))
    print("\n".join(md), flush=True)
    os.makedirs(os.path.join(args.out, "profile"), exist_ok=True)
    write_md(os.path.join(args.out, "profile", "suite.md"), md)
    return md


def recipe(args, argv):
    """train.py on shapes and emoji, per --compare value -> CLAIMS rows."""
    if not os.path.exists(os.path.join(args.emoji, "names.json")):
        prepare_py = os.path.join(HERE, "prepare.py")
        subprocess.run([sys.executable, prepare_py, "emoji", args.emoji], check=True)
    flag, values = args.compare.split("=", 1) if args.compare else ("", "defaults")
    dropped = {"--compare", "--emoji", "--out", "--json", "--data"}
    base, md = without_flags(argv, dropped, {"recipe"}), list(CLAIMS_HEAD)
    for v in values.split(","):
        extra = flag_args(flag, v) if flag else []
        for name, where in (("shapes", data.BUILTIN), ("emoji", args.emoji)):
            folder = f"{name}_{v}" if flag else name
            out = os.path.join(args.out, "recipe", folder.replace(os.sep, "_"))
            flags = base + extra + ["--data", where, "--out", out]
            # the recipe's own folder
            shutil.rmtree(out, ignore_errors=True)
            command = "python train.py " + " ".join(flags)
            print("recipe: " + command, flush=True)
            start = time.time()
            subprocess.run([sys.executable, os.path.join(HERE, "train.py"), *flags], check=True)
            minutes = (time.time() - start) / 60
            with open(os.path.join(out, "log.jsonl")) as f:
                evals = [json.loads(line) for line in f if '"eval"' in line]
            final = evals[-1]["eval"]
            if name == "shapes":
                scores = f"all three {final['all']:.1%}"
            else:
                scores = (f"top-1 {final['top1']:.1%}, top-5 {final['top5']:.1%}, "
                          f"sharpness {final['sharpness']:.2f}")
            claim = f"{' '.join(base + extra) or 'defaults'}, {name}"
            md.append(claims_row(claim, f"{scores}, {minutes:.1f} min", command))
    print("\n".join(md), flush=True)
    write_md(os.path.join(args.out, "recipe", "recipe.md"), md)
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
