// Shared device helpers: dtype conversions with explicit round-to-nearest-even, vector loads, the
// SiLU/sigmoid formulas torch uses on CUDA, and the one blocked FP32 reduction tree all row kernels
// use. Every add and multiply that feeds a declared reduction or a rounding point is written with
// __fadd_rn/__fmul_rn so nvcc cannot contract it into an FMA (which would round once instead of
// twice and break bit-for-bit emulation).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cstdint>

#include "launchers.h"

namespace ulptrace {

template <typename T>
struct Num;

template <>
struct Num<float> {
    __device__ __forceinline__ static float to_float(float x) { return x; }
    __device__ __forceinline__ static float from_float(float x) { return x; }
};

template <>
struct Num<__half> {
    __device__ __forceinline__ static float to_float(__half x) { return __half2float(x); }
    __device__ __forceinline__ static __half from_float(float x) { return __float2half_rn(x); }
};

template <>
struct Num<__nv_bfloat16> {
    __device__ __forceinline__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
    __device__ __forceinline__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

// Round an FP32 value to T and back: the value a T tensor would hold.
template <typename T>
__device__ __forceinline__ float round_to(float x) {
    return Num<T>::to_float(Num<T>::from_float(x));
}

// V contiguous elements, loaded or stored as one access of V * sizeof(T) bytes.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
    T v[V];
};

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> load_pack(const T* p) {
    return *reinterpret_cast<const Pack<T, V>*>(p);
}

template <typename T, int V>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, V>& pack) {
    *reinterpret_cast<Pack<T, V>*>(p) = pack;
}

// torch's CUDA formulas (opmath float): silu(x) = x / (1 + exp(-x)), sigmoid(x) = 1 / (1 + exp(-x)),
// softplus(x) = x > 20 ? x : log1p(exp(x)) (beta 1, threshold 20). expf/log1pf are the IEEE-mode
// libdevice functions torch also calls (no fast-math).
__device__ __forceinline__ float silu_f32(float x) { return __fdiv_rn(x, __fadd_rn(1.0f, expf(-x))); }
__device__ __forceinline__ float sigmoid_f32(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x))); }
__device__ __forceinline__ float softplus_f32(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// The "blocked" tree's cross-lane stage: xor butterfly with offsets 16, 8, 4, 2, 1; every lane ends
// with the warp total (IEEE addition is commutative, so lane l and lane l^offset agree).
__device__ __forceinline__ float warp_butterfly_sum(float acc) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, offset));
    }
    return acc;
}

// Finish a blocked:t{threads}:v{V} reduction for rows of `threads_per_row` threads (a multiple of
// 32) laid out consecutively in the block: `acc` is this thread's sequential partial sum. Warp
// totals go to shared memory; the first warp of each row loads them (lanes >= warps-per-row load
// 0) and runs the same butterfly. Returns the row total to every thread of the row. Must be
// reached by every thread of the block (it synchronises when rows span several warps).
// `scratch` needs 2 * 32 floats.
__device__ __forceinline__ float blocked_row_sum(float acc, int threads_per_row, float* scratch) {
    acc = warp_butterfly_sum(acc);
    const int warps_per_row = threads_per_row >> 5;
    if (warps_per_row == 1) {
        return acc;
    }
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int row_in_block = threadIdx.x / threads_per_row;
    const int warp_in_row = warp - row_in_block * warps_per_row;
    float* warp_totals = scratch;
    float* row_totals = scratch + 32;
    if (lane == 0) {
        warp_totals[warp] = acc;
    }
    __syncthreads();
    if (warp_in_row == 0) {
        float w = lane < warps_per_row ? warp_totals[row_in_block * warps_per_row + lane] : 0.0f;
        w = warp_butterfly_sum(w);
        if (lane == 0) {
            row_totals[row_in_block] = w;
        }
    }
    __syncthreads();
    return row_totals[row_in_block];
}

}  // namespace ulptrace
