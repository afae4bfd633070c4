// Chapter 04 tests of the learner's 1F1B schedule: compiled against the solution (must
// pass) and the exercise stub (every case must fail). p = 1..8 stages, m = 1..3p
// microbatches.
//
// Wrong versions these tests were checked against (each fails with the message quoted,
// at the first p and m where it goes wrong):
//   GPipe's order (every forward, then every backward)
//     -> "stage 0 holds 2 microbatches at once; 1F1B holds at most p - s = 1"
//   a warm-up of p - s forwards instead of p - s - 1
//     -> "stage 0 holds 2 microbatches at once; 1F1B holds at most p - s = 1"
//   a warm-up of p - 1 forwards on every stage
//     -> "stage 1 holds 2 microbatches at once; 1F1B holds at most p - s = 1"
//   a warm-up of p - s - 2 forwards (one short)
//     -> "stage 0 holds only 1 microbatch(es) at once: 1F1B's warm-up keeps p - s = 2 in
//        flight (too few forwards before the first backward leave the stage idle)"
//   the steady state's backward before its forward (B(i), F(w + i))
//     -> "stage 0: op 0, B0: comes before its forward on this stage"
//   the cool-down one backward short
//     -> "stage 0: no B0: microbatch 0 never goes backward"
//   the cool-down's backwards in reverse order
//     -> "microbatches go backward in order 0, 1, ..., m - 1: stage 0 runs B1 first"
//   a warm-up of p - s - 1 without the min (m < p)
//     -> "stage 0: op 1, F1: microbatch 1 does not exist (microbatches 0..0)"
// The warm-up mistakes still run, and with the right bubble: only the memory shows them.
#include <doctest/doctest.h>

#include <sstream>

#include "pipeline.hpp"
#include "schedule.hpp"
#include "shardlab/testing.hpp"
#include "simulate.hpp"
#include "toy_stage.hpp"

using namespace shardlab;
using shardlab::testing::on_ranks;

namespace {

/// The first backward out of microbatch order on any stage, or "".
std::string order_error(const ch04::Schedule& s) {
  for (int st = 0; st < s.stages; ++st) {
    int forward = -1, backward = -1;
    for (const ch04::Op& op : s.ops[static_cast<std::size_t>(st)]) {
      int& last = op.kind == ch04::OpKind::forward ? forward : backward;
      if (op.microbatch != last + 1) {
        std::ostringstream out;
        out << "microbatches go " << (op.kind == ch04::OpKind::forward ? "forward" : "backward")
            << " in order 0, 1, ..., m - 1: stage " << st << " runs " << ch04::label(op, 1) << " "
            << (last < 0 ? std::string("first")
                         : "after " + std::string(op.kind == ch04::OpKind::forward ? "F" : "B") +
                               std::to_string(last));
        return out.str();
      }
      last = op.microbatch;
    }
  }
  return "";
}

}  // namespace

TEST_SUITE("ch04") {
  TEST_CASE("every stage runs each microbatch forward then backward, once, in order") {
    for (int p = 1; p <= 8; ++p)
      for (int m = 1; m <= 3 * p; ++m) {
        CAPTURE(p);
        CAPTURE(m);
        const ch04::Schedule s = ch04::one_f_one_b(p, m);
        REQUIRE_MESSAGE(s.stages == p, "the schedule says " << s.stages << " stages, not " << p);
        REQUIRE_MESSAGE(s.microbatches == m,
                        "the schedule says " << s.microbatches << " microbatches");
        REQUIRE_MESSAGE(s.chunks == 1, "1F1B has one chunk per stage");
        const std::string problem = ch04::validate(s);
        REQUIRE_MESSAGE(problem.empty(), problem);
        REQUIRE_MESSAGE(!s.split_backward(), "1F1B's backward is one op (no W)");
        const std::string order = order_error(s);
        REQUIRE_MESSAGE(order.empty(), order);
      }
  }

  TEST_CASE("stage s holds at most p - s microbatches, and GPipe's bubble") {
    // With t_b = 2 t_f: the bubble is (p-1)/(m+p-1) of the total time, as for GPipe.
    for (int p = 1; p <= 8; ++p)
      for (int m = 1; m <= 3 * p; ++m) {
        CAPTURE(p);
        CAPTURE(m);
        const ch04::Schedule s = ch04::one_f_one_b(p, m);
        REQUIRE(ch04::validate(s).empty());
        const ch04::Timeline t = ch04::simulate(s, ch04::Costs{1, 2, 0});
        REQUIRE_MESSAGE(t.deadlock.empty(), "the stages cannot run it together: " << t.deadlock);
        for (int st = 0; st < p; ++st) {
          const double want = std::min(p - st, m);
          const double got = t.peak_in_flight[static_cast<std::size_t>(st)];
          const std::string rule = std::string(want < p - st ? "m = " : "p - s = ");
          REQUIRE_MESSAGE(got <= want, "stage " << st << " holds " << got
                                                << " microbatches at once; 1F1B holds at most "
                                                << rule << want);
          REQUIRE_MESSAGE(got == want, "stage " << st << " holds only " << got
                                                << " microbatch(es) at once: 1F1B's warm-up "
                                                << "keeps " << rule << want
                                                << " in flight (too few forwards before the "
                                                << "first backward leave the stage idle)");
        }
        const double want = ch04::bubble_fraction_formula(p, m);
        REQUIRE_MESSAGE(std::fabs(t.bubble_fraction() - want) <= 1e-12,
                        "bubble " << t.bubble_fraction() << " of the total time; the formula "
                                  << "(p-1)/(m+p-1) says " << want
                                  << ": a stage waits where it need not");
      }
  }

  TEST_CASE("runs on real ranks without deadlock, with the single-device gradients") {
    for (int p = 1; p <= 8; ++p)
      for (int m = 1; m <= 3 * p; ++m) {
        CAPTURE(p);
        CAPTURE(m);
        const ch04::Schedule s = ch04::one_f_one_b(p, m);
        REQUIRE(ch04::validate(s).empty());
        const ch04::ModelConfig cfg{p, 8, 3 * p, 11};
        const ch04::Batch batch = ch04::make_batch(cfg);
        ch04::Reference ref;
        ch04::run_reference(cfg, batch, ref);
        const double scale = max_abs(ref.store.grads());
        on_ranks(
            p,
            [&](Communicator& comm) {
              ch04::ToyStage model(cfg, comm.rank(), p, 1, Memory::host);
              model.store().zero_grad();
              ch04::Pipeline pipeline(comm);
              (void)pipeline.run(s, model.stage(batch, m));
              const double diff = ch04::max_gradient_diff(model, ref);
              if (!(diff <= 1e-5 * scale))
                throw Error("stage " + std::to_string(comm.rank()) +
                            ": gradients differ from one device's by " + std::to_string(diff));
            },
            std::chrono::seconds(2));
      }
  }
}
