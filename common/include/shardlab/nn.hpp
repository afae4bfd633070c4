// nn: the layers the chapters train, forward and backward written out, and the
// optimizers that update them.
//
// Parameters live in one flat buffer and their gradients in another (ParameterStore, as
// llm.c's malloc_and_point_parameters does): every weight is a view into the first, its
// gradient a view into the second, so a gradient bucket (chapter 02) or a ZeRO shard
// (chapter 05) is a range of one buffer, not a copy.
//
// A layer keeps no state between calls. forward(x) returns the output and what backward
// will need (Saved: the input, the activations), so any number of micro-batches can be in
// flight at once (a pipeline schedule keeps one Saved per micro-batch). Backward comes in
// two halves, as zero-bubble pipelines need:
//   backward_input(dy, saved)   B: dL/dx, from dL/dy; keeps dy in `saved` for W
//   backward_weight(saved)      W: adds dL/dparameters into the gradients
// backward(dy, saved) is B then W: the same calls, so the same bits.
// Gradients accumulate (+=) until zero_grad, so micro-batches add up.
//
// Shapes (2-D, rows are tokens or samples): B = rows, I = input features, O = output
// features, C = channels, V = vocabulary, T = sequence length, H = heads, D = C / H.
//   Linear        y = x @ W + b                x is B x I, W is I x O, b is 1 x O
//   Tanh, Gelu    elementwise
//   LayerNorm     y = (x - mean) / sqrt(var + eps) * gamma + beta, over each row of C
//   Embedding     y[i] = W[index[i]]           index is i32/i64 [B], W is V x C
//   CausalSelfAttention  qkv (B*T x 3C) -> y (B*T x C); each head's q, k, v side by side
//   cross_entropy        mean over rows of -log softmax(logits)[target]
// Every backward is checked against finite differences (test_nn.cpp). Every layer and the
// loss run on the host, or on a GPU when their tensors are in device memory (kernels in
// cuda.cu that follow the host loops step for step; test_cuda.cpp compares the two).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "shardlab/tensor.hpp"

namespace shardlab::nn {

// ---------------------------------------------------------------------------
// Parameters

/// A trainable tensor and its gradient: views into the store's flat buffers once the
/// store is allocated (standalone tensors before).
struct Parameter {
  std::string name;  ///< The layer's name and the parameter's: "l1.weight", "ln.gamma".
  Tensor value;      ///< The value; a view into the store's values() once allocated.
  Tensor grad;       ///< The gradient backward_weight adds into; a view into the store's grads().
  std::int64_t offset = 0;  ///< Where it starts in the flat buffers (elements).
};

/// All parameters in one flat buffer, all gradients in another.
///   ParameterStore store;
///   Linear l1(store, "l1", 16, 64, seed);   // layers add their parameters
///   store.allocate();                        // one buffer each; parameters become views
class ParameterStore {
 public:
  /// Adds a parameter with initial value `init`. The reference stays valid.
  Parameter& add(std::string name, Tensor init);
  /// Allocates the flat buffers in `memory`, of `type`, copies every initial value in
  /// (rounded once to `type`), and points each parameter's value and grad at its range.
  /// `type` is f32, or f16 / bf16 for mixed precision's 16-bit weights and gradients (the
  /// fp32 master copy is the optimizer's; Linear without bias, Tanh and Gelu run on
  /// them). The memory ledger counts the values as params and the gradients as grads
  /// (memory.hpp). Call once, after every add.
  void allocate(Memory memory = Memory::host, DType type = DType::f32);
  /// True once allocate() has run.
  bool allocated() const { return done_; }
  /// The type of the flat buffers: f32 until allocate() says otherwise.
  DType dtype() const { return dtype_; }

