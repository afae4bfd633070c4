// Chapter 06 — FP16 and loss scaling: why small gradients vanish, and how scaling the
// loss brings them back.
//
// The course (so-large-lm ch. 8, the walk-through's §7 "混合精度训练"): keep the master
// weights in FP32, compute in FP16, and scale the loss so that gradients below 2^-24 —
// which become 0 in FP16 — survive. This chapter shows the format's landmarks, converts
// any value to fp16 and bf16 (--to-half), and trains one small model three ways on
// data-parallel ranks: in fp32, in fp16 without scaling, and in fp16 with a loss scale
// (PyTorch GradScaler's dynamic rule by default; LossScaler in loss_scaler.hpp, for any
// trainer). The fp16 runs really are fp16: their weights, activations and gradients are
// 16-bit tensors (matmuls add in fp32 and round once, as tensor cores do); the gradients
// are summed across ranks in fp16 and unscaled in fp32, and the fp32 master weights take
// the Adam update.
//
// Simplified: toy.hpp's two-layer MLP on its teacher's regression with small targets
// (--target-scale), which is what makes its gradients small; no bf16 training run.
//
// Run:
//   build/default/bin/ch06_fp16_loss_scaling                         the three runs, 2 ranks
//   build/default/bin/ch06_fp16_loss_scaling --to-half 1e-8          a value in fp16 and bf16
//   build/default/bin/ch06_fp16_loss_scaling --inject-overflow 100,101 --growth-interval 50
//   build/default/bin/ch06_fp16_loss_scaling --scaler static --scale 2^10
//   mpirun -np 4 build/default/bin/ch06_fp16_loss_scaling
//   build/default/bin/ch06_fp16_loss_scaling --csv --csv-dir results  (for the notebook)
//
// Expected: most of the gradients are below fp16's range without scaling and almost none
// with it; fp16 without scaling ends far above the fp32 loss, fp16 with scaling on it.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <nlohmann/json.hpp>

#include "shardlab/check.hpp"
#include "shardlab/cli.hpp"
#include "shardlab/half.hpp"
#include "shardlab/launch.hpp"
#include "training.hpp"

using namespace shardlab;
using namespace ch06;

