// Chapter 11's faults and goodput: the specs --inject takes and refuses, and where a run's
// time went, on attempts written by hand.
//
// Wrong versions this test was checked against, and what each gives:
//   a step's time counted useful in every attempt that trained it: "useful 8" (6)
//   the faults left in the order given: "sorted by step"
//   a skipped step's time counted useful: "useful 6" (5) in "a skipped step is lost"
//   skipped_steps from every attempt, not the last that trained the step: {3, 4} ({4})
//   the vote's majority as "at least half" (two of four): "2 against 2" finds one healthy
//   the odd replicas without a majority left empty: "two that differ" gives agree()
//   draw_failures' gaps uniform on [0, 2N) instead of exponential: "a gap longer than 3N"
//   (none of 20,000 such gaps is; about 5 % of exponential ones are)
//   stragglers against the mean instead of the median: "one slow of four" names none
//   (the mean, 2.5, times 1.5 is 3.75 < 7 — names it too; see "two slow of five")
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "faults.hpp"
#include "shardlab/check.hpp"

using namespace ch11;

TEST_CASE("--inject's specs") {
  const Fault k = parse_fault("kill@3@10");
  CHECK(k.kind == Fault::Kind::kill);
  CHECK(k.rank == 3);
  CHECK(k.step == 10);
  CHECK(parse_fault("hang@0@0").kind == Fault::Kind::hang);
  CHECK(parse_fault("stall@4@2").kind == Fault::Kind::stall);
  CHECK(parse_fault("nan@2@5").kind == Fault::Kind::nan);
  const Fault flip = parse_fault("flip@1@6");
  CHECK(flip.kind == Fault::Kind::flip);
  CHECK(flip.step == 6);
  const Fault slow = parse_fault("slow@6@2.5");
  CHECK(slow.kind == Fault::Kind::slow);
  CHECK(slow.rank == 6);
  CHECK(slow.factor == 2.5);
  CHECK(parse_fault("slow@0@100").factor == 100);
  for (const char* bad :
       {"kill", "kill@3", "nap@1@3", "kill@-1@3", "kill@01@3", "kill@1@2 ", "kill@1@2@3",
        "KILL@1@2", "kill@1@1234567", "flip@1", "slow@1", "slow@1@0.5", "slow@1@101", "slow@1@abc",
        "slow@1@-2", "slow@1@1e3", "nan@1@x"})
    CHECK_THROWS_AS(parse_fault(bad), shardlab::UsageError);
  const std::vector<Fault> two = parse_faults({"kill@6@13", "hang@1@3"}, 8, 20);
  REQUIRE(two.size() == 2);
  CHECK_MESSAGE(two[0].step == 3, "sorted by step");
  CHECK(parse_faults({"none"}, 8, 20).empty());
  CHECK_THROWS_AS(parse_faults({"kill@8@3"}, 8, 20), shardlab::UsageError);
  CHECK_THROWS_AS(parse_faults({"kill@1@20"}, 8, 20), shardlab::UsageError);
  CHECK_THROWS_AS(parse_faults({"none", "kill@1@2"}, 8, 20), shardlab::UsageError);
}

TEST_CASE("where the time went, attempt by attempt") {
  // Attempt 0: ready at 1, steps 0-3 of 1 s each and a checkpoint (0.5 s) after step 1;
  // it fails at 6.5. Attempt 1 starts at 7, ready at 8, goes on from step 2: steps 2-5 of
  // 1 s, ends at 12. Useful: steps 0, 1 (attempt 0) and 2-5 (attempt 1): 6 s; lost: the
  // first run's steps 2 and 3, 2 s; checkpoints 0.5 s; the rest of 12 s, 3.5 s.
  Attempt a0{.start = 0,
             .ready = 1,
             .resumed = 0,
             .steps = {0, 1, 2, 3},
             .step_s = {1, 1, 1, 1},
             .checkpoint_s = {0.5},
             .written_s = {},
             .check_s = 0,
             .skipped = {},
             .failed_at = 3,
             .end = 6.5,
             .failure = "rank 1"};
  Attempt a1{.start = 7,
             .ready = 8,
             .resumed = 2,
             .steps = {2, 3, 4, 5},
             .step_s = {1, 1, 1, 1},
             .checkpoint_s = {},
             .written_s = {},
             .check_s = 0,
             .skipped = {},
             .failed_at = 5,
             .end = 12,
             .failure = ""};
  const Goodput g = goodput_of({a0, a1});
  CHECK(g.wall == doctest::Approx(12));
  CHECK_MESSAGE(g.useful == doctest::Approx(6), "useful " << g.useful);
  CHECK(g.lost == doctest::Approx(2));
  CHECK(g.checkpoints == doctest::Approx(0.5));
  CHECK(g.restart == doctest::Approx(3.5));
  CHECK(g.fraction() == doctest::Approx(0.5));
  CHECK(goodput_of({}).wall == 0);
}

TEST_CASE("two checkpoint folders compared file by file") {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / "shardlab_ch11_first_difference";
  fs::remove_all(root);
  fs::create_directories(root / "a");
  fs::create_directories(root / "b");
  for (const char* folder : {"a", "b"})
    for (const char* name : {"model.safetensors", "trainer.json"})
      std::ofstream(root / folder / name) << name << " 1";
  CHECK(first_difference((root / "a").string(), (root / "b").string()).empty());
  std::ofstream(root / "b" / "trainer.json") << "trainer.json 2";
  CHECK(first_difference((root / "a").string(), (root / "b").string()) == "trainer.json");
  std::ofstream(root / "b" / "trainer.json") << "trainer.json 1";
  fs::remove(root / "b" / "model.safetensors");
  CHECK(first_difference((root / "a").string(), (root / "b").string()) == "model.safetensors");
  fs::remove_all(root);
}

