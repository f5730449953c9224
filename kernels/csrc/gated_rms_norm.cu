// Gated RMSNorm of the GatedDeltaNet output (Qwen3_5RMSNormGated), faithful and fused.
//
// Rows of n = head_v_dim elements; the sum of squares follows blocked:t{threads_per_row}:v{V}
// exactly as in rms_norm.cu (same helper, same element order).
//   var = sum / n, rstd = 1 / sqrt(var + eps)                  (two IEEE roundings)
//   faithful: h = round_T(w * round_T(x * rstd));  out = round_T(h * silu(gate))   (h * silu in FP32)
//   fused:    out = round_T(((x * rstd) * w) * silu(gate))     (FP32, one rounding)
#include "common.cuh"

namespace ulptrace {
namespace {

template <typename T, int V>
struct GatedParams {
    T* out;
    const T* x;
    const T* gate;
    const T* weight;
    float eps;
    int64_t rows;
    int n;
    int threads_per_row;
    int mode;
    float* sumsq_out;
};

template <typename T, int V>
__global__ void gated_rms_norm_kernel(GatedParams<T, V> p) {
    __shared__ float scratch[64];
    const int t = threadIdx.x % p.threads_per_row;
    const int64_t row = int64_t(blockIdx.x) * (blockDim.x / p.threads_per_row) + threadIdx.x / p.threads_per_row;
    const bool row_ok = row < p.rows;
    const bool faithful = p.mode == 0;
    const int64_t off = row * p.n;
    const int stride = p.threads_per_row * V;

    float acc = 0.0f;
    if (row_ok) {
        for (int base = t * V; base < p.n; base += stride) {
            const Pack<T, V> xs = load_pack<T, V>(p.x + off + base);
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const float v = Num<T>::to_float(xs.v[j]);
                acc = __fadd_rn(acc, __fmul_rn(v, v));
            }
        }
    }
    const float total = blocked_row_sum(acc, p.threads_per_row, scratch);
    if (!row_ok) return;
    if (t == 0 && p.sumsq_out != nullptr) p.sumsq_out[row] = total;

    const float var = __fdiv_rn(total, float(p.n));
    const float rstd = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, p.eps)));
    for (int base = t * V; base < p.n; base += stride) {
        const Pack<T, V> xs = load_pack<T, V>(p.x + off + base);
        const Pack<T, V> gs = load_pack<T, V>(p.gate + off + base);
        const Pack<T, V> ws = load_pack<T, V>(p.weight + base);
        Pack<T, V> ys;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float normed = __fmul_rn(Num<T>::to_float(xs.v[j]), rstd);
            const float w = Num<T>::to_float(ws.v[j]);
            const float s = silu_f32(Num<T>::to_float(gs.v[j]));
            float y;
            if (faithful) {
                const float h = round_to<T>(__fmul_rn(w, round_to<T>(normed)));
                y = __fmul_rn(h, s);
            } else {
                y = __fmul_rn(__fmul_rn(normed, w), s);
            }
            ys.v[j] = Num<T>::from_float(y);
        }
        store_pack<T, V>(p.out + off + base, ys);
    }
}

template <typename T, int V>
cudaError_t launch_typed(void* out, const void* x, const void* gate, const void* weight, float eps, int64_t rows,
                         int n, int threads_per_row, int mode, float* sumsq_out, cudaStream_t stream) {
    GatedParams<T, V> p{static_cast<T*>(out), static_cast<const T*>(x), static_cast<const T*>(gate),
                        static_cast<const T*>(weight), eps, rows, n, threads_per_row, mode, sumsq_out};
    const int block = threads_per_row < 128 ? 128 : threads_per_row;
    const int rows_per_block = block / threads_per_row;
    const int64_t grid = (rows + rows_per_block - 1) / rows_per_block;
    gated_rms_norm_kernel<T, V><<<static_cast<unsigned>(grid), block, 0, stream>>>(p);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_vector(int vector, void* out, const void* x, const void* gate, const void* weight, float eps,
                          int64_t rows, int n, int threads_per_row, int mode, float* sumsq_out, cudaStream_t stream) {
    switch (vector) {
        case 1: return launch_typed<T, 1>(out, x, gate, weight, eps, rows, n, threads_per_row, mode, sumsq_out, stream);
        case 4: return launch_typed<T, 4>(out, x, gate, weight, eps, rows, n, threads_per_row, mode, sumsq_out, stream);
        case 8: return launch_typed<T, 8>(out, x, gate, weight, eps, rows, n, threads_per_row, mode, sumsq_out, stream);
        default: return cudaErrorInvalidValue;
    }
}

}  // namespace

cudaError_t launch_gated_rms_norm(DType dtype, void* out, const void* x, const void* gate, const void* weight,
                                  float eps, int64_t rows, int n, int threads_per_row, int vector, int mode,
                                  float* sumsq_out, cudaStream_t stream) {
    if (rows == 0) return cudaSuccess;
    switch (dtype) {
        case DType::F32: return launch_vector<float>(vector, out, x, gate, weight, eps, rows, n, threads_per_row, mode, sumsq_out, stream);
        case DType::F16: return launch_vector<__half>(vector, out, x, gate, weight, eps, rows, n, threads_per_row, mode, sumsq_out, stream);
        case DType::BF16: return launch_vector<__nv_bfloat16>(vector, out, x, gate, weight, eps, rows, n, threads_per_row, mode, sumsq_out, stream);
    }
    return cudaErrorInvalidValue;
}

}  // namespace ulptrace
