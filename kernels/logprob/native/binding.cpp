// Torch glue for logprob_kernels.cu: checks tensors, allocates outputs, picks the device and its
// current stream, turns a launcher's error string into a Python exception. Optional tensors
// (None) reach the launchers as null pointers.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

extern "C" int lockstep_logprob_vector_loads(int, const void*, int64_t, int64_t, int64_t);
extern "C" const char* lockstep_logprob_partials(int, const void*, const int64_t*, float*, float*, float*, float*,
                                                 int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                                 int64_t, int64_t, float, int, void*);
extern "C" const char* lockstep_logprob_merge(const float*, const float*, const float*, const float*, const int64_t*,
                                              const uint8_t*, float*, float*, float*, int64_t, int64_t, int64_t,
                                              int64_t, int64_t, void*);
extern "C" const char* lockstep_logprob_backward(int, const void*, void*, const int64_t*, const float*, const float*,
                                                 const float*, const float*, const float*, const uint8_t*, int64_t,
                                                 int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                                 int64_t, float, int, void*);

namespace {

using OptTensor = c10::optional<at::Tensor>;

int dtype_code(const at::Tensor& x) {
  if (x.scalar_type() == at::kBFloat16) return 0;
  if (x.scalar_type() == at::kFloat) return 1;
  if (x.scalar_type() == at::kHalf) return 2;
  TORCH_CHECK(false, "lockstep native logprob: logits must be bf16, fp16 or fp32, got ", x.scalar_type());
}

void check(const char* err, const char* what) {
  TORCH_CHECK(err == nullptr, "lockstep native logprob ", what, " launch failed: ", err);
}

void* stream() { return (void*)c10::cuda::getCurrentCUDAStream().stream(); }

void check_logits(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.stride(1) == 1,
              "lockstep native logprob: logits must be a 2-D device tensor with unit column stride");
}

// A per-row vector [T] (any stride) on x's device with the given dtype.
void check_rows(const at::Tensor& t, const at::Tensor& x, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.device() == x.device() && t.scalar_type() == dtype && t.dim() == 1 && t.size(0) == x.size(0),
              "lockstep native logprob: ", name, " must be ", dtype, " [", x.size(0), "] on ", x.device(), ", got ",
              t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

const float* opt_f32(const OptTensor& t, const at::Tensor& x, const char* name) {
  if (!t.has_value()) return nullptr;
  check_rows(*t, x, at::kFloat, name);
  return t->data_ptr<float>();
}

const uint8_t* active_ptr(const OptTensor& active, const at::Tensor& x) {
  if (!active.has_value()) return nullptr;
  check_rows(*active, x, at::kBool, "active");
  TORCH_CHECK(active->is_contiguous(), "lockstep native logprob: active must be contiguous");
  return (const uint8_t*)active->data_ptr();  // bool is one byte, 0 or 1
}

}  // namespace

// 1 when the partials kernel reads x's rows as 16-byte vectors (placement only, never the row count).
bool vector_loads(const at::Tensor& x, int64_t vocab_start) {
  check_logits(x);
  return lockstep_logprob_vector_loads(dtype_code(x), x.data_ptr(), x.stride(0), x.size(1), vocab_start) != 0;
}

// Slot-major m, s [S, T], w [S, T] when with_entropy, and the local target logit [T]:
// [m, s, tgt] or [m, s, w, tgt], views of one allocation.
std::vector<at::Tensor> partials(const at::Tensor& x, const at::Tensor& targets_in, int64_t n_slots, int64_t real_hi,
                                 int64_t col0, int64_t vocab_start, int64_t global_vocab, int64_t tile_w,
                                 double temperature, bool with_entropy) {
  check_logits(x);
  const at::Tensor targets = targets_in.contiguous();
  check_rows(targets, x, at::kLong, "targets");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t T = x.size(0), S = n_slots, n = with_entropy ? 3 : 2;
  at::Tensor buf = at::empty({n * S * T + T}, x.options().dtype(at::kFloat));
  at::Tensor m = buf.narrow(0, 0, S * T).view({S, T}), s = buf.narrow(0, S * T, S * T).view({S, T});
  at::Tensor w = with_entropy ? buf.narrow(0, 2 * S * T, S * T).view({S, T}) : at::Tensor();
  at::Tensor tgt = buf.narrow(0, n * S * T, T);
  check(lockstep_logprob_partials(dtype_code(x), x.data_ptr(), targets.data_ptr<int64_t>(), m.data_ptr<float>(),
                                  s.data_ptr<float>(), with_entropy ? w.data_ptr<float>() : nullptr,
                                  tgt.data_ptr<float>(), T, S, x.stride(0), x.size(1), real_hi, col0, vocab_start,
                                  global_vocab, tile_w, (float)temperature, temperature != 1.0, stream()),
        "partials");
  if (with_entropy) return {m, s, w, tgt};
  return {m, s, tgt};
}

