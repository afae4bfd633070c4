// Chapter 06's LossScaler in a trainer that is not the chapter's: a LayerNorm, a Linear
// with bias and a GELU, trained by data parallelism (an allreduce, then nn::Adam) on 1 to
// 4 ranks, with an inf injected on the last rank at step 4 and a NaN on rank 0 at step 5.
//
// The reference is the same trainer written without a scaler, which simply leaves steps 4
// and 5 out: the scales are powers of two, so scaling dL/dout and unscaling the
// gradients is exact in f32 and the scaled run must end with the reference's weights bit
// for bit. The scale sequence is worked out by hand from GradScaler's rule.
//
// Wrong versions this test was checked against (each planted alone in loss_scaler.cpp; the
// first message it failed with):
//   update() forgetting the dynamic scaler (the scale never moves)
//     -> "dynamic on 1 ranks: step 4 used the scale 1024, GradScaler's 2048"
//   scale() giving the dynamic scale for Scaler::fixed too
//     -> "static on 1 ranks: step 1 used the scale 2048, the static 1024"
//   unscaling by the fixed scale whatever the kind
//     -> "dynamic on 1 ranks: the weights differ from the reference's by 0.00824171"
//   Scaler::none checking for inf (and skipping) like the others
//     -> "none: a step was skipped although nothing scales the loss"
#include <doctest/doctest.h>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "loss_scaler.hpp"
#include "shardlab/nn.hpp"
#include "shardlab/testing.hpp"

using namespace shardlab;
using shardlab::testing::on_ranks;

namespace {

/// LayerNorm(6) -> Linear(6, 4) -> GELU; MSE against fixed targets.
struct Model {
  nn::ParameterStore store;
  nn::Sequential net;
  Model() {
    net.add<nn::LayerNorm>(store, "ln", 6);
    net.add<nn::Linear>(store, "fc", 6, 4, 5);
    net.add<nn::Gelu>();
    store.allocate();
  }
};

struct Outcome {
  std::vector<float> scales;
  std::vector<int> skipped;
  Tensor weights;
};

/// `steps` steps of data parallelism on this rank's rows; with `scaler`, dL/dout is
/// multiplied by its scale and the step goes through unscale_and_check and update; without,
/// the steps in `leave_out` are simply not taken. Rank `bad_rank` poisons its gradients
/// at the steps of `poison` (inf, then NaN).
Outcome train(Communicator& comm, ch06::LossScaler* scaler, int steps,
              const std::vector<int>& poison, const std::vector<int>& leave_out) {
  Model model;
  nn::Adam adam(model.store.size(), {.lr = 0.01f});
  Tensor unscaled(Shape{model.store.size()}, DType::f32);
  Outcome out;
  for (int t = 1; t <= steps; ++t) {
    const auto seed = static_cast<std::uint64_t>(100 * t + comm.rank());
    const Tensor x = randn(Shape{3 + comm.rank(), 6}, seed),
                 y = randn(Shape{3 + comm.rank(), 4}, seed + 50);
    model.store.zero_grad();
    nn::Forward f = model.net.forward(x);
    Tensor dy = nn::mse_backward(f.out, y, 7.0);
    const float scale = scaler ? scaler->scale() : 1.0f;
    out.scales.push_back(scale);
    scale_in_place(dy, scale);
    model.net.backward(dy, f.saved);
    Tensor& grads = model.store.grads();
    comm.allreduce(grads, ReduceOp::sum);
    for (std::size_t k = 0; k < poison.size(); ++k) {
      const int bad_rank = k == 0 ? comm.size() - 1 : 0;  // the last rank, then the first
      if (t == poison[k] && comm.rank() == bad_rank)
        grads[3] = k == 0 ? std::numeric_limits<float>::infinity()
                          : std::numeric_limits<float>::quiet_NaN();
    }
    bool skip = false;
    if (scaler) {
      skip = scaler->unscale_and_check(comm, grads, unscaled);
      scaler->update(skip);
    } else {
      skip = std::count(leave_out.begin(), leave_out.end(), t) > 0;
      unscaled.copy_from(grads);
    }
    if (skip)
      out.skipped.push_back(t);
    else
      adam.step(model.store.values(), unscaled);
  }
  out.weights = model.store.values().clone();
  return out;
}

}  // namespace

