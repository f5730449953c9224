// Decode attention: one query token per sequence over a KV cache, grouped-query heads, per-row
// valid positions (a length and/or a boolean mask). One block of 256 threads per (batch, q head);
// q head h reads kv head h / (Hq / Hkv), as HF's repeat_kv.
//
// Declared FP32 reductions (see ulptrace/kernels/decode_attention.py):
//   qk:  blocked:t32:v{V} over the head dimension, one warp per cached position (each warp works on
//        kPositions positions at once, interleaved for latency, each with its own accumulator)
//   sum: blocked:t256:v1 over cached positions (masked positions contribute 0)
//   pv:  sequential over cached positions, per output element (masked positions skipped)
// The row maximum is order-free.
//
//   eager faithful: s = round_T(round_T(q.k) * scale); p = round_T(exp(s - max) / sum); out = round_T(sum_j p v)
//   sdpa  faithful: s = (q.k) * scale;                p = exp(s - max) / sum;           out = round_T(sum_j p v)
//   fused:          s = (q.k) * scale;                e = exp(s - max);                 out = round_T((sum_j e v) / sum)
#include "common.cuh"

#include <math.h>

namespace ulptrace {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kPositions = 8;  // positions per warp per iteration of the score loop
constexpr int kUnroll = 32;    // positions per iteration of the P @ V loop (loads in flight)

template <typename T, int V>
__global__ void decode_attention_kernel(DecodeAttentionArgs a) {
    extern __shared__ float smem[];
    __shared__ float scratch[64];
    float* q_s = smem;                                        // [D]
    float* p_s = smem + a.head_dim;                           // [L]
    unsigned char* ok_s = reinterpret_cast<unsigned char*>(p_s + a.kv_len);  // [L]

    const int b = blockIdx.x / a.q_heads;
    const int h = blockIdx.x % a.q_heads;
    const int kvh = h / (a.q_heads / a.kv_heads);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const bool eager = a.mode == 0 && a.semantics == 0;
    const bool fused = a.mode == 1;
    const T* q = static_cast<const T*>(a.q) + b * a.q_stride_b + h * a.q_stride_h;
    const T* k = static_cast<const T*>(a.k) + b * a.k_stride_b + kvh * a.k_stride_h;
    const T* v = static_cast<const T*>(a.v) + b * a.v_stride_b + kvh * a.v_stride_h;
    T* out = static_cast<T*>(a.out) + (int64_t(b) * a.q_heads + h) * a.head_dim;
    const int len = a.lengths != nullptr ? min(a.kv_len, max(0, a.lengths[b])) : a.kv_len;

    for (int d = threadIdx.x; d < a.head_dim; d += kThreads) q_s[d] = Num<T>::to_float(q[d]);
    for (int j = threadIdx.x; j < a.kv_len; j += kThreads) {
        const bool ok = j < len && (a.valid == nullptr || a.valid[b * a.valid_stride_b + j]);
        ok_s[j] = ok ? 1 : 0;
    }
    __syncthreads();

    // scores: blocked:t32:v{V} over the head dimension for each position. A warp takes kPositions
    // positions at a time; loads are unconditional (positions are clamped into the cache) so they
    // can be in flight together, and results of masked or out-of-range positions are dropped.
    for (int j0 = warp * kPositions; j0 < a.kv_len; j0 += kWarps * kPositions) {
        float acc[kPositions];
#pragma unroll
        for (int u = 0; u < kPositions; ++u) acc[u] = 0.0f;
        for (int base = lane * V; base < a.head_dim; base += 32 * V) {
            float qv[V];
#pragma unroll
            for (int jj = 0; jj < V; ++jj) qv[jj] = q_s[base + jj];
            Pack<T, V> ks[kPositions];
#pragma unroll
            for (int u = 0; u < kPositions; ++u) {
                const int j = min(j0 + u, a.kv_len - 1);
                ks[u] = load_pack<T, V>(k + int64_t(j) * a.k_stride_l + base);
            }
#pragma unroll
            for (int u = 0; u < kPositions; ++u) {
#pragma unroll
                for (int jj = 0; jj < V; ++jj) {
                    acc[u] = __fadd_rn(acc[u], __fmul_rn(qv[jj], Num<T>::to_float(ks[u].v[jj])));
                }
            }
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
#pragma unroll
            for (int u = 0; u < kPositions; ++u) {
                acc[u] = __fadd_rn(acc[u], __shfl_xor_sync(0xffffffffu, acc[u], offset));
            }
        }
        if (lane == 0) {
#pragma unroll
            for (int u = 0; u < kPositions; ++u) {
                const int j = j0 + u;
                if (j < a.kv_len && ok_s[j]) {
                    const float dot = acc[u];
                    p_s[j] = eager ? round_to<T>(__fmul_rn(round_to<T>(dot), a.scale)) : __fmul_rn(dot, a.scale);
                }
            }
        }
    }
    __syncthreads();

    // row maximum (order-free)
    float m = -INFINITY;
    for (int j = threadIdx.x; j < a.kv_len; j += kThreads) {
        if (ok_s[j]) m = fmaxf(m, p_s[j]);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    if (lane == 0) scratch[warp] = m;
    __syncthreads();
    m = scratch[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) m = fmaxf(m, scratch[w]);
    __syncthreads();
    if (m == -INFINITY) {  // no valid position: define the output as 0
        for (int d = threadIdx.x; d < a.head_dim; d += kThreads) out[d] = Num<T>::from_float(0.0f);
        return;
    }

    // exp and their sum: blocked:t256:v1 over positions
    float acc = 0.0f;
    for (int j = threadIdx.x; j < a.kv_len; j += kThreads) {
        const float e = ok_s[j] ? expf(__fsub_rn(p_s[j], m)) : 0.0f;
        p_s[j] = e;
        acc = __fadd_rn(acc, e);
    }
    const float sum = blocked_row_sum(acc, kThreads, scratch);
    if (!fused) {
        for (int j = threadIdx.x; j < a.kv_len; j += kThreads) {
            const float p = __fdiv_rn(p_s[j], sum);
            p_s[j] = eager ? round_to<T>(p) : p;
        }
    }
    __syncthreads();

    // P @ V: sequential over positions for each output element. kUnroll values are loaded before
    // they are added (in position order), masked positions are skipped by a select.
    for (int d = threadIdx.x; d < a.head_dim; d += kThreads) {
        const T* vd = v + d;
        float o = 0.0f;
        int j = 0;
        for (; j + kUnroll <= a.kv_len; j += kUnroll) {
            float vals[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) vals[u] = Num<T>::to_float(vd[int64_t(j + u) * a.v_stride_l]);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const float next = __fadd_rn(o, __fmul_rn(p_s[j + u], vals[u]));
                o = ok_s[j + u] ? next : o;
            }
        }
        for (; j < a.kv_len; ++j) {
            if (ok_s[j]) o = __fadd_rn(o, __fmul_rn(p_s[j], Num<T>::to_float(vd[int64_t(j) * a.v_stride_l])));
        }
        if (fused) o = __fdiv_rn(o, sum);
        out[d] = Num<T>::from_float(o);
    }
}

size_t smem_bytes(int head_dim, int kv_len) {
    return sizeof(float) * (size_t(head_dim) + size_t(kv_len)) + size_t(kv_len);
}

int max_dynamic_smem() {
    int device = 0;
    cudaGetDevice(&device);
    int optin = 0;
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    return optin - 64 * int(sizeof(float));  // leave room for the static scratch
}

template <typename T, int V>
cudaError_t launch_typed(const DecodeAttentionArgs& args, cudaStream_t stream) {
    const size_t smem = smem_bytes(args.head_dim, args.kv_len);
    if (smem > size_t(max_dynamic_smem())) return cudaErrorInvalidValue;
    if (smem > 48 * 1024) {
        const cudaError_t err = cudaFuncSetAttribute(decode_attention_kernel<T, V>,
                                                     cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
        if (err != cudaSuccess) return err;
    }
    const unsigned grid = unsigned(args.batch) * unsigned(args.q_heads);
    decode_attention_kernel<T, V><<<grid, kThreads, smem, stream>>>(args);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_vector(const DecodeAttentionArgs& args, cudaStream_t stream) {
    switch (args.vector) {
        case 1: return launch_typed<T, 1>(args, stream);
        case 4: return launch_typed<T, 4>(args, stream);
        case 8: return launch_typed<T, 8>(args, stream);
        default: return cudaErrorInvalidValue;
    }
}

}  // namespace

int decode_attention_max_len(int head_dim) {
    const long long budget = static_cast<long long>(max_dynamic_smem()) - static_cast<long long>(sizeof(float)) * head_dim;
    return budget > 0 ? int(budget / (sizeof(float) + 1)) : 0;
}

cudaError_t launch_decode_attention(DType dtype, const DecodeAttentionArgs& args, cudaStream_t stream) {
    if (args.batch == 0 || args.q_heads == 0) return cudaSuccess;
    switch (dtype) {
        case DType::F32: return launch_vector<float>(args, stream);
        case DType::F16: return launch_vector<__half>(args, stream);
        case DType::BF16: return launch_vector<__nv_bfloat16>(args, stream);
    }
    return cudaErrorInvalidValue;
}

}  // namespace ulptrace
