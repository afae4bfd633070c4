// Chapter 05's ZeroOptimizer on models that are not the chapter's: an Embedding, a
// LayerNorm and a Linear with bias trained by cross-entropy in fp32 (three groups of
// 66, 12 and 35 elements: uneven shards on every world size but 1), and a Linear, GELU,
// Linear stack without biases in mixed precision (f16 store, MSE).
//
// The references are written here, independently of zero.cpp: plain data parallelism as
// a trainer writes it by hand — an allreduce of the store's gradients, then nn::Adam (fp32)
// or nn::adam_update on an fp32 master copy rounded back to f16 (mixed) — and the bytes of
// each ledger category from shard_range of each group. Every stage, 1 to 4 ranks, ends
// with the reference's weights bit for bit (the threads backend adds in one order in both).
//
// Wrong versions this test was checked against (each planted alone in zero.cpp; the first
// message it failed with):
//   stage 2 and 3 reduce-scattering every group into the start of the gradient shard
//     -> "stage 2 on 1 ranks (fp32): the weights differ from plain data parallelism's by
//        up to 0.150116"
//   stage 3 keeping the store's whole values (release_values left out)
//     -> "stage 3 on 1 ranks (fp32): rank 0's params hold 904 bytes, want 452"
//   stage 3 prefetching the group after the next
//     -> "Tensor::view: elements 0..30 of a tensor of 12" (a gathered group of the wrong
//        size); with equal sizes "stage 3 on 2 ranks (mixed): rank 0 received 528 bytes
//        per step, the formula says 504" and "the weights differ ... by up to 0.2816"
//   stage 2's step all-gathering every group but the last
//     -> "stage 2 on 2 ranks (fp32): rank 0 received 384 bytes per step, the formula says
//        452" and "the weights differ ... by up to 0.131898"
//   prepare_gradients not zeroing at stages 0 and 1 (step 2 adds to step 1's gradients)
//     -> "stage 0 on 1 ranks (fp32): the weights differ ... by up to 0.0719728"
//   the gradients averaged (ReduceOp::avg) in reduce_gradients
//     -> "stage 2 on 2 ranks (fp32): the weights differ ... by up to 3.21865e-06" (Adam
//        barely sees a gradient's scale: only a bitwise check catches it)
//   zero_comm_bytes without stage 3's second gather
//     -> "stage 3 on 2 ranks (fp32): rank 1 received 680 bytes per step, the formula says
//        452"
//   stage 0 in mixed precision never rounding the master back into the f16 values
//     -> "stage 0 on 1 ranks (mixed): the weights differ ... by up to 0.147726"
// and stage 1 by group (ZeroConfig::by_group, each group reduce-scattered after its
// backward, all-gathered by step(), waited for before its forward with overlap):
//   every group reduce-scattered into the first group's part of the shard
//     -> "stage 1 by group on 1 ranks (fp32)" failing (the shard's other parts never set)
//   the update not copied into the all-gather's send buffer
//     -> "stage 1 by group on 1 ranks (fp32): the weights differ ... by up to 1.24886"
//   zero_shard_elements counting stage 1 by group as one flat range
//     -> "stage 1 by group on 4 ranks (fp32): zero_state_bytes differs from the bytes
//        written out"
//   step() waiting for every all-gather though asked to overlap
//     -> "stage 1 by group, overlapped, on 2 ranks (fp32): step() waited"
//   only the last group all-gathered
//     -> "stage 1 by group on 2 ranks (fp32): rank 1 received 296 bytes per step, the
//        formula says 452"
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "shardlab/memory.hpp"
#include "shardlab/nn.hpp"
#include "shardlab/testing.hpp"
#include "zero.hpp"

using namespace shardlab;
using memory::Category;
using shardlab::testing::on_ranks;

