// Chapter 08's 3-D training (mlp_stack.hpp), against the solution: every factorisation of 8
// ranks trains like one device, the bytes per axis are the formulas', ZeRO-1 over dp gives
// plain data parallelism's weights, and the tensor-parallel blocks run on chapter 04's
// runtime under every one-chunk schedule.
//
// Wrong versions this test was checked against: the row-parallel bias added before g
// (every tp rank adds it: y too large by (tp - 1) b; found once b has trained away from
// 0: "the final weights differ"); the loss divided by the replica's rows instead of the
// global batch (every dp > 1 mesh: the curve differs); the gradient sync left disabled
// (never switched back on before the last backward: "every dp replica's weights" differ
// and the dp bytes are 0); the dp formula counting the whole model's parameters instead
// of the rank's shard (every tp > 1 or pp > 1 mesh); the pp formula counting one
// direction only (inner stages).
#include <doctest/doctest.h>

#include <string>
#include <utility>

#include "mlp_stack.hpp"
#include "shardlab/testing.hpp"
#include "tensor_parallel.hpp"

using namespace shardlab;
using namespace ch08;
using shardlab::testing::check_equal;
using shardlab::testing::on_ranks;

namespace {

HybridConfig small(MeshShape mesh) {
  HybridConfig c;
  c.mesh = mesh;
  c.blocks = 8;
  c.hidden = 8;
  c.ffn = 32;
  c.batch = 32;
  c.microbatches = 4;
  c.steps = 3;
  return c;
}

struct Outcome {
  double loss_diff = 0, weight_diff = 0, replica_diff = 0;
  bool bytes_match = true;
  std::string bytes_detail;
};

/// Trains `c` on its mesh and compares with one device, on every rank; rank 0's view.
Outcome train_and_compare(const HybridConfig& c) {
  Reference ref;
  train_reference(c, ref);
  Outcome out;
  on_ranks(c.mesh.ranks(), [&](Communicator& world) {
    Mesh mesh(world, c.mesh);
    HybridModel model(mesh, c, Memory::host);
    const HybridRun run = train_hybrid(mesh, model, c, Memory::host);
    double loss = 0;
    for (std::size_t t = 0; t < run.loss.size(); ++t)
      loss = nan_max(loss, std::abs(run.loss[t] - ref.loss[t]));
    const double weights = world.agree(model.max_weight_diff(ref.model), ReduceOp::max);
    const double replicas = replica_divergence(mesh.dp(), model.store().values());
    const AxisBytes want = formula_bytes(c, mesh.coords());
    // The first rank whose bytes differ from the formula, and its numbers.
    std::vector<std::int64_t> got;
    for (std::uint64_t v : {run.bytes[Axis::tp], want[Axis::tp], run.bytes[Axis::dp],
                            want[Axis::dp], run.bytes[Axis::pp], want[Axis::pp]})
      got.push_back(static_cast<std::int64_t>(v));
    std::vector<std::vector<std::int64_t>> all;
    for (std::int64_t v : got) all.push_back(world.gather_values(v));
    const double diverged = world.agree(replicas, ReduceOp::max);
    int bad = -1;
    for (int r = world.size() - 1; r >= 0; --r) {
      const auto q = static_cast<std::size_t>(r);
      if (all[0][q] != all[1][q] || all[2][q] != all[3][q] || all[4][q] != all[5][q]) bad = r;
    }
    if (world.rank() != 0) return;
    out = {loss, weights, diverged, bad < 0, ""};
    if (bad >= 0) {
      const auto q = static_cast<std::size_t>(bad);
      out.bytes_detail = "rank " + std::to_string(bad) + " sent tp " + std::to_string(all[0][q]) +
                         " (formula " + std::to_string(all[1][q]) + "), dp " +
                         std::to_string(all[2][q]) + " (" + std::to_string(all[3][q]) + "), pp " +
                         std::to_string(all[4][q]) + " (" + std::to_string(all[5][q]) + ")";
    }
  });
  return out;
}

}  // namespace

