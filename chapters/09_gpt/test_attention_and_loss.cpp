// Chapter 09's exercise tests: tensor-parallel attention and the vocabulary-parallel
// cross-entropy (attention_and_loss.hpp), against one device, on tp 1, 2, 3 and 4 ranks.
//
// References are computed independently of the code under test: the one-device block
// from the library's layers (gpt.cpp's attention_block), the cross-entropy in double
// from its definition, over every element.
//
// Wrong versions this test was checked against, and what each gives:
//   attention over all H heads on every rank (nn::CausalSelfAttention(H, T) on the rank's
//     3C/t columns): "y on tp 2: 384 of 384 elements differ" (heads of the wrong size)
//   c_attn as a whole nn::Linear on every rank (every rank computes every head's q, k,
//     v): "h.1.attn.c_proj: x is f32 24x16 on host, expected 8 columns" on tp 2
//   c_proj without residual_scale, or another seed: "y on tp 1: 384 of 384 elements
//     differ" (tp 1 already)
//   the Linears built without options.tp (sequence parallelism ignored): "y under sequence
//     parallelism (options.tp: this rank's n/t rows) on tp 2, rank 0: 256 of 256 elements
//     differ"
//   softmax over the rank's own columns only: "the loss differs on tp 2, rank 0: -3.36,
//     want 1.58"
//   each rank's own maximum, not the agreed one: "the loss differs on tp 2, rank 1: 1.76"
//   the target's logit looked up at targets[r] instead of targets[r] - vocab.offset:
//     "the loss differs on tp 2, rank 1: 2.00"
//   no maximum subtracted at all: "the loss is not finite on tp 1: inf" (logits near 200)
//   the backward without 1 / denominator: "dlogits on tp 1, rank 0: 46 of 60 elements
//     differ"
//   the backward's one-hot also on a column of another rank's token: "dlogits on tp 2,
//     rank 1: 3 of 30 elements differ"
#include <doctest/doctest.h>

#include <cmath>
#include <map>

#include "attention_and_loss.hpp"
#include "shardlab/testing.hpp"

using namespace shardlab;
using namespace ch09;
using shardlab::testing::check_close;
using shardlab::testing::on_ranks;

namespace {

GptShape tiny() {
  GptShape s;
  s.layers = 2;
  s.channels = 16;
  s.heads = 4;
  s.context = 8;
  s.seed = 3;
  return s;
}

struct BlockRun {
  Tensor y, dx;
  std::map<std::string, Tensor> grads, values;
};

BlockRun run_block(nn::Layer& block, nn::ParameterStore& store, const Tensor& x, const Tensor& dy) {
  BlockRun out;
  nn::Forward f = block.forward(x);
  out.y = f.out;
  store.zero_grad();
  out.dx = block.backward(dy, f.saved);
  for (nn::Parameter* p : store.parameters()) {
    out.grads[p->name] = p->grad.clone();
    out.values[p->name] = p->value.clone();
  }
  return out;
}

/// One device's attention block b on n random rows (seeded): the input, dL/dy and what
/// the block gives.
struct OneDevice {
  Tensor x, dy;
  BlockRun want;
};
OneDevice one_device(const GptShape& s, std::int64_t n, int block, std::uint64_t seed) {
  OneDevice out{randn(n, s.channels, seed), randn(n, s.channels, seed + 1), {}};
  nn::ParameterStore one;
  nn::Residual whole = attention_block(one, "h." + std::to_string(block), s, block);
  one.allocate();
  out.want = run_block(whole, one, out.x, out.dy);
  return out;
}

/// Rank r's share of a whole tensor of the block, as the names say it is cut.
Tensor share(const std::string& name, const Tensor& whole, int t, int r) {
  if (name.find("c_attn") != std::string::npos) return shard(whole, t, 1, r);
  if (name.find("c_proj.weight") != std::string::npos) return shard(whole, t, 0, r);
  return whole;
}

}  // namespace

TEST_CASE("parallel_attention equals one device's block, forward and backward, on tp 1, 2, 4") {
  const GptShape s = tiny();
  const auto [x, dy, want] = one_device(s, 3 * s.context, 1, 11);
  for (int t : {1, 2, 4}) {
    CAPTURE(t);
    on_ranks(t, [&](Communicator& tp) {
      nn::ParameterStore store;
      nn::Residual block = parallel_attention(store, tp, "h.1", s, 1);
      store.allocate();
      const BlockRun got = run_block(block, store, x, dy);
      check_close(got.y, want.y, 1e-5f, 1e-5f, "y on tp " + std::to_string(t));
      check_close(got.dx, want.dx, 1e-5f, 1e-5f, "dL/dx on tp " + std::to_string(t));
      REQUIRE_MESSAGE(got.grads.size() == want.grads.size(),
                      "the block holds " << got.grads.size() << " parameters, one device's "
                                         << want.grads.size());
      for (const auto& [name, g] : want.grads) {
        REQUIRE_MESSAGE(got.grads.count(name), "no parameter named " << name);
        const Tensor mine = share(name, g, t, tp.rank());
        REQUIRE_MESSAGE(got.grads.at(name).size() == mine.size(),
                        name << ": rank " << tp.rank() << " holds " << got.grads.at(name).size()
                             << " elements, its share is " << mine.size());
        check_close(got.values.at(name).reshape(mine.shape()),
                    share(name, want.values.at(name), t, tp.rank()), 0, 0,
                    name + "'s initial value on tp " + std::to_string(t));
        check_close(got.grads.at(name).reshape(mine.shape()), mine, 1e-5f, 1e-4f,
                    name + "'s gradient on tp " + std::to_string(t));
      }
    });
  }
}

