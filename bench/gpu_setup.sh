# The device calls' common start, sourced by bench/gpu_*.sh from the repository root with $OUT set: the build's
# settings, this tree installed over the image's packages, the versions and the device written to $OUT/env.log, and
# ulptrace's CUDA extension built (so that no timed run pays its compilation).
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())" \
    | tee $OUT/env.log
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
