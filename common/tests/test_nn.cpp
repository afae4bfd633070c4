// nn: the layer library, checked against references that do not use the code under test.
//
//   - every layer's backward (dL/dx and dL/d every parameter element) against central
//     differences of its forward, for L = sum(out * R) with a fixed random R;
//     cross_entropy and the MSE helpers the same way, with their own loss
//   - the forwards against direct computations in double
//   - backward_input + backward_weight against the fused backward, bit for bit, and two
//     micro-batches in flight at once adding up to the separate gradients
//   - Sequential::slice: stages one after the other give the whole model's bits
//   - ParameterStore: parameters are views into the flat buffers, in f32 or 16 bits (the
//     ledger's params and grads), and released to an owner that keeps them its own way
//   - sgd_step, Adam (plain, L2, AdamW) against the update written out in double; a shard
//     of the flat buffer with its own Adam against one Adam over the whole buffer; f16 and
//     bf16 gradients read as the floats they hold; a 16-bit Linear's dW added in f32
//   - an autocast Linear (16-bit products on f32 weights) against its arithmetic written
//     out in double from the rounded operands, y, dx, dW and db
//   - errors: shape mismatches and misuse throw shardlab::Error
//
// Wrong versions this suite was checked against, each planted alone in a copy of nn.cpp
// (test that failed: excerpt of its message):
//   (autocast) an autocast Linear's dW added unrounded: "an autocast Linear rounds ...":
//       "dW(0,0) = -0.000297427 is not a f16 value"; its y left unrounded: "y(0,0) =
//       -1.94796 is not a f16 value"
//   (a) Linear's weight gradient transposed, dy^T @ x instead of x^T @ dy: "every layer's
//       backward matches central differences" / "Linear 4 -> 4 on 4 rows (square)":
//       "dL/dsquare.weight: 12 of 16 elements differ ..., max abs diff 3.2"; the other
//       Linears: "threw axpy: the tensors differ (f32 5x3 on host vs f32 3x5 on host)".
//   (b) Linear's bias gradient from the row sums of dy: the same test, square case:
//       "dL/dsquare.bias: 4 of 4 elements differ"; others throw "axpy: the tensors differ
//       (f32 1x4 ... vs f32 1x5 ...)". Bias gradient missing: "Linear 3 -> 5 with bias:
//       dL/dfc.bias: 5 of 5 elements differ" (and every bias in the Sequentials).
//   (c) Adam without bias correction (c1 = c2 = 1): "Adam's first step moves every element
//       by lr * sign(g)": "step 1: ... elements differ"; "Adam, Adam with L2 and AdamW
//       follow the update written out in double": "Adam step 1: params: 12 of 13 ...".
//   (d) AdamW decaying after the Adam update: the same test, "AdamW step 1: params: 12 of
//       13 elements differ ..., max abs diff 0.00025"; AdamW in the coupled form (wd * p
//       added to the gradient): "AdamW step 1: m: 13 of 13 elements differ".
//   (e) LayerNorm's backward without the mean(g * xhat) term: "every layer's backward ...":
//       "LayerNorm of 6 channels: dL/dx: 18 of 18 elements differ" (and both Sequentials
//       that hold a LayerNorm).
//   (f) attention's backward without the 1/sqrt(D) on dk: the same test, "CausalSelf-
//       Attention, 2 heads, T = 4, B = 2: dL/dx: 62 of 192 elements differ" (and the
//       transformer-like Sequential: dL/dqkv.weight, dL/dwte.weight).
//   (g) Embedding's scatter overwriting (=) instead of adding (+=): the same test,
//       "Embedding 5 x 3, repeated i32 ids: dL/demb.weight: 6 of 15 elements differ" (the
//       rows of repeated ids); also "two micro-batches in flight ...".
//   (h) cross_entropy_backward without the 1/B: "cross_entropy's gradient matches central
//       differences ...": "cross_entropy: dL/dlogits: 20 of 20 elements differ".
//   (i) a 16-bit store's values not charged to the ledger's params: "a 16-bit store rounds
//       the initial values once ...": "CHECK( 0 == 44 )", "params hold 0 bytes, want 44".
//   (j) Linear's f16 weight gradient assigned instead of added: "Linear in a 16-bit store
//       adds ...": "dW(0, 1) = 0.00846863, want -0.0197906", "12 of 12 ... differ".
//   (k) adam_update reading f16 gradients as bf16: "adam_update reads f16 and bf16
//       gradients ...": "params from f16 gradients differ from the same values in f32 by
//       0.14513".
//   (l) release_grads dropping the flat buffer but not the parameters' views: "release_grads
//       and release_values ...": "CHECK_FALSE( a.grad.defined() )", "the gradient buffer
//       is still alive: 40 bytes"; zero_grad zeroing the flat buffer whenever allocated (as
//       before release existed): "zero_grad zeroes the gradient an owner points at: 6 of 6
//       elements differ".
// Also caught: Linear's dx = dy @ W (untransposed); Linear's W assigning instead of adding
// (micro-batches); W's work done inside B ("B alone leaves the gradients at zero"); Adam
// ignoring L2; LayerNorm's dgamma without xhat; attention seeing token t + 1 (forwards vs
// double); allocate not copying initial values; zero_grad a no-op after allocate;
// parameter offsets out of add order; slice starting one layer early; the loss value not
// divided by B; mse_backward off by 2.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "shardlab/check.hpp"
#include "shardlab/half.hpp"
#include "shardlab/memory.hpp"
#include "shardlab/nn.hpp"
#include "shardlab/testing.hpp"

using namespace shardlab;
using namespace shardlab::nn;
using shardlab::testing::check_close;
using shardlab::testing::check_equal;

