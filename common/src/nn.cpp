// nn: the parameter store, the layers, the losses and the optimizers (see nn.hpp).
#include "shardlab/nn.hpp"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <type_traits>
#include <vector>

#include "gemm.hpp"
#include "kernels.hpp"
#include "shardlab/check.hpp"
#include "shardlab/half.hpp"
#include "shardlab/memory.hpp"
#include "vector_math.hpp"

namespace shardlab::nn {

// ---------------------------------------------------------------------------
// Parameters

Parameter& ParameterStore::add(std::string name, Tensor init) {
  require(!done_,
          [&] { return "ParameterStore::add(" + name + "): the store is already allocated"; });
  require(init.dtype() == DType::f32,
          [&] { return "ParameterStore::add(" + name + "): parameters are f32"; });
  Parameter& p = params_.emplace_back();
  p.name = std::move(name);
  p.grad = zeros(init.shape(), DType::f32, init.memory());
  p.value = std::move(init);
  p.offset = size_;
  size_ += p.value.size();
  return p;
}

void ParameterStore::allocate(Memory memory, DType type) {
  require(!done_, "ParameterStore::allocate: called twice");
  require(type == DType::f32 || is_half(type), [&] {
    return "ParameterStore::allocate: parameters are f32, f16 or bf16, not " +
           std::string(dtype_name(type));
  });
  {
    memory::Scope scope(memory::Category::params);
    values_ = empty(Shape{size_}, type, memory);
  }
  {
    memory::Scope scope(memory::Category::grads);
    grads_ = zeros(Shape{size_}, type, memory);
  }
  for (Parameter& p : params_) {
    Tensor value = values_.view(p.offset, p.value.shape());
    value.copy_from(type == DType::f32 ? p.value : cast(p.value, type));
    p.value = value;
    p.grad = grads_.view(p.offset, p.value.shape());
  }
  dtype_ = type;
  done_ = true;
}

void ParameterStore::release_grads() {
  require(done_, "ParameterStore::release_grads: allocate first");
  grads_ = Tensor();
  for (Parameter& p : params_) p.grad = Tensor();
}

void ParameterStore::release_values() {
  require(done_, "ParameterStore::release_values: allocate first");
  values_ = Tensor();
  for (Parameter& p : params_) p.value = Tensor();
}

std::vector<Parameter*> ParameterStore::parameters() {
  std::vector<Parameter*> out;
  for (Parameter& p : params_) out.push_back(&p);
  return out;
}

void ParameterStore::zero_grad() {
  if (grads_.defined()) return grads_.zero();
  for (Parameter& p : params_)
    if (p.grad.defined()) p.grad.zero();
}

// ---------------------------------------------------------------------------
// Layer

void Layer::backward_weight(Saved&) {}

Tensor Layer::backward(const Tensor& dy, Saved& saved) {
  Tensor dx = backward_input(dy, saved);
  backward_weight(saved);
  return dx;
}

namespace {
void require_rows(const Tensor& dy, const Tensor& x, std::int64_t cols, const std::string& who) {
  require(dy.ndim() == 2 && dy.rows() == x.rows() && dy.cols() == cols, [&] {
    return who + ": dy is " + dy.describe() + ", expected " + std::to_string(x.rows()) + "x" +
           std::to_string(cols);
  });
}
void require_w_after_b(const Saved& saved, const std::string& who) {
  require(saved.dy.defined() && !saved.tensors.empty(), [&] {
    return who + ": backward_weight needs backward_input first (or was called twice)";
  });
}
/// A layer's tensors all in one memory: `t` (what it is: `what`) where x is.
void require_same_memory(const Tensor& t, const Tensor& x, const std::string& who,
                         const char* what) {
  require(t.memory() == x.memory(), [&] {
    return who + ": " + what + " is " + t.describe() + " but x is " + x.describe() +
           " (a layer runs where its tensors are: all on the host, or all on one GPU)";
  });
}
/// grad += g, element by element, for H = Half or BFloat16: in f32, rounded once.
template <class H>
void accumulate_half(const H* g, H* grad, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) grad[i] = from_float<H>(to_float(grad[i]) + to_float(g[i]));
}
/// grad += g. A 16-bit gradient (mixed precision) adds in f32 and is rounded once: on the
/// host in place, on a GPU through f32 temporaries.
void accumulate(const Tensor& g, Tensor& grad) {
  if (grad.dtype() == DType::f32) return axpy(1.0f, g, grad);
  require(g.dtype() == grad.dtype() && g.same_shape(grad), [&] {
    return "Linear: the weight gradient " + g.describe() + " does not fit " + grad.describe();
  });
  if (grad.on_device()) {
    Tensor sum = cast(grad, DType::f32);
    axpy(1.0f, cast(g, DType::f32), sum);
    return grad.copy_from(cast(sum, grad.dtype()));
  }
  if (grad.dtype() == DType::f16)
    return accumulate_half(g.data<Half>(), grad.data<Half>(), g.size());
  accumulate_half(g.data<BFloat16>(), grad.data<BFloat16>(), g.size());
}
}  // namespace

