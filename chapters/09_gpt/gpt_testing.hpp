// Chapter 09's GPT trained in a test: a small model on any mesh against one device (the
// tests of chapters 09 and 10, which trains it with its sequences cut over a ring).
#pragma once

#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include "checkpoint.hpp"
#include "shardlab/testing.hpp"
#include "train.hpp"

namespace ch09::testing {

namespace fs = std::filesystem;
using shardlab::Communicator;
using shardlab::testing::on_ranks;

/// A text to learn, made up on the spot: sentences with numbers, 12 KB.
inline std::string text_file() {
  static const std::string path = [] {
    const fs::path p = fs::temp_directory_path() / "shardlab_ch09_test.txt";
    std::ofstream out(p);
    for (int i = 0; i < 300; ++i)
      out << "Rank " << i % 8 << " sends " << i * 37 % 1000 << " bytes to rank " << (i + 1) % 8
          << ".\n";
    return p.string();
  }();
  return path;
}

/// The tests' model on `mesh`: L 8, C 32, H 8, T `context` (8), batch 8 in 2 microbatches,
/// clipped at 0.5 (the clipping is at work from the first step).
inline TrainConfig small(MeshShape mesh, std::int64_t context = 8) {
  TrainConfig c;
  c.model = {.layers = 8, .channels = 32, .heads = 8, .context = context, .vocab = 256, .seed = 5};
  c.mesh = mesh;
  c.batch = 8;
  c.microbatches = 2;
  c.clip = 0.5f;
  return c;
}

/// What a test's training did, rank 0's view.
struct Run {
  std::vector<double> loss;     ///< per step, the batch's mean loss
  std::vector<double> norm;     ///< per step, the gradient norm before clipping
  std::vector<double> scale;    ///< per step, the loss scale
  std::vector<double> aux;      ///< per step, with experts: the aux loss
  std::vector<double> dropped;  ///< per step, with experts: the dropped choices
  double validation = 0;        ///< the validation loss after the last step
  /// Tensor storages taken from the system allocator in the steps after the first, on the
  /// rank that took most (tensor.cpp's cache of freed blocks serves the rest).
  std::uint64_t later_allocations = 0;
  /// Empty, or the first rank, axis and step whose bytes differ from the formula.
  std::string bytes_mismatch;
};

#if defined(SHARDLAB_ASAN_BUILD)
inline constexpr bool storage_is_cached = false;  // AddressSanitizer sees every allocation
#else
inline constexpr bool storage_is_cached = true;
#endif

/// Trains steps [first, first + steps) on c's mesh (rank 0's view); `load`/`save`: a
/// checkpoint to start from / to write after.
inline Run train(TrainConfig c, int first, int steps, const std::string& load = "",
                 const std::string& save = "") {
  const Corpus data = Corpus::load(text_file(), c.model.context);
  Run out;
  std::atomic<std::uint64_t> later_allocations{0};
  std::mutex mismatch_mutex;
  std::string bytes_mismatch;
  on_ranks(
      c.mesh.ranks(),
      [&](Communicator& world) {
        Mesh mesh(world, c.mesh);
        GptModel model(mesh, c.model, c.model_options());
        Trainer trainer(mesh, model, c, data);
        if (!load.empty())
          CHECK(load_checkpoint(load, model, &trainer.optimizer(), &trainer.scaler(),
                                trainer.expert_optimizer()) == first);
        Run mine;
        std::uint64_t after_first = 0;
        for (int t = first; t < first + steps; ++t) {
          if (t == first + 1) after_first = shardlab::host_storage_allocations();
          const StepResult r = trainer.step(t);
          mine.loss.push_back(r.loss);
          mine.norm.push_back(r.grad_norm);
          mine.scale.push_back(r.loss_scale);
          mine.aux.push_back(r.routing.aux_loss);
          mine.dropped.push_back(r.routing.dropped);
          // Every rank's bytes per axis against the formulas (with experts, the step's
          // routing's): the first that differs, in the rank's words.
          const RoutingCounts routing =
              c.model.experts > 0 ? ep_routing(world, c.mesh, mesh.coords(), r) : RoutingCounts{};
          const ch08::AxisBytes want =
              formula_bytes(c, mesh.coords(), routing, trainer.dp_buckets());
          for (ch08::Axis a : ch08::kAxes)
            if (r.bytes[a] != want[a] && mine.bytes_mismatch.empty())
              mine.bytes_mismatch =
                  "rank " + std::to_string(world.rank()) + " sent " + std::to_string(r.bytes[a]) +
                  " bytes on " + std::string(ch08::axis_name(a)) + " at step " +
                  std::to_string(t + 1) + ", the formula says " + std::to_string(want[a]);
        }
        if (steps > 1) {
          const std::uint64_t taken = shardlab::host_storage_allocations() - after_first;
          std::uint64_t most = later_allocations.load();
          while (taken > most && !later_allocations.compare_exchange_weak(most, taken)) {
          }
        }
        mine.validation = trainer.evaluate(data.validation(6));
        if (!save.empty())
          save_checkpoint(save, mesh, model, &trainer.optimizer(), first + steps, &trainer.scaler(),
                          trainer.expert_optimizer());
        if (world.rank() == 0) out = mine;
        const std::lock_guard<std::mutex> lock(mismatch_mutex);
        if (!mine.bytes_mismatch.empty() && bytes_mismatch.empty())
          bytes_mismatch = mine.bytes_mismatch;
      },
      std::chrono::seconds(20));
  out.later_allocations = later_allocations.load();
  out.bytes_mismatch = bytes_mismatch;
  return out;
}

/// c trained on one device (a 1 x 1 x 1 mesh, one microbatch) for `steps` steps.
inline Run one_device(TrainConfig c, int steps) {
  c.mesh = {.pp = 1, .dp = 1, .tp = 1};
  c.microbatches = 1;
  return train(c, 0, steps);
}

/// |a - b| / max(1, |b|).
inline double rel(double a, double b) { return std::abs(a - b) / std::max(1.0, std::abs(b)); }

/// A run resumed at step 2 of `whole` for two steps: each loss within 1e-5 of the
/// uninterrupted run's.
inline void check_resumed(const Run& resumed, const Run& whole, const char* what) {
  REQUIRE(resumed.loss.size() == 2);
  for (std::size_t t = 0; t < 2; ++t)
    CHECK_MESSAGE(rel(resumed.loss[t], whole.loss[t + 2]) < 1e-5,
                  what << ", step " << t + 3 << ": " << resumed.loss[t] << ", uninterrupted "
                       << whole.loss[t + 2]);
}

/// Every step's loss (and, with `norms`, gradient norm) and the validation loss of `got`
/// within `tolerance` of `want`'s, relative.
inline void check_same_training(const Run& got, const Run& want, double tolerance,
                                bool norms = true) {
  REQUIRE(got.loss.size() == want.loss.size());
  for (std::size_t t = 0; t < got.loss.size(); ++t) {
    CHECK_MESSAGE(rel(got.loss[t], want.loss[t]) < tolerance,
                  "the loss differs at step " << t + 1 << ": " << got.loss[t] << ", one device "
                                              << want.loss[t]);
    if (norms)
      CHECK_MESSAGE(rel(got.norm[t], want.norm[t]) < tolerance,
                    "the gradient norm differs at step " << t + 1 << ": " << got.norm[t]
                                                         << ", one device " << want.norm[t]);
  }
  CHECK_MESSAGE(
      rel(got.validation, want.validation) < tolerance,
      "the validation loss differs: " << got.validation << ", one device " << want.validation);
  // With experts: every step routes as one device does (each sequence on its own).
  for (std::size_t t = 0; t < got.dropped.size() && t < want.dropped.size(); ++t) {
    CHECK_MESSAGE(got.dropped[t] == want.dropped[t], "the dropped choices differ at step "
                                                         << t + 1 << ": " << got.dropped[t]
                                                         << ", one device " << want.dropped[t]);
    CHECK_MESSAGE(rel(got.aux[t], want.aux[t]) < tolerance, "the aux loss differs at step "
                                                                << t + 1 << ": " << got.aux[t]
                                                                << ", one device " << want.aux[t]);
  }
  CHECK_MESSAGE(got.bytes_mismatch.empty(), got.bytes_mismatch);
}

}  // namespace ch09::testing