  /// The flat buffers (1-D, size() elements each): for an optimizer, a bucket, a shard.
  /// Undefined once released (below).
  Tensor& values() { return values_; }
  /// The flat gradient buffer (as values(): 1-D, size() elements; undefined once released).
  Tensor& grads() { return grads_; }
  /// For an owner that keeps the gradients its own way (ZeRO stages 2 and 3, chapter 05:
  /// each rank a shard of them): the flat gradient buffer is dropped, and every
  /// parameter's grad is empty until that owner points it at a tensor of its own (a
  /// bucket the backward adds into).
  void release_grads();
  /// The same for the values (ZeRO stage 3): every parameter's value is empty until its
  /// owner points it at a tensor of its own (its group, gathered for a forward).
  void release_values();
  /// Parameters in the order they were added (the order of the flat buffers).
  std::vector<Parameter*> parameters();
  /// Total number of parameter elements.
  std::int64_t size() const { return size_; }
  /// Sets every gradient to zero (one pass over the flat gradient buffer; once it is
  /// released, every parameter's grad that points somewhere).
  void zero_grad();

 private:
  std::deque<Parameter> params_;  // a deque: references stay valid as it grows
  Tensor values_, grads_;
  std::int64_t size_ = 0;
  DType dtype_ = DType::f32;
  bool done_ = false;
};

// ---------------------------------------------------------------------------
// Layers

/// What one forward call keeps for its backward. Each layer says what it puts here.
struct Saved {
  std::vector<Tensor> tensors;  ///< Inputs, activations.
  Tensor dy;                    ///< Kept by backward_input for backward_weight.
  std::vector<Saved> children;  ///< A Sequential's: one per layer (Residual, Checkpoint: one).
};

/// What a layer's forward returns: the output, and what its backward needs.
struct Forward {
  Tensor out;   ///< y = f(x).
  Saved saved;  ///< What backward_input and backward_weight need from this call.
};

/// A layer: forward, and backward in two halves (B: backward_input, W: backward_weight).
/// It keeps no state between calls: what a backward needs travels in Saved.
class Layer {
 public:
  virtual ~Layer() = default;
  /// For messages: a layer with parameters gives its own name (its parameters' prefix),
  /// the others their kind ("tanh").
  virtual std::string name() const = 0;
  /// y = f(x), and what backward needs.
  virtual Forward forward(const Tensor& x) const = 0;
  /// B: dL/dx from dL/dy. Layers with parameters keep dy in `saved` for backward_weight.
  virtual Tensor backward_input(const Tensor& dy, Saved& saved) const = 0;
  /// W: adds dL/dparameters into the gradients, from what forward and backward_input
  /// kept (then drops it). Nothing for layers without parameters.
  virtual void backward_weight(Saved& saved);
  /// B then W.
  Tensor backward(const Tensor& dy, Saved& saved);
  /// The layer's parameters (views into its store): none unless a layer says otherwise.
  virtual std::vector<Parameter*> parameters() const { return {}; }
};

/// Mixed precision as torch.autocast runs a Linear on f32 weights (PyTorch's autocast op
/// list puts linear and matmul in the 16-bit type; LayerNorm, softmax and the loss stay
/// f32): `type` f16 or bf16 (f32: off). Forward: x, W and b rounded to `type`, the
/// products summed in f32 (a product of two 16-bit values is exact in f32), y rounded to
/// `type` once. Backward: dL/dy rounded to `type`; dL/dx from the rounded operands,
/// rounded once; dW and db from them, each rounded to `type` once and added into the f32
/// gradients (autocast's weight cast, whose backward casts back). A tensor-parallel
/// layer whose y (or dL/dx) is a partial sum rounds it after the sum instead: it turns
/// round_output (round_input_grad) off. The values are held in f32 tensors: the
/// arithmetic of 16-bit storage, not its memory.
struct Autocast {
  DType type = DType::f32;       ///< f16 or bf16: the type operands are rounded to; f32: off.
  bool round_output = true;      ///< Round y to `type` (off where y is a partial sum).
  bool round_input_grad = true;  ///< Round dL/dx to `type` (off where it is a partial sum).
};

/// y = x @ W + b. Saved: x. W ~ N(0, 1/I) from `seed` (LeCun init), b = 0. In a 16-bit
/// store (no bias), x and dy are of the store's type and dW is added in f32, rounded once.
class Linear final : public Layer {
 public:
  /// Adds its parameters to `store`: `<name>.weight` (in x out) and, with `bias`,
  /// `<name>.bias` (1 x out).
  Linear(ParameterStore& store, const std::string& name, std::int64_t in, std::int64_t out,
         std::uint64_t seed, bool bias = true);
  std::string name() const override { return name_; }
  Forward forward(const Tensor& x) const override;
  /// dL/dx = dy @ W^T.
  Tensor backward_input(const Tensor& dy, Saved& saved) const override;
  /// dL/dW += x^T @ dy, dL/db += the column sums of dy.
  void backward_weight(Saved& saved) override;
  std::vector<Parameter*> parameters() const override;
  /// W, in x out.
  Parameter& weight() { return *weight_; }
  /// b, 1 x out; null for a Linear without bias.
  Parameter* bias() { return bias_; }
  /// Mixed precision on an f32 store (Autocast above).
  void set_autocast(Autocast autocast);

