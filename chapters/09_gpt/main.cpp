// Chapter 09 — a GPT trained with everything: data x tensor x pipeline parallelism, on CPU
// threads, equal to one device, with checkpoints Hugging Face loads.
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
#include <nlohmann/json.hpp>

#include "checkpoint.hpp"
#include "context_parallel.hpp"  // chapter 10's ring, for --cp
#include "measurements.hpp"
#include "mesh_checks.hpp"
#include "profile.hpp"
#include "references.hpp"
#include "sample.hpp"
#include "shardlab/cli.hpp"
#include "shardlab/launch.hpp"
#include "train.hpp"

using namespace shardlab;
using namespace ch09;

namespace {

struct Settings {
  TrainConfig run;
  int dp = 0, tp = 2, pp = 2, cp = 1, ep = 1;  // dp 0: the ranks left over by the others
  int steps = 200, log_every = 20, sample = 0, top_k = 0;
  float temperature = 0;
  bool reference = true, benchmark = false;
  std::string data = beside_program("ch09_gpt.txt").string(), save, load, prompt,
              recompute = "none", trace;
  std::string precision = "fp32", scaler;  // scaler "": dynamic with fp16, else none
};

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
  int first = 0;
  if (!s.load.empty())
    first = load_checkpoint(s.load, mesh, model, &trainer.optimizer(), &trainer.scaler(),
                            trainer.expert_optimizer());
  // 3. Step by step, the mesh against one device (rank 0 holds the references' curves).
  CurveTable curve(c, reference && ctx.rank() == 0 ? &ref : nullptr);
  const auto start = std::chrono::steady_clock::now();
  StepResult last;
  Profile profile;
  ch08::StepClock clock;
  for (int t = first; t < first + s.steps; ++t) {
    if (t == first + s.steps - 1) trainer.profile_next_step(&profile);  // the last step's
    const std::uint64_t storages = host_storage_allocations();
    clock.start();
    last = trainer.step(t);
    clock.stop();
    // From the second step on, every tensor's storage is one the step before freed.
    ctx.json()["last_step_allocations"] = host_storage_allocations() - storages;
    curve.add(static_cast<std::size_t>(t - first), t + 1, last,
              (t - first + 1) % s.log_every == 0 || t == first || t == first + s.steps - 1);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
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
  // Guessing uniformly costs ln 256 = 5.55 nats a byte: a run that ends a nat above it
  // has diverged, whatever the reference did.
  ctx.verify(std::isfinite(last.loss) && last.loss < std::log(256.0) + 1,
             "the training diverged: the last step's loss is " + format_number(last.loss) +
                 " (guessing uniformly gives 5.55; try a lower --lr)");
  ctx.verify(curve.dead_run().empty(), curve.dead_run());

  // 4. What the last step sent per axis, what each rank holds, how long the stages
  // waited: each next to its prediction (measurements.hpp).
  report_bytes(ctx, c, last);
  ch08::report_hosts(ctx, c.mesh, last.bytes, clock.measure());
  report_memory(ctx, c, mesh, model, tracker.usage());
  const double bubble = report_bubble(ctx, c, mesh, last.events);
  report_planner(ctx, c, last, tracker.usage(), bubble);
  report_profile(ctx, c.mesh, profile);
  if (!s.trace.empty()) write_profile_trace(ctx, c.mesh, profile, s.trace);

  report_throughput(ctx, c, s.steps, seconds);
  // A run that failed a check (diverged, or off one device's curve) leaves the folder as
  // it was: a bad model does not replace a good one.
  if (!s.save.empty() && !ctx.comm().all_true(ctx.ok())) {
    ctx.say("not saved: the run failed its checks, so " + s.save + " is left as it was");
  } else if (!s.save.empty()) {
    save_checkpoint(s.save, mesh, model, &trainer.optimizer(), first + s.steps, &trainer.scaler(),
                    trainer.expert_optimizer());
    ctx.say("saved " + s.save + " (step " + std::to_string(first + s.steps) + ")");
  }
}

void generate(Context& ctx, const Settings& s) {
  const TrainConfig& c = s.run;
  const Corpus data = Corpus::load(s.data, c.model.context);
  Mesh mesh(ctx.comm(), c.mesh);
  GptModel model(mesh, c.model, c.model_options());
  Trainer trainer(mesh, model, c, data);
  if (!s.load.empty()) load_checkpoint(s.load, mesh, model, nullptr);
  const std::string text = sample(trainer, s.prompt, s.sample, s.temperature, s.top_k, c.model.seed,
                                  sample_progress(s.sample, ctx.rank() == 0 && ctx.talking()));
  // JSON strings are UTF-8: the text with U+FFFD for each byte that is not, and the bytes
  // themselves, exactly, as numbers.
  ctx.json()["sample"] = nlohmann::json::parse(
      nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  ctx.json()["sample_bytes"] = std::vector<unsigned char>(text.begin(), text.end());
  ctx.say(s.prompt + text);
}

}  // namespace

int main(int argc, char** argv) {
  Program program("ch09_gpt",
                  "Chapter 09: a GPT trained with data x tensor x pipeline parallelism, "
                  "equal to one device");
  program.default_ranks(8);
  Settings s;
  TrainConfig& c = s.run;
  auto& cli = program.cli();
  auto option = [&](const char* flag, auto& value, const char* what, auto check) {
    return cli.add_option(flag, value, what)->check(check)->capture_default_str();
  };
  option("--dp", s.dp, "data-parallel replicas (default: the ranks the other axes leave)",
         CLI::Range(0, 1 << 20));
  option("--tp", s.tp, "tensor-parallel ranks (heads, vocabulary)", CLI::Range(1, 1 << 20));
  option("--pp", s.pp, "pipeline stages", CLI::Range(1, 1 << 20));
  option("--cp", s.cp, "context-parallel ranks: each sequence cut over a ring (chapter 10)",
         CLI::Range(1, 1 << 20));
  option("--ep", s.ep, "expert-parallel ranks: the experts split, carved out of dp (chapter 07)",
         CLI::Range(1, 1 << 20));
  option("--experts", c.model.experts,
         "a Mixture-of-Experts MLP of E experts in every --moe-every-th block (0: dense)",
         CLI::Range(0, 256));
  option("--moe-every", c.model.moe_every, "1: every block's MLP a MoE; 2: every other block's",
         CLI::Range(1, 64));
  option("--capacity-factor", c.model.capacity_factor,
         "an expert takes ceil(k T / E x this) of a sequence's tokens", cli::between(1e-3, 1e3));
  option("--aux-alpha", c.model.aux_alpha, "the load-balancing loss's weight (Switch: 0.01)",
         cli::between(0, 1e3));
  option("--layers", c.model.layers, "transformer blocks L", CLI::Range(1, 64));
  option("--channels", c.model.channels, "channels C", CLI::Range(1, 2048));
  option("--heads", c.model.heads, "attention heads H", CLI::Range(1, 256));
  option("--context", c.model.context, "tokens per sequence T", CLI::Range(1, 1024));
  option("--batch", c.batch, "sequences per step, all replicas", CLI::Range(1, 4096));
  option("--microbatches", c.microbatches, "microbatches per step and replica",
         CLI::Range(1, 4096));
  option("--steps", s.steps, "training steps", CLI::Range(1, 100000));
  option("--lr", c.adam.lr, "Adam's learning rate", cli::between(1e-9, 10.0));
  option("--clip", c.clip, "max global gradient norm (0: no clipping)", cli::between(0, 1e9));
  option("--schedule", c.schedule, "pipeline schedule (chapter 04)",
         CLI::IsMember({"gpipe", "1f1b", "interleaved", "zb1"}));
  option("--chunks", c.chunks, "model chunks per stage (interleaved; default 2 there)",
         CLI::Range(1, 64));
  option("--recompute", s.recompute, "what the blocks recompute in the backward",
         CLI::IsMember({"none", "selective", "full"}));
  option("--zero", c.zero, "1: ZeRO-1 over dp (chapter 05)", CLI::Range(0, 1));
  option("--precision", s.precision,
         "fp16 or bf16: the products in 16 bits on f32 weights (torch.autocast)",
         CLI::IsMember({"fp32", "fp16", "bf16"}));
  option("--scaler", s.scaler,
         "the loss scaler (chapter 06): none, static (2^16) or dynamic (default with fp16)",
         CLI::IsMember({"none", "static", "dynamic"}));
  option("--init-scale", c.scaler_config.init_scale, "the dynamic scaler's first scale (2^16)",
         cli::between(1e-30, 1e30));
  cli.add_flag("--sequence-parallel", c.sequence_parallel,
               "split the rows between the tensor-parallel regions over tp (Korthikanti et al.)");
  option("--log-every", s.log_every, "a row of the loss curve every N steps",
         CLI::Range(1, 100000));
  option("--data", s.data, "the text to learn (the chapters' READMEs)", CLI::Validator());
  option("--trace", s.trace, "write a Chrome trace of the last step, every rank, here",
         CLI::Validator());
  option("--save", s.save, "write a checkpoint (Hugging Face's GPT-2 layout) here",
         CLI::Validator());
  option("--load", s.load, "start from this checkpoint", CLI::Validator());
  option("--sample", s.sample, "generate N bytes (from --load's model) instead of training",
         CLI::Range(0, 100000));
  option("--prompt", s.prompt, "the text --sample continues", CLI::Validator());
  option("--temperature", s.temperature, "how --sample draws: 0 greedy, else softmax(logits / T)",
         cli::between(0, 100));
  option("--top-k", s.top_k,
         "with --experts, the experts a token goes to (2); with --sample, how it draws: from the "
         "k most likely bytes (0: all)",
         CLI::Range(0, 1 << 20));
  cli.add_flag("--benchmark", s.benchmark,
               "train every mesh shape of the ranks in turn (--steps each, default 6): tokens/s "
               "and loss curves, as CSV for the notebook");
  cli.add_flag(
      "--no-reference", [&](std::int64_t) { s.reference = false; },
      "skip one device's training (nothing to compare with)");

  // 8 ranks, or as many as the axes given ask for (--cp 2 --ep 2 with the default tp 2
  // and pp 2: 16).
  program.default_ranks([&](const Options&) {
    const double asked = double(s.tp) * s.pp * s.cp * s.ep * std::max(1, s.dp);
    return asked > 8 && asked <= 1024 ? static_cast<int>(asked) : 8;  // more: the mesh says no
  });
  program.world_size([&](const Options&, int ranks) {
    if (c.schedule == "interleaved" && !program.cli().count("--chunks")) c.chunks = 2;
    // Sampling: --top-k is how it draws, and the model's experts are its checkpoint's.
    if (s.sample && !s.load.empty())
      adopt_experts(s.load, c.model);
    else if (cli.count("--top-k"))
      c.model.top_k = s.top_k;
    if (s.benchmark) return;  // every mesh shape of the ranks, in turn
    c.mesh = ch08::settle_mesh({.pp = s.pp, .dp = s.dp, .tp = s.tp, .cp = s.cp, .ep = s.ep}, ranks);
    if (c.mesh.cp > 1) c.context = ch10::ring_context();
    check_config(c);
  });
  program.validate([&](const Options& o) {
    c.model.seed = o.seed;
    c.memory = o.memory();
    c.recompute = ch08::parse_recompute(s.recompute);
    set_precision(c, s.precision, s.scaler);
    // Where the run writes is tried before it trains, not after.
    if (program.cli().count("--trace")) check_writable_file(s.trace, "--trace");
    if (cli.count("--save")) check_save_target(s.save);
    if (s.sample) s.reference = false;
    // Flags that would do nothing are refused, not ignored.
    for (const char* flag : {"--prompt", "--temperature"})
      require_usage(s.sample || !cli.count(flag), std::string(flag) + " is for --sample N");
    require_usage(s.sample || c.model.experts > 0 || !cli.count("--top-k"),
                  "--top-k is for --sample N (how it draws), or with --experts E (the experts a "
                  "token goes to)");
    for (const char* flag : {"--moe-every", "--capacity-factor", "--aux-alpha"})
      require_usage(c.model.experts > 0 || !cli.count(flag),
                    std::string(flag) + " is for a model with --experts E");
    for (const char* flag : {"--experts", "--moe-every", "--capacity-factor", "--aux-alpha"})
      require_usage(!s.sample || !cli.count(flag),
                    std::string(flag) + " with --sample: the model's experts are --load's");
    for (const char* flag : {"--save", "--trace", "--steps", "--log-every"})
      require_usage(!s.sample || !cli.count(flag),
                    std::string(flag) + " is for training, not with --sample");
    if (s.benchmark && !program.cli().count("--steps")) s.steps = 6;
    require_usage(!(s.benchmark && (s.sample || !s.save.empty() || !s.load.empty())),
                  "--benchmark trains fresh models: not with --sample, --save or --load");
  });
  program.writes_csv([&] { return s.benchmark; });
  program.supports_cuda();
  program.memory_estimate([&](const Options& o) {
    return run_bytes(c, o.backend == "threads" || o.backend == "auto");
  });

  return program.run(argc, argv, [&](Context& ctx) {
    ctx.json()["chapter"] = "09_gpt";
    if (s.sample) return generate(ctx, s);
    if (s.benchmark) return run_benchmark(ctx, c, Corpus::load(s.data, c.model.context), s.steps);
    train(ctx, s);
  });
}
