// GatedDeltaNet gates from the projections a and b (elementwise over [..., heads]).
//   g    = (-exp(A_log)) * softplus(a + dt_bias)     FP32 (faithful: stored FP32, as HF keeps it;
//                                                      fused: rounded once to T, the BF16-gate defect)
//   beta = round_T(sigmoid(b))                        (HF: b.sigmoid() on a T tensor)
// softplus(x) = x > 20 ? x : log1p(exp(x)), sigmoid(x) = 1 / (1 + exp(-x)): torch's CUDA formulas.
#include "common.cuh"

namespace ulptrace {
namespace {

template <typename T>
__global__ void gdn_gates_kernel(void* g_out, T* beta_out, const T* a, const T* b, const float* a_log,
                                 const float* dt_bias, int64_t numel, int heads, int mode) {
    const int64_t stride = int64_t(gridDim.x) * blockDim.x;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += stride) {
        const int h = static_cast<int>(i % heads);
        const float neg_a = -expf(a_log[h]);
        const float sp = softplus_f32(__fadd_rn(Num<T>::to_float(a[i]), dt_bias[h]));
        const float g = __fmul_rn(neg_a, sp);
        if (mode == 0) {
            static_cast<float*>(g_out)[i] = g;
        } else {
            static_cast<T*>(g_out)[i] = Num<T>::from_float(g);
        }
        beta_out[i] = Num<T>::from_float(sigmoid_f32(Num<T>::to_float(b[i])));
    }
}

template <typename T>
cudaError_t launch_typed(void* g_out, void* beta_out, const void* a, const void* b, const float* a_log,
                         const float* dt_bias, int64_t numel, int heads, int mode, cudaStream_t stream) {
    const int block = 256;
    int64_t grid = (numel + block - 1) / block;
    if (grid > 65536) grid = 65536;
    gdn_gates_kernel<T><<<static_cast<unsigned>(grid), block, 0, stream>>>(
        g_out, static_cast<T*>(beta_out), static_cast<const T*>(a), static_cast<const T*>(b), a_log, dt_bias,
        numel, heads, mode);
    return cudaGetLastError();
}

}  // namespace

cudaError_t launch_gdn_gates(DType dtype, void* g_out, void* beta_out, const void* a, const void* b,
                             const float* a_log, const float* dt_bias, int64_t numel, int heads, int mode,
                             cudaStream_t stream) {
    if (numel == 0) return cudaSuccess;
    switch (dtype) {
        case DType::F32: return launch_typed<float>(g_out, beta_out, a, b, a_log, dt_bias, numel, heads, mode, stream);
        case DType::F16: return launch_typed<__half>(g_out, beta_out, a, b, a_log, dt_bias, numel, heads, mode, stream);
        case DType::BF16: return launch_typed<__nv_bfloat16>(g_out, beta_out, a, b, a_log, dt_bias, numel, heads, mode, stream);
    }
    return cudaErrorInvalidValue;
}

}  // namespace ulptrace
