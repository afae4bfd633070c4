// Chapter 09's exercise tests: tensor-parallel attention and the vocabulary-parallel
// cross-entropy (attention_and_loss.hpp), against one device, on tp 1, 2, 3 and 4 ranks.
//
// References are computed independently of the code under test: the one-device block
// from the library's layers (gpt.cpp's attention_block), the cross-entropy in double
// from its definition, over every element.
//
// Wrong versions these tests were checked against, and the first failure each gives
// (what `make check CH=09` prints; "(CTest)": kept as the test chNN.wrong_<name> in
// CMakeLists.txt, which builds the exercise's tests on the wrong version):
//   the core built by hand, nn::CausalSelfAttention(H/t, T), not by attention_core (so
//     neither selective recomputation nor context parallelism reaches it): "parallel_
//     attention asked options.context for 0 cores on tp 1, rank 0, not 1: build the core
//     with attention_core(heads, shape, options), which asks it" (CTest core_by_hand)
//   the same over all H heads on every rank: the same message
//   attention_core(H, ...) (every head on every rank): "the core was asked for 4 heads of
//     8 tokens on tp 2, rank 1; this rank computes 2 heads of 8"
//   c_attn as a whole nn::Linear on every rank: "h.1.attn.c_attn.bias on tp 2, rank 1
//     holds f32 1x48 on host, its share is f32 1x24 on host"
//   c_proj without residual_scale: "h.1.attn.c_proj.weight's initial value on tp 1, rank
//     0 (its seed and scale: attention_block's): 256 of 256 elements differ"
//   c_attn with c_proj's seed: "h.1.attn.c_attn.weight's initial value on tp 1, rank 0
//     (...): 768 of 768 elements differ"
//   a Linear built without options.tp (sequence parallelism ignored): "add: the tensors
//     differ (f32 16x16 on host vs f32 8x16 on host)", logged "under sequence parallelism
//     (options.tp: each rank n/t rows in and out)", t := 2
//   softmax over the rank's own columns only: "the loss differs on tp 2, rank 0: -3.36,
//     want 1.58"
//   each rank's own maximum, not the agreed one: "the loss differs on tp 2, rank 1: 1.76"
//   the target's logit looked up at targets[r] instead of targets[r] - vocab.offset:
//     "the loss differs on tp 2, rank 1: 2.00"
//   no maximum subtracted at all: "the loss is not finite on tp 1: inf" (logits near 200)
//   the target's logit not shifted by the maximum (the rest is): "the loss differs on tp 1,
//     rank 0: -21.6654, want 1.57815"
//   the backward without 1 / denominator: "dlogits on tp 1, rank 0: 46 of 60 elements
//     differ"
//   the backward's one-hot forgotten, or its sign flipped: "dlogits on tp 1, rank 0: 6 of
//     60 elements differ"
//   the backward's one-hot also on a column of another rank's token: "dlogits on tp 2,
//     rank 1: 3 of 30 elements differ"
//   the backward writing into saved.probs through a shared handle (Tensor d =
//     saved.probs): "saved.probs after vocab_parallel_cross_entropy_backward on tp 1, rank
//     0 (the backward changed what the forward saved): 60 of 60 elements differ" (CTest
//     backward_writes_saved)
//
// The program's verdict on a wrong cross-entropy (CTests, ch09_gpt linked with it; its
// one-device reference takes the library's nn::cross_entropy, not the exercise's):
//   the target's logit not shifted by the maximum: "the training loss, worst step differs
//     from one device's by 0.465 (tolerance 0.0001)" (loss_not_shifted); with
//     --no-reference, 12 steps: "step 9's loss is -0.309265: a cross-entropy is -log of a
//     probability, never negative" (loss_not_shifted_alone)
//   the backward's one-hot forgotten: "the training loss, worst step differs from one
//     device's by 0.189" (one_hot_forgotten). With --no-reference nothing catches it: its
//     loss still falls, to about 5.0 by step 20 (the tied embedding learns from the
//     inputs), as low as a correct run's at --lr 1e-4
//   its sign flipped: "... differs from one device's by 0.332" (one_hot_sign); with
//     --no-reference, 10 steps: "in the last 5 of 10 steps the loss never fell below ln
//     256 = 5.55, a uniform guess's" (one_hot_sign_alone)
#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <map>
#include <memory>

#include "attention_and_loss.hpp"
#include "shardlab/memory.hpp"
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