TEST_CASE("parallel_attention with sequence parallelism: each rank its n/t rows in and out") {
  // options.tp.sequence_parallel: x, y and dL/dx are this rank's rows of the whole; ln_1's
  // parameters and c_proj's bias are whole on every rank, their gradients each rank's
  // rows' part (summed over tp here, as the trainer does).
  const GptShape s = tiny();
  const auto [x, dy, want] = one_device(s, 4 * s.context, 0, 21);
  BlockOptions options;
  options.tp.sequence_parallel = true;
  for (int t : {2, 4}) {
    CAPTURE(t);
    on_ranks(t, [&](Communicator& tp) {
      const std::string on = " on tp " + std::to_string(t) + ", rank " + std::to_string(tp.rank());
      nn::ParameterStore store;
      nn::Residual block = parallel_attention(store, tp, "h.0", s, 0, options);
      store.allocate();
      const BlockRun got =
          run_block(block, store, shard(x, t, 0, tp.rank()), shard(dy, t, 0, tp.rank()));
      check_close(got.y, shard(want.y, t, 0, tp.rank()), 1e-5f, 1e-5f,
                  "y under sequence parallelism (options.tp: this rank's n/t rows)" + on);
      check_close(got.dx, shard(want.dx, t, 0, tp.rank()), 1e-5f, 1e-5f,
                  "dL/dx under sequence parallelism (options.tp: this rank's n/t rows)" + on);
      for (const auto& [name, g] : want.grads) {
        REQUIRE_MESSAGE(got.grads.count(name), "no parameter named " << name);
        Tensor mine = got.grads.at(name).clone();
        const Tensor share_of = share(name, g, t, tp.rank());
        if (share_of.size() == g.size()) tp.allreduce(mine, ReduceOp::sum);
        check_close(mine.reshape(share_of.shape()), share_of, 1e-5f, 1e-4f,
                    name + "'s gradient" + on);
      }
    });
  }
}

TEST_CASE("parallel_attention refuses a tp that does not divide the heads") {
  GptShape s = tiny();
  s.heads = 4;
  on_ranks(3, [&](Communicator& tp) {
    nn::ParameterStore store;
    CHECK_THROWS_AS(parallel_attention(store, tp, "h.0", s, 0), UsageError);
  });
}

namespace {

/// The definition, in double: sum over rows of log sum exp(l) - l[target], / denominator,
/// and its gradient (softmax - one_hot) / denominator.
struct Exact {
  double value = 0;
  Tensor grad;
};
Exact exact(const Tensor& logits, const std::vector<int>& targets, double denominator) {
  Exact e{0, Tensor(logits.rows(), logits.cols())};
  for (std::int64_t r = 0; r < logits.rows(); ++r) {
    double top = -INFINITY, sum = 0;
    for (std::int64_t v = 0; v < logits.cols(); ++v) top = std::max(top, double(logits(r, v)));
    for (std::int64_t v = 0; v < logits.cols(); ++v) sum += std::exp(logits(r, v) - top);
    const int t = targets[static_cast<std::size_t>(r)];
    e.value += (std::log(sum) + top - logits(r, t)) / denominator;
    for (std::int64_t v = 0; v < logits.cols(); ++v)
      e.grad(r, v) = static_cast<float>(
          (std::exp(logits(r, v) - top) / sum - (v == t ? 1.0 : 0.0)) / denominator);
  }
  return e;
}

}  // namespace

TEST_CASE("vocab_parallel_cross_entropy equals the full-vocabulary loss and gradient") {
  // 10 tokens, so tp 3 and 4 cut unevenly; rows whose logits reach 200 (exp overflows
  // without the maximum subtracted), and targets on every rank's shard.
  const std::int64_t n = 6, V = 10;
  Tensor logits = scale(randn(n, V, 21), 4.0f);
  for (std::int64_t v = 0; v < V; ++v) logits(2, v) += 190.0f;
  logits(4, 9) = 60.0f;
  const std::vector<int> targets = {0, 9, 4, 7, 9, 2};
  const double denominator = 12;
  const Exact want = exact(logits, targets, denominator);
  for (int t : {1, 2, 3, 4}) {
    CAPTURE(t);
    on_ranks(t, [&](Communicator& tp) {
      const ShardRange vocab = shard_range(V, t, tp.rank());
      const Tensor mine = shard(logits, t, 1, tp.rank());
      const Tensor ids = Tensor::from_vector(targets);
      const VocabLoss loss = vocab_parallel_cross_entropy(tp, mine, ids, vocab, denominator);
      REQUIRE_MESSAGE(std::isfinite(loss.value),
                      "the loss is not finite on tp " << t << ": " << loss.value);
      CHECK_MESSAGE(std::abs(loss.value - want.value) <= 1e-5 * std::abs(want.value),
                    "the loss differs on tp " << t << ", rank " << tp.rank() << ": " << loss.value
                                              << ", want " << want.value);
      const Tensor d = vocab_parallel_cross_entropy_backward(loss);
      check_close(d, shard(want.grad, t, 1, tp.rank()), 1e-6f, 1e-4f,
                  "dlogits on tp " + std::to_string(t) + ", rank " + std::to_string(tp.rank()));
    });
  }
}