// ---------------------------------------------------------------------------
// Linear

Linear::Linear(ParameterStore& store, const std::string& name, std::int64_t in, std::int64_t out,
               std::uint64_t seed, bool bias)
    : name_(name),
      weight_(&store.add(name + ".weight", scale(randn(Shape{in, out}, seed),
                                                 1.0f / std::sqrt(static_cast<float>(in))))) {
  if (bias) bias_ = &store.add(name + ".bias", zeros(Shape{1, out}));
}

void Linear::set_autocast(Autocast autocast) {
  require(autocast.type == DType::f32 ||
              (is_half(autocast.type) && weight_->value.dtype() == DType::f32),
          [&] { return name_ + ": autocast runs a 16-bit product on f32 weights"; });
  autocast_ = autocast;
}

Forward Linear::forward(const Tensor& x) const {
  require(x.ndim() == 2 && x.cols() == weight_->value.rows(), [&] {
    return name_ + ": x is " + x.describe() + ", expected " +
           std::to_string(weight_->value.rows()) + " columns";
  });
  const DType type = autocast_.type;
  if (type == DType::f32) {
    Tensor y = matmul(x, weight_->value);
    if (bias_) add_row(y, bias_->value);
    Forward f{std::move(y), {}};
    f.saved.tensors = {x};
    return f;
  }
  const Tensor x16 = round_to(x, type);
  Tensor y = matmul(x16, round_to(weight_->value, type));
  if (bias_) add_row(y, round_to(bias_->value, type));
  Forward f{autocast_.round_output ? round_to(y, type) : std::move(y), {}};
  f.saved.tensors = {x16};
  return f;
}

Tensor Linear::backward_input(const Tensor& dy, Saved& saved) const {
  require_rows(dy, saved.tensors.at(0), weight_->value.cols(), name_ + " backward");
  const DType type = autocast_.type;
  saved.dy = round_to(dy, type);
  Tensor dx = matmul(saved.dy, round_to(weight_->value, type), false, true);  // dy @ W^T
  return autocast_.round_input_grad ? round_to(dx, type) : dx;
}

void Linear::backward_weight(Saved& saved) {
  require_w_after_b(saved, name_);
  const Tensor& x = saved.tensors.at(0);
  const DType type = autocast_.type;
  accumulate(round_to(matmul(x, saved.dy, true, false), type), weight_->grad);  // x^T @ dy
  if (bias_) axpy(1.0f, round_to(column_sums(saved.dy), type), bias_->grad);
  saved = Saved{};
}

std::vector<Parameter*> Linear::parameters() const {
  if (bias_) return {weight_, bias_};
  return {weight_};
}

// ---------------------------------------------------------------------------
// Tanh, Gelu

Forward Tanh::forward(const Tensor& x) const {
  Forward f{tanh(x), {}};
  f.saved.tensors = {f.out};
  return f;
}

Tensor Tanh::backward_input(const Tensor& dy, Saved& saved) const {
  return tanh_backward(saved.tensors.at(0), dy);
}

Forward Gelu::forward(const Tensor& x) const {
  Forward f{gelu(x), {}};
  f.saved.tensors = {x};
  return f;
}

Tensor Gelu::backward_input(const Tensor& dy, Saved& saved) const {
  return gelu_backward(saved.tensors.at(0), dy);
}

// ---------------------------------------------------------------------------
// LayerNorm

LayerNorm::LayerNorm(ParameterStore& store, const std::string& name, std::int64_t channels,
                     float eps)
    : name_(name),
      gamma_(&store.add(name + ".gamma", full(Shape{1, channels}, 1.0f))),
      beta_(&store.add(name + ".beta", zeros(Shape{1, channels}))),
      eps_(eps) {}

