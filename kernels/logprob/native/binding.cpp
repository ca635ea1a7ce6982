// Torch glue for logprob_kernels.cu: checks tensors, picks the current stream,
// turns a launcher's error string into a Python exception.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

extern "C" const char* lockstep_logprob_partials(int, const void*, const int64_t*, float*, float*, float*, int64_t,
                                                 int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                                 int64_t, float, int, void*);
extern "C" const char* lockstep_logprob_merge(const float*, const float*, const float*, const int64_t*, const uint8_t*,
                                              float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t, void*);
extern "C" const char* lockstep_logprob_backward(int, const void*, void*, const int64_t*, const float*, const float*,
                                                 const float*, const uint8_t*, int64_t, int64_t, int64_t, int64_t,
                                                 int64_t, int64_t, float, int, void*);

namespace {

int dtype_code(const at::Tensor& x) {
  if (x.scalar_type() == at::kBFloat16) return 0;
  if (x.scalar_type() == at::kFloat) return 1;
  TORCH_CHECK(false, "lockstep native logprob: logits must be bf16 or fp32, got ", x.scalar_type());
}

void check(const char* err, const char* what) {
  TORCH_CHECK(err == nullptr, "lockstep native logprob ", what, " launch failed: ", err);
}

void* stream() { return (void*)c10::cuda::getCurrentCUDAStream().stream(); }

const uint8_t* active_ptr(const c10::optional<at::Tensor>& active) {
  return active.has_value() ? (const uint8_t*)active->data_ptr() : nullptr;  // bool is one byte
}

}  // namespace

// Returns slot-major m, s [S, T] and the local target logit [T].
std::vector<at::Tensor> partials(const at::Tensor& x, const at::Tensor& targets, int64_t n_slots, int64_t real_hi,
                                 int64_t col0, int64_t vocab_start, int64_t global_vocab, int64_t tile_w,
                                 double temperature) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.stride(1) == 1, "logits must be a 2-D device tensor, unit column stride");
  const int64_t T = x.size(0);
  auto f32 = x.options().dtype(at::kFloat);
  at::Tensor m = at::empty({n_slots, T}, f32), s = at::empty({n_slots, T}, f32), tgt = at::empty({T}, f32);
  check(lockstep_logprob_partials(dtype_code(x), x.data_ptr(), targets.data_ptr<int64_t>(), m.data_ptr<float>(),
                                  s.data_ptr<float>(), tgt.data_ptr<float>(), T, n_slots, x.stride(0), x.size(1),
                                  real_hi, col0, vocab_start, global_vocab, tile_w, (float)temperature,
                                  temperature != 1.0, stream()),
        "partials");
  return {m, s, tgt};
}

std::vector<at::Tensor> merge(const at::Tensor& m, const at::Tensor& s, const at::Tensor& tgt,
                              const at::Tensor& targets, const c10::optional<at::Tensor>& active,
                              int64_t global_vocab) {
  TORCH_CHECK(m.strides() == s.strides(), "m and s must share strides");
  const int64_t T = m.size(0);
  at::Tensor logp = at::empty({T}, m.options()), lse = at::empty({T}, m.options());
  check(lockstep_logprob_merge(m.data_ptr<float>(), s.data_ptr<float>(), tgt.data_ptr<float>(),
                               targets.data_ptr<int64_t>(), active_ptr(active), logp.data_ptr<float>(),
                               lse.data_ptr<float>(), T, m.size(1), m.stride(0), m.stride(1), global_vocab, stream()),
        "merge");
  return {logp, lse};
}

at::Tensor backward(const at::Tensor& x, const at::Tensor& targets, const at::Tensor& lse, const at::Tensor& g_logp,
                    const at::Tensor& g_lse, const c10::optional<at::Tensor>& active, int64_t vocab_start,
                    int64_t global_vocab, double temperature) {
  at::Tensor g = at::empty({x.size(0), x.size(1)}, x.options());
  check(lockstep_logprob_backward(dtype_code(x), x.data_ptr(), g.data_ptr(), targets.data_ptr<int64_t>(),
                                  lse.data_ptr<float>(), g_logp.data_ptr<float>(), g_lse.data_ptr<float>(),
                                  active_ptr(active), x.size(0), x.stride(0), g.stride(0), x.size(1), vocab_start,
                                  global_vocab, (float)temperature, temperature != 1.0, stream()),
        "backward");
  return g;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("partials", &partials);
  mod.def("merge", &merge);
  mod.def("backward", &backward);
}
