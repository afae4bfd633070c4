// Chapter 09's program: what its flags set, the flags themselves, and the combinations of
// them it refuses (main.cpp).
#pragma once

#include <string>

#include "shardlab/cli.hpp"
#include "shardlab/results.hpp"
#include "train.hpp"

namespace ch09 {

/// --steps' default: 200; 20 in a build under AddressSanitizer (the learner's), where a
/// step takes some 25 times as long.
#if defined(SHARDLAB_ASAN_BUILD)
inline constexpr int kSteps = 20;
#else
inline constexpr int kSteps = 200;
#endif

/// What the ch09_gpt program's flags set.
struct Settings {
  TrainConfig run;  ///< The training's configuration, as the flags set it.
  /// --pp, --dp, --ep, --cp, --tp; dp 0: the ranks the other axes leave.
  MeshShape mesh{.pp = 2, .dp = 0, .tp = 2};
  int steps = kSteps;      ///< --steps.
  int log_every = 20;      ///< --log-every.
  int sample = 0;          ///< --sample: bytes to generate (0: train).
  int top_k = 0;           ///< --top-k.
  float temperature = 0;   ///< --temperature.
  bool reference = true;   ///< Train one device's reference too (not with --no-reference).
  bool benchmark = false;  ///< --benchmark.
  std::string data = shardlab::beside_program("ch09_gpt.txt").string();  ///< --data.
  std::string save;                                                      ///< --save.
  std::string load;                                                      ///< --load.
  std::string prompt;                                                    ///< --prompt.
  std::string recompute = "none";                                        ///< --recompute.
  std::string trace;                                                     ///< --trace.
  std::string precision = "fp32";                                        ///< --precision.
  std::string overlap = "all";                                           ///< --overlap.
  std::string calibrate;   ///< --calibrate: the machine profile to write.
  std::string predict;     ///< --predict: the machine profile to predict from.
  bool mesh_auto = false;  ///< --mesh auto: the mesh --predict's profile ranks fastest.
  std::string scaler;      ///< --scaler; "": dynamic with fp16, else none.
};

/// The program's flags, on `app`, setting `s`.
void add_flags(CLI::App& app, Settings& s);
/// Of them, the mesh's and the model's (chapter 11 trains the same model)...
void add_model_flags(CLI::App& app, Settings& s);
/// ...and the training's: the batch, the schedule, the optimizer, recomputation, precision.
void add_training_flags(CLI::App& app, Settings& s);
/// Once those are parsed: --overlap's axes; the experts' flags only with --experts, and
/// --init-scale only with the dynamic scaler (shardlab::UsageError).
void check_training_flags(const CLI::App& app, Settings& s);

/// Once the flags are parsed: the ones that would do nothing (--prompt without --sample,
/// --moe-every without --experts, ...) or contradict each other are refused with
/// shardlab::UsageError, not ignored; --benchmark's default --steps is 6.
void check_flags(const CLI::App& app, Settings& s);

}  // namespace ch09