namespace {

// ---------------------------------------------------------------------------
// Finite differences

/// sum_i out[i] * r[i], in double: the loss whose dL/dout is r.
double weighted_sum(const Tensor& out, const Tensor& r) {
  REQUIRE(out.same_shape(r));
  double sum = 0;
  for (std::int64_t i = 0; i < out.size(); ++i)
    sum += static_cast<double>(out[i]) * static_cast<double>(r[i]);
  return sum;
}

/// dloss/dt by central differences, one element of t at a time: t[i] set to t[i] + eps
/// and t[i] - eps (in place; `loss` reads t), then restored. The step divided by is the
/// difference of the two rounded f32 values, so rounding t[i] +- eps costs no accuracy.
/// Only outputs that depend on t[i] change, so f32 rounding elsewhere cancels exactly.
Tensor numeric_gradient(Tensor& t, const std::function<double()>& loss, float eps = 3e-3f) {
  Tensor grad = zeros(t.shape());
  for (std::int64_t i = 0; i < t.size(); ++i) {
    const float v = t[i], up = v + eps, down = v - eps;
    t[i] = up;
    const double loss_up = loss();
    t[i] = down;
    const double loss_down = loss();
    t[i] = v;
    grad[i] = static_cast<float>((loss_up - loss_down) /
                                 (static_cast<double>(up) - static_cast<double>(down)));
  }
  return grad;
}

/// An analytic gradient against a numeric one, every element: within 1e-3 of the largest
/// numeric element plus 1e-3 relative. With eps = 3e-3 on O(1) inputs the f32 layers here
/// agree to 1.5e-4 of that scale at worst (truncation and rounding together); a wrong
/// gradient is off by O(1).
constexpr float fd_tolerance = 1e-3f;
void check_gradient(const Tensor& got, const Tensor& want, const std::string& what) {
  const auto scale = static_cast<float>(std::max(max_abs(want), 1e-3));
  check_close(got, want, fd_tolerance * scale, fd_tolerance, what);
}

// ---------------------------------------------------------------------------
// The layers under test, each built on a store of its own from fixed seeds, so that two
// builds are the same bits.

using Builder = std::function<std::shared_ptr<Layer>(ParameterStore&)>;

struct LayerCase {
  std::string name;
  Builder build;
  std::function<Tensor(std::uint64_t seed)> input;  // a batch for the layer
};

/// A layer and its store. Parameters are moved away from their initial values (gamma = 1,
/// beta = 0, bias = 0) so that no term of a gradient hides behind a 1 or a 0.
struct Built {
  ParameterStore store;
  std::shared_ptr<Layer> layer;
  explicit Built(const LayerCase& c) : layer(c.build(store)) {
    store.allocate();
    if (store.size() > 0) axpy(0.5f, randn(Shape{store.size()}, 777), store.values());
  }
};

/// rows x cols of N(0, s^2), from the seed.
std::function<Tensor(std::uint64_t)> normal(std::int64_t rows, std::int64_t cols, float s = 1) {
  return [=](std::uint64_t seed) { return scale(randn(rows, cols, seed), s); };
}

/// n token ids below `vocab` with repeats (one id three times, another twice), shifted by
/// the seed so that two seeds give two batches.
std::function<Tensor(std::uint64_t)> token_ids(std::int64_t n, std::int64_t vocab, DType type) {
  return [=](std::uint64_t seed) {
    static constexpr std::int64_t pattern[] = {3, 1, 3, 0, 3, 1};
    std::vector<std::int64_t> ids;
    for (std::int64_t i = 0; i < n; ++i)
      ids.push_back((pattern[i % 6] + static_cast<std::int64_t>(seed)) % vocab);
    if (type == DType::i64) return Tensor::from_vector(ids);
    return Tensor::from_vector(std::vector<std::int32_t>(ids.begin(), ids.end()));
  };
}

template <class L, class... Args>
Builder make(Args... args) {
  return [=](ParameterStore& store) -> std::shared_ptr<Layer> {
    if constexpr (std::is_constructible_v<L, ParameterStore&, Args...>)
      return std::make_shared<L>(store, args...);
    else
      return std::make_shared<L>(args...);
  };
}

std::shared_ptr<Layer> mlp(ParameterStore& s) {
  auto seq = std::make_shared<Sequential>();
  seq->add<Linear>(s, "fc1", 3, 6, 21);
  seq->add<Gelu>();
  seq->add<Linear>(s, "fc2", 6, 2, 22);
  return seq;
}

std::shared_ptr<Layer> normed_mlp(ParameterStore& s) {
  auto seq = std::make_shared<Sequential>();
  seq->add<Linear>(s, "fc1", 3, 5, 31);
  seq->add<LayerNorm>(s, "ln", 5);
  seq->add<Tanh>();
  seq->add<Linear>(s, "fc2", 5, 4, 32);
  return seq;
}

/// x + fc2(gelu(fc1(x))): a Megatron MLP block on one device.
std::shared_ptr<Layer> residual_mlp(ParameterStore& s) {
  Sequential inner;
  inner.add<Linear>(s, "fc1", 4, 8, 51);
  inner.add<Gelu>();
  inner.add<Linear>(s, "fc2", 8, 4, 52);
  return std::make_shared<Residual>(std::move(inner));
}

/// Tokens -> embedding -> qkv -> attention -> LayerNorm -> logits: 2 sequences of 3.
std::shared_ptr<Layer> tiny_transformer(ParameterStore& s) {
  auto seq = std::make_shared<Sequential>();
  seq->add<Embedding>(s, "wte", 7, 4, 41);
  seq->add<Linear>(s, "qkv", 4, 12, 42);
  seq->add<CausalSelfAttention>(2, 3);
  seq->add<LayerNorm>(s, "lnf", 4);
  seq->add<Linear>(s, "head", 4, 7, 43, false);
  return seq;
}

std::vector<LayerCase> layer_cases() {
  return {
      {"Linear 3 -> 5 with bias", make<Linear>("fc", 3, 5, 11), normal(4, 3)},
      {"Linear 4 -> 2 without bias", make<Linear>("nobias", 4, 2, 12, false), normal(3, 4)},
      {"Linear 4 -> 4 on 4 rows (square)", make<Linear>("square", 4, 4, 13), normal(4, 4)},
      {"Tanh", make<Tanh>(), normal(3, 5, 1.5f)},
      {"Gelu", make<Gelu>(), normal(3, 5, 1.5f)},
      {"LayerNorm of 6 channels", make<LayerNorm>("ln", 6), normal(3, 6, 2.0f)},
      {"Embedding 5 x 3, repeated i32 ids", make<Embedding>("emb", 5, 3, 14),
       token_ids(6, 5, DType::i32)},
      {"Embedding 5 x 3, repeated i64 ids", make<Embedding>("emb", 5, 3, 14),
       token_ids(6, 5, DType::i64)},
      {"CausalSelfAttention, 2 heads, T = 4, B = 2", make<CausalSelfAttention>(2, 4),
       normal(8, 24)},
      {"Sequential Linear -> Gelu -> Linear", mlp, normal(4, 3)},
      {"Sequential Linear -> LayerNorm -> Tanh -> Linear", normed_mlp, normal(4, 3)},
      {"Sequential Embedding -> Linear -> attention -> LayerNorm -> Linear", tiny_transformer,
       token_ids(6, 7, DType::i32)},
      {"Residual x + Linear(Gelu(Linear(x)))", residual_mlp, normal(3, 4)},
  };
}

bool is_sequential(const LayerCase& c) { return c.name.rfind("Sequential", 0) == 0; }
bool has_parameters(const LayerCase& c) { return Built(c).store.size() > 0; }

/// body(c) for every case (those `which` picks), each in a SUBCASE of its name. An
/// exception fails that case only: doctest would end the test case and skip the rest.
void for_each_layer(const std::function<void(const LayerCase&)>& body,
                    bool (*which)(const LayerCase&) = nullptr) {
  for (const LayerCase& c : layer_cases()) {
    if (which && !which(c)) continue;
    SUBCASE(c.name.c_str()) {
      try {
        body(c);
      } catch (const std::exception& e) {
        FAIL_CHECK(c.name << ": threw " << std::string(e.what()));
      }
    }
  }
}

/// Clones of every gradient, in the store's order.
std::vector<Tensor> grads_of(ParameterStore& store) {
  std::vector<Tensor> out;
  for (Parameter* p : store.parameters()) out.push_back(p->grad.clone());
  return out;
}

/// Every parameter's gradient against `want` (one tensor per parameter, in order);
/// atol is relative to the largest element of each.
void check_grads(ParameterStore& store, const std::vector<Tensor>& want, float tolerance,
                 const std::string& what) {
  const std::vector<Parameter*> params = store.parameters();
  REQUIRE(params.size() == want.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto atol = static_cast<float>(tolerance * max_abs(want[i]));
    check_close(params[i]->grad, want[i], atol, tolerance, what + ": d" + params[i]->name);
  }
}

Tensor backward_of(Layer& layer, const Tensor& x, std::uint64_t r_seed) {
  Forward f = layer.forward(x);
  return layer.backward(randn(f.out.shape(), r_seed), f.saved);
}

// ---------------------------------------------------------------------------
// Adam as PyTorch's documentation writes it, in double, one element at a time.

struct AdamReference {
  AdamConfig c;
  std::vector<double> m, v;
  int t = 0;