TEST_SUITE("ch06") {
  TEST_CASE(
      "LossScaler in another trainer: every rank skips the poisoned steps, the scale backs off and "
      "grows back") {
    for (int N : {1, 2, 3, 4}) {
      const std::string where = " on " + std::to_string(N) + " ranks";
      on_ranks(N, [&](Communicator& comm) {
        const Outcome reference = train(comm, nullptr, 9, {}, {4, 5});
        // Dynamic: init 2^10, x2 after 3 finite steps, x0.5 on inf or NaN. By hand:
        //   step     1     2     3     4      5     6    7    8    9
        //   uses     1024  1024  1024  2048X  1024X 512  512  512  1024
        ch06::LossScaler dynamic(ch06::Scaler::dynamic, {.init_scale = 1024, .growth_interval = 3});
        const Outcome d = train(comm, &dynamic, 9, {4, 5}, {});
        const float want[9] = {1024, 1024, 1024, 2048, 1024, 512, 512, 512, 1024};
        for (int t = 0; t < 9; ++t)
          CHECK_MESSAGE(d.scales[static_cast<std::size_t>(t)] == want[t],
                        "dynamic" << where << ": step " << t + 1 << " used the scale "
                                  << d.scales[static_cast<std::size_t>(t)] << ", GradScaler's "
                                  << want[t]);
        CHECK_MESSAGE((d.skipped == std::vector<int>{4, 5}),
                      "dynamic" << where << ": rank " << comm.rank() << " skipped "
                                << d.skipped.size() << " steps, not steps 4 and 5");
        CHECK_MESSAGE(d.weights.bitwise_equal(reference.weights),
                      "dynamic" << where << ": the weights differ from the reference's by "
                                << max_abs_diff(d.weights, reference.weights));
        CHECK(dynamic.scale() == 1024.0f);
        CHECK(dynamic.dynamic().growth_tracker() == 1);
        // Static: the same skips, the scale never moves.
        ch06::LossScaler fixed(ch06::Scaler::fixed, {.init_scale = 2048}, 1024.0f);
        const Outcome s = train(comm, &fixed, 9, {4, 5}, {});
        for (int t = 0; t < 9; ++t)
          CHECK_MESSAGE(s.scales[static_cast<std::size_t>(t)] == 1024.0f,
                        "static" << where << ": step " << t + 1 << " used the scale "
                                 << s.scales[static_cast<std::size_t>(t)] << ", the static 1024");
        CHECK((s.skipped == std::vector<int>{4, 5}));
        CHECK_MESSAGE(s.weights.bitwise_equal(reference.weights),
                      "static" << where << ": the weights differ from the reference's by "
                               << max_abs_diff(s.weights, reference.weights));
      });
    }
  }

  TEST_CASE("LossScaler none scales nothing and checks nothing") {
    on_ranks(2, [](Communicator& comm) {
      ch06::LossScaler none(ch06::Scaler::none, {.init_scale = 8});
      CHECK(none.scale() == 1.0f);
      Tensor g = cast(Tensor::from_1d({0.5f, std::numeric_limits<float>::infinity(), 2.0f}),
                      DType::f16),
             out(3);
      CHECK_MESSAGE(!none.unscale_and_check(comm, g, out),
                    "none: a step was skipped although nothing scales the loss");
      CHECK(out[0] == 0.5f);
      CHECK(out[2] == 2.0f);
      none.update(true);
      CHECK(none.scale() == 1.0f);
      CHECK(none.dynamic().scale() == 8.0f);  // untouched
    });
  }
}
