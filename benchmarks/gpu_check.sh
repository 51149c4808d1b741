#!/usr/bin/env bash
# The checks of a lent GPU machine, prepared to fit one call of the device tool
# (at most 10 minutes; a session has 15 minutes of device time in all).
#
# Parts, in this order unless named as arguments:
#   bench-gpu       benchmarks/gpu.py: plain, DDP, prepare + allreduce / sharded on
#                   one GPU (the MLP at batch 64 and 4096, GPT-2 small in bf16),
#                   host syncs and copies per step from the profiler      (<= 150 s)
#   test-gpu        the tests `make test-gpu` runs (tests/gpu and every `gpu` mark)
#                                                                          (<= 270 s)
#   bench-cpu-host  benchmarks/training.py on the machine's many-core host with
#                   CUDA hidden: the 21M MLP under DDP and prepare + allreduce /
#                   sharded, and the sleeping-backward table               (<= 150 s)
# Each part has its own timeout and log; a part that fails or runs out does not
# stop the others. Everything goes to $OUT (the device tool's folder), with
# summary.txt: one line per part (exit code, seconds) and the tests' last lines.
#
# On this machine first:   make gpu-wheels     (pyzmq for the device's Python into .whl/)
# Then the device tool:    command "bash benchmarks/gpu_check.sh", carry [".whl"]
# A dry run on a machine without CUDA (the GPU parts say so and skip):
#   INSTALL=0 PY=.venv/bin/python OUT=build/gpu-check bash benchmarks/gpu_check.sh bench-gpu
#
# INSTALL=1 (the default) installs gradhub and the wheels in .whl/ into /tmp/site
# over the machine's own torch (no index: the device machine has no network).
# The tests run with `-W default` (over pyproject's filterwarnings = error): the
# device's torch is another version than the pinned one, whose deprecation
# warnings would fail unrelated tests. A part that runs out gets SIGINT (pytest
# then prints what ran and ends its rank processes), SIGKILL 15 s later.
set -u
OUT=${OUT:-build/gpu-check}
PY=${PY:-python3}
mkdir -p "$OUT"
summary="$OUT/summary.txt"
: > "$summary"

if [ "${INSTALL:-1}" = 1 ]; then
    if ! { "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
        "$PY" -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site .; } \
        > "$OUT/install.log" 2>&1; then
        echo "install: failed (see install.log)" | tee -a "$summary"
        exit 1
    fi
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi

{
    nvidia-smi -L 2>&1 || echo "no nvidia-smi"
    nproc
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} > "$OUT/machine.txt" 2>&1

part() { # name, seconds, command...
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout --signal=INT --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc in $(($(date +%s) - start)) s" | tee -a "$summary"
}

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(bench-gpu test-gpu bench-cpu-host)
for name in "${parts[@]}"; do
    case $name in
    bench-gpu)
        part bench-gpu 150 "$PY" benchmarks/gpu.py --rounds 5 --steps 4 --out "$OUT" ;;
    test-gpu)
        part test-gpu 270 "$PY" -m pytest -W default -rs -v --durations=15 -p no:cacheprovider \
            -m gpu tests
        tail -n 3 "$OUT/test-gpu.log" >> "$summary" ;;
    bench-cpu-host)
        part bench-cpu-host 150 env CUDA_VISIBLE_DEVICES= "$PY" benchmarks/training.py \
            --rounds 5 --steps 3 --models "MLP 21M" \
            --methods "prepare + allreduce,prepare + sharded" --out "$OUT" ;;
    *)
        echo "$name: unknown part (bench-gpu, test-gpu, bench-cpu-host)" | tee -a "$summary" ;;
    esac
done
