// Chapter 11's checkpoints in the background: what a save written while training goes on
// holds, against chapter 09's save written there and then.
//
// Wrong versions this test was checked against, and what each gives:
//   the snapshot sharing the model's tensors (to() of a host tensor is itself, no clone):
//   "the snapshot's values is the model's own tensor", and the files differ from the save
//   written there and then (model-00001-of-00002.safetensors: the weights overwritten)
//   wait() not rethrowing the save's error: "did NOT throw at all" (after the 5 s timeout)
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>

#include "background_save.hpp"
#include "faults.hpp"
#include "gpt_testing.hpp"
#include "shardlab/testing.hpp"

using namespace ch09;
using namespace ch09::testing;
using namespace ch11;
using namespace shardlab;
namespace fs = std::filesystem;

TEST_CASE("a save in the background holds the state of its start while training goes on") {
  const fs::path base = fs::temp_directory_path() / "shardlab_ch11_background";
  fs::remove_all(base);
  fs::create_directories(base);
  const std::string now = (base / "now").string(), later = (base / "later").string();
  const Corpus data = Corpus::load(text_file(), 8);
  const TrainConfig c = small({.pp = 2, .dp = 2, .tp = 1});
  run_threads(
      4,
      [&](Communicator& world) {
        BackgroundSaver saver(world);
        Mesh mesh(world, c.mesh);
        GptModel model(mesh, c.model);
        Trainer trainer(mesh, model, c, data);
        (void)trainer.step(0);
        save_checkpoint(now, mesh, model, &trainer.optimizer(), 1);  // there and then
        CheckpointSnapshot snap = snapshot_checkpoint(mesh, model, &trainer.optimizer(), 1);
        for (const auto& [name, t] : snap.shard)
          CHECK_MESSAGE(t.raw() != model.store().values().raw(),
                        "the snapshot's " << name << " is the model's own tensor, not a copy");
        saver.start(later, std::move(snap));
        model.store().values().fill(7);  // the live weights change at once...
        (void)trainer.step(1);           // ...and Adam's moments, the step's calls beside the save
        CHECK(saver.wait() > 0);
        CHECK(saver.completed() == 1);
      },
      std::chrono::seconds(20));
  const std::string differs = first_difference(now, later);
  CHECK_MESSAGE(
      differs.empty(),
      "the save in the background differs from the one written there and then in " << differs);
  fs::remove_all(base);
}

TEST_CASE("a failing save in the background says so when waited for") {
  const fs::path base = fs::temp_directory_path() / "shardlab_ch11_background_fails";
  fs::remove_all(base);
  fs::create_directories(base / "taken");
  std::ofstream(base / "taken" / "mine.txt") << "not a checkpoint";  // check_save_target refuses
  const Corpus data = Corpus::load(text_file(), 8);
  const TrainConfig c = small({.pp = 1, .dp = 2, .tp = 1});
  // Rank 0's save refuses the folder; its wait() says so and ends the job, which stops the
  // other ranks' saves where they wait for rank 0.
  CHECK_THROWS_AS(run_threads(
                      2,
                      [&](Communicator& world) {
                        BackgroundSaver saver(world);
                        Mesh mesh(world, c.mesh);
                        GptModel model(mesh, c.model);
                        Trainer trainer(mesh, model, c, data);
                        saver.start((base / "taken").string(),
                                    snapshot_checkpoint(mesh, model, &trainer.optimizer(), 0));
                        (void)saver.wait();
                      },
                      std::chrono::seconds(5)),
                  UsageError);
  CHECK(fs::exists(base / "taken" / "mine.txt"));
  fs::remove_all(base);
}
