// Chapter 09's program's flags (options.hpp).
#include "options.hpp"

#include <cstdint>

#include "mesh_flags.hpp"
#include "shardlab/check.hpp"

namespace ch09 {

using shardlab::require_usage;
namespace cli = shardlab::cli;

/// The mesh, and the model's shape and experts.
void add_model_flags(CLI::App& app, Settings& s) {
  GptShape& g = s.run.model;
  ch08::add_mesh_flags(app, s.mesh, {std::begin(ch08::kAxes), std::end(ch08::kAxes)},
                       "the ranks the other axes leave");
  cli::option(app, "--layers", g.layers, "transformer blocks L", cli::whole(1, 64));
  cli::option(app, "--channels", g.channels, "channels C", cli::whole(1, 2048));
  cli::option(app, "--heads", g.heads, "attention heads H", cli::whole(1, 256));
  cli::option(app, "--context", g.context, "tokens per sequence T", cli::whole(1, 1024));
  cli::option(app, "--experts", g.experts,
              "a Mixture-of-Experts MLP of E experts in every --moe-every-th block (0: dense)",
              cli::whole(0, 256));
  cli::option(app, "--moe-every", g.moe_every, "1: every block's MLP a MoE; 2: every other block's",
              cli::whole(1, 64));
  cli::option(app, "--capacity-factor", g.capacity_factor,
              "an expert takes ceil(k T / E x this) of a sequence's tokens",
              cli::between(1e-3, 1e3));
  cli::option(app, "--aux-alpha", g.aux_alpha, "the load-balancing loss's weight (Switch: 0.01)",
              cli::between(0, 1e3));
}

/// The batch, the schedule, the optimizer, recomputation and precision.
void add_training_flags(CLI::App& app, Settings& s) {
  TrainConfig& c = s.run;
  cli::option(app, "--batch", c.batch, "sequences per step, all replicas", cli::whole(1, 4096));
  cli::option(app, "--microbatches", c.microbatches, "microbatches per step and replica",
              cli::whole(1, 4096));
  cli::option(app, "--steps", s.steps,
              "training steps (200; 20 in the learner build, under the sanitizers)",
              cli::whole(1, 100000));
  cli::option(app, "--lr", c.adam.lr, "Adam's learning rate", cli::between(1e-9, 10.0));
  cli::option(app, "--clip", c.clip, "max global gradient norm (0: no clipping)",
              cli::between(0, 1e9));
  cli::option(app, "--schedule", c.schedule, "pipeline schedule (chapter 04)",
              CLI::IsMember(ch04::schedule_names(true, false)));
  cli::option(app, "--chunks", c.chunks, "model chunks per stage (interleaved; default 2 there)",
              cli::whole(1, 64));
  cli::option(app, "--recompute", s.recompute, "what the blocks recompute in the backward",
              CLI::IsMember({"none", "selective", "full"}));
  cli::option(app, "--zero", c.zero, "1: ZeRO-1 over dp (chapter 05)", cli::whole(0, 1));
  cli::option(app, "--precision", s.precision,
              "fp16 or bf16: the products in 16 bits on f32 weights (torch.autocast)",
              CLI::IsMember({"fp32", "fp16", "bf16"}));
  cli::option(app, "--scaler", s.scaler,
              "the loss scaler (chapter 06): none, static (2^16) or dynamic (default with fp16)",
              CLI::IsMember({"none", "static", "dynamic"}));
  cli::option(app, "--init-scale", c.scaler_config.init_scale,
              "the dynamic scaler's first scale (2^16)", cli::between(1e-30, 1e30));
  cli::option(app, "--buckets", c.buckets,
              "dp's gradients in this many buckets (each as the last layers' backward ends)",
              cli::whole(1, 4096));
  cli::option(app, "--overlap", s.overlap,
              "the axes whose communication runs under the computation: all, none, or a list "
              "of dp, pp, ep, cp, tp",
              CLI::Validator());
  app.add_flag("--sequence-parallel", c.sequence_parallel,
               "split the rows between the tensor-parallel regions over tp (Korthikanti et al.)");
}

namespace {

/// What the run reads and writes, the sampling, the benchmark, the reference.
void add_run_flags(CLI::App& app, Settings& s) {
  cli::option(app, "--log-every", s.log_every, "a row of the loss curve every N steps",
              cli::whole(1, 100000));
  cli::option(app, "--data", s.data, "the text to learn (the chapters' READMEs)", CLI::Validator());
  cli::option(app, "--trace", s.trace, "write a Chrome trace of the last step, every rank, here",
              CLI::Validator());
  cli::option(app, "--save", s.save, "write a checkpoint (Hugging Face's GPT-2 layout) here",
              CLI::Validator());
  cli::option(app, "--load", s.load, "start from this checkpoint", CLI::Validator());
  cli::option(app, "--sample", s.sample,
              "generate N bytes (from --load's model) instead of training", cli::whole(0, 100000));
  cli::option(app, "--prompt", s.prompt, "the text --sample continues", CLI::Validator());
  cli::option(app, "--temperature", s.temperature,
              "how --sample draws: 0 greedy, else softmax(logits / T)", cli::between(0, 100));
  cli::option(app, "--top-k", s.top_k,
              "with --experts, the experts a token goes to (2); with --sample, how it draws: "
              "from the k most likely bytes (0: all)",
              cli::whole(0, 1 << 20));
  app.add_flag("--benchmark", s.benchmark,
               "train every mesh shape of the ranks in turn (--steps each, default 6): tokens/s "
               "and loss curves, as CSV for the notebook");
  cli::option(app, "--calibrate", s.calibrate,
              "measure this machine for the model on every mesh of the ranks (GEMMs, memory, "
              "the layers' shards, each collective's alpha and beta) and write its profile here "
              "(JSON)",
              CLI::Validator());
  cli::option(app, "--predict", s.predict,
              "with --benchmark: each mesh's step predicted from this machine profile "
              "(--calibrate's), beside the measured one; with --mesh auto: the one to choose by",
              CLI::Validator());
  app.add_option_function<std::string>(
         "--mesh", [&](const std::string& how) { s.mesh_auto = how == "auto"; },
         "auto: train on the mesh of the ranks that --predict's profile predicts fastest, and "
         "say why")
      ->check(CLI::IsMember({"auto"}));
  app.add_flag(
      "--no-reference", [&](std::int64_t) { s.reference = false; },
      "skip one device's training (nothing to compare with)");
}

}  // namespace

void add_flags(CLI::App& app, Settings& s) {
  add_model_flags(app, s);
  add_training_flags(app, s);
  add_run_flags(app, s);
}

void check_training_flags(const CLI::App& app, Settings& s) {
  s.run.overlap = overlap_of(s.overlap);
  const TrainConfig& c = s.run;
  for (const char* flag : {"--moe-every", "--capacity-factor", "--aux-alpha"})
    require_usage(c.model.experts > 0 || !app.count(flag),
                  std::string(flag) + " is for a model with --experts E");
  require_usage(!app.count("--init-scale") || c.scaler == ch06::Scaler::dynamic,
                "--init-scale is the dynamic loss scaler's first scale: give --precision fp16 "
                "(its scaler is dynamic) or --scaler dynamic");
}

void check_flags(const CLI::App& app, Settings& s) {
  check_training_flags(app, s);
  const TrainConfig& c = s.run;
  // Flags that would do nothing are refused, not ignored.
  for (const char* flag : {"--prompt", "--temperature"})
    require_usage(s.sample || !app.count(flag), std::string(flag) + " is for --sample N");
  require_usage(s.sample || c.model.experts > 0 || !app.count("--top-k"),
                "--top-k is for --sample N (how it draws), or with --experts E (the experts a "
                "token goes to)");
  for (const char* flag : {"--experts", "--moe-every", "--capacity-factor", "--aux-alpha"})
    require_usage(!s.sample || !app.count(flag),
                  std::string(flag) + " with --sample: the model's experts are --load's");
  for (const char* flag : {"--save", "--trace", "--steps", "--log-every"})
    require_usage(!s.sample || !app.count(flag),
                  std::string(flag) + " is for training, not with --sample");
  if (s.benchmark && !app.count("--steps")) s.steps = 6;
  for (const ch08::AxisInfo& axis : ch08::kAxisInfo)
    require_usage(!s.benchmark || !app.count("--" + std::string(axis.name)),
                  "--" + std::string(axis.name) +
                      " with --benchmark: it trains every mesh of the ranks in turn");
  require_usage(!(s.benchmark && (s.sample || !s.save.empty() || !s.load.empty())),
                "--benchmark trains fresh models: not with --sample, --save or --load");
  require_usage(s.benchmark || s.mesh_auto || !app.count("--predict"),
                "--predict is for --benchmark (each mesh measured beside its prediction) or "
                "--mesh auto (the mesh predicted fastest)");
  if (s.mesh_auto) {
    require_usage(app.count("--predict"),
                  "--mesh auto chooses by a machine's profile: give --predict FILE "
                  "(ch09_gpt --calibrate FILE writes one)");
    require_usage(!s.benchmark && !s.sample, "--mesh auto is for a training run");
    for (const ch08::AxisInfo& axis : ch08::kAxisInfo)
      require_usage(
          !app.count("--" + std::string(axis.name)),
          "--" + std::string(axis.name) + " with --mesh auto: the profile chooses the mesh");
  }
  if (app.count("--calibrate")) {
    for (const char* flag : {"--benchmark", "--sample", "--save", "--load", "--trace"})
      require_usage(!app.count(flag),
                    std::string("--calibrate measures the machine: not with ") + flag);
    for (const ch08::AxisInfo& axis : ch08::kAxisInfo)
      require_usage(!app.count("--" + std::string(axis.name)),
                    "--" + std::string(axis.name) +
                        " with --calibrate: it measures every mesh's shapes of the ranks");
  }
}

}  // namespace ch09