 private:
  std::string name_;
  Parameter* weight_;
  Parameter* bias_ = nullptr;
  Autocast autocast_;
};

/// y = tanh(x); dL/dx = dy * (1 - y^2). Saved: y.
class Tanh final : public Layer {
 public:
  std::string name() const override { return "tanh"; }
  Forward forward(const Tensor& x) const override;
  Tensor backward_input(const Tensor& dy, Saved& saved) const override;
};

/// GELU, tanh approximation (tensor.hpp). Saved: x.
class Gelu final : public Layer {
 public:
  std::string name() const override { return "gelu"; }
  Forward forward(const Tensor& x) const override;
  Tensor backward_input(const Tensor& dy, Saved& saved) const override;
};

/// Normalises each row of C channels, then scales by gamma and shifts by beta (both
/// learned; gamma = 1, beta = 0 at the start). Saved: x, and each row's mean and
/// 1/sqrt(var + eps). On the host or a GPU (x, the parameters and dy in one memory).
class LayerNorm final : public Layer {
 public:
  /// Adds `<name>.gamma` (ones) and `<name>.beta` (zeros), 1 x `channels` each, to `store`;
  /// `eps` is added to the variance.
  LayerNorm(ParameterStore& store, const std::string& name, std::int64_t channels,
            float eps = 1e-5f);
  std::string name() const override { return name_; }
  Forward forward(const Tensor& x) const override;
  Tensor backward_input(const Tensor& dy, Saved& saved) const override;
  void backward_weight(Saved& saved) override;
  std::vector<Parameter*> parameters() const override { return {gamma_, beta_}; }

 private:
  std::string name_;
  Parameter* gamma_;
  Parameter* beta_;
  float eps_;
};

/// Rows of a V x C table picked by token ids: x is an i32/i64 index vector, y is B x C.
/// There is no dL/dx (ids are not differentiable): backward_input returns an empty
/// tensor. W ~ N(0, 1) * `scale` from `seed`.
class Embedding final : public Layer {
 public:
  /// Adds `<name>.weight` (vocab x channels) to `store`.
  Embedding(ParameterStore& store, const std::string& name, std::int64_t vocab,
            std::int64_t channels, std::uint64_t seed, float scale = 0.02f);
  std::string name() const override { return name_; }
  Forward forward(const Tensor& x) const override;
  Tensor backward_input(const Tensor& dy, Saved& saved) const override;
  /// dL/dW[index[i]] += dy[i], in order of i.
  void backward_weight(Saved& saved) override;
  std::vector<Parameter*> parameters() const override { return {weight_}; }

 private:
  std::string name_;
  Parameter* weight_;
};

/// Causal self-attention with H heads of D = C / H channels, for sequences of T tokens:
/// x is (B*T) x 3C, rows grouped by sequence; for head h, columns [3hD, 3hD + D) are its
/// queries, the next D its keys, the next D its values (Megatron's layout: each head's
/// q, k, v side by side, so a contiguous block of columns is a set of whole heads and
/// tensor parallelism splits heads by splitting columns). y is (B*T) x C, head h in
/// columns [hD, hD + D). Token t attends to tokens 0..t, with weights
/// softmax(q k^T / sqrt(D)). No parameters: the projections are Linear layers around it.
/// Saved: x and the attention weights (B x H x T x T). On the host or a GPU.
class CausalSelfAttention final : public Layer {
 public:
  /// H = `heads`, T = `sequence`; throws Error unless both are at least 1.
  CausalSelfAttention(std::int64_t heads, std::int64_t sequence);
  std::string name() const override { return "attention"; }
  Forward forward(const Tensor& x) const override;
  Tensor backward_input(const Tensor& dy, Saved& saved) const override;

