// Chapter 09's program's flags (options.hpp).
#include "options.hpp"

#include <cstdint>

#include "shardlab/check.hpp"

namespace ch09 {

using shardlab::require_usage;
namespace cli = shardlab::cli;

void add_flags(CLI::App& app, Settings& s) {
  TrainConfig& c = s.run;
  auto option = [&](const char* flag, auto& value, const char* what, auto check) {
    return app.add_option(flag, value, what)->check(check)->capture_default_str();
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
  option("--steps", s.steps, "training steps (200; 20 in the learner build, under the sanitizers)",
         CLI::Range(1, 100000));
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
  app.add_flag("--sequence-parallel", c.sequence_parallel,
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
  app.add_flag("--benchmark", s.benchmark,
               "train every mesh shape of the ranks in turn (--steps each, default 6): tokens/s "
               "and loss curves, as CSV for the notebook");
  app.add_flag(
      "--no-reference", [&](std::int64_t) { s.reference = false; },
      "skip one device's training (nothing to compare with)");
}

void check_flags(const CLI::App& app, Settings& s) {
  const TrainConfig& c = s.run;
  // Flags that would do nothing are refused, not ignored.
  for (const char* flag : {"--prompt", "--temperature"})
    require_usage(s.sample || !app.count(flag), std::string(flag) + " is for --sample N");
  require_usage(s.sample || c.model.experts > 0 || !app.count("--top-k"),
                "--top-k is for --sample N (how it draws), or with --experts E (the experts a "
                "token goes to)");
  for (const char* flag : {"--moe-every", "--capacity-factor", "--aux-alpha"})
    require_usage(c.model.experts > 0 || !app.count(flag),
                  std::string(flag) + " is for a model with --experts E");
  for (const char* flag : {"--experts", "--moe-every", "--capacity-factor", "--aux-alpha"})
    require_usage(!s.sample || !app.count(flag),
                  std::string(flag) + " with --sample: the model's experts are --load's");
  for (const char* flag : {"--save", "--trace", "--steps", "--log-every"})
    require_usage(!s.sample || !app.count(flag),
                  std::string(flag) + " is for training, not with --sample");
  if (s.benchmark && !app.count("--steps")) s.steps = 6;
  require_usage(!(s.benchmark && (s.sample || !s.save.empty() || !s.load.empty())),
                "--benchmark trains fresh models: not with --sample, --save or --load");
}

}  // namespace ch09
