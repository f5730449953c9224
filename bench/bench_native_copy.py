"""What a copy and a kernel launch cost the host below Python: the floor of moving the recorder's per-value work
to C++ (issue 11: P1 is bound by per-value host work; measure before building).

A small extension, built here with ``torch.utils.cpp_extension.load_inline`` (nvcc, ninja), copies tensors with
``cudaMemcpyAsync`` into ``at::empty`` (one call per value, and eight values per call) and launches a trivial
comparison kernel (one launch per call from Python, and eight per call), and copies with a copy kernel of its own
into ``at::empty`` (one and eight values per call); torch's ``clone``, ``empty_like`` (+ ``copy_``), a bit-pattern
``bitwise_or(0)`` (an exact copy by an elementwise kernel instead of a memcpy) and a ``flatten_dense_tensors`` of
eight values are measured beside them. Per value, in microseconds of wall time, the
least mean of 5 batches (the device synchronised at each batch's end), at a decode-step size and a prefill size:

    python bench/bench_native_copy.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

_DECLARATIONS = r"""
#include <torch/extension.h>
at::Tensor memcpy_one(const at::Tensor& x);
std::vector<at::Tensor> memcpy_each(const std::vector<at::Tensor>& xs);
void compare_launch(int64_t a, int64_t b, int64_t n, int64_t out);
void compare_many(const std::vector<int64_t>& args);
at::Tensor kernel_copy_one(const at::Tensor& x);
std::vector<at::Tensor> kernel_copy_each(const std::vector<at::Tensor>& xs);
"""

_CUDA = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime.h>
at::Tensor memcpy_one(const at::Tensor& x) {
  auto y = at::empty(x.sizes(), x.options());
  cudaMemcpyAsync(y.data_ptr(), x.data_ptr(), x.nbytes(), cudaMemcpyDeviceToDevice, at::cuda::getCurrentCUDAStream());
  return y;
}
std::vector<at::Tensor> memcpy_each(const std::vector<at::Tensor>& xs) {
  std::vector<at::Tensor> out;
  out.reserve(xs.size());
  for (const auto& x : xs) out.push_back(memcpy_one(x));
  return out;
}
__global__ void differ_kernel(const unsigned short* a, const unsigned short* b, long long n, unsigned long long* out) {
  unsigned long long c = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    c += a[i] != b[i];
  if (c) atomicAdd(out, c);
}
void compare_launch(int64_t a, int64_t b, int64_t n, int64_t out) {
  int blocks = (int)std::min<long long>((n + 255) / 256, 1024);
  differ_kernel<<<blocks, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      (const unsigned short*)a, (const unsigned short*)b, n, (unsigned long long*)out);
}
void compare_many(const std::vector<int64_t>& args) {
  for (size_t i = 0; i + 3 < args.size(); i += 4) compare_launch(args[i], args[i + 1], args[i + 2], args[i + 3]);
}
__global__ void copy16_kernel(const uint4* src, uint4* dst, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dst[i] = src[i];
}
// a contiguous tensor's bytes copied by a kernel (16 bytes a thread) instead of cudaMemcpyAsync
at::Tensor kernel_copy_one(const at::Tensor& x) {
  auto y = at::empty(x.sizes(), x.options());
  long long n = x.nbytes() / 16;  // the bench's tensors are 16-byte multiples
  int blocks = (int)std::min<long long>((n + 255) / 256, 1056);
  copy16_kernel<<<blocks, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      (const uint4*)x.data_ptr(), (uint4*)y.data_ptr(), n);
  return y;
}
std::vector<at::Tensor> kernel_copy_each(const std::vector<at::Tensor>& xs) {
  std::vector<at::Tensor> out;
  out.reserve(xs.size());
  for (const auto& x : xs) out.push_back(kernel_copy_one(x));
  return out;
}
"""


def per_value(fn, calls: int, values: int = 1) -> float:
    """Least mean wall time per value in microseconds over 5 batches of ``calls`` calls of ``values`` values."""
    fn()
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls / values * 1e6)
    return best


def _cases(ext, shape: tuple[int, ...]) -> dict[str, tuple]:
    """name -> (function, calls per batch, values per call) for BF16 tensors of ``shape``."""
    x = torch.randn(shape, device="cuda").bfloat16()
    y = x.clone()
    x16 = x.view(torch.int16)
    eight = [torch.randn(shape, device="cuda").bfloat16() for _ in range(8)]
    slot = torch.zeros(1, dtype=torch.int64, device="cuda")
    a, b, n, at = x.data_ptr(), y.data_ptr(), x.numel(), slot.data_ptr()
    return {
        "torch clone": (lambda: x.clone(), 2000, 1),
        "torch empty_like": (lambda: torch.empty_like(x), 2000, 1),
        "torch empty_like + copy_": (lambda: torch.empty_like(x).copy_(x), 2000, 1),
        "torch bit-pattern bitwise_or(0) (an elementwise kernel, views included)":
            (lambda: x.view(torch.int16).bitwise_or(0).view(torch.bfloat16), 2000, 1),
        "torch bit-pattern bitwise_or(0) on the bit view only": (lambda: x16.bitwise_or(0), 2000, 1),
        "C++ at::empty + copy kernel, one value per call": (lambda: ext.kernel_copy_one(x), 2000, 1),
        "C++ at::empty + copy kernel, 8 values per call": (lambda: ext.kernel_copy_each(eight), 250, 8),
        "torch flatten_dense_tensors of 8, per value": (lambda: torch._C._nn.flatten_dense_tensors(eight), 250, 8),
        "C++ at::empty + cudaMemcpyAsync, one value per call": (lambda: ext.memcpy_one(x), 2000, 1),
        "C++ at::empty + cudaMemcpyAsync, 8 values per call": (lambda: ext.memcpy_each(eight), 250, 8),
        "C++ kernel launch, one per call (data_ptr read each call)":
            (lambda: ext.compare_launch(x.data_ptr(), y.data_ptr(), x.numel(), at), 2000, 1),
        "C++ kernel launch, one per call": (lambda: ext.compare_launch(a, b, n, at), 2000, 1),
        "C++ kernel launch, 8 per call": (lambda: ext.compare_many([a, b, n, at] * 8), 250, 8),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA device (it measures CUDA copies and launches), but torch.cuda.is_available() is False")
    from torch.utils.cpp_extension import load_inline

    ext = load_inline("ulptrace_bench_native_copy", cpp_sources=_DECLARATIONS, cuda_sources=_CUDA,
                      functions=["memcpy_one", "memcpy_each", "compare_launch", "compare_many", "kernel_copy_one",
                                 "kernel_copy_each"],
                      extra_cuda_cflags=["-O2"])
    out: dict[str, float] = {}
    for label, shape in (("decode 8 x 1024", (8, 1024)), ("prefill 1024 x 1024", (1024, 1024))):
        for name, (fn, calls, values) in _cases(ext, shape).items():
            out[f"{name}, {label}"] = per_value(fn, calls, values)
            print(f"{out[f'{name}, {label}']:8.2f} us  {name}, {label}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "us_per_value": out}, f,
                      indent=1)


if __name__ == "__main__":
    main()
