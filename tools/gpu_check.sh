#!/usr/bin/env bash
# The GPU check of leancompile, prepared for a lent GPU machine (one H100 or
# H200, Python 3.12 with its own CUDA build of torch, no network; see docs/gpu_check.md).
#
#   here:   tools/gpu_check.sh fetch          wheels the GPU image lacks, into .whl/ (ignored)
#   there:  tools/gpu_check.sh run [STAGE...] with .whl carried; reports under $OUT (or ./gpu-out)
#
# Stages, in the order given (default: smoke tests; one call runs at most 600 s, so flux and
# wan each get a call of their own):
#   tests   tests/test_devices.py on cuda: the trainer, the bench's eager FlowGRPO row and a
#           wrapped user loop against the host's results, bf16 LoRA under Inductor (2 min on CPU)
#   flux    leancompile bench grpo --model flux on cuda, bf16, aot_eager and inductor
#   wan     the same with --model wan
#   smoke   a tiny bench (both compilers, one round) to see that everything runs (1 min on CPU)
# Sizes: FLUX_ARGS / WAN_ARGS replace the bench's size flags (defaults below).
set -uo pipefail

# (diffusers imports importlib_metadata only on Python < 3.8: the GPU image's 3.12 needs none)
WHEELS="diffusers==0.42.1"
SIZES="--text-length 128 --group-size 4 --steps 8"
FLUX_ARGS=${FLUX_ARGS:-"--layers 2 --hidden 3072 --latent 64 $SIZES"}
WAN_ARGS=${WAN_ARGS:-"--layers 4 --hidden 1536 --latent 32 --frames 17 $SIZES"}
COMMON="--device cuda --dtype bfloat16 --compilers aot_eager,inductor --repeats 5 --json"

cd "$(dirname "$0")/.."

if [ "${1:-}" = "fetch" ]; then
    # Pure-Python wheels for the GPU image's Python 3.12 (its list of packages is in the
    # device tool's notes: it has torch, numpy, huggingface_hub, safetensors, peft, pytest).
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
        -d .whl $WHEELS || exit 1
    ls -l .whl
    exit 0
fi
if [ "${1:-}" != "run" ]; then
    sed -n 2,15p "$0"
    exit 2
fi
shift
STAGES=${*:-"smoke tests"}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/leancompile-site .whl/*.whl \
    || { echo "no wheels: run 'tools/gpu_check.sh fetch' before the call"; exit 1; }
export PYTHONPATH=$PWD:/tmp/leancompile-site
export TORCHINDUCTOR_CACHE_DIR=/tmp/leancompile-inductor PYTHONUNBUFFERED=1
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, diffusers; print('torch', torch.__version__, 'cuda',
torch.version.cuda, 'diffusers', diffusers.__version__, torch.cuda.get_device_name())"
    git log -1 --format='%H %s' 2>/dev/null
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

status=0
for stage in $STAGES; do
    start=$(date +%s)
    case $stage in
        tests)
            python3 -m pytest -q -p no:cacheprovider tests/test_devices.py -rs \
                > "$OUT/tests.log" 2>&1 ;;
        flux)
            # shellcheck disable=SC2086
            python3 -m leancompile.cli bench grpo --model flux $FLUX_ARGS $COMMON \
                > "$OUT/flux.json" 2> "$OUT/flux.log" ;;
        wan)
            # shellcheck disable=SC2086
            python3 -m leancompile.cli bench grpo --model wan $WAN_ARGS $COMMON \
                > "$OUT/wan.json" 2> "$OUT/wan.log" ;;
        smoke)
            python3 -m leancompile.cli bench grpo --device cuda --compilers aot_eager,inductor \
                --steps 2 --layers 1 --hidden 64 --latent 8 --text-length 8 --repeats 1 \
                > "$OUT/smoke.txt" 2>&1 ;;
        *)
            echo "unknown stage $stage"; exit 2 ;;
    esac
    rc=$?
    [ $rc -ne 0 ] && status=$rc
    echo "stage $stage: exit $rc in $(( $(date +%s) - start )) s"
    tail -n 25 "$OUT/$stage".* 2>/dev/null | cut -c1-240
done
exit $status