  void step(std::vector<double>& p, const std::vector<double>& g) {
    const double lr = c.lr, beta1 = c.beta1, beta2 = c.beta2, wd = c.weight_decay;
    m.resize(p.size());
    v.resize(p.size());
    ++t;
    for (std::size_t i = 0; i < p.size(); ++i) {
      double grad = g[i];
      if (c.decoupled)
        p[i] *= 1.0 - lr * wd;  // AdamW: decay first, apart from the gradient
      else
        grad += wd * p[i];  // Adam: L2 through the gradient
      m[i] = beta1 * m[i] + (1.0 - beta1) * grad;
      v[i] = beta2 * v[i] + (1.0 - beta2) * grad * grad;
      const double m_hat = m[i] / (1.0 - std::pow(beta1, t));
      const double v_hat = v[i] / (1.0 - std::pow(beta2, t));
      p[i] -= lr * m_hat / (std::sqrt(v_hat) + static_cast<double>(c.eps));
    }
  }
};

std::vector<double> to_doubles(const Tensor& t) { return std::vector<double>(t.begin(), t.end()); }

Tensor to_tensor(const std::vector<double>& v) {
  Tensor t(static_cast<std::int64_t>(v.size()));
  for (std::size_t i = 0; i < v.size(); ++i)
    t[static_cast<std::int64_t>(i)] = static_cast<float>(v[i]);
  return t;
}

/// For every layer with parameters: backward_weight straight after forward, and a second
/// backward_weight after backward, each checked by `check(call)`. Not a Sequential's second
/// W: Sequential::backward_weight does not check that its saved state holds one child per
/// layer, and indexes past the end of the emptied one (it would crash this binary).
void for_each_w_out_of_turn(const std::function<void(const std::function<void()>&)>& check) {
  for_each_layer(
      [&](const LayerCase& c) {
        Built b(c);
        Forward f = b.layer->forward(c.input(1));
        check([&] { b.layer->backward_weight(f.saved); });
        if (is_sequential(c)) return;
        f = b.layer->forward(c.input(1));
        b.layer->backward(randn(f.out.shape(), 1), f.saved);
        check([&] { b.layer->backward_weight(f.saved); });
      },
      has_parameters);
}

}  // namespace