TEST_CASE(
    "parallel_attention holds its share of each parameter, named and seeded as one device's") {
  // What each rank holds, by name, before anything runs: a wrong cut, seed or scale is
  // named here, not as a y that differs everywhere.
  const GptShape s = tiny();
  const auto [x, dy, want] = one_device(s, s.context, 1, 11);
  for (int t : {1, 2, 4}) {
    CAPTURE(t);
    on_ranks(t, [&](Communicator& tp) {
      const std::string on = " on tp " + std::to_string(t) + ", rank " + std::to_string(tp.rank());
      nn::ParameterStore store;
      nn::Residual block = parallel_attention(store, tp, "h.1", s, 1);
      store.allocate();
      std::map<std::string, Tensor> got;
      for (nn::Parameter* p : store.parameters()) got[p->name] = p->value;
      REQUIRE_MESSAGE(got.size() == want.values.size(),
                      "the block holds " << got.size() << " parameters" << on << ", one device's "
                                         << want.values.size());
      for (const auto& [name, whole] : want.values) {
        REQUIRE_MESSAGE(got.count(name), "no parameter named " << name << on);
        const Tensor mine = share(name, whole, t, tp.rank());
        REQUIRE_MESSAGE(got.at(name).size() == mine.size(),
                        name << on << " holds " << got.at(name).describe() << ", its share is "
                             << mine.describe());
        check_close(got.at(name).reshape(mine.shape()), mine, 0, 0,
                    name + "'s initial value" + on + " (its seed and scale: attention_block's)");
      }
    });
  }
}

namespace {

/// A layer that counts its forwards (in `count`) around another.
class Counting final : public nn::Layer {
 public:
  Counting(std::shared_ptr<nn::Layer> inner, std::shared_ptr<std::atomic<int>> count)
      : inner_(std::move(inner)), count_(std::move(count)) {}
  std::string name() const override { return inner_->name(); }
  nn::Forward forward(const Tensor& x) const override {
    ++*count_;
    return inner_->forward(x);
  }
  Tensor backward_input(const Tensor& dy, nn::Saved& saved) const override {
    return inner_->backward_input(dy, saved);
  }

 private:
  std::shared_ptr<nn::Layer> inner_;
  std::shared_ptr<std::atomic<int>> count_;
};

/// A ContextParallel that records what the block asks of it. Its "cp" holds every token
/// (one rank), so its core is one device's attention, counted.
class RecordingContext final : public ContextParallel {
 public:
  struct Asked {
    const Communicator* cp;
    std::int64_t heads, T;
  };
  std::string name() const override { return "recording"; }
  void check(std::int64_t, int) const override {}
  std::vector<std::int64_t> positions(std::int64_t T, int, int) const override {
    std::vector<std::int64_t> all;
    for (std::int64_t t = 0; t < T; ++t) all.push_back(t);
    return all;
  }
  std::shared_ptr<nn::Layer> core(Communicator& cp, std::int64_t heads,
                                  std::int64_t T) const override {
    asked.push_back({&cp, heads, T});
    return std::make_shared<Counting>(std::make_shared<nn::CausalSelfAttention>(heads, T),
                                      forwards);
  }
  std::uint64_t forward_bytes(int, std::int64_t, std::int64_t, std::int64_t,
                              std::int64_t) const override {
    return 0;
  }
  std::uint64_t backward_bytes(int, std::int64_t, std::int64_t, std::int64_t,
                               std::int64_t) const override {
    return 0;
  }
  double kept_per_token_and_head(std::int64_t T) const override { return double(T); }

  mutable std::vector<Asked> asked;  ///< every core() call
  std::shared_ptr<std::atomic<int>> forwards = std::make_shared<std::atomic<int>>(0);
};

}  // namespace

TEST_CASE("parallel_attention's core: options.context's over options.cp, recomputed on demand") {
  // The block's core is whatever attention_core makes of `options`: under context
  // parallelism the context's core over options.cp, under selective recomputation one
  // that runs its forward again in the backward. A core built by hand does neither.
  const GptShape s = tiny();
  const auto [x, dy, want] = one_device(s, 2 * s.context, 1, 31);
  for (int t : {1, 2}) {
    for (bool recompute : {false, true}) {
      CAPTURE(t);
      CAPTURE(recompute);
      on_ranks(t, [&](Communicator& tp) {
        const std::string on = " on tp " + std::to_string(t) + ", rank " +
                               std::to_string(tp.rank()) +
                               (recompute ? ", options.recompute_core" : "");
        auto cp = tp.split(tp.rank(), 0);  // a ring of one: every rank holds whole sequences
        RecordingContext context;
        BlockOptions options;
        options.context = &context;
        options.cp = cp.get();
        options.recompute_core = recompute;
        nn::ParameterStore store;
        nn::Residual block = parallel_attention(store, tp, "h.1", s, 1, options);
        store.allocate();
        REQUIRE_MESSAGE(context.asked.size() == 1,
                        "parallel_attention asked options.context for "
                            << context.asked.size() << " cores" << on
                            << ", not 1: build the core with attention_core(heads, shape, "
                               "options), which asks it");
        const RecordingContext::Asked asked = context.asked[0];
        CHECK_MESSAGE((asked.cp == cp.get() && asked.heads == s.heads / t && asked.T == s.context),
                      "the core was asked for "
                          << asked.heads << " heads of " << asked.T << " tokens"
                          << std::string(asked.cp == cp.get() ? "" : ", not over options.cp") << on
                          << "; this rank computes " << s.heads / t << " heads of " << s.context);
        const BlockRun got = run_block(block, store, x, dy);
        CHECK_MESSAGE(context.forwards->load() == (recompute ? 2 : 1),
                      "the core ran " << context.forwards->load() << " forwards for one forward "
                                      << "and backward of the block" << on << ", expected "
                                      << (recompute ? 2 : 1));
        check_close(got.y, want.y, 1e-5f, 1e-5f, "y" + on);
        check_close(got.dx, want.dx, 1e-5f, 1e-5f, "dL/dx" + on);
      });
    }
  }
}

