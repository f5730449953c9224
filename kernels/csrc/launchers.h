// Host-side entry points of ulptrace's CUDA kernels.
//
// The .cu files include only CUDA headers and this file, so they compile (and can be checked with
// plain nvcc) without PyTorch; bindings.cpp validates tensors, picks the current stream and calls
// these launchers. Each launcher returns cudaSuccess or the launch error. Shapes, launch shapes
// (threads per row, vector width) and modes are chosen in Python, which also declares the FP32
// reduction tree that those launch shapes imply (see ulptrace/kernels/_common.py).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace ulptrace {

enum class DType : int { F32 = 0, F16 = 1, BF16 = 2 };

// variant: 0 = llama (round the normalised value to the input dtype, then multiply by the weight),
//          1 = zero-centred (multiply by (1 + w) in FP32, round once).
// mode:    0 = faithful (HF's rounding points), 1 = fused (FP32 inside, one final rounding).
cudaError_t launch_rms_norm(DType dtype, void* out, void* residual_out, const void* x, const void* residual,
                            const void* weight, float eps, int64_t rows, int n, int threads_per_row,
                            int vector, int variant, int mode, float* sumsq_out, cudaStream_t stream);

cudaError_t launch_glu(DType dtype, void* out, const void* gate, const void* up, int64_t numel, int vector,
                       int mode, cudaStream_t stream);

cudaError_t launch_gated_rms_norm(DType dtype, void* out, const void* x, const void* gate, const void* weight,
                                  float eps, int64_t rows, int n, int threads_per_row, int vector, int mode,
                                  float* sumsq_out, cudaStream_t stream);

// g_out is float32 in faithful mode and `dtype` in fused mode; beta_out is always `dtype`.
cudaError_t launch_gdn_gates(DType dtype, void* g_out, void* beta_out, const void* a, const void* b,
                             const float* a_log, const float* dt_bias, int64_t numel, int heads, int mode,
                             cudaStream_t stream);

// semantics: 0 = eager (HF eager_attention_forward's rounding points), 1 = sdpa (FP32 math definition).
// Strides are in elements; the head dimension is contiguous. valid (bool [B, L], row stride
// valid_stride) and lengths (int32 [B]) are optional (nullptr).
struct DecodeAttentionArgs {
    void* out;              // [B, Hq, D] contiguous
    const void* q;          // [B, Hq, D]
    const void* k;          // [B, Hkv, L, D]
    const void* v;          // [B, Hkv, L, D]
    const bool* valid;      // [B, L] or nullptr
    const int32_t* lengths; // [B] or nullptr
    int64_t q_stride_b, q_stride_h;
    int64_t k_stride_b, k_stride_h, k_stride_l;
    int64_t v_stride_b, v_stride_h, v_stride_l;
    int64_t valid_stride_b;
    int batch, q_heads, kv_heads, kv_len, head_dim;
    float scale;
    int vector;
    int semantics;
    int mode;
};

cudaError_t launch_decode_attention(DType dtype, const DecodeAttentionArgs& args, cudaStream_t stream);

// Largest number of cached positions decode attention keeps in shared memory on this device.
int decode_attention_max_len(int head_dim);

}  // namespace ulptrace