// [logp, lse] or, with w, [logp, lse, ent]; m, s (and w) share strides, [T, N] in any layout.
std::vector<at::Tensor> merge(const at::Tensor& m, const at::Tensor& s, const OptTensor& w, const at::Tensor& tgt,
                              const at::Tensor& targets_in, const OptTensor& active, int64_t global_vocab) {
  TORCH_CHECK(m.is_cuda() && m.dim() == 2 && m.scalar_type() == at::kFloat && s.scalar_type() == at::kFloat,
              "lockstep native logprob: partials must be fp32 [T, N] device tensors");
  TORCH_CHECK(m.sizes() == s.sizes() && m.strides() == s.strides() &&
                  (!w.has_value() || (w->scalar_type() == at::kFloat && w->sizes() == m.sizes() &&
                                      w->strides() == m.strides())),
              "lockstep native logprob: m, s (and w) must share shape and strides");
  const int64_t T = m.size(0);
  const at::Tensor targets = targets_in.contiguous(), t_logit = tgt.contiguous();
  TORCH_CHECK(targets.scalar_type() == at::kLong && targets.numel() == T && t_logit.scalar_type() == at::kFloat &&
                  t_logit.numel() == T,
              "lockstep native logprob: targets (int64) and target logits (fp32) must have T elements");
  const c10::cuda::CUDAGuard guard(m.device());
  const bool ent = w.has_value();
  at::Tensor out = at::empty({(ent ? 3 : 2) * T}, m.options());
  at::Tensor logp = out.narrow(0, 0, T), lse = out.narrow(0, T, T);
  at::Tensor entropy = ent ? out.narrow(0, 2 * T, T) : at::Tensor();
  check(lockstep_logprob_merge(m.data_ptr<float>(), s.data_ptr<float>(), ent ? w->data_ptr<float>() : nullptr,
                               t_logit.data_ptr<float>(), targets.data_ptr<int64_t>(), active_ptr(active, m),
                               logp.data_ptr<float>(), lse.data_ptr<float>(), ent ? entropy.data_ptr<float>() : nullptr,
                               T, m.size(1), m.stride(0), m.stride(1), global_vocab, stream()),
        "merge");
  if (ent) return {logp, lse, entropy};
  return {logp, lse};
}

// d/dlogits of g_logp*logp + g_lse*lse [+ g_ent*entropy] in the logits dtype. Absent gradients
// are 0; each is read with its row stride (0 for an expanded scalar). The entropy term needs
// both g_ent and mean_x (= lse - entropy).
at::Tensor backward(const at::Tensor& x, const at::Tensor& targets_in, const at::Tensor& lse_in,
                    const OptTensor& mean_x_in, const OptTensor& g_logp, const OptTensor& g_lse,
                    const OptTensor& g_ent, const OptTensor& active, int64_t vocab_start, int64_t global_vocab,
                    double temperature) {
  check_logits(x);
  const at::Tensor targets = targets_in.contiguous(), lse = lse_in.contiguous();
  check_rows(targets, x, at::kLong, "targets");
  check_rows(lse, x, at::kFloat, "lse");
  const OptTensor mean_x = mean_x_in.has_value() ? OptTensor(mean_x_in->contiguous()) : OptTensor();
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor g = at::empty({x.size(0), x.size(1)}, x.options());
  const float* gl = opt_f32(g_logp, x, "g_logp");
  const float* gs = opt_f32(g_lse, x, "g_lse");
  const float* ge = opt_f32(g_ent, x, "g_ent");
  check(lockstep_logprob_backward(dtype_code(x), x.data_ptr(), g.data_ptr(), targets.data_ptr<int64_t>(),
                                  lse.data_ptr<float>(), opt_f32(mean_x, x, "mean_x"), gl, gs, ge,
                                  active_ptr(active, x), x.size(0), x.stride(0), g.stride(0),
                                  gl ? g_logp->stride(0) : 0, gs ? g_lse->stride(0) : 0, ge ? g_ent->stride(0) : 0,
                                  x.size(1), vocab_start, global_vocab, (float)temperature, temperature != 1.0,
                                  stream()),
        "backward");
  return g;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("vector_loads", &vector_loads);
  mod.def("partials", &partials);
  mod.def("merge", &merge);
  mod.def("backward", &backward);
}