TEST_SUITE("nn") {
  // -------------------------------------------------------------------------
  // 1. Backward against central differences

  TEST_CASE("every layer's backward matches central differences of its forward") {
    for_each_layer([](const LayerCase& c) {
      Built b(c);
      Layer& layer = *b.layer;
      Tensor x = c.input(1);
      Forward f = layer.forward(x);
      const Tensor r = randn(f.out.shape(), 101);  // L = sum(out * r), so dL/dout = r
      const Tensor dx = layer.backward(r, f.saved);
      const auto loss = [&] { return weighted_sum(layer.forward(x).out, r); };

      if (x.dtype() == DType::f32)
        check_gradient(dx, numeric_gradient(x, loss), c.name + ": dL/dx");
      else
        CHECK_MESSAGE(dx.empty(), c.name << ": token ids have no gradient, got " << dx.describe());
      for (Parameter* p : layer.parameters())
        check_gradient(p->grad, numeric_gradient(p->value, loss), c.name + ": dL/d" + p->name);
    });
  }

  TEST_CASE(
      "cross_entropy's gradient matches central differences, and its value is the mean "
      "of -log softmax[target]") {
    const std::vector<std::int64_t> classes = {0, 4, 2, 4};
    Tensor targets = Tensor::from_vector(std::vector<std::int32_t>{0, 4, 2, 4});
    SUBCASE("i32 targets") {}  // what follows runs once for each
    SUBCASE("i64 targets") { targets = Tensor::from_vector(classes); }
    Tensor logits = scale(randn(4, 5, 5), 2.0f);

    // The value, directly in double.
    double want = 0;
    for (std::int64_t i = 0; i < logits.rows(); ++i) {
      double sum = 0;
      for (std::int64_t j = 0; j < logits.cols(); ++j) sum += std::exp(double{logits(i, j)});
      want += std::log(sum) - logits(i, classes[static_cast<std::size_t>(i)]);
    }
    want /= static_cast<double>(logits.rows());
    const Loss loss = cross_entropy(logits, targets);
    CHECK(loss.value == doctest::Approx(want).epsilon(1e-6));

    const Tensor grad = cross_entropy_backward(loss.saved);
    const auto value = [&] { return cross_entropy(logits, targets).value; };
    check_gradient(grad, numeric_gradient(logits, value), "cross_entropy: dL/dlogits");
  }

  TEST_CASE("squared_error sums in double and mse_backward is the gradient of sum / (2 n)") {
    Tensor pred = randn(3, 4, 6);
    const Tensor target = randn(3, 4, 7);
    double want = 0;
    for (std::int64_t i = 0; i < pred.size(); ++i)
      want += (double{pred[i]} - target[i]) * (double{pred[i]} - target[i]);
    CHECK(squared_error(pred, target) == doctest::Approx(want).epsilon(1e-12));

    const double n = 3;
    const Tensor grad = mse_backward(pred, target, n);
    const auto loss = [&] { return squared_error(pred, target) / (2 * n); };
    check_gradient(grad, numeric_gradient(pred, loss), "mse_backward");
  }

  // -------------------------------------------------------------------------
  // Forwards against direct computations

  TEST_CASE("Linear, LayerNorm and attention forwards match direct computations in double") {
    SUBCASE("Linear: y = x @ W + b") {
      Built b({"", make<Linear>("fc", 3, 5, 11), normal(4, 3)});
      auto& fc = dynamic_cast<Linear&>(*b.layer);
      const Tensor x = randn(4, 3, 1);
      Tensor want(4, 5);
      for (std::int64_t i = 0; i < 4; ++i)
        for (std::int64_t j = 0; j < 5; ++j) {
          double sum = fc.bias()->value[j];
          for (std::int64_t k = 0; k < 3; ++k) sum += double{x(i, k)} * fc.weight().value(k, j);
          want(i, j) = static_cast<float>(sum);
        }
      check_close(fc.forward(x).out, want, 1e-6f, 1e-6f, "Linear forward");
    }
    SUBCASE("LayerNorm: (x - mean) / sqrt(var + eps) * gamma + beta, per row") {
      Built b({"", make<LayerNorm>("ln", 6), normal(3, 6)});
      const std::vector<Parameter*> gb = b.layer->parameters();
      const Tensor x = scale(randn(3, 6, 2), 3.0f);
      Tensor want(3, 6);
      for (std::int64_t i = 0; i < 3; ++i) {
        double mean = 0, var = 0;
        for (std::int64_t j = 0; j < 6; ++j) mean += x(i, j) / 6.0;
        for (std::int64_t j = 0; j < 6; ++j) var += (x(i, j) - mean) * (x(i, j) - mean) / 6.0;
        for (std::int64_t j = 0; j < 6; ++j)
          want(i, j) = static_cast<float>(
              (x(i, j) - mean) / std::sqrt(var + 1e-5) * gb[0]->value[j] + gb[1]->value[j]);
      }
      check_close(b.layer->forward(x).out, want, 1e-5f, 1e-5f, "LayerNorm forward");
    }
    SUBCASE("attention: softmax over s <= t of q_t . k_s / sqrt(D), times v_s") {
      const std::int64_t B = 2, T = 4, H = 2, C = 8, D = C / H;
      const Tensor x = randn(B * T, 3 * C, 3);
      Tensor want(B * T, C);
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t t = 0; t < T; ++t) {
            // column of head h's q (part 0), k (1) or v (2), channel d, of token s
            const auto at = [&](std::int64_t s, std::int64_t part, std::int64_t d) {
              return double{x(b * T + s, h * 3 * D + part * D + d)};
            };
            std::vector<double> w;
            double total = 0;
            for (std::int64_t s = 0; s <= t; ++s) {
              double dot = 0;
              for (std::int64_t d = 0; d < D; ++d) dot += at(t, 0, d) * at(s, 1, d);
              w.push_back(std::exp(dot / std::sqrt(double(D))));
              total += w.back();
            }
            for (std::int64_t d = 0; d < D; ++d) {
              double y = 0;
              for (std::int64_t s = 0; s <= t; ++s)
                y += w[static_cast<std::size_t>(s)] / total * at(s, 2, d);
              want(b * T + t, h * D + d) = static_cast<float>(y);
            }
          }
      const CausalSelfAttention attention(H, T);
      check_close(attention.forward(x).out, want, 1e-6f, 1e-5f, "attention forward");

      // Causal: changing the last token of each sequence changes no earlier output.
      Tensor later = x.clone();
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t j = 0; j < 3 * C; ++j) later(b * T + T - 1, j) += 1.0f;
      const Tensor y0 = attention.forward(x).out, y1 = attention.forward(later).out;
      for (std::int64_t b = 0; b < B; ++b)
        check_equal(y1.slice(b * T, T - 1), y0.slice(b * T, T - 1),
                    "tokens before the last of sequence " + std::to_string(b));
    }
  }

  TEST_CASE("Embedding's forward picks the rows of its ids") {
    Built b({"", make<Embedding>("emb", 5, 3, 14), token_ids(6, 5, DType::i32)});
    const Tensor ids = Tensor::from_vector(std::vector<std::int32_t>{4, 0, 4, 2});
    const Tensor y = b.layer->forward(ids).out;
    const Tensor& w = b.layer->parameters()[0]->value;
    REQUIRE(y.shape() == Shape{4, 3});
    for (std::int64_t i = 0; i < 4; ++i)
      check_equal(y.slice(i, 1), w.slice(ids.data<std::int32_t>()[i], 1),
                  "row " + std::to_string(i));
  }

  // -------------------------------------------------------------------------
  // 2. Split backward, micro-batches in flight

  TEST_CASE(
      "backward_input then backward_weight gives the fused backward's bits, and B alone "
      "leaves the gradients at zero") {
    for_each_layer([](const LayerCase& c) {
      Built fused(c), split(c);
      const Tensor x = c.input(1);
      Forward f1 = fused.layer->forward(x), f2 = split.layer->forward(x);
      const Tensor r = randn(f1.out.shape(), 102);
      const Tensor dx = fused.layer->backward(r, f1.saved);

      const Tensor dx_split = split.layer->backward_input(r, f2.saved);
      if (split.store.size() > 0)
        CHECK_MESSAGE(max_abs(split.store.grads()) == 0.0,
                      c.name << ": backward_input changed a gradient");
      split.layer->backward_weight(f2.saved);

      check_equal(dx_split, dx, c.name + ": dL/dx");
      check_grads(split.store, grads_of(fused.store), 0.0f, c.name);
    });
  }

  TEST_CASE(
      "two micro-batches in flight, backwards in reverse order, add up to the separate "
      "gradients") {
    for_each_layer([](const LayerCase& c) {
      Built first(c), second(c), both(c);
      const Tensor x1 = c.input(1), x2 = c.input(2);
      const Tensor dx1 = backward_of(*first.layer, x1, 201);
      const Tensor dx2 = backward_of(*second.layer, x2, 202);

      // Both forwards first, then B of the second, B of the first, W of each.
      Forward f1 = both.layer->forward(x1), f2 = both.layer->forward(x2);
      const Tensor got2 = both.layer->backward_input(randn(f2.out.shape(), 202), f2.saved);
      const Tensor got1 = both.layer->backward_input(randn(f1.out.shape(), 201), f1.saved);
      both.layer->backward_weight(f2.saved);
      both.layer->backward_weight(f1.saved);

      check_equal(got1, dx1, c.name + ": micro-batch 1 dL/dx");
      check_equal(got2, dx2, c.name + ": micro-batch 2 dL/dx");
      std::vector<Tensor> sum = grads_of(first.store);
      const std::vector<Tensor> g2 = grads_of(second.store);
      for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = add(sum[i], g2[i]);
      // Summed in another order (row by row for LayerNorm), so within rounding.
      check_grads(both.store, sum, 1e-6f, c.name + ": sum of the micro-batches");
    });
  }

  // -------------------------------------------------------------------------
  // 3. Pipeline stages

  TEST_CASE(
      "Sequential::slice: stages [0, k) then [k, n) give the whole model's output and "
      "gradients, bit for bit") {
    for_each_layer(
        [](const LayerCase& c) {
          Built b(c);
          const auto& model = dynamic_cast<const Sequential&>(*b.layer);
          const Tensor x = c.input(1);
          Forward whole = b.layer->forward(x);
          const Tensor r = randn(whole.out.shape(), 103);
          const Tensor dx = b.layer->backward(r, whole.saved);
          const std::vector<Tensor> grads = grads_of(b.store);

          for (std::size_t k = 0; k <= model.size(); ++k) {
            const std::string what = c.name + ", stages [0, " + std::to_string(k) + ") [" +
                                     std::to_string(k) + ", " + std::to_string(model.size()) + ")";
            Sequential front = model.slice(0, k), back = model.slice(k, model.size());
            // The stages share the model's layers: together, its parameters in order.
            std::vector<Parameter*> params = front.parameters();
            for (Parameter* p : back.parameters()) params.push_back(p);
            CHECK_MESSAGE(params == model.parameters(), what << ": not the model's parameters");

            b.store.zero_grad();
            Forward f1 = front.forward(x);
            Forward f2 = back.forward(f1.out);
            check_equal(f2.out, whole.out, what + ": output");
            const Tensor d_mid = back.backward(r, f2.saved);
            check_equal(front.backward(d_mid, f1.saved), dx, what + ": dL/dx");
            check_grads(b.store, grads, 0.0f, what);
          }
        },
        is_sequential);
  }

  // -------------------------------------------------------------------------
  // 4. The parameter store

  TEST_CASE("ParameterStore::allocate makes every parameter a view into the flat buffers") {
    ParameterStore store;
    Parameter& a = store.add("a", Tensor::from({{1, 2, 3}, {4, 5, 6}}));
    Parameter& b = store.add("b", Tensor::from_1d({7, 8}));
    Parameter& c = store.add("c", Tensor::from({{9, 10}, {11, 12}}));
    CHECK_FALSE(store.allocated());
    CHECK(store.size() == 12);
    CHECK(a.offset == 0);  // consecutive, in add order
    CHECK(b.offset == 6);
    CHECK(c.offset == 8);
    const std::vector<Parameter*> order = {&a, &b, &c};
    CHECK(store.parameters() == order);
    c.grad.fill(3.0);
    store.zero_grad();  // before allocate too
    check_equal(c.grad, zeros(Shape{2, 2}), "c.grad zeroed before allocate");

    store.allocate();
    CHECK(store.allocated());
    CHECK(store.parameters() == order);  // the references stay valid
    const Tensor flat = Tensor::from_1d({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12});
    check_equal(store.values(), flat, "the flat values hold the initial values in add order");
    check_equal(store.grads(), zeros(Shape{12}), "the flat gradients start at zero");
    CHECK(a.value.shape() == Shape{2, 3});
    CHECK(b.value.shape() == Shape{2});
    CHECK(c.grad.shape() == Shape{2, 2});

    for (std::int64_t i = 0; i < 12; ++i) {
      store.values()[i] = -static_cast<float>(i);
      store.grads()[i] = static_cast<float>(i) + 0.5f;
    }
    for (Parameter* p : order) {
      CAPTURE(p->name);
      CHECK(p->value.shares_memory_with(store.values()));
      CHECK(p->grad.shares_memory_with(store.grads()));
      for (std::int64_t j = 0; j < p->value.size(); ++j) {
        const auto at = static_cast<float>(p->offset + j);
        CHECK_MESSAGE(p->value[j] == -at, p->name << "[" << j << "] is not values()[offset + j]");
        CHECK_MESSAGE(p->grad[j] == at + 0.5f, p->name << ".grad[" << j << "]");
      }
    }
    c.value[3] = 100.0f;  // and the other way
    CHECK(store.values()[11] == 100.0f);

    store.zero_grad();
    check_equal(store.grads(), zeros(Shape{12}), "zero_grad");
    for (Parameter* p : order) check_equal(p->grad, zeros(p->grad.shape()), p->name + ".grad");

    CHECK_THROWS_AS(store.add("late", zeros(1, 1)), Error);
    CHECK_THROWS_AS(store.allocate(), Error);
  }

  TEST_CASE("a 16-bit store rounds the initial values once and counts values and gradients") {
    for (DType type : {DType::f16, DType::bf16}) {
      CAPTURE(dtype_name(type));
      ParameterStore store;
      const Tensor a0 = randn(Shape{3, 5}, 31), b0 = randn(Shape{7}, 32);
      Parameter& a = store.add("a", a0.clone());
      Parameter& b = store.add("b", b0.clone());
      memory::Tracker tracker;
      store.allocate(Memory::host, type);
      CHECK(store.dtype() == type);
      CHECK(store.values().dtype() == type);
      CHECK(store.grads().dtype() == type);
      // Each value is its f32 initial value rounded to the type, once.
      const Tensor a_want = cast(a0, type), b_want = cast(b0, type);
      CHECK_MESSAGE(a.value.bitwise_equal(a_want), "a: not the initial values rounded once");
      CHECK_MESSAGE(b.value.bitwise_equal(b_want), "b: not the initial values rounded once");
      CHECK_MESSAGE(a.grad.bitwise_equal(zeros(Shape{3, 5}, type)), "a's gradient starts at 0");
      CHECK(a.value.shares_memory_with(store.values()));
      CHECK(b.grad.shares_memory_with(store.grads()));
      const memory::Usage u = tracker.usage();
      CHECK_MESSAGE(u.live(memory::Category::params) == 2 * 22,
                    "params hold " << u.live(memory::Category::params) << " bytes, want 44");
      CHECK_MESSAGE(u.live(memory::Category::grads) == 2 * 22,
                    "grads hold " << u.live(memory::Category::grads) << " bytes, want 44");
    }
    ParameterStore f32;
    f32.add("w", zeros(2, 2));
    CHECK(f32.dtype() == DType::f32);
    CHECK_THROWS_AS(f32.allocate(Memory::host, DType::i32), Error);
  }

  TEST_CASE("an autocast Linear rounds its operands and results to 16 bits, as written out") {
    // The reference, in double from the rounded operands: y = r(sum_k r(x) r(W) + r(b)),
    // dx = r(r(dy) r(W)^T), dW = r(r(x)^T r(dy)), db = r(sum of r(dy)); r() rounds to the
    // type. The layer sums in f32, so each result is the reference's or a 16-bit step off.
    for (DType type : {DType::f16, DType::bf16}) {
      CAPTURE(dtype_name(type));
      ParameterStore store;
      Linear fc(store, "fc", 7, 5, 77);
      store.allocate();
      fc.bias()->value.copy_from(randn(Shape{1, 5}, 78));
      fc.set_autocast({.type = type});
      const Tensor x = randn(Shape{4, 7}, 79), dy = scale(randn(Shape{4, 5}, 80), 1e-3f);
      Forward f = fc.forward(x);
      const Tensor dx = fc.backward_input(dy, f.saved);
      fc.backward_weight(f.saved);
      auto r = [&](double v) {
        Tensor one(Shape{1}, DType::f32);
        one[0] = static_cast<float>(v);
        return round_to(one, type)[0];
      };
      auto rv = [&](const Tensor& t) { return round_to(t, type); };
      const Tensor xr = rv(x), wr = rv(fc.weight().value), br = rv(fc.bias()->value), dyr = rv(dy);
      auto near = [&](float got, double want, const std::string& what) {
        const float w = r(want);
        const float step =
            std::max(std::abs(w), 1e-30f) * (type == DType::f16 ? 0x1p-10f : 0x1p-7f);
        CHECK_MESSAGE(r(got) == got,
                      what << " = " << got << " is not a " << dtype_name(type) << " value");
        CHECK_MESSAGE(std::abs(got - w) <= step, what << " = " << got << ", want " << w);
      };
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 5; ++j) {
          double y = br(0, j);
          for (int k = 0; k < 7; ++k) y += static_cast<double>(xr(i, k)) * wr(k, j);
          near(f.out(i, j), y, "y(" + std::to_string(i) + "," + std::to_string(j) + ")");
        }
      for (int i = 0; i < 4; ++i)
        for (int k = 0; k < 7; ++k) {
          double v = 0;
          for (int j = 0; j < 5; ++j) v += static_cast<double>(dyr(i, j)) * wr(k, j);
          near(dx(i, k), v, "dx(" + std::to_string(i) + "," + std::to_string(k) + ")");
        }
      for (int k = 0; k < 7; ++k)
        for (int j = 0; j < 5; ++j) {
          double v = 0;
          for (int i = 0; i < 4; ++i) v += static_cast<double>(xr(i, k)) * dyr(i, j);
          near(fc.weight().grad(k, j), v,
               "dW(" + std::to_string(k) + "," + std::to_string(j) + ")");
        }
      for (int j = 0; j < 5; ++j) {
        double v = 0;
        for (int i = 0; i < 4; ++i) v += dyr(i, j);
        near(fc.bias()->grad(0, j), v, "db(" + std::to_string(j) + ")");
      }
      // Not f32's product: the rounding is there.
      ParameterStore plain_store;
      Linear plain(plain_store, "fc", 7, 5, 77);
      plain_store.allocate();
      plain.bias()->value.copy_from(fc.bias()->value);
      CHECK_FALSE(plain.forward(x).out.bitwise_equal(f.out));
    }
    // round_output / round_input_grad off: the f32 sums of the rounded products.
    ParameterStore store;
    Linear fc(store, "fc", 3, 2, 5, false);
    store.allocate();
    fc.set_autocast({.type = DType::f16, .round_output = false, .round_input_grad = false});
    const Tensor x = randn(Shape{2, 3}, 6);
    Forward f = fc.forward(x);
    CHECK(f.out.bitwise_equal(
        matmul(round_to(x, DType::f16), round_to(fc.weight().value, DType::f16))));
  }

  TEST_CASE("release_grads and release_values drop the flat buffers and empty every view") {
    ParameterStore store;
    Parameter& a = store.add("a", randn(Shape{4}, 41));
    Parameter& b = store.add("b", randn(Shape{2, 3}, 42));
    memory::Tracker tracker;
    store.allocate();
    CHECK_THROWS_AS(ParameterStore().release_grads(), Error);  // nothing allocated
    store.release_grads();
    CHECK_FALSE(store.grads().defined());
    CHECK_FALSE(a.grad.defined());
    CHECK_FALSE(b.grad.defined());
    CHECK(a.value.defined());
    CHECK_MESSAGE(tracker.usage().live(memory::Category::grads) == 0,
                  "the gradient buffer is still alive: "
                      << tracker.usage().live(memory::Category::grads) << " bytes");
    // The owner points a gradient somewhere; zero_grad zeroes it, and skips the empty ones.
    Tensor bucket = full(Shape{2, 3}, 5.0f);
    b.grad = bucket;
    store.zero_grad();
    check_equal(bucket, zeros(Shape{2, 3}), "zero_grad zeroes the gradient an owner points at");
    store.release_values();
    CHECK_FALSE(store.values().defined());
    CHECK_FALSE(a.value.defined());
    CHECK_FALSE(b.value.defined());
    CHECK(tracker.usage().live(memory::Category::params) == 0);
    CHECK(store.size() == 10);  // the parameters themselves stay
    CHECK(store.parameters().size() == 2);
  }

  TEST_CASE("layers add their parameters in order, initialised as documented") {
    ParameterStore store;
    Linear fc(store, "fc", 3, 4, 5);
    LayerNorm ln(store, "ln", 4);
    Embedding emb(store, "emb", 6, 4, 7, 0.5f);
    Linear head(store, "head", 4, 2, 8, false);
    store.allocate();

    std::int64_t offset = 0;
    for (Parameter* p : store.parameters()) {
      CHECK_MESSAGE(p->offset == offset, p->name << " is not right after the one before");
      offset += p->value.size();
    }
    CHECK(offset == store.size());
    CHECK(store.parameters().size() == 6);

    check_close(fc.weight().value, scale(randn(3, 4, 5), 1.0f / std::sqrt(3.0f)), 0, 1e-6f,
                "fc.weight ~ N(0, 1/I) from the seed");
    check_equal(fc.bias()->value, zeros(1, 4), "fc.bias = 0");
    CHECK(head.bias() == nullptr);
    check_equal(ln.parameters()[0]->value, full(1, 4, 1.0f), "gamma = 1");
    check_equal(ln.parameters()[1]->value, zeros(1, 4), "beta = 0");
    check_close(emb.parameters()[0]->value, scale(randn(6, 4, 7), 0.5f), 0, 1e-6f,
                "emb.weight ~ N(0, 1) * scale from the seed");
  }

  // -------------------------------------------------------------------------
  // 5. Optimizers

  TEST_CASE("sgd_step subtracts lr times the gradient from every element, and only those") {
    Tensor flat = randn(Shape{10}, 1);
    const Tensor before = flat.clone(), grads = randn(Shape{6}, 2);
    Tensor part = flat.view(2, Shape{6});  // a shard of a flat buffer
    sgd_step(part, grads, 0.1f);
    Tensor want = before.clone();
    for (std::int64_t i = 0; i < 6; ++i)
      want[2 + i] = static_cast<float>(double{before[2 + i]} - 0.1 * double{grads[i]});
    check_close(flat, want, 1e-7f, 1e-6f, "sgd_step on elements 2..7 of 10");
  }

  TEST_CASE("Adam's first step moves every element by lr * sign(g) (bias correction)") {
    // m_hat = g and v_hat = g^2 after one step, so the step is lr * g / (|g| + eps).
    Tensor p = Tensor::from_1d({1.0f, -2.0f, 0.5f, 3.0f, -0.25f, 0.0f});
    const Tensor g = Tensor::from_1d({0.5f, -2.0f, 0.01f, -30.0f, 0.2f, 0.0f});
    const Tensor want = Tensor::from_1d({0.9f, -1.9f, 0.4f, 3.1f, -0.35f, 0.0f});
    Adam adam(6, AdamConfig{.lr = 0.1f});
    adam.step(p, g);
    CHECK(adam.steps() == 1);
    check_close(p, want, 3e-7f, 1e-6f, "step 1");  // eps moves it by lr eps / |g| <= 1e-7
  }

  TEST_CASE("Adam, Adam with L2 and AdamW follow the update written out in double") {
    struct Variant {
      const char* name;
      AdamConfig config;
    };
    const Variant variants[] = {
        {"Adam", {.lr = 0.05f}},
        {"Adam with L2", {.lr = 0.05f, .weight_decay = 0.1f}},
        {"AdamW", {.lr = 0.05f, .weight_decay = 0.1f, .decoupled = true}},
    };
    for (const Variant& variant : variants) {
      SUBCASE(variant.name) {
        const std::int64_t n = 13;
        Tensor p = randn(Shape{n}, 3);
        std::vector<double> want = to_doubles(p);
        Adam adam(n, variant.config);
        AdamReference reference{variant.config, {}, {}, 0};
        // The gradient changes scale and sign from step to step; element 0 is 0 at first.
        const float scales[] = {1.0f, -0.1f, 3.0f, 0.5f};
        for (int t = 1; t <= 4; ++t) {
          Tensor g = scale(randn(Shape{n}, 10 + static_cast<std::uint64_t>(t)), scales[t - 1]);
          if (t == 1) g[0] = 0.0f;
          adam.step(p, g);
          reference.step(want, to_doubles(g));
          const std::string what = std::string(variant.name) + " step " + std::to_string(t);
          CHECK(adam.steps() == t);
          // The bias corrections in double, as PyTorch computes them, each rounded once:
          // within 1e-7 lr of the double update (in f32, 1 - beta2^t is off by up to
          // 2^-25 / (1 - beta2^t), 1e-5 of the step at t = 2: that version fails here). A
          // wrong update is off by lr or by lr^2 wd (1e-4 and more here).
          check_close(p, to_tensor(want), 1e-7f * variant.config.lr, 1e-6f, what + ": params");
          check_close(adam.m(), to_tensor(reference.m), 2e-7f, 1e-6f, what + ": m");
          check_close(adam.v(), to_tensor(reference.v), 1e-10f, 1e-6f, what + ": v");
        }
      }
    }
  }

  TEST_CASE(
      "shards of the flat buffer, each updated by its own Adam, match one Adam over the "
      "whole buffer") {
    const std::int64_t n = 11;
    const AdamConfig config{.lr = 0.01f, .weight_decay = 0.1f, .decoupled = true};
    Tensor whole = randn(Shape{n}, 4), sharded = whole.clone();
    Adam one(n, config);
    std::vector<Adam> per_shard;
    for (int part = 0; part < 3; ++part)
      per_shard.emplace_back(shard_range(n, 3, part).length, config);
    for (std::uint64_t t = 1; t <= 3; ++t) {
      const Tensor g = randn(Shape{n}, 20 + t);
      one.step(whole, g);
      for (int part = 0; part < 3; ++part) {
        const ShardRange range = shard_range(n, 3, part);
        Tensor params = sharded.view(range.offset, Shape{range.length});
        per_shard[static_cast<std::size_t>(part)].step(params,
                                                       g.view(range.offset, Shape{range.length}));
      }
      check_equal(sharded, whole, "step " + std::to_string(t) + ": 3 shards of 11 vs the whole");
    }
    for (int part = 0; part < 3; ++part) {
      const ShardRange range = shard_range(n, 3, part);
      const Adam& mine = per_shard[static_cast<std::size_t>(part)];
      check_equal(mine.m(), one.m().view(range.offset, Shape{range.length}), "shard's m");
      check_equal(mine.v(), one.v().view(range.offset, Shape{range.length}), "shard's v");
    }
  }

  TEST_CASE("adam_update reads f16 and bf16 gradients as the floats they hold") {
    const std::int64_t n = 37;
    for (DType type : {DType::f16, DType::bf16}) {
      CAPTURE(dtype_name(type));
      for (const AdamConfig& config :
           {AdamConfig{.lr = 0.05f}, AdamConfig{.lr = 0.05f, .weight_decay = 0.1f},
            AdamConfig{.lr = 0.05f, .weight_decay = 0.1f, .decoupled = true}}) {
        Tensor a = randn(Shape{n}, 3), b = a.clone(), ma(n), va(n), mb(n), vb(n);
        for (int t = 1; t <= 3; ++t) {
          // Small gradients, subnormal in f16 for some elements, and an exact zero.
          Tensor g = scale(randn(Shape{n}, 50 + static_cast<std::uint64_t>(t)), 1e-3f);
          g[0] = 0.0f;
          g[1] = 3e-7f;
          const Tensor g16 = cast(g, type), g32 = cast(g16, DType::f32);
          adam_update(a, g16, ma, va, t, config);
          adam_update(b, g32, mb, vb, t, config);
        }
        CHECK_MESSAGE(a.bitwise_equal(b), "params from " << dtype_name(type) << " gradients differ "
                                                         << "from the same values in f32 by "
                                                         << max_abs_diff(a, b));
        CHECK(ma.bitwise_equal(mb));
        CHECK(va.bitwise_equal(vb));
      }
    }
    Tensor p(4), m(4), v(4);
    const Tensor ids = Tensor::from_vector(std::vector<std::int32_t>{1, 2, 3, 4});
    CHECK_THROWS_AS(adam_update(p, ids, m, v, 1, AdamConfig{}), Error);
    Tensor p16 = cast(p, DType::f16);  // the weights Adam updates stay f32
    CHECK_THROWS_AS(adam_update(p16, cast(p, DType::f16), m, v, 1, AdamConfig{}), Error);
  }

  TEST_CASE("Linear in a 16-bit store adds its weight gradient in f32, rounded once") {
    // x (5 x 4) and dy (5 x 3) in f16; dW = x^T dy, from two micro-batches (rows 0-2 and
    // 3-4): dW = round(round(x1^T dy1) + round(x2^T dy2)), every sum in double here.
    ParameterStore store;
    Linear fc(store, "fc", 4, 3, 9, false);
    store.allocate(Memory::host, DType::f16);
    const Tensor x = cast(randn(Shape{5, 4}, 61), DType::f16);
    const Tensor dy = cast(scale(randn(Shape{5, 3}, 62), 0.01f), DType::f16);
    const Tensor x32 = cast(x, DType::f32), dy32 = cast(dy, DType::f32);
    auto partial = [&](std::int64_t first, std::int64_t rows, std::int64_t i, std::int64_t j) {
      double sum = 0;
      for (std::int64_t k = first; k < first + rows; ++k)
        sum += static_cast<double>(x32(k, i)) * static_cast<double>(dy32(k, j));
      return sum;
    };
    store.zero_grad();
    for (auto [first, rows] : {std::pair<std::int64_t, std::int64_t>{0, 3}, {3, 2}}) {
      Forward f = fc.forward(x.slice(first, rows));
      CHECK(f.out.dtype() == DType::f16);
      const Tensor dx = fc.backward(dy.slice(first, rows), f.saved);
      CHECK(dx.dtype() == DType::f16);
    }
    const Tensor got = cast(fc.weight().grad, DType::f32);
    int wrong = 0;
    for (std::int64_t i = 0; i < 4; ++i)
      for (std::int64_t j = 0; j < 3; ++j) {
        const float first = to_float(from_float<Half>(static_cast<float>(partial(0, 3, i, j))));
        const float second = to_float(from_float<Half>(static_cast<float>(partial(3, 2, i, j))));
        const float want = to_float(from_float<Half>(first + second));
        // An f32 sum of the products may round to the f16 neighbour of the double's: one ulp.
        const float ulp = std::ldexp(1.0f, std::ilogb(std::max(std::fabs(want), 6.1e-5f)) - 10);
        if (std::fabs(got(i, j) - want) > ulp) {
          ++wrong;
          MESSAGE("dW(" << i << ", " << j << ") = " << got(i, j) << ", want " << want
                        << " (the two micro-batches' sums added)");
        }
      }
    CHECK_MESSAGE(wrong == 0, wrong << " of 12 weight-gradient elements differ");
  }

  // -------------------------------------------------------------------------
  // 6. Errors

  TEST_CASE("shape mismatches inside layers throw shardlab::Error") {
    ParameterStore store;
    Linear fc(store, "fc", 4, 2, 1);
    LayerNorm ln(store, "ln", 6);
    Embedding emb(store, "emb", 5, 3, 2);
    store.allocate();
    const CausalSelfAttention attention(2, 4);
    Tanh tanh_layer;
    Gelu gelu_layer;

    CHECK_THROWS_WITH_AS(fc.forward(zeros(3, 5)), doctest::Contains("fc"), Error);
    Forward f = fc.forward(zeros(3, 4));
    CHECK_THROWS_AS(fc.backward_input(zeros(3, 3), f.saved), Error);
    CHECK_THROWS_AS(fc.backward_input(zeros(2, 2), f.saved), Error);

    CHECK_THROWS_WITH_AS(ln.forward(zeros(3, 5)), doctest::Contains("ln"), Error);
    f = ln.forward(zeros(3, 6));
    CHECK_THROWS_AS(ln.backward_input(zeros(3, 5), f.saved), Error);

    for (Layer* layer : std::vector<Layer*>{&tanh_layer, &gelu_layer}) {
      CAPTURE(layer->name());
      f = layer->forward(zeros(3, 5));
      CHECK_THROWS_AS(layer->backward_input(zeros(3, 4), f.saved), Error);
    }

    CHECK_THROWS_AS(emb.forward(zeros(Shape{4})), Error);  // f32 ids
    CHECK_THROWS_AS(emb.forward(Tensor::from_vector(std::vector<std::int32_t>{0, 5})), Error);
    CHECK_THROWS_AS(emb.forward(Tensor::from_vector(std::vector<std::int64_t>{-1})), Error);
    f = emb.forward(Tensor::from_vector(std::vector<std::int32_t>{0, 4}));
    CHECK_THROWS_AS(emb.backward_input(zeros(2, 4), f.saved), Error);

    CHECK_THROWS_AS(attention.forward(zeros(8, 10)), Error);  // 10 columns: not 3C, H | C
    CHECK_THROWS_AS(attention.forward(zeros(7, 24)), Error);  // 7 rows: not sequences of 4
    f = attention.forward(zeros(8, 24));
    CHECK_THROWS_AS(attention.backward_input(zeros(8, 7), f.saved), Error);

    Built model({"", mlp, normal(4, 3)});
    auto& seq = dynamic_cast<Sequential&>(*model.layer);
    Saved wrong;  // not from this model's forward
    CHECK_THROWS_AS(seq.backward_input(zeros(4, 2), wrong), Error);
    CHECK_THROWS_AS(seq.forward(zeros(4, 4)), Error);
    CHECK_THROWS_AS(seq.slice(2, 1), Error);
    CHECK_THROWS_AS(seq.slice(0, 4), Error);

    CHECK_THROWS_AS(squared_error(zeros(2, 3), zeros(3, 2)), Error);
    CHECK_THROWS_AS(store.add("late", zeros(1, 1)), Error);
    CHECK_THROWS_AS(ParameterStore().add("ids", Tensor::from_vector(std::vector<std::int32_t>{1})),
                    Error);
  }

  TEST_CASE("backward_weight before backward_input, or twice, throws shardlab::Error") {
    for_each_w_out_of_turn(
        [](const std::function<void()>& call) { CHECK_THROWS_AS(call(), Error); });
  }

  TEST_CASE("backward_weight before backward_input says that backward_input must come first") {
    for_each_w_out_of_turn([](const std::function<void()>& call) {
      CHECK_THROWS_WITH_AS(call(), doctest::Contains("needs backward_input first"), Error);
    });
  }

  TEST_CASE("cross_entropy refuses targets out of range or of the wrong count or type") {
    const Tensor logits = randn(2, 5, 1);
    CHECK_THROWS_WITH_AS(
        cross_entropy(logits, Tensor::from_vector(std::vector<std::int32_t>{0, 5})),
        doctest::Contains("target[1] = 5"), Error);
    CHECK_THROWS_AS(cross_entropy(logits, Tensor::from_vector(std::vector<std::int64_t>{-1, 0})),
                    Error);
    CHECK_THROWS_AS(cross_entropy(logits, Tensor::from_vector(std::vector<std::int32_t>{0})),
                    Error);
    CHECK_THROWS_AS(cross_entropy(logits, Tensor::from_1d({0, 1})), Error);
  }

  TEST_CASE("optimizers refuse buffers of another size") {
    Adam adam(4, AdamConfig{});
    Tensor p(4), g5(5);
    CHECK_THROWS_AS(adam.step(p, g5), Error);
    Tensor p5(5);
    CHECK_THROWS_AS(adam.step(p5, g5), Error);
    CHECK_THROWS_AS(sgd_step(p, g5, 0.1f), Error);
    CHECK(adam.steps() == 0);
  }
}

