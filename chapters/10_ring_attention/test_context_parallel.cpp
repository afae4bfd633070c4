// Chapter 10's ring as chapter 09's attention: the GPT with every sequence cut over the cp
// ranks of the mesh trains as it does on one device, on meshes of cp alone and of cp with
// the other axes, and with experts on every factorisation of 8 ranks over all five axes
// (routing included); the cp bytes of a step equal the ring's formula.
//
// Wrong versions this test was checked against, and what each gives (cp 8):
//   the embedding's positions taken as 0 .. T/cp - 1 on every cp rank (wpe of the wrong
//     tokens): "the loss differs at step 1: 5.55543, one device 5.54631"
//   the gradients summed over the replicas' dp and ep but not their cp ranks: "the
//     gradient norm differs at step 1: 2.4131, one device 2.92295"
//   the loss's denominator the rank's tokens (B T / cp) instead of the batch's: "the loss
//     differs at step 1: 44.3704, one device 5.54631"
//   with experts, each cp rank routing its chunk of a sequence as a group of its own
//     (Megatron-LM's local routing), not the sequence whole: "the loss differs at step 1:
//     5.53653, one device 5.53293" (pp 1 x dp 1 x cp 2 x tp 4)
#include <doctest/doctest.h>

#include "context_parallel.hpp"
#include "gpt_testing.hpp"

using namespace ch09;
using namespace ch09::testing;

namespace {

/// "pp 2 x dp 1 x cp 2 x tp 2"
std::string mesh_text(const MeshShape& m) { return ch08::mesh_name(m); }

}  // namespace

TEST_CASE("the GPT with its sequences cut over a ring trains like one device") {
  // T 16: cp up to 8 (the zigzag cuts a sequence into 2 cp chunks).
  const Run want = one_device(small({.pp = 1, .dp = 1, .tp = 1}, 16), 3);
  REQUIRE(want.loss.size() == 3);
  for (MeshShape m : {MeshShape{.pp = 1, .dp = 1, .cp = 8, .tp = 1},
                      MeshShape{.pp = 2, .dp = 1, .cp = 2, .tp = 2},
                      MeshShape{.pp = 1, .dp = 2, .cp = 2, .tp = 2},
                      MeshShape{.pp = 1, .dp = 1, .cp = 4, .tp = 2},
                      MeshShape{.pp = 4, .dp = 1, .cp = 2, .tp = 1},
                      MeshShape{.pp = 2, .dp = 2, .cp = 2, .tp = 1}}) {
    const std::string mesh = mesh_text(m);
    CAPTURE(mesh);
    TrainConfig c = small(m, 16);
    c.context = ch10::ring_context();
    const Run got = train(c, 0, 3);
    check_same_training(got, want, 1e-5);
    if (storage_is_cached) CHECK(got.later_allocations == 0);
  }
}

TEST_CASE(
    "a MoE GPT on every factorisation of 8 ranks over the five axes trains like one "
    "device") {
  // Megatron-LM's five axes: tp, cp, ep, dp, pp. 8 experts (ep up to 8), 8 heads and 8
  // layers (tp and pp up to 8), T 16 (cp up to 8), a batch of 16 (8 replicas of 2
  // microbatches).
  TrainConfig base = small({.pp = 1, .dp = 1, .tp = 1}, 16);
  base.model.experts = 8;
  base.batch = 16;
  base.context = ch10::ring_context();
  const Run want = one_device(base, 3);
  REQUIRE(want.dropped.size() == 3);
  CHECK(want.dropped[0] > 0);
  int meshes = 0;
  for (int pp = 1; pp <= 8; pp *= 2)
    for (int dp = 1; pp * dp <= 8; dp *= 2)
      for (int ep = 1; pp * dp * ep <= 8; ep *= 2)
        for (int cp = 1; pp * dp * ep * cp <= 8; cp *= 2) {
          const MeshShape m{.pp = pp, .dp = dp, .ep = ep, .cp = cp, .tp = 8 / (pp * dp * ep * cp)};
          const std::string mesh = mesh_text(m);
          CAPTURE(mesh);
          TrainConfig c = base;
          c.mesh = m;
          check_same_training(train(c, 0, 3), want, 1e-5);
          ++meshes;
        }
  CHECK(meshes == 35);
}

TEST_CASE("with sequence parallelism, recomputation and ZeRO-1 too") {
  const Run want = one_device(small({.pp = 1, .dp = 1, .tp = 1}, 16), 3);
  struct Case {
    MeshShape mesh;
    bool sequence_parallel;
    Recompute recompute;
    int zero;
  };
  for (const Case& k : {Case{{.pp = 2, .dp = 1, .cp = 2, .tp = 2}, true, Recompute::none, 0},
                        Case{{.pp = 1, .dp = 2, .cp = 2, .tp = 2}, true, Recompute::full, 1},
                        Case{{.pp = 2, .dp = 1, .cp = 4, .tp = 1}, false, Recompute::selective, 0},
                        Case{{.pp = 1, .dp = 2, .cp = 4, .tp = 1}, false, Recompute::none, 1}}) {
    const std::string mesh = mesh_text(k.mesh);
    CAPTURE(mesh);
    CAPTURE(k.sequence_parallel);
    CAPTURE(ch08::recompute_name(k.recompute));
    CAPTURE(k.zero);
    TrainConfig c = small(k.mesh, 16);
    c.context = ch10::ring_context();
    c.sequence_parallel = k.sequence_parallel;
    c.recompute = k.recompute;
    c.zero = k.zero;
    check_same_training(train(c, 0, 3), want, 1e-5);
  }
}

TEST_CASE("a step sends over cp what the ring's formula says, on every rank") {
  for (Recompute r : {Recompute::none, Recompute::selective, Recompute::full}) {
    TrainConfig c = small({.pp = 2, .dp = 1, .cp = 2, .tp = 2}, 16);
    c.context = ch10::ring_context();
    c.recompute = r;
    CAPTURE(ch08::recompute_name(r));
    const Corpus data = Corpus::load(text_file(), c.model.context);
    on_ranks(c.mesh.ranks(), [&](Communicator& world) {
      Mesh mesh(world, c.mesh);
      GptModel model(mesh, c.model, c.model_options());
      Trainer trainer(mesh, model, c, data);
      const StepResult step = trainer.step(0);
      const ch08::AxisBytes want = formula_bytes(c, mesh.coords());
      CHECK(step.bytes[ch08::Axis::cp] > 0);
      CHECK(step.bytes[ch08::Axis::cp] == want[ch08::Axis::cp]);
      CHECK(step.bytes[ch08::Axis::tp] == want[ch08::Axis::tp]);
      CHECK(step.bytes[ch08::Axis::dp] == want[ch08::Axis::dp]);
      CHECK(step.bytes[ch08::Axis::pp] == want[ch08::Axis::pp]);
      // By hand: 4 blocks a stage, 2 microbatches of 4 sequences, 8 tokens of each on this
      // rank, 4 heads of 4 (tp 2): a block of k or v is 4 x 8 x 16 floats; the forward
      // passes k and v once (cp - 1 = 1), the backward k, v, their gradients, and the
      // gradients home: 2 + 4 blocks; recomputation runs the forward again.
      const std::uint64_t block = 4 * 8 * 16 * 4, forwards = r == Recompute::none ? 1 : 2;
      CHECK(step.bytes[ch08::Axis::cp] == 4 * 2 * (forwards * 2 + 6) * block);
    });
  }
}
