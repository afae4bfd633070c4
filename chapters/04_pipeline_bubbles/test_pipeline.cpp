// Chapter 04 tests of the chapter's own code (compiled against the solution): the other
// schedules against their papers' formulas, the simulator against hand-worked timelines,
// the checks, a deadlocking schedule on real ranks, and every schedule's gradients.
//
// Wrong versions these tests were checked against: the simulator releasing a split
// backward's activations at B instead of W (ZB-H1's peak p - s instead of p); interleaved
// warm-up without the (v - 1) p term ("the stages cannot run it together" at p = 4, v = 2);
// ZB-H1's B index x - (p - s) ("bubble ... formula (p-1)/(3m)"); the executor sending
// a backward's input gradient to the next stage instead of the previous one (timeout
// naming "stage 1, op B0").
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "pipeline.hpp"
#include "schedule.hpp"
#include "shardlab/testing.hpp"
#include "shardlab/timer.hpp"
#include "simulate.hpp"
#include "timeline.hpp"
#include "toy_stage.hpp"

using namespace shardlab;
using ch04::OpKind;
using shardlab::testing::on_ranks;

using ch04::Schedule;

namespace {

bool close(double a, double b) { return std::fabs(a - b) <= 1e-9 * std::max(1.0, std::fabs(b)); }

/// Runs `s` on p ranks and checks every stage's gradients against one device's.
void check_gradients(const Schedule& s, int layers) {
  const ch04::ModelConfig cfg{layers, 8, 2 * s.microbatches + 1, 5};
  const ch04::Batch batch = ch04::make_batch(cfg);
  ch04::Reference ref;
  ch04::run_reference(cfg, batch, ref);
  const double scale = max_abs(ref.store.grads());
  double loss = 0;
  on_ranks(
      s.stages,
      [&](Communicator& comm) {
        ch04::ToyStage model(cfg, comm.rank(), s.stages, s.chunks, Memory::host);
        model.store().zero_grad();
        ch04::Pipeline pipeline(comm);
        const ch04::StageRun run = pipeline.run(s, model.stage(batch, s.microbatches));
        const double diff = ch04::max_gradient_diff(model, ref);
        if (!(diff <= 1e-5 * scale))
          throw Error(s.name + ", stage " + std::to_string(comm.rank()) + ": gradients differ by " +
                      std::to_string(diff));
        const double total = comm.agree(run.loss, ReduceOp::sum);
        if (comm.rank() == 0) loss = total;
      },
      std::chrono::seconds(5));
  CHECK_MESSAGE(std::fabs(loss - ref.loss) <= 1e-5 * ref.loss,
                s.name << ": loss " << loss << " vs " << ref.loss);
}

}  // namespace