namespace {

const nn::AdamConfig adam{.lr = 0.05f, .weight_decay = 0.01f, .decoupled = true};

/// Embedding(11, 6) -> LayerNorm(6) -> Linear(6, 5) -> cross-entropy over 5 classes.
struct Classifier {
  nn::ParameterStore store;
  nn::Embedding emb{store, "emb", 11, 6, 1, 0.5f};
  nn::LayerNorm ln{store, "ln", 6};
  nn::Linear fc{store, "fc", 6, 5, 2};
  std::vector<nn::Layer*> layers() { return {&emb, &ln, &fc}; }
  std::vector<std::vector<nn::Parameter*>> groups() {
    return {emb.parameters(), ln.parameters(), fc.parameters()};
  }
};

/// Linear(4, 24) -> GELU -> Linear(24, 3), no biases, in f16; MSE against a fixed target.
struct HalfMlp {
  nn::ParameterStore store;
  nn::Linear up{store, "up", 4, 24, 3, false};
  nn::Gelu gelu;
  nn::Linear down{store, "down", 24, 3, 4, false};
  std::vector<nn::Layer*> layers() { return {&up, &gelu, &down}; }
  std::vector<std::vector<nn::Parameter*>> groups() { return {up.parameters(), down.parameters()}; }
};

/// Rank q's rows at step t: ids / inputs and targets that differ by rank, step and row
/// (rank q has 3 + q rows: the ranks' batches differ in size too).
struct Rows {
  Tensor x, targets;
};
Rows rows_of(bool classifier, int q, int t) {
  const int B = 3 + q;
  if (classifier) {
    std::vector<std::int32_t> ids, labels;
    for (int i = 0; i < B; ++i) {
      ids.push_back((7 * q + 3 * t + 5 * i) % 11);
      labels.push_back((q + 2 * t + i) % 5);
    }
    return {Tensor::from_vector(ids), Tensor::from_vector(labels)};
  }
  return {cast(randn(Shape{B, 4}, 100 + 10 * static_cast<std::uint64_t>(t) + q), DType::f16),
          scale(randn(Shape{B, 3}, 200 + 10 * static_cast<std::uint64_t>(t) + q), 0.5f)};
}

/// dL/dout of this rank's rows, in the output's type.
Tensor loss_gradient(bool classifier, const Tensor& out, const Tensor& targets) {
  if (classifier) return nn::cross_entropy_backward(nn::cross_entropy(out, targets).saved);
  const Tensor out32 = cast(out, DType::f32);
  return cast(nn::mse_backward(out32, targets, static_cast<double>(out.rows())), out.dtype());
}

/// One step of the layers, each layer one group: through `opt`'s calls when given,
/// else plain (the store's gradients zeroed first).
template <class Model>
void forward_backward(Model& model, bool classifier, const Rows& rows, ch05::ZeroOptimizer* opt) {
  const std::vector<nn::Layer*> layers = model.layers();
  // Group of each layer: the classifier's layers are groups 0, 1, 2; the MLP's GELU
  // belongs to no group (it has no parameters).
  const std::vector<int> group =
      classifier ? std::vector<int>{0, 1, 2} : std::vector<int>{0, -1, 1};
  if (!opt) model.store.zero_grad();
  std::vector<nn::Saved> saved(layers.size());
  Tensor h = rows.x;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    if (opt && group[i] >= 0 && opt->by_group()) opt->wait_values(group[i]);
    if (opt && group[i] >= 0) opt->gather(group[i]);
    nn::Forward f = layers[i]->forward(h);
    saved[i] = std::move(f.saved);
    h = std::move(f.out);
    if (opt && group[i] >= 0) opt->release(group[i]);
  }
  Tensor dy = loss_gradient(classifier, h, rows.targets);
  for (std::size_t i = layers.size(); i-- > 0;) {
    if (opt && group[i] >= 0) {
      opt->gather(group[i]);
      opt->prepare_gradients(group[i]);
    }
    dy = layers[i]->backward(dy, saved[i]);
    if (opt && group[i] >= 0 && opt->by_group()) opt->reduce_group(group[i]);
    if (opt && group[i] >= 0) {
      opt->reduce_gradients(group[i]);
      opt->release(group[i]);
    }
  }
}

/// Plain data parallelism, by hand: allreduce, then Adam on every element (fp32: on the
/// values; f16: on an fp32 master, rounded back). Returns the weights, f32.
template <class Model>
Tensor plain_data_parallel(Communicator& comm, bool classifier, int steps) {
  Model model;
  const DType type = classifier ? DType::f32 : DType::f16;
  model.store.allocate(Memory::host, type);
  const std::int64_t P = model.store.size();
  Tensor master = cast(model.store.values(), DType::f32), m(P), v(P);
  for (int t = 1; t <= steps; ++t) {
    forward_backward(model, classifier, rows_of(classifier, comm.rank(), t), nullptr);
    comm.allreduce(model.store.grads(), ReduceOp::sum);
    nn::adam_update(master, model.store.grads(), m, v, t, adam);
    model.store.values().copy_from(cast(master, type));
  }
  return master;
}