namespace {
/// LayerNorm's rows on the host: each row's mean and variance in double (lane_sum's order),
/// then y = (x - mean) rstd gamma + beta in float. (The GPU's kernel sums in its threads'
/// order: the two agree to rounding, not bit for bit.)
SHARDLAB_VECTOR_CLONES void layernorm_rows(const float* __restrict x, const float* __restrict gamma,
                                           const float* __restrict beta, float* __restrict y,
                                           float* __restrict mean, float* __restrict rstd,
                                           std::int64_t B, std::int64_t C, float eps) {
  for (std::int64_t i = 0; i < B; ++i) {
    const float* row = x + i * C;
    const double m =
        vmath::lane_sum(C, [row](std::int64_t j) { return static_cast<double>(row[j]); }) /
        static_cast<double>(C);
    const double var = vmath::lane_sum(C,
                                       [row, m](std::int64_t j) {
                                         const double d = row[j] - m;
                                         return d * d;
                                       }) /
                       static_cast<double>(C);
    const auto s = static_cast<float>(1.0 / std::sqrt(var + eps));
    const auto mf = static_cast<float>(m);
    mean[i] = mf;
    rstd[i] = s;
    float* out = y + i * C;
    for (std::int64_t j = 0; j < C; ++j) out[j] = (row[j] - mf) * s * gamma[j] + beta[j];
  }
}

/// dx of LayerNorm's rows. With xhat = (x - mean) rstd and g = dy gamma (floats):
///   dx = rstd (g - mean(g) - xhat mean(g xhat)), the two means in double.
SHARDLAB_VECTOR_CLONES void layernorm_dx_rows(const float* __restrict x,
                                              const float* __restrict mean,
                                              const float* __restrict rstd,
                                              const float* __restrict gamma,
                                              const float* __restrict dy, float* __restrict dx,
                                              std::int64_t B, std::int64_t C) {
  for (std::int64_t i = 0; i < B; ++i) {
    const float *xi = x + i * C, *dyi = dy + i * C;
    const float m = mean[i], s = rstd[i];
    auto g = [&](std::int64_t j) { return dyi[j] * gamma[j]; };
    auto xhat = [&](std::int64_t j) { return (xi[j] - m) * s; };
    const double mean_g =
        vmath::lane_sum(C, [&](std::int64_t j) { return static_cast<double>(g(j)); }) /
        static_cast<double>(C);
    const double mean_gx =
        vmath::lane_sum(C, [&](std::int64_t j) { return static_cast<double>(g(j)) * xhat(j); }) /
        static_cast<double>(C);
    const auto mg = static_cast<float>(mean_g), mgx = static_cast<float>(mean_gx);
    float* out = dx + i * C;
    for (std::int64_t j = 0; j < C; ++j) out[j] = s * (g(j) - mg - xhat(j) * mgx);
  }
}
}  // namespace

Forward LayerNorm::forward(const Tensor& x) const {
  const std::int64_t C = gamma_->value.cols();
  require(x.ndim() == 2 && x.cols() == C, [&] {
    return name_ + ": x is " + x.describe() + ", expected " + std::to_string(C) + " columns";
  });
  const std::int64_t B = x.rows();
  if (x.on_device()) {  // the same loop, one block of threads per row (cuda.cu)
    require_same_memory(gamma_->value, x, name_, "gamma");
    // Every element of these is written by the kernel: no zeros first.
    Tensor y = empty(Shape{B, C}, DType::f32, Memory::device);
    Tensor mean = empty(Shape{B}, DType::f32, Memory::device);
    Tensor rstd = empty(Shape{B}, DType::f32, Memory::device);
    kernels::layernorm_forward(x.data(), gamma_->value.data(), beta_->value.data(), y.data(),
                               mean.data(), rstd.data(), B, C, eps_);
    Forward f{std::move(y), {}};
    f.saved.tensors = {x, mean, rstd};
    return f;
  }
  Tensor y(B, C), mean(B), rstd(B);
  layernorm_rows(x.data(), gamma_->value.data(), beta_->value.data(), y.data(), mean.data(),
                 rstd.data(), B, C, eps_);
  Forward f{std::move(y), {}};
  f.saved.tensors = {x, mean, rstd};
  return f;
}

Tensor LayerNorm::backward_input(const Tensor& dy, Saved& saved) const {
  const Tensor& x = saved.tensors.at(0);
  const Tensor& mean = saved.tensors.at(1);
  const Tensor& rstd = saved.tensors.at(2);
  const std::int64_t C = gamma_->value.cols(), B = x.rows();
  require_rows(dy, x, C, name_ + " backward");
  require_same_memory(dy, x, name_ + " backward", "dy");
  saved.dy = dy;
  if (x.on_device()) {
    Tensor dx = empty(Shape{B, C}, DType::f32, Memory::device);
    kernels::layernorm_backward_input(x.data(), mean.data(), rstd.data(), gamma_->value.data(),
                                      dy.data(), dx.data(), B, C);
    return dx;
  }
  Tensor dx(B, C);
  layernorm_dx_rows(x.data(), mean.data(), rstd.data(), gamma_->value.data(), dy.data(), dx.data(),
                    B, C);
  return dx;
}