namespace {

struct Settings {
  double to_half = 0;    // --to-half's value
  bool convert = false;  // --to-half given: convert it, no training
  std::string scaler = "dynamic";
  std::string inject;
  bool csv = false;
  ModelConfig model;
  RunConfig run;
};

// ---------------------------------------------------------------------------
// The formats

void landmarks(Context& ctx) {
  ctx.report(format_landmarks(), "landmarks", "Chapter 06 - fp16 and loss scaling\n");
  ctx.verify(half_bits_to_float(0x7bff) == 65504.0f &&
                 half_bits_to_float(0x0001) == std::ldexp(1.0f, -24) &&
                 half_bits_to_float(0x0400) == std::ldexp(1.0f, -14) &&
                 bf16_bits_to_float(0x3f81) - 1.0f == std::ldexp(1.0f, -7),
             "the fp16 / bf16 landmarks differ from the powers of two they are");
}

// ---------------------------------------------------------------------------
// The three runs

double at(const std::vector<double>& v, double fraction) {
  return v[static_cast<std::size_t>(std::lround(fraction * static_cast<double>(v.size() - 1)))];
}

void three_runs(Context& ctx, const Settings& s) {
  RunConfig fp32 = s.run, unscaled = s.run, scaled = s.run;
  fp32.fp16 = false;
  fp32.inject_overflow.clear();
  unscaled.scaler = Scaler::none;
  unscaled.inject_overflow.clear();
  const RunResult a = train(ctx.comm(), s.model, fp32, ctx.memory());
  const RunResult b = train(ctx.comm(), s.model, unscaled, ctx.memory());
  const RunResult c = train(ctx.comm(), s.model, scaled, ctx.memory());
  const auto chosen = static_cast<float>(c.scales.front());
  ctx.say("\nOne model trained three ways on " + std::to_string(ctx.size()) +
          " data-parallel ranks: out = tanh(x W1) W2, " + std::to_string(s.model.in) + " -> " +
          std::to_string(s.model.hidden) + " -> " + std::to_string(s.model.out) + ", " +
          std::to_string(s.model.rows) + " rows shared out, targets of size " +
          format_number(s.model.target_scale) + ", Adam (lr " + format_number(s.run.lr) + "), " +
          std::to_string(s.run.steps) + " steps\n");
  // 1. Step 1's gradients against fp16's range, unscaled and times the scale.
  const Table histogram = gradient_histogram(a.first_gradients, chosen);
  ctx.report(histogram, "histogram",
             "Step 1's gradients (the fp32 run's dL/dout, dL/dh, dL/d(x W1), dL/dW1, dL/dW2; " +
                 std::to_string(a.first_gradients.size()) + " values) by magnitude, in fp16 " +
                 "as they are and times the scale " + format_number(chosen) + ":");
  const double lost = underflow_fraction(a.first_gradients, 1.0f);
  const double lost_scaled = underflow_fraction(a.first_gradients, chosen);
  ctx.json()["underflow_fraction_unscaled"] = lost;
  ctx.json()["underflow_fraction_scaled"] = lost_scaled;
  ctx.say(
      "  become 0 in fp16: " + format_number(100 * lost, 3) + "% of the nonzero values " +
      "unscaled, " + format_number(100 * lost_scaled, 3) + "% scaled; the fp16 runs' " +
      "weight gradients at step 1 exactly 0: " + format_number(100 * b.first_zero_weight_grads, 3) +
      "% unscaled, " + format_number(100 * c.first_zero_weight_grads, 3) + "% scaled\n");
  // 2. The loss of each run, relative to the first step's of fp32.
  const double first = a.losses.front();
  Table losses({"run", "step 1", "25%", "50%", "final", "final_loss"});
  for (const auto& [name, r] : {std::pair{"fp32", &a}, {"fp16_unscaled", &b}, {"fp16_scaled", &c}})
    losses.add({name, r->losses.front() / first, at(r->losses, 0.25) / first,
                at(r->losses, 0.5) / first, r->losses.back() / first, r->losses.back()});
  ctx.report(losses, "losses",
             "\nLoss, relative to the first step's " + format_number(first, 3) + ":");
  // 3. The scale over time, the skipped steps, the bytes of the gradients' allreduce.
  std::string changes = format_number(c.scales.front());
  for (std::size_t t = 1; t < c.scales.size(); ++t)
    if (c.scales[t] != c.scales[t - 1])
      changes += ", step " + std::to_string(t + 1) + ": " + format_number(c.scales[t]);
  ctx.json()["scale_history"] = c.scales;
  ctx.json()["skipped_steps"] = c.skipped;
  ctx.json()["grad_bytes_per_step"] = {{"fp32", a.grad_bytes_per_step},
                                       {"fp16", c.grad_bytes_per_step}};
  ctx.json()["traffic_modeled"] = c.grad_traffic_modeled;
  ctx.say(
      "  fp16 without scaling ends at " + format_number(b.losses.back() / a.losses.back(), 3) +
      "x the fp32 loss; with scaling at " + format_number(c.losses.back() / a.losses.back(), 3) +
      "x\nLoss scale (" + s.scaler + "): " + changes + "\nSkipped steps (non-finite " +
      "gradients): " + format_steps(c.skipped) +
      "\nGradient allreduce per step, bytes each rank received: " +
      std::to_string(a.grad_bytes_per_step) + " in fp32, " + std::to_string(c.grad_bytes_per_step) +
      " in fp16 (" + (c.grad_traffic_modeled ? "modeled" : "measured") + ")");

  // Checks: what must hold whatever the flags.
  for (const std::string& failure : failed_checks(s.run, a, c)) ctx.verify(false, failure);
  for (const RunResult* r : {&a, &b, &c})
    ctx.verify_replicas("the weights after training", r->weights);

  if (!s.csv) return;
  ctx.save_csv(histogram, "06_fp16_loss_scaling_histogram");
  Table curves({"step", "run", "loss", "scale", "skipped"});
  for (const auto& [name, r] : {std::pair{"fp32", &a}, {"fp16_unscaled", &b}, {"fp16_scaled", &c}})
    for (std::size_t t = 0; t < r->losses.size(); ++t)
      curves.add(
          {t + 1, name, r->losses[t], r->scales[t],
           std::count(r->skipped.begin(), r->skipped.end(), static_cast<int>(t + 1)) ? 1 : 0});
  ctx.save_csv(curves, "06_fp16_loss_scaling");
}

}  // namespace

