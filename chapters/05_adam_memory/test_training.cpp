// Chapter 05's own code: the calculator against the ZeRO paper's numbers, and training at
// every ZeRO stage against plain data parallelism, its bytes against the formula.
//
// Checked against these wrong versions (each fails the case named, with the message quoted):
//   K = 16 (master, m, v and an fp32 gradient copy) -> "ZeRO's Figure 1 and Table 1":
//     "r.nd := 1 ... 150 vs 120" (|got - want| = 30);
//   stage 2 without sharding the gradients (2 Psi + 2 Psi + 12 Psi / Nd) -> the same case,
//     "r.nd := 4": 52.5 GB where the table has 41.3;
//   stage 2 reduce-scattering a block's gradients into another block's shard -> "every
//     stage ends with plain data parallelism's weights": "st := 2 ... weights differ";
//   checkpointing that keeps the hidden activation too -> "activation checkpointing keeps
//     L B d": 3840 bytes kept, the formula 768.
#include <doctest/doctest.h>

#include <cmath>

#include "calculator.hpp"
#include "shardlab/testing.hpp"
#include "training.hpp"

using namespace shardlab;
using namespace ch05;
using shardlab::testing::on_ranks;

TEST_SUITE("ch05") {
  TEST_CASE("ZeRO's Figure 1 and Table 1: the 7.5B model, K = 12") {
    // Table 1, Psi = 7.5B, GB per device for P_os, P_os+g, P_os+g+p (stage 0 is 120).
    struct Row {
      double nd, s1, s2, s3;
    };
    const Row table[] = {{1, 120, 120, 120},     {4, 52.5, 41.3, 30},     {16, 35.6, 21.6, 7.5},
                         {64, 31.4, 16.6, 1.88}, {256, 30.4, 15.4, 0.47}, {1024, 30.1, 15.1, 0.12}};
    for (const Row& r : table) {
      CAPTURE(r.nd);
      const double got[4] = {zero_memory(7.5e9, r.nd, 0, Precision::mixed).total() / 1e9,
                             zero_memory(7.5e9, r.nd, 1, Precision::mixed).total() / 1e9,
                             zero_memory(7.5e9, r.nd, 2, Precision::mixed).total() / 1e9,
                             zero_memory(7.5e9, r.nd, 3, Precision::mixed).total() / 1e9};
      const double want[4] = {120, r.s1, r.s2, r.s3};
      for (int st = 0; st < 4; ++st) {
        // The paper prints 3 significant digits, and 2 decimals below 1 GB.
        const double digit =
            want[st] < 1 ? 0.01 : std::pow(10.0, std::floor(std::log10(want[st])) - 2);
        CHECK_MESSAGE(std::fabs(got[st] - want[st]) <= 0.5 * digit + 1e-12,
                      "stage " << st << ": " << got[st] << " GB, the paper's table " << want[st]);
      }
    }
    // Figure 1: Nd = 64 -> 120, 31.4, 16.6, 1.9 GB.
    CHECK(zero_memory(7.5e9, 64, 3, Precision::mixed).total() == doctest::Approx(1.875e9));
    // GPT-2 1.5B needs 24 GB in mixed-precision Adam (ZeRO §3.1).
    CHECK(zero_memory(1.5e9, 1, 0, Precision::mixed).total() == doctest::Approx(24e9));
    // fp32: 16 bytes too, split 4 + 4 + 8.
    CHECK(zero_memory(1e9, 1, 0, Precision::fp32).total() == doctest::Approx(16e9));
    CHECK(zero_memory(1e9, 4, 2, Precision::fp32).total() == doctest::Approx(4e9 + 12e9 / 4));
    CHECK(zero_comm_elements(1e9, 4, 2) == doctest::Approx(2 * 0.75e9));
    CHECK(zero_comm_elements(1e9, 4, 3) == doctest::Approx(3 * 0.75e9));
  }

  TEST_CASE(
      "every stage ends with plain data parallelism's weights and holds the formula's bytes") {
    const ModelConfig model{2, 12, 5, 3};  // 8 * 2 * 144 = 2304 parameters: uneven for 5 ranks
    for (int N : {1, 2, 3, 5})
      for (Precision p : {Precision::mixed, Precision::fp32}) {
        CAPTURE(N);
        CAPTURE(precision_name(p));
        on_ranks(N, [&](Communicator& comm) {
          RunConfig rc;
          rc.precision = p;
          rc.steps = 3;
          const RunResult base = train(comm, model, rc, Memory::host);
          CHECK(base.states == formula_states(model, rc, N, comm.rank()));
          CHECK(base.losses.back() < base.losses.front());
          for (int st = 1; st <= 3; ++st)
            for (bool prefetch : {true, false}) {
              if (st < 3 && !prefetch) continue;
              CAPTURE(st);
              CAPTURE(prefetch);
              rc.zero.stage = st;
              rc.zero.prefetch = prefetch;
              const RunResult r = train(comm, model, rc, Memory::host);
              CHECK_MESSAGE(r.weights.bitwise_equal(base.weights),
                            "stage " << st << ": weights differ from plain data parallel by "
                                     << max_abs_diff(r.weights, base.weights));
              const StateBytes f = formula_states(model, rc, N, comm.rank());
              CHECK_MESSAGE(r.states == f, "stage " << st << ": rank " << comm.rank() << " holds "
                                                    << r.states.total()
                                                    << " bytes of model states, the formula "
                                                    << f.total());
              CHECK_MESSAGE(r.comm.total().bytes_received / 3 ==
                                formula_comm_bytes(model, rc, N, comm.rank()),
                            "stage " << st << ": received " << r.comm.total().bytes_received / 3
                                     << " bytes per step, formula "
                                     << formula_comm_bytes(model, rc, N, comm.rank()));
              // Stage 3 keeps at most two blocks gathered (this one and the prefetched next).
              const std::uint64_t block = static_cast<std::uint64_t>(model.block_params()) *
                                          (p == Precision::mixed ? 2 : 4);
              if (st == 3)
                CHECK(r.usage.peak(memory::Category::comm) <= (prefetch ? 2 : 1) * block + block);
            }
        });
      }
  }

  TEST_CASE("mixed-precision Adam holds 16 bytes per parameter, fp32 SGD 8, fp32 Adam 16") {
    const ModelConfig model{3, 8, 4, 1};
    on_ranks(2, [&](Communicator& comm) {
      const auto P = static_cast<std::uint64_t>(model.params());
      RunConfig sgd{.zero = {.stage = 0, .sgd = true}, .precision = Precision::fp32};
      RunConfig adam32{.precision = Precision::fp32};
      RunConfig mixed{.precision = Precision::mixed};
      CHECK(train(comm, model, sgd, Memory::host).states.total() == 8 * P);
      CHECK(train(comm, model, adam32, Memory::host).states.total() == 16 * P);
      const StateBytes m = train(comm, model, mixed, Memory::host).states;
      CHECK(m.params == 2 * P);
      CHECK(m.grads == 2 * P);
      CHECK(m.master == 4 * P);
      CHECK(m.optimizer == 8 * P);
    });
  }

  TEST_CASE("activation checkpointing keeps L B d instead of 5 L B d, and the same bits") {
    const ModelConfig model{4, 16, 6, 2};
    on_ranks(2, [&](Communicator& comm) {
      for (Precision p : {Precision::mixed, Precision::fp32}) {
        RunConfig plain{.precision = p, .keep_grads = true};
        RunConfig ckpt{.precision = p, .checkpoint = true, .keep_grads = true};
        const RunResult a = train(comm, model, plain, Memory::host);
        const RunResult b = train(comm, model, ckpt, Memory::host);
        CHECK(a.activations_after_forward == formula_activations(model, plain));
        CHECK(b.activations_after_forward == formula_activations(model, ckpt));
        CHECK(5 * b.activations_after_forward == a.activations_after_forward);
        CHECK_MESSAGE(a.first_grads.bitwise_equal(b.first_grads), "gradients not bit for bit");
        CHECK_MESSAGE(a.weights.bitwise_equal(b.weights), "weights not bit for bit");
      }
    });
  }
}