TEST_CASE("a skipped step is lost, and a run without failures skips it only if kept skipped") {
  // Attempt 0 trains steps 0-4 (1 s each), skipping step 4 (a NaN), and fails in step 5;
  // attempt 1 goes on from 3 and trains 3-6, skipping step 6 this time. Useful: steps 0-2
  // of attempt 0 and 3-5 of attempt 1, 6 s; lost: attempt 0's 3 and 4 (trained again) and
  // attempt 1's 6 (skipped), 3 s. The run in the end skipped step 6 only.
  Attempt a0;
  a0.steps = {0, 1, 2, 3, 4};
  a0.step_s = {1, 1, 1, 1, 1};
  a0.skipped = {4};
  a0.end = 5;
  Attempt a1;
  a1.start = a1.ready = 5;
  a1.resumed = 3;
  a1.steps = {3, 4, 5, 6};
  a1.step_s = {1, 1, 1, 1};
  a1.skipped = {6};
  a1.end = 9;
  const Goodput g = goodput_of({a0, a1});
  CHECK_MESSAGE(g.useful == doctest::Approx(6), "useful " << g.useful);  // 0-2, then 3-5
  CHECK(g.lost == doctest::Approx(3));  // attempt 0's 3 and 4, attempt 1's 6
  CHECK(skipped_steps({a0, a1}) == std::vector<int>{6});
  CHECK(skipped_steps({a0}) == std::vector<int>{4});
}

TEST_CASE("the replicas' vote: the odd one out, or no majority") {
  CHECK(vote({7, 7, 7, 7}).agree());
  CHECK(vote({7, 7, 7, 7}).healthy == 0);
  const ReplicaVote one = vote({7, 9, 7, 7});
  CHECK(one.odd == std::vector<int>{1});
  CHECK(one.healthy == 0);
  CHECK(vote({9, 7, 7}).healthy == 1);
  const ReplicaVote two = vote({7, 9});  // two that differ: which is right?
  CHECK(!two.agree());
  CHECK(two.odd == std::vector<int>{0, 1});
  CHECK(two.healthy == -1);
  const ReplicaVote tie = vote({7, 7, 9, 9});  // 2 against 2
  CHECK(tie.healthy == -1);
  CHECK(tie.odd.size() == 4);
  CHECK(vote({5}).agree());
  // A checksum sees one flipped bit, and only that.
  shardlab::Tensor a = shardlab::Tensor::from_vector(std::vector<float>{1, 2, 3, 4});
  shardlab::Tensor b = shardlab::Tensor::from_vector(std::vector<float>{1, 2, 3, 4});
  CHECK(checksum(a) == checksum(b));
  std::uint32_t bits = 0;
  std::memcpy(&bits, b.data<float>() + 3, 4);
  bits ^= 1u << 16;
  std::memcpy(b.data<float>() + 3, &bits, 4);
  CHECK(checksum(a) != checksum(b));
}

TEST_CASE("stragglers: busier than 1.5 times the median rank") {
  CHECK(stragglers({1, 1, 1, 7}) == std::vector<int>{3});        // one slow of four
  CHECK(stragglers({1, 1, 7, 1, 7}) == std::vector<int>{2, 4});  // two slow of five
  CHECK(stragglers({1, 1.2, 0.9, 1.4}).empty());
  CHECK(stragglers({1, 4}) == std::vector<int>{1});  // the median of two is their mean, 2.5
  CHECK(stragglers({1, 2}).empty());
  CHECK(stragglers({}).empty());
}

TEST_CASE("failures drawn from a mean time between them: seeded, exponential gaps") {
  const std::vector<Fault> a = draw_failures(8, 3, 8, 40), b = draw_failures(8, 3, 8, 40);
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].spec == b[i].spec);
    CHECK(a[i].kind == Fault::Kind::kill);
    CHECK(a[i].spec == "kill@" + std::to_string(a[i].rank) + "@" + std::to_string(a[i].step));
  }
  CHECK(draw_failures(8, 4, 8, 40).size() + a.size() > 0);
  bool differ = draw_failures(8, 4, 8, 40).size() != a.size();
  for (std::size_t i = 0; !differ && i < a.size(); ++i)
    differ = draw_failures(8, 4, 8, 40)[i].spec != a[i].spec;
  CHECK_MESSAGE(differ, "another seed, other failures");
  // Over 2,000,000 steps with a failure every 100 on average: about 20,000 failures (a
  // Poisson count: within 3 % is 4 standard deviations), every step and rank in range, in
  // order, the ranks about equally often, and the gaps exponential: P(gap > 3N) = e^-3.
  const std::vector<Fault> many = draw_failures(100, 1, 4, 2000000);
  CHECK(many.size() == doctest::Approx(20000).epsilon(0.03));
  std::vector<int> per_rank(4, 0);
  int long_gaps = 0;
  for (std::size_t i = 0; i < many.size(); ++i) {
    REQUIRE(many[i].rank >= 0);
    REQUIRE(many[i].rank < 4);
    REQUIRE(many[i].step < 2000000);
    if (i > 0) {
      REQUIRE(many[i].step >= many[i - 1].step);
      long_gaps += many[i].step - many[i - 1].step > 300;
    }
    ++per_rank[std::size_t(many[i].rank)];
  }
  for (int n : per_rank) CHECK(n == doctest::Approx(5000).epsilon(0.1));
  CHECK(double(long_gaps) / double(many.size()) == doctest::Approx(std::exp(-3.0)).epsilon(0.15));
  CHECK(draw_failures(1e6, 1, 8, 10).size() <= 1);
}