void LayerNorm::backward_weight(Saved& saved) {
  require_w_after_b(saved, name_);
  const Tensor& x = saved.tensors.at(0);
  const Tensor& mean = saved.tensors.at(1);
  const Tensor& rstd = saved.tensors.at(2);
  const Tensor& dy = saved.dy;
  float* dgamma = gamma_->grad.data();
  float* dbeta = beta_->grad.data();
  if (x.on_device()) {
    require_same_memory(gamma_->grad, x, name_ + " backward", "gamma's gradient");
    kernels::layernorm_backward_weight(x.data(), mean.data(), rstd.data(), dy.data(), dgamma, dbeta,
                                       x.rows(), x.cols());
    saved = Saved{};
    return;
  }
  const std::int64_t B = x.rows(), C = x.cols();
  const float *px = x.data(), *pm = mean.data(), *ps = rstd.data(), *pdy = dy.data();
  for (std::int64_t i = 0; i < B; ++i)
    for (std::int64_t j = 0; j < C; ++j) {
      dgamma[j] += pdy[i * C + j] * ((px[i * C + j] - pm[i]) * ps[i]);
      dbeta[j] += pdy[i * C + j];
    }
  saved = Saved{};
}

// ---------------------------------------------------------------------------
// Embedding

Embedding::Embedding(ParameterStore& store, const std::string& name, std::int64_t vocab,
                     std::int64_t channels, std::uint64_t seed, float scale_by)
    : name_(name),
      weight_(&store.add(name + ".weight", scale(randn(Shape{vocab, channels}, seed), scale_by))) {}

Forward Embedding::forward(const Tensor& x) const {
  Forward f{index_rows(weight_->value, x), {}};
  f.saved.tensors = {x};
  return f;
}

Tensor Embedding::backward_input(const Tensor& dy, Saved& saved) const {
  require(dy.ndim() == 2 && dy.rows() == saved.tensors.at(0).size() &&
              dy.cols() == weight_->value.cols(),
          [&] { return name_ + " backward: dy is " + dy.describe(); });
  saved.dy = dy;
  return {};  // token ids have no gradient
}

void Embedding::backward_weight(Saved& saved) {
  require_w_after_b(saved, name_);
  scatter_add_rows(weight_->grad, saved.tensors.at(0), saved.dy);
  saved = Saved{};
}

// ---------------------------------------------------------------------------
// Causal self-attention

namespace {
/// One head's T x D blocks, dense for the GEMMs, reused across sequences and heads.
struct HeadBuffers {
  std::int64_t T, D;
  std::vector<float> storage;
  float *q, *k, *v, *out, *dq, *dk, *dv, *scores;
  HeadBuffers(std::int64_t tokens, std::int64_t dim)
      : T(tokens), D(dim), storage(static_cast<std::size_t>(7 * tokens * dim + tokens * tokens)) {
    float* p = storage.data();
    for (float** block : {&q, &k, &v, &out, &dq, &dk, &dv}) *block = p, p += T * D;
    scores = p;
  }
  /// Copies T rows of D values, `stride` apart, from `from` (+ D, + 2D, ... for each next block).
  void take(const float* from, std::int64_t stride, std::initializer_list<float*> blocks) const {
    std::int64_t offset = 0;
    for (float* block : blocks) {
      for (std::int64_t t = 0; t < T; ++t)
        std::copy_n(from + t * stride + offset, D, block + t * D);
      offset += D;
    }
  }
  /// Copies a T x D block into T rows `stride` apart at `to`.
  void give(const float* block, float* to, std::int64_t stride) const {
    for (std::int64_t t = 0; t < T; ++t) std::copy_n(block + t * D, D, to + t * stride);
  }
};

/// a[0..n) = softmax(scores[0..n) x scale): the maximum subtracted first, e^ by vector_math,
/// summed in order.
void softmax_prefix(const float* scores, std::int64_t n, float scale, float* a) {
  float top = -INFINITY;
  for (std::int64_t s = 0; s < n; ++s) a[s] = scores[s] * scale, top = std::max(top, a[s]);
  vmath::exp(a, top, a, n);
  float sum = 0;
  for (std::int64_t s = 0; s < n; ++s) sum += a[s];
  for (std::int64_t s = 0; s < n; ++s) a[s] /= sum;
}
}  // namespace

CausalSelfAttention::CausalSelfAttention(std::int64_t heads, std::int64_t sequence)
    : heads_(heads), sequence_(sequence) {
  require(heads >= 1 && sequence >= 1, "attention: needs at least one head and one token");
}

