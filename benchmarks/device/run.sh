#!/usr/bin/env bash
# On the device machine, from the repository root (after prepare.sh here): the CUDA tests, the gpu
# suite on random weights of the 1.5B's shape beside the reference step and HF, a profile of the
# graph-replayed step (PROFILE=1), and the divergence tool in bf16 and fp32. Each part has its own
# time limit, so one that hangs leaves the others' output; everything lands in $OUT (log.txt, bench.tgz).
# Usage: bash benchmarks/device/run.sh [TESTS_S] [BENCH_S] [extra bench arguments...]
T_TESTS=${1:-90}; T_BENCH=${2:-240}; shift $(( $# < 2 ? $# : 2 ))
export PYTHONUNBUFFERED=1 DRAFTWISE_CACHE=/tmp/dwcache HF_HUB_OFFLINE=1
exec > >(tee -a "$OUT/log.txt") 2>&1
date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
echo "=== cuda tests"; date
timeout "$T_TESTS" python3 -m pytest -q -m cuda -p no:cacheprovider --timeout 100 -rfE tests/test_triton_rmsnorm.py \
  tests/test_static_step.py tests/test_triton_attention.py tests/test_token_tree.py tests/test_triton_linear.py \
  tests/test_triton_rotary.py tests/test_triton_silu_mul.py tests/test_triton_kv_write.py tests/test_cuda_row_invariance.py \
  tests/test_cuda_quantized.py
echo "=== gpu suite"; date
timeout "$T_BENCH" python3 -m draftwise bench --suite gpu --device cuda --load-format dummy \
  --model .gpu/qwen2.5-coder-1.5b --reference .gpu/graph_step.py --peers hf --output /tmp/bench "$@"
echo "rc $?"; date
tar czf "$OUT/bench.tgz" -C /tmp bench 2>/dev/null
[ -n "$PROFILE" ] && { echo "=== profile"; date; timeout 60 python3 benchmarks/device/profile_step.py .gpu/qwen2.5-coder-1.5b; }
echo "=== divergence"; date
for dtype in bfloat16 float32; do
  timeout 40 python3 -m draftwise divergence --model .gpu/qwen2.5-coder-1.5b --load-format dummy --device cuda \
    --dtype $dtype --tokens 24
done
date