/// The bytes of each category at `stage`, from the groups' shard_range, written out.
ch05::StateBytes expected_bytes(const std::vector<std::int64_t>& groups, int stage, DType type,
                                int N, int r, bool by_group) {
  std::uint64_t P = 0, per_group = 0;
  for (std::int64_t n : groups) {
    P += static_cast<std::uint64_t>(n);
    per_group += static_cast<std::uint64_t>(shard_range(n, N, r).length);
  }
  const auto flat =
      static_cast<std::uint64_t>(shard_range(static_cast<std::int64_t>(P), N, r).length);
  const std::uint64_t S = stage == 0 ? P : stage == 1 && !by_group ? flat : per_group;
  const std::uint64_t w = dtype_size(type);
  return {w * (stage == 3 ? S : P), w * (stage >= 2 ? S : P), type == DType::f32 ? 0 : 4 * S,
          8 * S};
}

template <class Model>
void check_every_stage(bool classifier) {
  const DType type = classifier ? DType::f32 : DType::f16;
  const int steps = 3;
  // Stage 1 also by group (Megatron-LM's buckets): each group reduce-scattered after its
  // backward, all-gathered by step() and waited for before its forward (overlap) or not.
  struct Variant {
    int stage;
    bool prefetch = true, by_group = false, overlap = false;
  };
  const Variant variants[] = {{0}, {1},       {1, true, true, false}, {1, true, true, true}, {2},
                              {3}, {3, false}};
  for (int N : {1, 2, 3, 4})
    for (const auto& [stage, prefetch, by_group, overlap] : variants) {
      const std::string what = "stage " + std::to_string(stage) + (by_group ? " by group" : "") +
                               (overlap ? ", overlapped," : "") + " on " + std::to_string(N) +
                               " ranks (" + (classifier ? "fp32" : "mixed") + ")" +
                               (stage == 3 && !prefetch ? " without prefetch" : "");
      CAPTURE(what);
      on_ranks(N, [&](Communicator& comm) {
        const Tensor reference = plain_data_parallel<Model>(comm, classifier, steps);
        Model model;
        memory::Tracker tracker;
        model.store.allocate(Memory::host, type);
        ch05::ZeroOptimizer opt(comm, model.store,
                                {.stage = stage,
                                 .adam = adam,
                                 .prefetch = prefetch,
                                 .by_group = by_group,
                                 .overlap = overlap},
                                model.groups());
        const std::vector<std::int64_t> sizes = ch05::group_sizes(model.groups(), model.store);
        std::uint64_t received = 0;
        for (int t = 1; t <= steps; ++t) {
          const CommStats before = comm.stats();
          forward_backward(model, classifier, rows_of(classifier, comm.rank(), t), &opt);
          opt.step();
          // Overlapped: the all-gathers still travel when step() returns.
          if (overlap && N > 1)
            CHECK_MESSAGE(opt.values_in_flight_sent() > 0, what << ": step() waited");
          received = comm.stats().since(before).total().bytes_received;
        }
        // The bytes this rank holds, category by category, and the formula's.
        const memory::Usage u = tracker.usage();
        const ch05::StateBytes got{u.live(Category::params), u.live(Category::grads),
                                   u.live(Category::master), u.live(Category::optimizer)};
        const ch05::StateBytes want = expected_bytes(sizes, stage, type, N, comm.rank(), by_group);
        const std::string names[] = {"params", "grads", "master", "optimizer"};
        const std::uint64_t have[] = {got.params, got.grads, got.master, got.optimizer};
        const std::uint64_t need[] = {want.params, want.grads, want.master, want.optimizer};
        for (int k = 0; k < 4; ++k)
          CHECK_MESSAGE(have[k] == need[k], what << ": rank " << comm.rank() << "'s " << names[k]
                                                 << " hold " << have[k] << " bytes, want "
                                                 << need[k]);
        CHECK_MESSAGE((ch05::zero_state_bytes(sizes, {.stage = stage, .by_group = by_group}, type,
                                              N, comm.rank()) == want),
                      what << ": zero_state_bytes differs from the bytes written out");
        CHECK_MESSAGE(opt.shard_elements() ==
                          ch05::zero_shard_elements(sizes, stage, N, comm.rank(), by_group),
                      what << ": the shard has " << opt.shard_elements() << " elements");
        const std::uint64_t formula =
            ch05::zero_comm_bytes(sizes, stage, type, N, comm.rank(), by_group);
        CHECK_MESSAGE(received == formula, what << ": rank " << comm.rank() << " received "
                                                << received << " bytes per step, the formula says "
                                                << formula);
        const Tensor weights = opt.weights();
        CHECK_MESSAGE(weights.bitwise_equal(reference),
                      what << ": the weights differ from plain data parallelism's by up to "
                           << max_abs_diff(weights, reference));
        CHECK(opt.steps() == steps);
      });
    }
}

}  // namespace