TEST_CASE("Checkpoint recomputes its layer's forward and gives the same gradients, bit for bit") {
  // Wrong version tried: a forward that keeps its output instead of its input (the
  // recomputation starts from the wrong tensor): "dL/dx differs", "W's gradient differs"
  // (and in chapter 09, where the attention's output is narrower than its input, a shape
  // error naming the op).
  for (bool split : {false, true}) {
    CAPTURE(split);
    ParameterStore plain_store, wrapped_store;
    auto build = [](ParameterStore& store) {
      auto block = std::make_shared<Sequential>();
      block->add<Linear>(store, "fc1", 6, 12, 31);
      block->add<Gelu>();
      block->add<Linear>(store, "fc2", 12, 6, 32);
      return block;
    };
    auto plain = build(plain_store);
    Checkpoint wrapped(build(wrapped_store));
    plain_store.allocate();
    wrapped_store.allocate();
    const Tensor x = randn(5, 6, 33), dy = randn(5, 6, 34);
    Forward a = plain->forward(x), b = wrapped.forward(x);
    CHECK(b.out.bitwise_equal(a.out));
    CHECK(b.saved.tensors.size() == 1);  // the input only
    Tensor dxa, dxb;
    if (split) {
      dxa = plain->backward_input(dy, a.saved);
      plain->backward_weight(a.saved);
      dxb = wrapped.backward_input(dy, b.saved);
      wrapped.backward_weight(b.saved);
    } else {
      dxa = plain->backward(dy, a.saved);
      dxb = wrapped.backward(dy, b.saved);
    }
    CHECK_MESSAGE(dxb.bitwise_equal(dxa), "dL/dx differs");
    CHECK_MESSAGE(wrapped_store.grads().bitwise_equal(plain_store.grads()), "W's gradient differs");
    CHECK(max_abs(plain_store.grads()) > 0);
  }
}