TEST_SUITE("ch04.chapter") {
  TEST_CASE("GPipe: bubble (p-1)/(m+p-1) of the total, m microbatches held on every stage") {
    for (int p = 1; p <= 6; ++p)
      for (int m = 1; m <= 12; ++m) {
        CAPTURE(p);
        CAPTURE(m);
        const ch04::Timeline t = ch04::simulate(ch04::gpipe(p, m), ch04::Costs{1, 2, 0});
        CHECK(t.deadlock.empty());
        CHECK(close(t.bubble_fraction(), ch04::bubble_fraction_formula(p, m)));
        CHECK(close(t.bubble_over_ideal(), static_cast<double>(p - 1) / m));
        CHECK(close(t.makespan, 3.0 * (m + p - 1)));
        for (double held : t.peak_in_flight) CHECK(held == m);
      }
  }

  TEST_CASE("naive: one stage works at a time, bubble (p-1)/p") {
    for (int p = 1; p <= 6; ++p) {
      const ch04::Timeline t = ch04::simulate(ch04::naive(p), ch04::Costs{1, 2, 0}, 8);
      CHECK(close(t.bubble_fraction(), static_cast<double>(p - 1) / p));
      CHECK(close(t.makespan, 24.0 * p));
    }
  }

  TEST_CASE("interleaved: bubble (p-1)/(v m) of the ideal, m a multiple of p") {
    for (int p = 1; p <= 6; ++p)
      for (int v = 1; v <= 4; ++v)
        for (int m = p; m <= 4 * p; m += p) {
          CAPTURE(p);
          CAPTURE(v);
          CAPTURE(m);
          const Schedule s = ch04::interleaved(p, m, v);
          REQUIRE(ch04::validate(s).empty());
          const ch04::Timeline t = ch04::simulate(s, ch04::Costs{1, 2, 0});
          REQUIRE_MESSAGE(t.deadlock.empty(), "the stages cannot run it together: " << t.deadlock);
          CHECK_MESSAGE(close(t.bubble_over_ideal(), static_cast<double>(p - 1) / (v * m)),
                        "bubble " << t.bubble_over_ideal() << " of the ideal");
        }
    CHECK_THROWS_WITH_AS(ch04::interleaved(4, 6, 2), doctest::Contains("not a multiple of 4"),
                         UsageError);
  }

  TEST_CASE("interleaved: Megatron-LM's and PyTorch's warm-up, at m = p too") {
    // Stage s's warm-up is min(2 (p - 1 - s) + (v - 1) p, v m) forwards (Megatron-LM's
    // get_pp_rank_microbatches; PyTorch's ScheduleInterleaved1F1B), and the steady state
    // starts with one more forward before the first backward. Wrong
    // versions this catches: all forwards first when m = p (earlier Megatron-LM: every
    // stage then holds all m), p - 1 - s without the factor 2 (1F1B's: a stage waits for a
    // backward that cannot have come round yet).
    for (int p = 1; p <= 6; ++p)
      for (int v = 1; v <= 3; ++v)
        for (int m = p; m <= 3 * p; m += p)
          for (int st = 0; st < p; ++st) {
            CAPTURE(p);
            CAPTURE(v);
            CAPTURE(m);
            CAPTURE(st);
            const Schedule s = ch04::interleaved(p, m, v);
            const auto& ops = s.ops[static_cast<std::size_t>(st)];
            int warmup = 0;
            while (warmup < static_cast<int>(ops.size()) &&
                   ops[static_cast<std::size_t>(warmup)].kind == OpKind::forward)
              ++warmup;
            CHECK(warmup == std::min(2 * (p - 1 - st) + (v - 1) * p + 1, v * m));
          }
    // At m = p the last stage holds fewer than all m microbatches (chunks count 1/v each).
    const ch04::Timeline t = ch04::simulate(ch04::interleaved(4, 4, 2), ch04::Costs{1, 2, 0});
    CHECK(t.peak_in_flight == std::vector<double>{4, 4, 3.5, 2.5});
  }

  TEST_CASE("ZB-H1: with t_f = t_b = t_w, a third of 1F1B's bubble, and p microbatches held") {
    for (int p = 1; p <= 8; ++p)
      for (int m = p; m <= 3 * p; ++m) {
        CAPTURE(p);
        CAPTURE(m);
        const Schedule s = ch04::zb_h1(p, m);
        REQUIRE(ch04::validate(s).empty());
        CHECK(s.split_backward() == (m > 0));
        const ch04::Timeline zb = ch04::simulate(s, ch04::Costs{1, 1, 1});
        REQUIRE(zb.deadlock.empty());
        CHECK_MESSAGE(close(zb.bubble_over_ideal(), (p - 1) / (3.0 * m)),
                      "bubble " << zb.bubble_over_ideal() << ", formula (p-1)/(3m)");
        // 1F1B's holds p - s; ZB-H1 keeps the activations until W: p on every stage, no
        // more than 1F1B's first stage.
        for (double held : zb.peak_in_flight) CHECK(held == p);
        // The same costs, backward not split: 1F1B's bubble, three times as large.
        const ch04::Timeline f = ch04::simulate(ch04::gpipe(p, m), ch04::Costs{1, 1, 1});
        CHECK(close(f.bubble_over_ideal(), 3 * zb.bubble_over_ideal()));
      }
  }

  TEST_CASE("the simulator: a hand-worked 2-stage GPipe timeline, and costs per stage") {
    const ch04::Timeline t = ch04::simulate(ch04::gpipe(2, 2), ch04::Costs{1, 2, 0});
    // stage 0: F0 [0,1) F1 [1,2) ........ B0 [5,7) B1 [7,9)
    // stage 1: .  F0 [1,2) F1 [2,3) B0 [3,5) B1 [5,7)
    REQUIRE(t.events.size() == 8);
    CHECK(t.events[0].op == ch04::Op{OpKind::forward, 0, 0});
    CHECK(t.events[2].op == ch04::Op{OpKind::backward, 0, 0});
    CHECK(t.events[2].start == 5);
    CHECK(t.events[4].stage == 1);
    CHECK(t.events[4].start == 1);
    CHECK(t.events[6].start == 3);
    CHECK(t.makespan == 9);
    CHECK(t.busy == std::vector<double>{6, 6});
    // A slower last stage: everybody waits for it.
    const ch04::Timeline slow =
        ch04::simulate(ch04::gpipe(2, 2), [](int stage, const ch04::Op& op) {
          return (op.kind == OpKind::forward ? 1.0 : 2.0) * (stage == 1 ? 2 : 1);
        });
    CHECK(slow.makespan == 1 + 2 + 2 + 4 + 4 + 2);
  }

  TEST_CASE("validate names the stage and the op") {
    Schedule s = ch04::gpipe(2, 2);
    CHECK(ch04::validate(s).empty());
    s.ops[1][0] = ch04::Op{OpKind::backward, 0, 0};
    CHECK(ch04::validate(s).find("stage 1: op 0, B0: comes before its forward") !=
          std::string::npos);
    s = ch04::gpipe(2, 2);
    s.ops[0].pop_back();
    CHECK(ch04::validate(s) == "stage 0: no B1: microbatch 1 never goes backward");
    s = ch04::gpipe(2, 2);
    s.ops[0].push_back(ch04::Op{OpKind::forward, 2, 0});
    CHECK(ch04::validate(s).find("microbatch 2 does not exist") != std::string::npos);
    s = ch04::zb_h1(2, 2);
    s.ops[1].erase(s.ops[1].end() - 1);
    CHECK(ch04::validate(s).find("never gets its weight gradient") != std::string::npos);
  }

  TEST_CASE("a schedule whose stages wait for each other: named on paper and on ranks") {
    // Stage 0 wants B0 back before it sends F1; stage 1 wants F1 before it runs B0.
    Schedule s{"circular", 2, 2, 1, {}};
    s.ops = {
        {{OpKind::forward, 0}, {OpKind::backward, 0}, {OpKind::forward, 1}, {OpKind::backward, 1}},
        {{OpKind::forward, 0}, {OpKind::forward, 1}, {OpKind::backward, 0}, {OpKind::backward, 1}}};
    REQUIRE(ch04::validate(s).empty());
    const ch04::Timeline t = ch04::simulate(s, ch04::Costs{});
    CHECK(t.deadlock ==
          "stage 0 waits at op 1 (B0) for B0 on stage 1; stage 1 waits at op 1 (F1) for F1 on "
          "stage 0");
    // On ranks: the communicator's timeout, naming the stage and the op, within seconds.
    const ch04::ModelConfig cfg{2, 4, 4, 1};
    const ch04::Batch batch = ch04::make_batch(cfg);
    std::string error;
    const Stopwatch watch;
    try {
      run_threads(
          2,
          [&](Communicator& comm) {
            ch04::ToyStage model(cfg, comm.rank(), 2, 1, Memory::host);
            ch04::Pipeline pipeline(comm);
            (void)pipeline.run(s, model.stage(batch, s.microbatches));
          },
          std::chrono::milliseconds(500));
    } catch (const std::exception& e) {
      error = e.what();
    }
    const double seconds = watch.seconds();
    CHECK_MESSAGE(error.find("of the circular schedule: ") != std::string::npos, error);
    CHECK_MESSAGE(error.find("waited 0.5 s") != std::string::npos, error);
    CHECK(seconds < 5);
  }

  TEST_CASE("every schedule gives the single-device gradients on real ranks") {
    for (int p : {1, 2, 3, 4}) {
      CAPTURE(p);
      check_gradients(ch04::naive(p), p);
      check_gradients(ch04::gpipe(p, 3), p + 1);
      check_gradients(ch04::one_f_one_b(p, 5), 2 * p);
      check_gradients(ch04::zb_h1(p, p + 2), p);
      for (int v : {1, 2, 3}) check_gradients(ch04::interleaved(p, 2 * p, v), p * v);
    }
  }

  TEST_CASE("the terminal timeline and the Chrome trace") {
    const ch04::Timeline t = ch04::simulate(ch04::gpipe(2, 2), ch04::Costs{1, 2, 0});
    const std::string drawn = ch04::draw(t, ch04::cell_for(t), false);
    CHECK(drawn ==
          "stage 0 |F0 F1 .........B0    B1    |\n"
          "stage 1 |...F0 F1 B0    B1    ......|\n");
    nlohmann::json events = nlohmann::json::array();
    ch04::add_trace(events, t, 3, "gpipe", 1, 1000);
    REQUIRE(events.size() == 1 + 2 + 8);
    CHECK(events[0]["args"]["name"] == "gpipe");
    const auto& b0 = events[3 + 2];
    CHECK(b0["name"] == "B0");
    CHECK(b0["ph"] == "X");
    CHECK(b0["ts"] == 5000.0);
    CHECK(b0["dur"] == 2000.0);
    CHECK(b0["pid"] == 3);
    CHECK(b0["tid"] == 0);
  }
}
