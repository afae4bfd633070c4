// Chapter 11's faults and goodput: the specs --inject takes and refuses, and where a run's
// time went, on attempts written by hand.
//
// Wrong versions this test was checked against, and what each gives:
//   a step's time counted useful in every attempt that trained it: "useful 8" (6)
//   the faults left in the order given: "sorted by step"
#include <doctest/doctest.h>

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
  for (const char* bad : {"kill", "kill@3", "nan@1@3", "kill@-1@3", "kill@01@3", "kill@1@2 ",
                          "kill@1@2@3", "KILL@1@2", "kill@1@1234567"})
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
             .end = 6.5,
             .failure = "rank 1"};
  Attempt a1{.start = 7,
             .ready = 8,
             .resumed = 2,
             .steps = {2, 3, 4, 5},
             .step_s = {1, 1, 1, 1},
             .checkpoint_s = {},
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
