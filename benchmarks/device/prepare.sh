#!/usr/bin/env bash
# Fill .gpu/ (ignored) with what a device run needs and cannot fetch there: the 1.5B's and 0.5B's
# config.json + tokenizer (no weights: --load-format dummy), the reference step, and wheels of the
# packages the device image lacks. Run here, in the repository root, once a session:
#   bash benchmarks/device/prepare.sh && echo /.gpu/ >> .git/info/exclude
# then on the device (the `device` tool's run, carry [".gpu"]): bash benchmarks/device/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .gpu/whl
for model in qwen2.5-coder-1.5b qwen2.5-coder-0.5b; do
  folder=$(python -c "from draftwise.loading.resolve import resolve_model; print(resolve_model('$model', load_format='dummy'))")
  mkdir -p ".gpu/$model" && cp "$folder"/{config.json,tokenizer.json,tokenizer_config.json} ".gpu/$model/"
done
cp ../shared/gpu/graph_step.py .gpu/
# The image has torch, triton, transformers, tokenizers, numpy; draftwise's CLI also imports these.
version() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
for name in gguf llguidance pydantic pydantic_core annotated_types typing_inspection typing_extensions; do
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl "$name==$(version "$name")"
done
du -sh .gpu
