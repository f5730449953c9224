// PyTorch bindings of ulptrace's CUDA kernels. Python (ulptrace/kernels/*.py) validates shapes and
// dtypes, allocates (possibly poisoned) outputs and chooses the launch shape; this file checks the
// invariants the kernels rely on (device, contiguity, alignment), then launches on the current stream.
#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>

#include "launchers.h"

namespace {

using ulptrace::DType;

DType dtype_of(const torch::Tensor& t) {
    switch (t.scalar_type()) {
        case torch::kFloat32: return DType::F32;
        case torch::kFloat16: return DType::F16;
        case torch::kBFloat16: return DType::BF16;
        default: TORCH_CHECK(false, "ulptrace kernels take float32, float16 or bfloat16 tensors, but got ", t.scalar_type());
    }
    return DType::F32;
}

void check_cuda(const torch::Tensor& t, const char* name, const torch::Tensor& like) {
    TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, but it is on ", t.device());
    TORCH_CHECK(t.device() == like.device(), name, " must be on ", like.device(), ", but it is on ", t.device());
}

void check_dense(const torch::Tensor& t, const char* name, const torch::Tensor& like, int vector) {
    check_cuda(t, name, like);
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
    TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have dtype ", like.scalar_type(), ", but got ",
                t.scalar_type());
    const auto align = static_cast<uintptr_t>(vector) * t.element_size();
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % align == 0, name, " must be aligned to ", align,
                " bytes for vector width ", vector);
}

void check_launch(cudaError_t err, const char* op) {
    TORCH_CHECK(err == cudaSuccess, "ulptrace ", op, " kernel launch failed: ", cudaGetErrorString(err));
}

float* optional_f32(const std::optional<torch::Tensor>& t, const torch::Tensor& like, int64_t numel, const char* name) {
    if (!t.has_value()) return nullptr;
    check_cuda(*t, name, like);
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->numel() == numel, name,
                " must be a contiguous float32 tensor of ", numel, " elements");
    return t->data_ptr<float>();
}

void rms_norm(torch::Tensor out, std::optional<torch::Tensor> residual_out, torch::Tensor x,
              std::optional<torch::Tensor> residual, torch::Tensor weight, double eps, int64_t variant, int64_t mode,
              int64_t threads_per_row, int64_t vector, std::optional<torch::Tensor> sumsq_out) {
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t n = x.size(-1);
    const int64_t rows = n == 0 ? 0 : x.numel() / n;
    check_dense(x, "x", x, vector);
    check_dense(out, "out", x, vector);
    check_dense(weight, "weight", x, vector);
    TORCH_CHECK(weight.numel() == n, "weight must have ", n, " elements, but got ", weight.numel());
    TORCH_CHECK(residual.has_value() == residual_out.has_value(), "residual and residual_out go together");
    if (residual.has_value()) {
        check_dense(*residual, "residual", x, vector);
        check_dense(*residual_out, "residual_out", x, vector);
    }
    check_launch(ulptrace::launch_rms_norm(dtype_of(x), out.data_ptr(),
                                           residual_out.has_value() ? residual_out->data_ptr() : nullptr,
                                           x.data_ptr(), residual.has_value() ? residual->data_ptr() : nullptr,
                                           weight.data_ptr(), static_cast<float>(eps), rows, static_cast<int>(n),
                                           static_cast<int>(threads_per_row), static_cast<int>(vector),
                                           static_cast<int>(variant), static_cast<int>(mode),
                                           optional_f32(sumsq_out, x, rows, "sumsq_out"),
                                           c10::cuda::getCurrentCUDAStream()),
                 "rms_norm");
}

void glu(torch::Tensor out, torch::Tensor gate, torch::Tensor up, int64_t vector, int64_t mode) {
    const c10::cuda::CUDAGuard guard(gate.device());
    check_dense(gate, "gate", gate, vector);
    check_dense(up, "up", gate, vector);
    check_dense(out, "out", gate, vector);
    TORCH_CHECK(up.numel() == gate.numel() && out.numel() == gate.numel(), "gate, up and out must have the same size");
    check_launch(ulptrace::launch_glu(dtype_of(gate), out.data_ptr(), gate.data_ptr(), up.data_ptr(), gate.numel(),
                                      static_cast<int>(vector), static_cast<int>(mode),
                                      c10::cuda::getCurrentCUDAStream()),
                 "glu");
}

void gated_rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor gate, torch::Tensor weight, double eps,
                    int64_t mode, int64_t threads_per_row, int64_t vector, std::optional<torch::Tensor> sumsq_out) {
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t n = x.size(-1);
    const int64_t rows = n == 0 ? 0 : x.numel() / n;
    check_dense(x, "x", x, vector);
    check_dense(gate, "gate", x, vector);
    check_dense(out, "out", x, vector);
    check_dense(weight, "weight", x, vector);
    TORCH_CHECK(gate.numel() == x.numel(), "gate must have the size of x");
    TORCH_CHECK(weight.numel() == n, "weight must have ", n, " elements, but got ", weight.numel());
    check_launch(ulptrace::launch_gated_rms_norm(dtype_of(x), out.data_ptr(), x.data_ptr(), gate.data_ptr(),
                                                 weight.data_ptr(), static_cast<float>(eps), rows,
                                                 static_cast<int>(n), static_cast<int>(threads_per_row),
                                                 static_cast<int>(vector), static_cast<int>(mode),
                                                 optional_f32(sumsq_out, x, rows, "sumsq_out"),
                                                 c10::cuda::getCurrentCUDAStream()),
                 "gated_rms_norm");
}