Forward CausalSelfAttention::forward(const Tensor& x) const {
  const std::int64_t T = sequence_, H = heads_;
  require(x.ndim() == 2 && x.cols() % (3 * H) == 0 && x.rows() % T == 0, [&] {
    return "attention: x is " + x.describe() + "; expected (B*" + std::to_string(T) +
           ") x 3C with C a multiple of " + std::to_string(H) + " heads";
  });
  const std::int64_t B = x.rows() / T, C = x.cols() / 3, D = C / H;
  const float scale_by = 1.0f / std::sqrt(static_cast<float>(D));
  if (x.on_device()) {  // the same loops, one block of threads per (b, h, t) (cuda.cu)
    Tensor y = empty(Shape{B * T, C}, DType::f32, Memory::device);  // every element written
    Tensor att(Shape{B, H, T, T}, DType::f32, Memory::device);      // zeros past each row's token
    kernels::attention_forward(x.data(), y.data(), att.data(), B, T, H, D, scale_by);
    Forward f{std::move(y), {}};
    f.saved.tensors = {x, att};
    return f;
  }
  // Per sequence and head: the scores S = Q K^T and the output A V are GEMMs (gemm.cpp,
  // on this head's queries, keys and values copied out of x), the softmax a loop over
  // each row's tokens 0..t. Zeros past t in A add nothing to A V.
  Tensor y = empty(Shape{B * T, C});
  Tensor att(Shape{B, H, T, T}, DType::f32);  // zeros past each row's token
  HeadBuffers w(T, D);
  float* pa = att.data();
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      w.take(x.data() + b * T * 3 * C + h * 3 * D, 3 * C, {w.q, w.k, w.v});
      gemm::host_matmul_fast_f32(w.q, w.k, w.scores, T, T, D, false, true);  // Q K^T
      float* a = pa + (b * H + h) * T * T;
      for (std::int64_t t = 0; t < T; ++t)
        softmax_prefix(w.scores + t * T, t + 1, scale_by, a + t * T);
      gemm::host_matmul_fast_f32(a, w.v, w.out, T, D, T, false, false);  // A V
      w.give(w.out, y.data() + b * T * C + h * D, C);
    }
  Forward f{std::move(y), {}};
  f.saved.tensors = {x, att};
  return f;
}

Tensor CausalSelfAttention::backward_input(const Tensor& dy, Saved& saved) const {
  const Tensor& x = saved.tensors.at(0);
  const Tensor& att = saved.tensors.at(1);
  const std::int64_t T = sequence_, H = heads_;
  const std::int64_t B = x.rows() / T, C = x.cols() / 3, D = C / H;
  require_rows(dy, x, C, "attention backward");
  require_same_memory(dy, x, "attention backward", "dy");
  const float scale_by = 1.0f / std::sqrt(static_cast<float>(D));
  if (x.on_device()) {  // queries one block per (b, h, t), then keys and values (cuda.cu)
    Tensor dx = empty(Shape{B * T, 3 * C}, DType::f32, Memory::device);    // every element written
    Tensor dscore = empty(Shape{B, H, T, T}, DType::f32, Memory::device);  // read where written
    kernels::attention_backward(x.data(), att.data(), dy.data(), dscore.data(), dx.data(), B, T, H,
                                D, scale_by);
    return dx;
  }
  // Per sequence and head, as the forward: dA = dY V^T, dV = A^T dY, the softmax's
  // gradient dS row by row, then dQ = dS K and dK = dS^T Q, all GEMMs.
  Tensor dx = empty(Shape{B * T, 3 * C});  // every element written: each head's q, k, v
  HeadBuffers w(T, D);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      w.take(x.data() + b * T * 3 * C + h * 3 * D, 3 * C, {w.q, w.k, w.v});
      w.take(dy.data() + b * T * C + h * D, C, {w.out});  // dY
      const float* a = att.data() + (b * H + h) * T * T;
      gemm::host_matmul_fast_f32(w.out, w.v, w.scores, T, T, D, false, true);  // dA = dY V^T
      gemm::host_matmul_fast_f32(a, w.out, w.dv, T, D, T, true, false);        // dV = A^T dY
      // Through the softmax: dS[s] = a[s] (dA[s] - sum_s' a[s'] dA[s']) / sqrt(D), s <= t.
      for (std::int64_t t = 0; t < T; ++t) {
        const float* at = a + t * T;
        float* row = w.scores + t * T;
        float weighted = 0;
        for (std::int64_t s = 0; s <= t; ++s) weighted += at[s] * row[s];
        for (std::int64_t s = 0; s <= t; ++s) row[s] = at[s] * (row[s] - weighted) * scale_by;
        std::fill(row + t + 1, row + T, 0.0f);
      }
      gemm::host_matmul_fast_f32(w.scores, w.k, w.dq, T, D, T, false, false);  // dQ = dS K
      gemm::host_matmul_fast_f32(w.scores, w.q, w.dk, T, D, T, true, false);   // dK = dS^T Q
      float* to = dx.data() + b * T * 3 * C + h * 3 * D;
      w.give(w.dq, to, 3 * C), w.give(w.dk, to + D, 3 * C), w.give(w.dv, to + 2 * D, 3 * C);
    }
  return dx;
}