 private:
  std::int64_t heads_, sequence_;
};

/// Layers in order; slice() gives a stage of a pipeline (the same layers, shared).
class Sequential final : public Layer {
 public:
  Sequential() = default;
  /// Adds a layer at the end and returns it.
  template <class L, class... Args>
  L& add(Args&&... args) {
    auto layer = std::make_shared<L>(std::forward<Args>(args)...);
    L& ref = *layer;
    layers_.push_back(std::move(layer));
    return ref;
  }
  /// Adds an existing layer at the end (shared, not copied).
  void add(std::shared_ptr<Layer> layer) { layers_.push_back(std::move(layer)); }
  /// The number of layers.
  std::size_t size() const { return layers_.size(); }
  /// Layer i (unchecked).
  Layer& operator[](std::size_t i) { return *layers_[i]; }
  /// Layer i itself, to wrap it (std::out_of_range past the end).
  std::shared_ptr<Layer> layer(std::size_t i) const { return layers_.at(i); }
  /// Layer i replaced (by a Checkpoint of it, say; std::out_of_range past the end).
  void set(std::size_t i, std::shared_ptr<Layer> layer) { layers_.at(i) = std::move(layer); }
  /// Layers [begin, end) as a Sequential of their own, sharing them (a pipeline stage).
  Sequential slice(std::size_t begin, std::size_t end) const;

  std::string name() const override { return "sequential"; }
  /// Saved: one child per layer.
  Forward forward(const Tensor& x) const override;
  /// Every layer's B, last to first; each keeps its own dy for W.
  Tensor backward_input(const Tensor& dy, Saved& saved) const override;
  /// Every layer's W.
  void backward_weight(Saved& saved) override;
  std::vector<Parameter*> parameters() const override;

 private:
  std::vector<std::shared_ptr<Layer>> layers_;
};

/// y = x + inner(x): a residual connection around a block (a transformer's attention or
/// MLP, a Megatron block). Saved: one child, the inner block's.
class Residual final : public Layer {
 public:
  /// Around `inner` (a Sequential is a handle: its layers are shared, not copied).
  explicit Residual(Sequential inner) : inner_(std::move(inner)) {}
  std::string name() const override { return "residual"; }
  Forward forward(const Tensor& x) const override;
  /// dL/dx = dy + the inner block's dL/dx.
  Tensor backward_input(const Tensor& dy, Saved& saved) const override;
  void backward_weight(Saved& saved) override;
  std::vector<Parameter*> parameters() const override { return inner_.parameters(); }
  /// The inner block.
  Sequential& inner() { return inner_; }

 private:
  Sequential inner_;
};

/// Activation checkpointing (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
/// Cost"; Megatron-LM's recompute): forward keeps only the input and drops everything
/// `inner` saved; backward_input runs inner's forward again from that input, then its
/// backward. The same gradients, bit for bit (the same forward, run twice), for a second
/// forward's time (and its communication, for a tensor-parallel block); inner's
/// activations live only while its own backward runs. Saved: the input, then (after
/// backward_input) one child, inner's.
class Checkpoint final : public Layer {
 public:
  /// Around `inner` (shared).
  explicit Checkpoint(std::shared_ptr<Layer> inner) : inner_(std::move(inner)) {}
  std::string name() const override { return "checkpoint(" + inner_->name() + ")"; }
  Forward forward(const Tensor& x) const override;
  Tensor backward_input(const Tensor& dy, Saved& saved) const override;
  void backward_weight(Saved& saved) override;
  std::vector<Parameter*> parameters() const override { return inner_->parameters(); }
  /// The layer it recomputes.
  Layer& inner() { return *inner_; }