void gdn_gates(torch::Tensor g_out, torch::Tensor beta_out, torch::Tensor a, torch::Tensor b, torch::Tensor a_log,
               torch::Tensor dt_bias, int64_t mode) {
    const c10::cuda::CUDAGuard guard(a.device());
    check_dense(a, "a", a, 1);
    check_dense(b, "b", a, 1);
    check_dense(beta_out, "beta_out", a, 1);
    check_cuda(g_out, "g_out", a);
    TORCH_CHECK(g_out.is_contiguous() && g_out.numel() == a.numel(), "g_out must be contiguous with a's size");
    TORCH_CHECK(g_out.scalar_type() == (mode == 0 ? torch::kFloat32 : a.scalar_type()),
                "g_out has the wrong dtype for this mode: ", g_out.scalar_type());
    const int64_t heads = a.size(-1);
    for (const auto* t : {&a_log, &dt_bias}) {
        check_cuda(*t, "A_log/dt_bias", a);
        TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->numel() == heads,
                    "A_log and dt_bias must be contiguous float32 tensors of ", heads, " elements");
    }
    check_launch(ulptrace::launch_gdn_gates(dtype_of(a), g_out.data_ptr(), beta_out.data_ptr(), a.data_ptr(),
                                            b.data_ptr(), a_log.data_ptr<float>(), dt_bias.data_ptr<float>(),
                                            a.numel(), static_cast<int>(heads), static_cast<int>(mode),
                                            c10::cuda::getCurrentCUDAStream()),
                 "gdn_gates");
}

void decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                      std::optional<torch::Tensor> valid, std::optional<torch::Tensor> lengths, double scale,
                      int64_t semantics, int64_t mode, int64_t vector) {
    const c10::cuda::CUDAGuard guard(q.device());
    TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4, "q must be [B, Hq, D] and k, v [B, Hkv, L, D]");
    check_cuda(k, "k", q);
    check_cuda(v, "v", q);
    check_dense(out, "out", q, 1);
    TORCH_CHECK(q.stride(2) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "the head dimension must be contiguous");
    TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "q, k, v dtypes differ");
    const int64_t align = vector * k.element_size();
    TORCH_CHECK(reinterpret_cast<uintptr_t>(k.data_ptr()) % align == 0 && (k.stride(2) * k.element_size()) % align == 0,
                "k rows must be aligned to ", align, " bytes for vector width ", vector);
    ulptrace::DecodeAttentionArgs args{};
    args.out = out.data_ptr();
    args.q = q.data_ptr();
    args.k = k.data_ptr();
    args.v = v.data_ptr();
    if (valid.has_value()) {
        check_cuda(*valid, "valid", q);
        TORCH_CHECK(valid->scalar_type() == torch::kBool && valid->dim() == 2 && valid->stride(1) == 1,
                    "valid must be a bool [B, L] tensor with a contiguous last dimension");
        args.valid = valid->data_ptr<bool>();
        args.valid_stride_b = valid->stride(0);
    }
    if (lengths.has_value()) {
        check_cuda(*lengths, "lengths", q);
        TORCH_CHECK(lengths->scalar_type() == torch::kInt32 && lengths->is_contiguous(), "lengths must be int32");
        args.lengths = lengths->data_ptr<int32_t>();
    }
    args.q_stride_b = q.stride(0);
    args.q_stride_h = q.stride(1);
    args.k_stride_b = k.stride(0);
    args.k_stride_h = k.stride(1);
    args.k_stride_l = k.stride(2);
    args.v_stride_b = v.stride(0);
    args.v_stride_h = v.stride(1);
    args.v_stride_l = v.stride(2);
    args.batch = static_cast<int>(q.size(0));
    args.q_heads = static_cast<int>(q.size(1));
    args.kv_heads = static_cast<int>(k.size(1));
    args.kv_len = static_cast<int>(k.size(2));
    args.head_dim = static_cast<int>(q.size(2));
    args.scale = static_cast<float>(scale);
    args.vector = static_cast<int>(vector);
    args.semantics = static_cast<int>(semantics);
    args.mode = static_cast<int>(mode);
    check_launch(ulptrace::launch_decode_attention(dtype_of(q), args, c10::cuda::getCurrentCUDAStream()),
                 "decode_attention");
}

int64_t decode_attention_max_len(int64_t head_dim) {
    return ulptrace::decode_attention_max_len(static_cast<int>(head_dim));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "ulptrace CUDA kernels (residual add + RMSNorm, GLU, gated RMSNorm, GDN gates, decode attention)";
    m.def("rms_norm", &rms_norm);
    m.def("glu", &glu);
    m.def("gated_rms_norm", &gated_rms_norm);
    m.def("gdn_gates", &gdn_gates);
    m.def("decode_attention", &decode_attention);
    m.def("decode_attention_max_len", &decode_attention_max_len);
}