// ---------------------------------------------------------------------------
// Sequential

Sequential Sequential::slice(std::size_t begin, std::size_t end) const {
  require(begin <= end && end <= layers_.size(), [&] {
    return "Sequential::slice: layers " + std::to_string(begin) + ".." + std::to_string(end) +
           " of " + std::to_string(layers_.size());
  });
  Sequential s;
  s.layers_.assign(layers_.begin() + static_cast<std::ptrdiff_t>(begin),
                   layers_.begin() + static_cast<std::ptrdiff_t>(end));
  return s;
}

Forward Sequential::forward(const Tensor& x) const {
  Forward f{x, {}};
  for (const auto& layer : layers_) {
    Forward next = layer->forward(f.out);
    f.saved.children.push_back(std::move(next.saved));
    f.out = std::move(next.out);
  }
  return f;
}

Tensor Sequential::backward_input(const Tensor& dy, Saved& saved) const {
  require(saved.children.size() == layers_.size(), [&] {
    return "Sequential::backward_input: saved state from a forward of " +
           std::to_string(saved.children.size()) + " layers, not " + std::to_string(layers_.size());
  });
  Tensor g = dy;
  for (std::size_t i = layers_.size(); i-- > 0;)
    g = layers_[i]->backward_input(g, saved.children[i]);
  return g;
}

void Sequential::backward_weight(Saved& saved) {
  require(saved.children.size() == layers_.size(), [&] {
    return "Sequential::backward_weight: saved state from a forward of " +
           std::to_string(saved.children.size()) + " layers, not " +
           std::to_string(layers_.size()) + " (or backward_weight was called twice)";
  });
  for (std::size_t i = layers_.size(); i-- > 0;) layers_[i]->backward_weight(saved.children[i]);
  saved = Saved{};
}

Forward Residual::forward(const Tensor& x) const {
  Forward inner = inner_.forward(x);
  Forward out{add(x, inner.out), {}};
  out.saved.children.push_back(std::move(inner.saved));
  return out;
}

Tensor Residual::backward_input(const Tensor& dy, Saved& saved) const {
  require(saved.children.size() == 1, "Residual::backward_input: no saved state of a forward");
  return add(dy, inner_.backward_input(dy, saved.children[0]));
}

void Residual::backward_weight(Saved& saved) {
  require(saved.children.size() == 1,
          "residual: backward_weight needs backward_input first (or was called twice)");
  inner_.backward_weight(saved.children[0]);
  saved = Saved{};
}

std::vector<Parameter*> Sequential::parameters() const {
  std::vector<Parameter*> out;
  for (const auto& layer : layers_)
    for (Parameter* p : layer->parameters()) out.push_back(p);
  return out;
}

// ---------------------------------------------------------------------------
// Losses

namespace {
std::int64_t target_at(const Tensor& targets, std::int64_t i) {
  return targets.dtype() == DType::i32 ? targets.data<std::int32_t>()[i]
                                       : targets.data<std::int64_t>()[i];
}
void require_class(std::int64_t i, std::int64_t target, std::int64_t V) {
  require(target >= 0 && target < V, [&] {
    return "cross_entropy: target[" + std::to_string(i) + "] = " + std::to_string(target) +
           " is outside 0.." + std::to_string(V - 1);
  });
}
/// cross_entropy for logits on a GPU: the targets are checked on the host first, then a
/// block of threads per row computes the softmax and the row's loss (cuda.cu); the rows'
/// losses are added here, in order, as the host loop adds them.
Loss cross_entropy_on_device(const Tensor& logits, const Tensor& targets) {
  const std::int64_t B = logits.rows(), V = logits.cols();
  const Tensor ids = targets.to(Memory::host);
  for (std::int64_t i = 0; i < B; ++i) require_class(i, target_at(ids, i), V);
  Tensor probs = empty(Shape{B, V}, DType::f32, Memory::device);
  Tensor row_loss = empty(Shape{B}, DType::f64, Memory::device);
  kernels::cross_entropy_forward(logits.data(), targets.raw(), targets.dtype(), probs.data(),
                                 row_loss.data<double>(), B, V);
  const Tensor losses = row_loss.to(Memory::host);
  double total = 0;
  for (std::int64_t i = 0; i < B; ++i) total += losses.data<double>()[i];
  Loss loss;
  loss.value = B ? total / static_cast<double>(B) : 0.0;
  loss.saved.tensors = {probs, targets};
  return loss;
}
}  // namespace