 private:
  std::shared_ptr<Layer> inner_;
};

// ---------------------------------------------------------------------------
// Losses

/// What a loss function returns: its value, and what its backward needs.
struct Loss {
  double value = 0;  ///< The mean over rows.
  Saved saved;       ///< What the backward needs (cross_entropy_backward).
};
/// Softmax cross-entropy, the mean over the B rows of -log softmax(logits[i])[target[i]];
/// logits is B x V (f32), targets an i32/i64 vector of B class ids. Saved: the softmax
/// probabilities and the targets. On the host or a GPU (logits and targets in one memory).
Loss cross_entropy(const Tensor& logits, const Tensor& targets);
/// dL/dlogits = (softmax - one_hot(target)) / B.
Tensor cross_entropy_backward(const Saved& saved);

/// Sum over elements of (pred - target)^2, in double; the MSE loss is this / (2B).
double squared_error(const Tensor& pred, const Tensor& target);
/// dL/dpred for L = sum (pred - target)^2 / (2 * denominator): (pred - target) / denominator.
Tensor mse_backward(const Tensor& pred, const Tensor& target, double denominator);

// ---------------------------------------------------------------------------
// Optimizers, over flat f32 tensors: the store's buffers, or any range of them (a shard
// of the flat buffer works the same), on the host or a GPU.

/// params -= lr * grads.
void sgd_step(Tensor& params, const Tensor& grads, float lr);

/// Adam's hyperparameters, with PyTorch's defaults (Adam describes the update).
struct AdamConfig {
  float lr = 1e-3f;           ///< Learning rate.
  float beta1 = 0.9f;         ///< Decay rate of the first moment m.
  float beta2 = 0.999f;       ///< Decay rate of the second moment v.
  float eps = 1e-8f;          ///< Added to the denominator, sqrt(v / (1 - beta2^t)).
  float weight_decay = 0.0f;  ///< 0: none; see `decoupled` for how it applies.
  /// false: Adam with L2 (weight decay added to the gradient, PyTorch's Adam);
  /// true: AdamW (decoupled: params *= 1 - lr * weight_decay first, PyTorch's AdamW).
  bool decoupled = false;
};

/// One Adam step t (1, 2, ...) over `params` with the state m and v (f32, one size, one
/// memory): the update Adam::step describes below, for a caller that keeps its own state
/// (a ZeRO shard's, chapter 05). `grads` is f32, or f16 / bf16 (mixed precision's
/// gradients), each element read as the float it holds.
void adam_update(Tensor& params, const Tensor& grads, Tensor& m, Tensor& v, int t,
                 const AdamConfig& config);

/// Adam (Kingma & Ba 2015, Algorithm 1) and AdamW (Loshchilov & Hutter 2019), with the
/// update PyTorch's documentation writes out. Step t = 1, 2, ..., element by element:
///   g = grad (+ weight_decay * p for Adam's L2)
///   p = p * (1 - lr * weight_decay)            (AdamW only)
///   m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
///   p -= lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
/// computed as torch.optim.Adam's single-tensor step (foreach=False) does it: the bias
/// corrections, lr / (1 - beta1^t) and sqrt(1 - beta2^t), and 1 - lr * weight_decay in
/// double, each rounded to float once; m moved by lerp(m, g, 1 - beta1); then
/// p += (-step_size * m) / (sqrt(v) / sqrt(1 - beta2^t) + eps). (The hyperparameters are
/// floats here, 0.9f being 0.899999976: PyTorch given the same values follows the same
/// steps; its vectorised kernels may fuse a multiply-add where these do not.)
/// The state is two f32 tensors the size of the parameters it updates: m and v, 8 bytes
/// per parameter (chapter 05's "4x the parameters" with params and grads).
class Adam {
 public:
  /// The state for `size` parameters: m and v, f32 zeros in `memory`.
  Adam(std::int64_t size, AdamConfig config, Memory memory = Memory::host);
  /// Step t = steps() + 1 over `params` (f32, `size` elements) with `grads` (as
  /// adam_update takes them); throws Error before counting a step for a bad call.
  void step(Tensor& params, const Tensor& grads);
  /// The number of steps taken: 0 before the first, t after step t.
  int steps() const { return t_; }
  /// Sets the state to a saved one (a checkpoint's): m and v (f32, the optimizer's size)
  /// after `steps` steps.
  void restore(const Tensor& m, const Tensor& v, int steps);
  /// The first moment m (1-D f32, `size` elements).
  const Tensor& m() const { return m_; }
  /// The second moment v (1-D f32, `size` elements).
  const Tensor& v() const { return v_; }
  /// The hyperparameters.
  const AdamConfig& config() const { return config_; }

 private:
  AdamConfig config_;
  Tensor m_, v_;
  int t_ = 0;
};

}  // namespace shardlab::nn