int main(int argc, char** argv) {
  Program program("ch06_fp16_loss_scaling",
                  "Chapter 06: fp16 and loss scaling - why small gradients vanish, and how "
                  "scaling brings them back");
  Settings s;
  auto& cli = program.cli();
  cli.option_defaults()->always_capture_default();
  // Scales are positive floats: "65536", "2^16", "1e-3" (cli::quantity), 2^-126 to 2^127.
  const auto scale_range = cli::between(FLT_MIN, FLT_MAX);
  ScalerConfig& dynamic = s.run.dynamic;
  cli.add_option("--to-half", s.to_half, "show a value's fp16 and bf16 bits, and what it becomes")
      ->transform(cli::quantity());
  cli.add_option("--scaler", s.scaler, "the scaled run's scaler: none, static or dynamic")
      ->check(CLI::IsMember({"none", "static", "dynamic"}));
  cli.add_option("--scale", s.run.static_scale, "static scaler: the loss scale (65536 or 2^16)")
      ->transform(cli::quantity())
      ->check(scale_range);
  cli.add_option("--init-scale", dynamic.init_scale, "dynamic scaler: the first scale")
      ->transform(cli::quantity())
      ->check(scale_range);
  cli.add_option("--growth-factor", dynamic.growth_factor, "dynamic scaler: x this when growing")
      ->check(cli::between(1.0, 1e6));
  cli.add_option("--backoff-factor", dynamic.backoff_factor,
                 "dynamic scaler: x this on an inf or NaN (between 0 and 1)")
      ->check(cli::between(0.0, 1.0));
  cli.add_option("--growth-interval", dynamic.growth_interval,
                 "dynamic scaler: finite steps before growing")
      ->check(shardlab::cli::whole(1, 1000000));
  cli.add_option("--inject-overflow", s.inject,
                 "make the gradients non-finite at these steps (30,31)");
  cli.add_option("--steps", s.run.steps, "training steps")->check(shardlab::cli::whole(1, 100000));
  cli.add_option("--lr", s.run.lr, "Adam's learning rate")->check(cli::between(1e-9, 1.0));
  cli.add_option("--target-scale", s.model.target_scale,
                 "size of the targets (small: small gradients)")
      ->check(cli::between(1e-30, 1e4));
  cli.add_option("--batch", s.model.rows, "rows of the batch, all ranks together")
      ->check(shardlab::cli::whole(1, 1 << 20));
  cli.add_option("--hidden", s.model.hidden, "hidden width")->check(shardlab::cli::whole(1, 4096));
  cli.add_flag("--csv", s.csv, "write the histogram and the loss curves as CSV (for the notebook)");

  program.validate([&](const Options& o) {
    s.model.seed = o.seed;
    s.convert = cli.count("--to-half") > 0;
    if (s.convert)
      for (const char* flag : {"--scaler", "--scale", "--init-scale", "--growth-factor",
                               "--backoff-factor", "--growth-interval", "--inject-overflow",
                               "--steps", "--lr", "--target-scale", "--batch", "--hidden", "--csv"})
        require_usage(!cli.count(flag),
                      std::string("--to-half only converts a value: drop ") + flag);
    require_usage(dynamic.growth_factor > 1.0f,
                  "--growth-factor " + format_number(dynamic.growth_factor) + ": must be above 1");
    require_usage(dynamic.backoff_factor > 0.0f && dynamic.backoff_factor < 1.0f,
                  "--backoff-factor " + format_number(dynamic.backoff_factor) +
                      ": must be between 0 and 1, exclusive");
    // One backoff must leave a scale the flags allow (fp32's normal range, as --scale's).
    require_usage(s.run.scaler != Scaler::dynamic ||
                      static_cast<double>(dynamic.init_scale) * dynamic.backoff_factor >= FLT_MIN,
                  "--backoff-factor " + format_number(dynamic.backoff_factor) +
                      ": one backoff takes the scale from " + format_number(dynamic.init_scale) +
                      " below fp32's smallest normal number (2^-126): use a factor nearer 1");
    s.run.scaler = s.scaler == "none"     ? Scaler::none
                   : s.scaler == "static" ? Scaler::fixed
                                          : Scaler::dynamic;
    require_usage(!cli.count("--scale") || s.run.scaler == Scaler::fixed,
                  "--scale is the static scaler's: add --scaler static");
    s.run.inject_overflow = parse_steps(s.inject, s.run.steps, "--inject-overflow");
    require_usage(s.run.scaler != Scaler::none || s.run.inject_overflow.empty(),
                  "--inject-overflow shows a scaler skipping steps: with --scaler none nothing "
                  "would skip them and the weights would turn to NaN");
  });
  // Every rank needs a row of the batch (under mpirun: the processes it started).
  program.world_size([&](const Options&, int ranks) {
    require_usage(s.convert || s.model.rows >= ranks, "--batch " + std::to_string(s.model.rows) +
                                                          " cannot give " + std::to_string(ranks) +
                                                          " ranks a row each");
  });
  // Three runs' tensors per rank (all small next to the data set every rank draws).
  program.memory_estimate([&](const Options& o) {
    if (s.convert) return 0.0;
    const double ranks = o.backend == "threads" || o.backend == "auto" ? o.ranks : 1;
    const double rows = s.model.rows, P = static_cast<double>(s.model.params());
    // The hidden activations dominate: measured peaks at 4096-65536 rows, hidden
    // 1024-4096 and 2-4 ranks hold (2 R + 3) rows x hidden floats; this is 1.1-1.2 times it.
    return ranks *
               (4.0 * (rows * (s.model.in + 2.0 * s.model.out) + 8.0 * P) + 32.0 * s.run.steps) +
           4.0 * rows * s.model.hidden * (2.2 * ranks + 3.5);
  });
  program.writes_csv([&] { return s.csv; });
  program.supports_cuda();

  return program.run(argc, argv, [&](Context& ctx) {
    ctx.json()["chapter"] = "06_fp16_loss_scaling";
    if (s.convert) return ctx.report(to_half_table(s.to_half), "to_half", "--to-half:");
    landmarks(ctx);
    three_runs(ctx, s);
  });
}