Loss cross_entropy(const Tensor& logits, const Tensor& targets) {
  require(logits.ndim() == 2 && logits.dtype() == DType::f32,
          [&] { return "cross_entropy: logits are " + logits.describe(); });
  require(targets.ndim() == 1 && targets.size() == logits.rows() &&
              (targets.dtype() == DType::i32 || targets.dtype() == DType::i64),
          [&] {
            return "cross_entropy: targets are " + targets.describe() + ", expected " +
                   std::to_string(logits.rows()) + " class ids (i32 or i64)";
          });
  require(targets.memory() == logits.memory(), [&] {
    return "cross_entropy: targets are " + targets.describe() + ", logits " + logits.describe() +
           " (both on the host, or both on one GPU)";
  });
  if (logits.on_device()) return cross_entropy_on_device(logits, targets);
  const std::int64_t B = logits.rows(), V = logits.cols();
  Tensor probs(B, V);
  double total = 0;
  for (std::int64_t i = 0; i < B; ++i) {
    const std::int64_t target = target_at(targets, i);
    require_class(i, target, V);
    float top = -INFINITY;
    for (std::int64_t j = 0; j < V; ++j) top = std::max(top, logits(i, j));
    double sum = 0;
    for (std::int64_t j = 0; j < V; ++j) {
      probs(i, j) = std::exp(logits(i, j) - top);
      sum += probs(i, j);
    }
    for (std::int64_t j = 0; j < V; ++j) probs(i, j) = static_cast<float>(probs(i, j) / sum);
    // -log p[target], from the logits (not the rounded probability): top + log(sum) - logit.
    total += static_cast<double>(top) + std::log(sum) - static_cast<double>(logits(i, target));
  }
  Loss loss;
  loss.value = B ? total / static_cast<double>(B) : 0.0;
  loss.saved.tensors = {probs, targets};
  return loss;
}

Tensor cross_entropy_backward(const Saved& saved) {
  Tensor d = saved.tensors.at(0).clone();
  const Tensor& targets = saved.tensors.at(1);
  const std::int64_t B = d.rows();
  if (d.on_device())
    kernels::cross_entropy_backward(d.data(), targets.raw(), targets.dtype(), B, d.cols());
  else
    for (std::int64_t i = 0; i < B; ++i) d(i, target_at(targets, i)) -= 1.0f;
  if (B) scale_in_place(d, 1.0f / static_cast<float>(B));
  return d;
}

double squared_error(const Tensor& pred, const Tensor& target) {
  require(pred.same_shape(target), [&] {
    return "squared_error: shapes differ (" + pred.describe() + " vs " + target.describe() + ")";
  });
  const Tensor p = pred.to(Memory::host), t = target.to(Memory::host);
  double sum = 0;
  for (std::int64_t i = 0; i < p.size(); ++i) {
    const double d = static_cast<double>(p[i]) - static_cast<double>(t[i]);
    sum += d * d;
  }
  return sum;
}

Tensor mse_backward(const Tensor& pred, const Tensor& target, double denominator) {
  Tensor d = sub(pred, target);
  scale_in_place(d, static_cast<float>(1.0 / denominator));
  return d;
}

// ---------------------------------------------------------------------------
// Optimizers

void sgd_step(Tensor& params, const Tensor& grads, float lr) { axpy(-lr, grads, params); }

Adam::Adam(std::int64_t size, AdamConfig config, Memory memory)
    : config_(config), m_(Shape{size}, DType::f32, memory), v_(Shape{size}, DType::f32, memory) {}

Forward Checkpoint::forward(const Tensor& x) const {
  Forward f{inner_->forward(x).out, {}};  // inner's saved state is dropped here
  f.saved.tensors = {x};
  return f;
}

Tensor Checkpoint::backward_input(const Tensor& dy, Saved& saved) const {
  require(saved.tensors.size() == 1, name() + ": backward without a forward");
  Forward again = inner_->forward(saved.tensors[0]);
  Tensor dx = inner_->backward_input(dy, again.saved);
  saved.tensors.clear();
  saved.children = {std::move(again.saved)};
  return dx;
}

void Checkpoint::backward_weight(Saved& saved) {
  require(saved.children.size() == 1, name() + ": backward_weight before backward_input");
  inner_->backward_weight(saved.children[0]);
  saved = Saved{};
}

