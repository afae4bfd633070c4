// Chapter 10's ring attention as the GPT's attention core (context_parallel.hpp).
#include "context_parallel.hpp"

#include "shardlab/check.hpp"

namespace ch10 {

using shardlab::Memory;
using shardlab::Shape;
using shardlab::Tensor;
namespace nn = shardlab::nn;

namespace {

using shardlab::idx;

/// Column `part` (0 q, 1 k, 2 v) of every head of `x` (rows x 3 heads D, each head's q, k,
/// v side by side), as rows x heads x D.
std::vector<float> take(const Tensor& x, std::int64_t heads, int part) {
  const std::int64_t rows = x.rows(), D = x.cols() / (3 * heads);
  std::vector<float> out(idx(rows * heads * D));
  const float* in = x.data();
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t h = 0; h < heads; ++h)
      std::copy_n(in + i * 3 * heads * D + (3 * h + part) * D, D,
                  out.begin() + static_cast<std::ptrdiff_t>((i * heads + h) * D));
  return out;
}

/// The inverse: `values` (rows x heads x D) into column `part` of every head of `x`.
void put(const std::vector<float>& values, std::int64_t heads, int part, Tensor& x) {
  const std::int64_t rows = x.rows(), D = x.cols() / (3 * heads);
  float* out = x.data();
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t h = 0; h < heads; ++h)
      std::copy_n(values.begin() + static_cast<std::ptrdiff_t>((i * heads + h) * D), D,
                  out + i * 3 * heads * D + (3 * h + part) * D);
}

std::vector<float> values_of(const Tensor& t) { return {t.data(), t.data() + t.size()}; }

class RingContext final : public ch09::ContextParallel {
 public:
  RingContext(Split split, bool overlap) : split_(split), overlap_(overlap) {}
  std::string name() const override {
    return std::string("ring attention (chapter 10), ") +
           (split_ == Split::zigzag ? "zigzag" : "plain") + " split";
  }
  void check(std::int64_t T, int cp) const override {
    const int chunks = split_ == Split::zigzag ? 2 * cp : cp;
    shardlab::require_usage(T % chunks == 0,
                            "--cp " + std::to_string(cp) + " cuts each sequence into " +
                                std::to_string(chunks) + " equal chunks (" +
                                (split_ == Split::zigzag ? "the zigzag split, 2 cp" : "cp") +
                                "): they must divide --context " + std::to_string(T));
  }
  std::vector<std::int64_t> positions(std::int64_t T, int cp, int rank) const override {
    return rank_positions(T, cp, rank, split_);
  }
  std::shared_ptr<nn::Layer> core(Communicator& cp, std::int64_t heads,
                                  std::int64_t T) const override {
    return std::make_shared<RingAttentionCore>(cp, heads, T, split_, overlap_);
  }
  std::uint64_t forward_bytes(int cp, std::int64_t T, std::int64_t sequences, std::int64_t heads,
                              std::int64_t head_dim) const override {
    return ring_forward_bytes(cp, block(cp, T, sequences, heads, head_dim));
  }
  std::uint64_t backward_bytes(int cp, std::int64_t T, std::int64_t sequences, std::int64_t heads,
                               std::int64_t head_dim) const override {
    return ring_backward_bytes(cp, block(cp, T, sequences, heads, head_dim));
  }
  double kept_per_token_and_head(std::int64_t) const override { return 1; }  // the log-sum-exp

 private:
  /// One of k or v of a rank's rows: T/cp rows of each sequence, heads x head_dim floats.
  static std::uint64_t block(int cp, std::int64_t T, std::int64_t sequences, std::int64_t heads,
                             std::int64_t head_dim) {
    return static_cast<std::uint64_t>(sequences * (T / cp) * heads * head_dim) * sizeof(float);
  }
  Split split_;
  bool overlap_;
};

}  // namespace

RingAttentionCore::RingAttentionCore(Communicator& cp, std::int64_t heads, std::int64_t T,
                                     Split split, bool overlap)
    : cp_(cp), heads_(heads), T_(T), split_(split), overlap_(overlap) {
  shardlab::require(heads >= 1 && T >= 1, "ring attention: needs a head and a token");
}

RingShape RingAttentionCore::shape_of(std::int64_t rows, std::int64_t columns) const {
  const std::int64_t n =
      static_cast<std::int64_t>(rank_positions(T_, cp_.size(), cp_.rank(), split_).size());
  shardlab::require(columns % (3 * heads_) == 0 && rows % n == 0, [&] {
    return "ring attention: x has " + std::to_string(rows) + " x " + std::to_string(columns) +
           "; expected whole sequences' " + std::to_string(n) + " rows on this rank x 3 x " +
           std::to_string(heads_) + " heads";
  });
  return {T_, split_, heads_, columns / (3 * heads_), rows / n, overlap_};
}

nn::Forward RingAttentionCore::forward(const Tensor& x_in) const {
  const RingShape shape = shape_of(x_in.rows(), x_in.cols());
  const Tensor x = x_in.to(Memory::host);
  RingSaved ring;
  ring_attention(cp_, take(x, heads_, 0), take(x, heads_, 1), take(x, heads_, 2), shape, &ring);
  // Kept: the input (c_attn's output, which it keeps too), the output (c_proj keeps it as
  // its input) and the log-sum-exp; the ring's own copies of q, k and v go.
  const Tensor y = ring.out.reshape(Shape{x.rows(), heads_ * shape.head_dim}).to(x_in.memory());
  nn::Forward f{y, {}};
  f.saved.tensors = {x_in, y, ring.lse};
  return f;
}

Tensor RingAttentionCore::backward_input(const Tensor& dy, nn::Saved& saved) const {
  const Tensor x = saved.tensors.at(0).to(Memory::host), y = saved.tensors.at(1).to(Memory::host);
  const RingShape shape = shape_of(x.rows(), x.cols());
  shardlab::require(dy.rows() == x.rows() && dy.cols() == y.cols(),
                    "ring attention backward: dy is " + dy.describe() + ", y " + y.describe());
  auto tensor = [](const std::vector<float>& v) { return Tensor::from_vector(v); };
  const RingSaved ring{
      tensor(take(x, heads_, 0)), tensor(take(x, heads_, 1)),
      tensor(take(x, heads_, 2)), y.flat(),
      saved.tensors.at(2),        rank_positions(T_, cp_.size(), cp_.rank(), split_)};
  const RingGrads g = ring_attention_backward(cp_, ring, values_of(dy.to(Memory::host)), shape);
  Tensor dx(Shape{x.rows(), x.cols()}, shardlab::DType::f32);
  put(g.dq, heads_, 0, dx);
  put(g.dk, heads_, 1, dx);
  put(g.dv, heads_, 2, dx);
  return dx.to(dy.memory());
}

std::shared_ptr<const ch09::ContextParallel> ring_context(Split split, bool overlap) {
  return std::make_shared<RingContext>(split, overlap);
}

}  // namespace ch10