TEST_SUITE("ch05") {
  TEST_CASE(
      "ZeroOptimizer trains an Embedding, LayerNorm and Linear as plain data parallelism does") {
    check_every_stage<Classifier>(true);
  }

  TEST_CASE(
      "ZeroOptimizer trains an f16 Linear, GELU, Linear in mixed precision as plain data "
      "parallelism does") {
    check_every_stage<HalfMlp>(false);
  }

  TEST_CASE(
      "ZeroOptimizer with one group: the whole model gathered for the forward and the backward") {
    on_ranks(3, [](Communicator& comm) {
      const Tensor reference = plain_data_parallel<Classifier>(comm, true, 2);
      Classifier model;
      model.store.allocate();
      ch05::ZeroOptimizer opt(comm, model.store, {.stage = 3, .adam = adam});
      CHECK(opt.group_count() == 1);
      for (int t = 1; t <= 2; ++t) {
        const Rows rows = rows_of(true, comm.rank(), t);
        opt.gather(0);
        std::vector<nn::Saved> saved;
        Tensor h = rows.x;
        for (nn::Layer* layer : model.layers()) {
          nn::Forward f = layer->forward(h);
          saved.push_back(std::move(f.saved));
          h = std::move(f.out);
        }
        opt.release(0);
        Tensor dy = loss_gradient(true, h, rows.targets);
        opt.gather(0);
        opt.prepare_gradients(0);
        for (std::size_t i = saved.size(); i-- > 0;) dy = model.layers()[i]->backward(dy, saved[i]);
        opt.reduce_gradients(0);
        opt.release(0);
        opt.step();
      }
      const Tensor weights = opt.weights();
      CHECK_MESSAGE(weights.bitwise_equal(reference),
                    "one group: the weights differ by up to " << max_abs_diff(weights, reference));
    });
  }

  TEST_CASE("ZeroOptimizer refuses groups out of order, gathers out of turn and a step half done") {
    on_ranks(1, [](Communicator& comm) {
      Classifier a;
      a.store.allocate();
      CHECK_THROWS_WITH_AS(
          ch05::ZeroOptimizer(comm, a.store, {.stage = 2},
                              {a.fc.parameters(), a.ln.parameters(), a.emb.parameters()}),
          doctest::Contains("not the next one"), Error);
      CHECK_THROWS_WITH_AS(ch05::ZeroOptimizer(comm, a.store, {.stage = 2}, {a.emb.parameters()}),
                           doctest::Contains("cover"), Error);
      CHECK_THROWS_AS(ch05::ZeroOptimizer(comm, a.store, {.stage = 4}), Error);
      Classifier b;
      b.store.allocate();
      ch05::ZeroOptimizer opt(comm, b.store, {.stage = 3}, b.groups());
      CHECK_THROWS_WITH_AS(opt.gather(1), doctest::Contains("expected group 0"), Error);
      opt.gather(0);
      CHECK_THROWS_WITH_AS(opt.gather(0), doctest::Contains("already gathered"), Error);
      CHECK_THROWS_AS(opt.step(), Error);               // group 0 still gathered
      CHECK_THROWS_AS(opt.reduce_gradients(0), Error);  // nothing prepared
      CHECK_THROWS_AS(opt.gather(7), Error);
      opt.release(0);
    });
  }
}