void Adam::restore(const Tensor& m, const Tensor& v, int steps) {
  require(m.size() == m_.size() && v.size() == v_.size() && steps >= 0, [&] {
    return "Adam::restore: m " + m.describe() + " and v " + v.describe() + " for a state of " +
           std::to_string(m_.size()) + ", step " + std::to_string(steps);
  });
  m_.copy_from(m.reshape(m_.shape()));
  v_.copy_from(v.reshape(v_.shape()));
  t_ = steps;
}

void Adam::step(Tensor& params, const Tensor& grads) {
  adam_update(params, grads, m_, v_, t_ + 1, config_);  // throws before counting a bad call
  ++t_;
}

namespace {
/// The per-step constants of torch.optim.Adam's single-tensor step, computed in double and
/// rounded once (see Adam).
struct AdamStep {
  float m_weight, v_keep, v_weight, step_size, correction2_sqrt, eps, l2, keep;
};
AdamStep adam_constants(const AdamConfig& c, int t) {
  const double b1 = c.beta1, b2 = c.beta2, lr = c.lr, wd = c.weight_decay;
  const double correction1 = 1.0 - std::pow(b1, t), correction2 = 1.0 - std::pow(b2, t);
  return {static_cast<float>(1.0 - b1),
          c.beta2,
          static_cast<float>(1.0 - b2),
          static_cast<float>(lr / correction1),
          static_cast<float>(std::sqrt(correction2)),
          c.eps,
          c.decoupled ? 0.0f : c.weight_decay,
          c.decoupled ? static_cast<float>(1.0 - lr * wd) : 1.0f};
}
/// ATen's lerp: start + w (end - start) for |w| < 0.5, else end - (end - start)(1 - w).
inline float lerp(float start, float end, float w) {
  return std::fabs(w) < 0.5f ? start + w * (end - start) : end - (end - start) * (1.0f - w);
}
/// Adam over n elements, the gradient of type G (float, Half or BFloat16) read as a float.
template <class G>
SHARDLAB_VECTOR_CLONES void adam_loop(float* __restrict p, const G* __restrict g,
                                      float* __restrict m, float* __restrict v, std::int64_t n,
                                      const AdamStep& k) {
  for (std::int64_t i = 0; i < n; ++i) {
    float grad;
    if constexpr (std::is_same_v<G, float>)
      grad = g[i];
    else
      grad = to_float(g[i]);
    if (k.l2 != 0.0f) grad = grad + k.l2 * p[i];
    if (k.keep != 1.0f) p[i] *= k.keep;
    m[i] = lerp(m[i], grad, k.m_weight);
    v[i] = v[i] * k.v_keep + k.v_weight * grad * grad;
    const float denom = std::sqrt(v[i]) / k.correction2_sqrt + k.eps;
    p[i] = p[i] + -k.step_size * m[i] / denom;
  }
}
}  // namespace

void adam_update(Tensor& params, const Tensor& grads, Tensor& m_, Tensor& v_, int t,
                 const AdamConfig& config) {
  require(params.dtype() == DType::f32 && (grads.dtype() == DType::f32 || is_half(grads.dtype())) &&
              m_.dtype() == DType::f32 && v_.dtype() == DType::f32 && params.size() == m_.size() &&
              grads.size() == m_.size() && v_.size() == m_.size() &&
              params.memory() == m_.memory() && grads.memory() == m_.memory() &&
              v_.memory() == m_.memory() && t >= 1,
          [&] {
            return "Adam step " + std::to_string(t) + ": params " + params.describe() +
                   " and grads " + grads.describe() + " must be f32 (grads f16 or bf16 too), " +
                   std::to_string(m_.size()) + " elements, in " +
                   std::string(memory_name(m_.memory())) + " memory, at a step t >= 1";
          });
  const AdamStep k = adam_constants(config, t);
  const std::int64_t n = params.size();
  if (params.on_device()) {  // the kernel reads f32: a 16-bit gradient is widened first
    const Tensor g32 = grads.dtype() == DType::f32 ? grads : cast(grads, DType::f32);
    return kernels::adam_step(params.data(), g32.data(), m_.data(), v_.data(), n, k.m_weight,
                              k.v_keep, k.v_weight, k.step_size, k.correction2_sqrt, k.eps, k.l2,
                              k.keep);
  }
  float* p = params.data();
  if (grads.dtype() == DType::f16)
    return adam_loop(p, grads.data<Half>(), m_.data(), v_.data(), n, k);
  if (grads.dtype() == DType::bf16)
    return adam_loop(p, grads.data<BFloat16>(), m_.data(), v_.data(), n, k);
  adam_loop(p, grads.data(), m_.data(), v_.data(), n, k);
}

}  // namespace shardlab::nn
