// GLU epilogue silu(gate) * up on the two projections' outputs (elementwise, no reduction).
//   faithful: out = round_T(round_T(silu(gate)) * up)   (HF: act_fn(gate_proj(x)) * up_proj(x), two T tensors)
//   fused:    out = round_T(silu(gate) * up)            (FP32 product, one rounding)
// silu(x) = x / (1 + expf(-x)) in FP32, the formula torch's CUDA SiLU uses.
#include "common.cuh"

namespace ulptrace {
namespace {

template <typename T, int V>
__global__ void glu_kernel(T* out, const T* gate, const T* up, int64_t numel, int mode) {
    const bool faithful = mode == 0;
    const int64_t stride = int64_t(gridDim.x) * blockDim.x * V;
    for (int64_t base = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V; base < numel; base += stride) {
        const Pack<T, V> gs = load_pack<T, V>(gate + base);
        const Pack<T, V> us = load_pack<T, V>(up + base);
        Pack<T, V> ys;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            float s = silu_f32(Num<T>::to_float(gs.v[j]));
            if (faithful) s = round_to<T>(s);
            ys.v[j] = Num<T>::from_float(__fmul_rn(s, Num<T>::to_float(us.v[j])));
        }
        store_pack<T, V>(out + base, ys);
    }
}

template <typename T, int V>
cudaError_t launch_typed(void* out, const void* gate, const void* up, int64_t numel, int mode, cudaStream_t stream) {
    const int block = 256;
    int64_t grid = (numel / V + block - 1) / block;
    if (grid > 65536) grid = 65536;
    if (grid < 1) grid = 1;
    glu_kernel<T, V><<<static_cast<unsigned>(grid), block, 0, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(gate), static_cast<const T*>(up), numel, mode);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_vector(int vector, void* out, const void* gate, const void* up, int64_t numel, int mode,
                          cudaStream_t stream) {
    switch (vector) {
        case 1: return launch_typed<T, 1>(out, gate, up, numel, mode, stream);
        case 4: return launch_typed<T, 4>(out, gate, up, numel, mode, stream);
        case 8: return launch_typed<T, 8>(out, gate, up, numel, mode, stream);
        default: return cudaErrorInvalidValue;
    }
}

}  // namespace

cudaError_t launch_glu(DType dtype, void* out, const void* gate, const void* up, int64_t numel, int vector,
                       int mode, cudaStream_t stream) {
    if (numel == 0) return cudaSuccess;
    switch (dtype) {
        case DType::F32: return launch_vector<float>(vector, out, gate, up, numel, mode, stream);
        case DType::F16: return launch_vector<__half>(vector, out, gate, up, numel, mode, stream);
        case DType::BF16: return launch_vector<__nv_bfloat16>(vector, out, gate, up, numel, mode, stream);
    }
    return cudaErrorInvalidValue;
}

}  // namespace ulptrace
