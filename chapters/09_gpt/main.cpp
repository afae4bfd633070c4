// Chapter 09 — a GPT trained with everything: Megatron-LM's five axes (pipeline, data,
// expert, context and tensor parallelism), on CPU threads, equal to one device, with
// checkpoints Hugging Face loads.
//
// The course (CS336 lecture 7's advanced exercise, "train GPT-2 on 4-8 devices and
// compare the strategies"; so-large-lm's distributed-training chapter §6 "混合并行"):
// GPT-2's architecture at laptop size learns to write like this project's own chapter
// texts. Every chapter below stands in it: chapter 04's pipeline runs the stages, chapter
// 08's layers cut the attention by heads and the MLP by columns and rows (the attention
// and the vocabulary-parallel cross-entropy are this chapter's exercise), chapter 02's
// sync or chapter 05's ZeRO-1 keeps the replicas together; rank 0 also trains the model on
// one device, and the two loss curves must agree, step by step.
//
// Run:
//   build/default/bin/ch09_gpt                               8 ranks: pp 2 x dp 2 x tp 2
//   build/default/bin/ch09_gpt --dp 1 --tp 4 --pp 2 --steps 50
//   build/default/bin/ch09_gpt --tp 2 --cp 2 --pp 2          the sequence cut over a ring
//   build/default/bin/ch09_gpt --experts 4 --ep 2 --tp 2 --pp 1   experts over 2 ranks
//   build/default/bin/ch09_gpt --save ckpt                   then: --load ckpt --steps 50
//   build/default/bin/ch09_gpt --load ckpt --sample 200 --temperature 0.8 --top-k 20
//   python3 chapters/09_gpt/hf_check.py ckpt                 Hugging Face's loss on it
//   mpirun -np 8 build/default/bin/ch09_gpt
//
// Expected: the mesh's loss equals one device's at every step to the stated tolerance,
// and the validation loss too; the loss falls from ln 256 = 5.55 to about 2.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "calibrate.hpp"
#include "checkpoint.hpp"
#include "context_parallel.hpp"  // chapter 10's ring, for --cp
#include "measurements.hpp"
#include "mesh_checks.hpp"
#include "mesh_flags.hpp"
#include "options.hpp"
#include "profile.hpp"
#include "references.hpp"
#include "sample.hpp"
#include "shardlab/cli.hpp"
#include "shardlab/launch.hpp"
#include "train.hpp"

using namespace shardlab;
using namespace ch09;