TEST_CASE("parallel_attention under options.recompute_core keeps no attention weights") {
  // One device's core keeps its softmax weights for the backward, H/t x T x T floats a
  // sequence; the recomputed one only its input.
  const GptShape s = tiny();
  const std::int64_t sequences = 2;
  const Tensor x = randn(sequences * s.context, s.channels, 41);
  for (int t : {1, 2}) {
    CAPTURE(t);
    on_ranks(t, [&](Communicator& tp) {
      auto kept = [&](bool recompute) {
        BlockOptions options;
        options.recompute_core = recompute;
        nn::ParameterStore store;
        nn::Residual block = parallel_attention(store, tp, "h.0", s, 0, options);
        store.allocate();
        memory::Tracker tracker;
        nn::Forward f;
        {
          memory::Scope scope(memory::Category::activations);
          f = block.forward(x);
        }
        return tracker.usage().live(memory::Category::activations);
      };
      const std::uint64_t plain = kept(false), recomputed = kept(true);
      const auto weights = static_cast<std::uint64_t>(sequences * s.heads / t * s.context *
                                                      s.context * sizeof(float));
      CHECK_MESSAGE(recomputed + weights <= plain,
                    "under options.recompute_core the block keeps "
                        << recomputed << " bytes for its backward, without it " << plain
                        << " (on tp " << t << "): its core keeps its attention weights (" << weights
                        << " bytes); build the core with attention_core");
    });
  }
}

TEST_CASE("parallel_attention equals one device's block, forward and backward, on tp 1, 2, 4") {
  const GptShape s = tiny();
  const auto [x, dy, want] = one_device(s, 3 * s.context, 1, 11);
  for (int t : {1, 2, 4}) {
    CAPTURE(t);
    on_ranks(t, [&](Communicator& tp) {
      const std::string on = " on tp " + std::to_string(t) + ", rank " + std::to_string(tp.rank());
      nn::ParameterStore store;
      nn::Residual block = parallel_attention(store, tp, "h.1", s, 1);
      store.allocate();
      const BlockRun got = run_block(block, store, x, dy);
      check_close(got.y, want.y, 1e-5f, 1e-5f, "y" + on);
      check_close(got.dx, want.dx, 1e-5f, 1e-5f, "dL/dx" + on);
      for (const auto& [name, g] : want.grads) {
        REQUIRE_MESSAGE(got.grads.count(name), "no parameter named " << name << on);
        const Tensor mine = share(name, g, t, tp.rank());
        check_close(got.grads.at(name).reshape(mine.shape()), mine, 1e-5f, 1e-4f,
                    name + "'s gradient" + on);
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
  INFO("under sequence parallelism (options.tp: each rank n/t rows in and out)");
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
    CHECK_THROWS_AS_MESSAGE(parallel_attention(store, tp, "h.0", s, 0), UsageError,
                            "4 heads on tp 3: the header promises a UsageError");
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
      const std::string on = " on tp " + std::to_string(t) + ", rank " + std::to_string(tp.rank());
      const Tensor probs = loss.probs.clone();
      const Tensor d = vocab_parallel_cross_entropy_backward(loss);
      check_close(d, shard(want.grad, t, 1, tp.rank()), 1e-6f, 1e-4f, "dlogits" + on);
      // The backward reads what the forward saved and leaves it as it was (a Tensor copy
      // shares its storage): a second backward, or another reader, sees the same.
      check_close(loss.probs, probs, 0, 0,
                  "saved.probs after vocab_parallel_cross_entropy_backward" + on +
                      " (the backward changed what the forward saved)");
      check_close(vocab_parallel_cross_entropy_backward(loss), d, 0, 0,
                  "a second vocab_parallel_cross_entropy_backward of the same loss" + on);
    });
  }
}