TEST_SUITE("ch08 hybrid") {
  TEST_CASE("every factorisation of 8 ranks, and 1 x 1 x 1, trains like one device") {
    const std::vector<MeshShape> meshes = {
        {.pp = 1, .dp = 1, .tp = 1}, {.pp = 1, .dp = 1, .tp = 8}, {.pp = 1, .dp = 8, .tp = 1},
        {.pp = 8, .dp = 1, .tp = 1}, {.pp = 2, .dp = 2, .tp = 2}, {.pp = 1, .dp = 2, .tp = 4},
        {.pp = 1, .dp = 4, .tp = 2}, {.pp = 2, .dp = 1, .tp = 4}, {.pp = 4, .dp = 1, .tp = 2},
        {.pp = 2, .dp = 4, .tp = 1}, {.pp = 4, .dp = 2, .tp = 1}};
    for (const MeshShape& m : meshes) {
      const std::string name =
          std::to_string(m.pp) + " x " + std::to_string(m.dp) + " x " + std::to_string(m.tp);
      SUBCASE(("pp x dp x tp = " + name).c_str()) {
        const Outcome o = train_and_compare(small(m));
        CHECK_MESSAGE(o.loss_diff <= 1e-5,
                      name << ": the loss curve differs from one device's by " << o.loss_diff);
        CHECK_MESSAGE(o.weight_diff <= 1e-5,
                      name << ": the final weights differ from one device's by " << o.weight_diff);
        CHECK_MESSAGE(o.replica_diff == 0.0,
                      name << ": every dp replica's weights must be identical, they differ by "
                           << o.replica_diff);
        CHECK_MESSAGE(o.bytes_match,
                      name << ": bytes per axis differ from the formula: " << o.bytes_detail);
      }
    }
  }

  TEST_CASE("uneven replicas and microbatches (batch 13 over dp 2, m 3) still agree") {
    HybridConfig c = small({.pp = 2, .dp = 2, .tp = 2});
    c.batch = 13;
    c.microbatches = 3;
    const Outcome o = train_and_compare(c);
    CHECK(o.loss_diff <= 1e-5);
    CHECK(o.weight_diff <= 1e-5);
    CHECK_MESSAGE(o.bytes_match, o.bytes_detail);
  }

  TEST_CASE("every one-chunk schedule of chapter 04 runs the tensor-parallel blocks") {
    for (const char* schedule : {"gpipe", "1f1b", "zb1"}) {
      CAPTURE(schedule);
      HybridConfig c = small({.pp = 4, .dp = 1, .tp = 2});
      c.schedule = schedule;
      const Outcome o = train_and_compare(c);
      CHECK_MESSAGE(o.loss_diff <= 1e-5, schedule << ": loss differs by " << o.loss_diff);
      CHECK_MESSAGE(o.weight_diff <= 1e-5, schedule << ": weights differ by " << o.weight_diff);
    }
  }

  TEST_CASE("ZeRO-1 over dp (chapter 05) gives the weights of plain data parallelism") {
    for (const MeshShape m :
         {MeshShape{.pp = 2, .dp = 2, .tp = 2}, MeshShape{.pp = 1, .dp = 4, .tp = 2},
          MeshShape{.pp = 1, .dp = 8, .tp = 1}}) {
      HybridConfig plain = small(m), zero = small(m);
      zero.zero = 1;
      Tensor plain_w, zero_w;
      for (HybridConfig* c : {&plain, &zero})
        on_ranks(m.ranks(), [&](Communicator& world) {
          Mesh mesh(world, m);
          HybridModel model(mesh, *c, Memory::host);
          (void)train_hybrid(mesh, model, *c, Memory::host);
          if (world.rank() == 0) (c->zero ? zero_w : plain_w) = model.store().values().clone();
        });
      CHECK_MESSAGE(max_abs_diff(plain_w, zero_w) == 0.0,
                    "ZeRO-1's weights differ from plain data parallelism's by "
                        << max_abs_diff(plain_w, zero_w));
      const Outcome o = train_and_compare(zero);
      CHECK(o.weight_diff <= 1e-5);
      CHECK_MESSAGE(o.bytes_match, "ZeRO-1: " << o.bytes_detail);
    }
  }

  TEST_CASE("formula_bytes, worked by hand for rank 5 of a 2 x 2 x 2 mesh") {
    // Rank 5 is at pp 1, dp 0, tp 1: B_r = 16 rows in 4 microbatches of 4; 4 blocks here.
    HybridConfig c = small({.pp = 2, .dp = 2, .tp = 2});
    c.blocks = 8;  // 4 per stage
    const AxisBytes b = formula_bytes(c, coords_of(c.mesh, 5));
    // tp: 2 allreduces x 4 blocks x 4 microbatches of 4 x 8 floats; 2 (t-1)/t = 1 of 128 B.
    CHECK(b[Axis::tp] == 2u * 4 * 4 * 128);
    // dp: 4 blocks x (2 x 8 x 16 + 16 + 8) = 1120 floats, allreduced over 2: 1120 x 4 B.
    CHECK(b[Axis::dp] == 1120u * 4);
    // pp: the last stage sends only gradients back: 16 rows x 8 x 4 B.
    CHECK(b[Axis::pp] == 16u * 8 * 4);
  }

  TEST_CASE("the collective matmul under sequence parallelism: by parts, the same bits") {
    // The block's four tp collectives (the gather into fc1, the reduce-scatter out of fc2,
    // their backwards) by parts of rows, each part's collective under another part's
    // product (overlap) or waited for at once: the output, dL/dx and every gradient equal
    // the whole block's (one gather, one reduce-scatter) bit for bit. Rows a rank: 5 (parts
    // of 3 and 2), and 1 (one part). Each rank's x and dy are its rows of one tensor.
    // Wrong versions seen failing: rank j's rows of a part taken from j * part rows instead
    // of j * n/t ("the block's output y, waited for: 30 of 30 elements differ"); a part
    // reduce-scattered into the first part's rows ("the block's output y, overlapped"); the
    // gathered dL/dy kept in part order ("dL/dW1, db1, dW2, db2, waited for"); fc1's bias
    // left out ("the block's output y, waited for").
    for (const auto& [t, share] : {std::pair{2, 5}, std::pair{3, 5}, std::pair{2, 1}}) {
      CAPTURE(t);
      CAPTURE(share);
      const std::int64_t n = t * share, hidden = 6, ffn = 12;
      const Tensor x = randn(n, hidden, 31), dy = randn(n, hidden, 32);
      on_ranks(t, [&](Communicator& tp) {
        const ShardRange mine = shard_range(n, t, tp.rank());
        struct Run {
          Tensor y, dx, grads;
        };
        auto run = [&](int chunks, bool overlap) {
          nn::ParameterStore store;
          nn::Residual block =
              parallel_mlp(store, tp, mlp_spec("b", hidden, ffn, 5, 0),
                           {.sequence_parallel = true, .chunks = chunks, .overlap = overlap});
          store.allocate();
          for (nn::Parameter* p : store.parameters())  // b1 and b2 away from 0
            if (p->name.ends_with("bias")) p->value.copy_from(randn(1, p->value.size(), 33));
          nn::Forward f = block.forward(x.slice(mine.offset, mine.length));
          const Tensor dx = block.backward(dy.slice(mine.offset, mine.length), f.saved);
          return Run{f.out, dx, store.grads().clone()};
        };
        const Run whole = run(1, false);
        for (const bool overlap : {false, true}) {
          const Run parts = run(2, overlap);
          const std::string how = overlap ? ", overlapped" : ", waited for";
          check_equal(parts.y, whole.y, "the block's output y" + how);
          check_equal(parts.dx, whole.dx, "dL/dx" + how);
          check_equal(parts.grads, whole.grads, "dL/dW1, db1, dW2, db2" + how);
        }
      });
    }
  }

  TEST_CASE("a mesh that does not hold the ranks is refused") {
    on_ranks(4, [](Communicator& world) {
      CHECK_THROWS_AS(Mesh(world, MeshShape{.pp = 2, .dp = 1, .tp = 3}), UsageError);
    });
  }
}
