// Residual add + RMSNorm, Llama-style and zero-centred (Qwen3.5), faithful and fused.
//
// One row of n elements per `threads_per_row` threads (several rows per block when a row needs
// fewer than 128 threads). Pass 1 forms the input value v (x, or residual + x), writes the new
// residual, and accumulates v*v in the declared tree blocked:t{threads_per_row}:v{V}: element
// i = (step * threads + t) * V + j is added by thread t in (step, j) order. Pass 2 re-reads the
// row and writes the normalised output.
//
//   var  = sum / n                      (__fdiv_rn, as torch's CPU mean)
//   rstd = 1 / sqrt(var + eps)          (__fsqrt_rn then __fdiv_rn: two IEEE roundings)
//   faithful, residual: v = round_T(residual + x)          (HF's BF16 add)
//   fused,    residual: v = residual + x in FP32 (never rounded; the new residual still is)
//   llama,        faithful: out = round_T(w * round_T(v * rstd))
//   llama,        fused:    out = round_T((v * rstd) * w)
//   zero-centred, both:     out = round_T((v * rstd) * (1 + w))
#include "common.cuh"

namespace ulptrace {
namespace {

template <typename T, int V>
struct RmsNormParams {
    T* out;
    T* residual_out;
    const T* x;
    const T* residual;
    const T* weight;
    float eps;
    int64_t rows;
    int n;
    int threads_per_row;
    int variant;
    int mode;
    float* sumsq_out;
};

template <typename T, int V>
__global__ void rms_norm_kernel(RmsNormParams<T, V> p) {
    __shared__ float scratch[64];
    const int t = threadIdx.x % p.threads_per_row;
    const int64_t row = int64_t(blockIdx.x) * (blockDim.x / p.threads_per_row) + threadIdx.x / p.threads_per_row;
    const bool row_ok = row < p.rows;
    const bool has_res = p.residual != nullptr;
    const bool faithful = p.mode == 0;
    const int64_t off = row * p.n;
    const int stride = p.threads_per_row * V;

    float acc = 0.0f;
    if (row_ok) {
        for (int base = t * V; base < p.n; base += stride) {
            Pack<T, V> xs = load_pack<T, V>(p.x + off + base);
            Pack<T, V> rs;
            Pack<T, V> new_res;
            if (has_res) rs = load_pack<T, V>(p.residual + off + base);
#pragma unroll
            for (int j = 0; j < V; ++j) {
                float v = Num<T>::to_float(xs.v[j]);
                if (has_res) {
                    const float sum = __fadd_rn(Num<T>::to_float(rs.v[j]), v);
                    new_res.v[j] = Num<T>::from_float(sum);
                    v = faithful ? Num<T>::to_float(new_res.v[j]) : sum;
                }
                acc = __fadd_rn(acc, __fmul_rn(v, v));
            }
            if (has_res) store_pack<T, V>(p.residual_out + off + base, new_res);
        }
    }
    const float total = blocked_row_sum(acc, p.threads_per_row, scratch);
    if (!row_ok) return;
    if (t == 0 && p.sumsq_out != nullptr) p.sumsq_out[row] = total;

    const float var = __fdiv_rn(total, float(p.n));
    const float rstd = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, p.eps)));
    for (int base = t * V; base < p.n; base += stride) {
        Pack<T, V> xs = load_pack<T, V>(p.x + off + base);
        Pack<T, V> ws = load_pack<T, V>(p.weight + base);
        Pack<T, V> rs;
        if (has_res) rs = load_pack<T, V>(p.residual + off + base);
        Pack<T, V> ys;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            float v = Num<T>::to_float(xs.v[j]);
            if (has_res) {
                const float sum = __fadd_rn(Num<T>::to_float(rs.v[j]), v);
                v = faithful ? round_to<T>(sum) : sum;
            }
            const float normed = __fmul_rn(v, rstd);
            const float w = Num<T>::to_float(ws.v[j]);
            float y;
            if (p.variant == 1) {
                y = __fmul_rn(normed, __fadd_rn(1.0f, w));
            } else if (faithful) {
                y = __fmul_rn(w, round_to<T>(normed));
            } else {
                y = __fmul_rn(normed, w);
            }
            ys.v[j] = Num<T>::from_float(y);
        }
        store_pack<T, V>(p.out + off + base, ys);
    }
}

template <typename T, int V>
cudaError_t launch_typed(void* out, void* residual_out, const void* x, const void* residual, const void* weight,
                         float eps, int64_t rows, int n, int threads_per_row, int variant, int mode,
                         float* sumsq_out, cudaStream_t stream) {
    RmsNormParams<T, V> p{static_cast<T*>(out),          static_cast<T*>(residual_out),
                          static_cast<const T*>(x),      static_cast<const T*>(residual),
                          static_cast<const T*>(weight), eps,
                          rows,                          n,
                          threads_per_row,               variant,
                          mode,                          sumsq_out};
    const int block = threads_per_row < 128 ? 128 : threads_per_row;
    const int rows_per_block = block / threads_per_row;
    const int64_t grid = (rows + rows_per_block - 1) / rows_per_block;
    rms_norm_kernel<T, V><<<static_cast<unsigned>(grid), block, 0, stream>>>(p);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_vector(int vector, void* out, void* residual_out, const void* x, const void* residual,
                          const void* weight, float eps, int64_t rows, int n, int threads_per_row, int variant,
                          int mode, float* sumsq_out, cudaStream_t stream) {
    switch (vector) {
        case 1: return launch_typed<T, 1>(out, residual_out, x, residual, weight, eps, rows, n, threads_per_row, variant, mode, sumsq_out, stream);
        case 4: return launch_typed<T, 4>(out, residual_out, x, residual, weight, eps, rows, n, threads_per_row, variant, mode, sumsq_out, stream);
        case 8: return launch_typed<T, 8>(out, residual_out, x, residual, weight, eps, rows, n, threads_per_row, variant, mode, sumsq_out, stream);
        default: return cudaErrorInvalidValue;
    }
}

}  // namespace

cudaError_t launch_rms_norm(DType dtype, void* out, void* residual_out, const void* x, const void* residual,
                            const void* weight, float eps, int64_t rows, int n, int threads_per_row,
                            int vector, int variant, int mode, float* sumsq_out, cudaStream_t stream) {
    if (rows == 0) return cudaSuccess;
    switch (dtype) {
        case DType::F32: return launch_vector<float>(vector, out, residual_out, x, residual, weight, eps, rows, n, threads_per_row, variant, mode, sumsq_out, stream);
        case DType::F16: return launch_vector<__half>(vector, out, residual_out, x, residual, weight, eps, rows, n, threads_per_row, variant, mode, sumsq_out, stream);
        case DType::BF16: return launch_vector<__nv_bfloat16>(vector, out, residual_out, x, residual, weight, eps, rows, n, threads_per_row, variant, mode, sumsq_out, stream);
    }
    return cudaErrorInvalidValue;
}

}  // namespace ulptrace