namespace {

/// The checkpoint --load names into the model, Adam and the scaler; the step it is at.
/// UsageError when --steps more would pass the step counter (2^31 - 1).
int resume(const Settings& s, GptModel& model, Trainer& trainer) {
  const int first = load_checkpoint(s.load, model, &trainer.optimizer(), &trainer.scaler(),
                                    trainer.expert_optimizer());
  require_usage(first <= std::numeric_limits<int>::max() - s.steps,
                "--load " + s.load + " is at step " + std::to_string(first) + ": --steps " +
                    std::to_string(s.steps) + " more would pass the step counter's 2^31 - 1");
  return first;
}

/// What the mesh's steps measured.
struct MeshSteps {
  StepResult last;          ///< the last step
  Profile profile;          ///< where the last step's time went, rank by rank
  ch08::StepMeasure clock;  ///< the median step's time, the last step's wire bytes
  double seconds = 0;       ///< the steps' time in all
};

/// 3. Steps first .. first + steps - 1 of the mesh, each into `curve` (rank 0 holds the
/// references' curves); the last one profiled.
MeshSteps train_steps(Context& ctx, const Settings& s, Mesh& mesh, Trainer& trainer, int first,
                      CurveTable& curve) {
  MeshSteps out;
  ch08::StepClock clock;
  const auto start = std::chrono::steady_clock::now();
  for (int t = first; t < first + s.steps; ++t) {
    if (t == first + s.steps - 1) trainer.profile_next_step(&out.profile);  // the last step's
    const std::uint64_t storages = host_storage_allocations();
    clock.start(mesh.world());
    out.last = trainer.step(t);
    clock.stop(mesh.world());
    // From the second step on, every tensor's storage is one the step before freed.
    ctx.json()["last_step_allocations"] = host_storage_allocations() - storages;
    curve.add(static_cast<std::size_t>(t - first), t + 1, out.last,
              (t - first + 1) % s.log_every == 0 || t == first || t == first + s.steps - 1);
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  out.clock = clock.measure();
  return out;
}

/// 4. What the last step sent per axis, what each rank holds, how long the stages waited:
/// each next to its prediction (measurements.hpp).
void report_measurements(Context& ctx, const Settings& s, Mesh& mesh, GptModel& model,
                         Trainer& trainer, const memory::Usage& used, const MeshSteps& run) {
  const TrainConfig& c = s.run;
  report_bytes(ctx, c, run.last, trainer.dp_buckets());
  ch08::report_hosts(ctx, c.mesh, run.last.bytes, run.clock);
  report_memory(ctx, c, mesh, model, used, trainer.dp_buckets());
  const double bubble = report_bubble(ctx, c, mesh, run.last.events);
  report_planner(ctx, c, run.last, used, bubble);
  report_profile(ctx, c.mesh, run.profile);
  if (!s.trace.empty()) write_profile_trace(ctx, c.mesh, run.profile, s.trace);
  report_throughput(ctx, c, s.steps, run.seconds);
}

void train(Context& ctx, const Settings& s) {
  const TrainConfig& c = s.run;
  const Corpus data = Corpus::load(s.data, c.model.context);

  // 1. The references: one device, the whole batch at once (rank 0); and one device again
  // with the batch in the mesh's pieces (rank 1): only the order of the additions
  // differs, and how far that alone moves the training is the yardstick below.
  References ref;
  const bool reference = s.reference && s.load.empty();
  if (reference) ref = train_references(ctx, c, data, s.steps);

  // 2. The mesh, its memory counted by the ledger from here.
  memory::Tracker tracker;
  Mesh mesh(ctx.comm(), c.mesh);
  GptModel model(mesh, c.model, c.model_options());
  Trainer trainer(mesh, model, c, data);
  const int first = s.load.empty() ? 0 : resume(s, model, trainer);

  // 3. Step by step, the mesh against one device.
  CurveTable curve(c, reference && ctx.rank() == 0 ? &ref : nullptr);
  const MeshSteps run = train_steps(ctx, s, mesh, trainer, first, curve);
  ctx.report(curve.table(), "loss_curve",
             "Chapter 09 - " + describe(c, ctx.comm().backend()) +
                 "\n\nthe training loss (the batch's mean, nats per byte) on one device and "
                 "on the mesh, their relative difference, and one device's own with the "
                 "batch added up in the mesh's pieces");
  const double validation = trainer.evaluate(data.validation(16));
  ctx.json()["validation_loss"] = validation;
  if (reference)
    compare_with_one_device(ctx, ref, curve.mesh(), validation);
  else
    ctx.say("\nvalidation loss " + format_number(validation));
  // What holds of any training, whatever computed it: not diverged, not negative, from
  // ln 256 down.
  check_training(ctx, curve, c.model.vocab, s.load.empty(), validation);

  // 4. Every measurement next to its prediction.
  report_measurements(ctx, s, mesh, model, trainer, tracker.usage(), run);
  // 5. A run that failed a check (diverged, or off one device's curve) leaves the folder
  // as it was: a bad model does not replace a good one.
  if (s.save.empty()) return;
  if (!ctx.comm().all_true(ctx.ok()))
    return ctx.say("not saved: the run failed its checks, so " + s.save + " is left as it was");
  save_checkpoint(s.save, mesh, model, &trainer.optimizer(), first + s.steps, &trainer.scaler(),
                  trainer.expert_optimizer());
  ctx.say("saved " + s.save + " (step " + std::to_string(first + s.steps) + ")");
}

void generate(Context& ctx, const Settings& s) {
  const TrainConfig& c = s.run;
  const Corpus data = Corpus::load(s.data, c.model.context);
  Mesh mesh(ctx.comm(), c.mesh);
  GptModel model(mesh, c.model, c.model_options());
  Trainer trainer(mesh, model, c, data);
  if (!s.load.empty()) load_checkpoint(s.load, model, nullptr);
  const std::string text = sample(trainer, s.prompt, s.sample, s.temperature, s.top_k, c.model.seed,
                                  sample_progress(s.sample, ctx.rank() == 0 && ctx.talking()));
  // JSON strings are UTF-8: the text with U+FFFD for each byte that is not, and the bytes
  // themselves, exactly, as numbers.
  ctx.json()["sample"] = nlohmann::json::parse(
      nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  ctx.json()["sample_bytes"] = std::vector<unsigned char>(text.begin(), text.end());
  ctx.say(s.prompt + text);
}

/// What the flags ask of `ranks` ranks: the mesh (dp what the others leave), chapter 10's
/// ring where it has cp, the interleaved schedule's chunks, the experts (--sample: its
/// checkpoint's); --benchmark: a mesh of the ranks that can run the model.
void fit_to_ranks(Settings& s, const CLI::App& cli, int ranks) {
  TrainConfig& c = s.run;
  if (ch04::schedule_info(c.schedule).chunked && !cli.count("--chunks")) c.chunks = 2;
  // Sampling: --top-k is how it draws, and the model's experts are its checkpoint's.
  if (s.sample && !s.load.empty())
    read_expert_config(s.load, c.model);
  else if (cli.count("--top-k"))
    c.model.top_k = s.top_k;
  if (s.benchmark || !s.calibrate.empty() || s.mesh_auto) {  // every mesh of the ranks
    c.context = ch10::ring_context(ch10::Split::zigzag, c.overlap[ch08::Axis::cp]);
    require_usage(!benchmark_meshes(c, ranks).empty(),
                  "--benchmark: no mesh of " + std::to_string(ranks) +
                      " ranks can run this model and batch (each needs tp to divide the "
                      "heads, pp the layers, and every replica's microbatches a sequence)");
    return;
  }
  c.mesh = ch08::mesh_for_ranks(s.mesh, ranks);
  if (c.mesh.cp > 1) c.context = ch10::ring_context(ch10::Split::zigzag, c.overlap[ch08::Axis::cp]);
  check_config(c);
}

}  // namespace

int main(int argc, char** argv) {
  Program program("ch09_gpt",
                  "Chapter 09: a GPT trained on Megatron-LM's five axes (pp x dp x ep x cp x tp), "
                  "equal to one device");
  program.default_ranks(8);
  Settings s;
  TrainConfig& c = s.run;
  ch08::MachineProfile machine;  // --predict's
  auto& cli = program.cli();
  add_flags(cli, s);

  // 8 ranks, or as many as the axes given ask for (--cp 2 --ep 2 with the default tp 2
  // and pp 2: 16).
  program.default_ranks([&](const Options&) {
    ch08::MeshShape asked = s.mesh;
    asked.dp = std::max(1, asked.dp);
    const double ranks = ch08::product(asked, {std::begin(ch08::kAxes), std::end(ch08::kAxes)});
    return ranks > 8 && ranks <= 1024 ? static_cast<int>(ranks) : 8;  // more: the mesh says no
  });
  program.world_size([&](const Options&, int ranks) { fit_to_ranks(s, cli, ranks); });
  program.validate([&](const Options& o) {
    c.model.seed = o.seed;
    c.memory = o.memory();
    c.recompute = ch08::parse_recompute(s.recompute);
    set_precision(c, s.precision, s.scaler);
    // Where the run writes is tried before it trains, not after.
    if (program.cli().count("--trace")) check_writable_file(s.trace, "--trace");
    if (cli.count("--save")) check_save_target(s.save);
    if (s.sample) s.reference = false;
    check_flags(cli, s);
    if (!s.predict.empty()) machine = ch08::load_machine(s.predict, "--predict");
    if (!s.calibrate.empty()) check_writable_file(s.calibrate, "--calibrate");
  });
  program.writes_csv([&] { return s.benchmark; });
  program.supports_cuda();
  program.memory_estimate([&](const Options& o) {
    return run_bytes(c, o.backend == "threads" || o.backend == "auto");
  });

  return program.run(argc, argv, [&](Context& ctx) {
    ctx.json()["chapter"] = "09_gpt";
    if (s.sample) return generate(ctx, s);
    if (!s.calibrate.empty()) return calibrate(ctx, c, s.calibrate);
    if (s.benchmark)
      return run_benchmark(ctx, c, Corpus::load(s.data, c.model.context), s.steps,
                           s.predict.empty() ? nullptr : &machine);
    if (s.mesh_auto) choose_mesh(ctx, c, machine);
    train(ctx, s);
  });
}
