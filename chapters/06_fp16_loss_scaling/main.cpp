// Chapter 06 — FP16 and loss scaling: why small gradients vanish, and how scaling the
// loss brings them back.
//
// The course (so-large-lm ch. 8, the walk-through's §7 "混合精度训练"): keep the master
// weights in FP32, compute in FP16, and scale the loss so that gradients below 2^-24 —
// which become 0 in FP16 — survive. This chapter shows the format's landmarks, converts
// any value to fp16 and bf16 (--to-half), and trains one small model three ways on
// data-parallel ranks: in fp32, in fp16 without scaling, and in fp16 with a loss scale
// (PyTorch GradScaler's dynamic rule by default). The fp16 runs really are fp16: their
// weights, activations and gradients are 16-bit tensors (matmuls add in fp32 and round
// once, as tensor cores do); the gradients are summed across ranks in fp16 and unscaled
// in fp32, and the fp32 master weights take the Adam update.
//
// Simplified: a two-layer MLP on a synthetic regression whose targets are small
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
#include <cmath>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "scaler.hpp"
#include "shardlab/check.hpp"
#include "shardlab/cli.hpp"
#include "shardlab/half.hpp"
#include "shardlab/launch.hpp"
#include "shardlab/results.hpp"
#include "training.hpp"

using namespace shardlab;
using namespace ch06;

namespace {

struct Settings {
  std::string to_half;
  std::string scaler = "dynamic";
  std::string scale_text = "2^16", init_scale_text = "2^16";
  float growth_factor = 2.0f, backoff_factor = 0.5f;
  int growth_interval = 2000;
  std::string inject;
  bool csv = false;
  ModelConfig model;
  RunConfig run;
};

/// "2^16", "65536", "1e-3" -> a positive finite float; anything else is bad usage.
float parse_scale(const std::string& text, const std::string& flag) {
  double value = 0;
  std::size_t used = 0;
  try {
    if (text.rfind("2^", 0) == 0) {
      const double k = std::stod(text.substr(2), &used);
      used += 2;
      if (!std::isfinite(k) || k != std::round(k) || std::fabs(k) > 1000)
        throw UsageError(flag + " " + text + ": 2^k needs a whole k within float's range (-126 to 127)");
      value = std::ldexp(1.0, static_cast<int>(k));
    } else {
      value = std::stod(text, &used);
    }
  } catch (const UsageError&) {
    throw;
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || text.empty())
    throw UsageError(flag + " " + text + ": not a number (try 65536 or 2^16)");
  if (!(value > 0) || !std::isfinite(value) || value > std::numeric_limits<float>::max() ||
      value < std::numeric_limits<float>::min())
    throw UsageError(flag + " " + text + ": must be a positive float from 2^-126 to 2^127");
  return static_cast<float>(value);
}

std::set<int> parse_steps(const std::string& text, int steps) {
  std::set<int> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    std::size_t used = 0;
    int k = 0;
    try {
      k = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size())
      throw UsageError("--inject-overflow " + text + ": a list of step numbers like 30,31");
    if (k < 1 || k > steps)
      throw UsageError("--inject-overflow " + text + ": step " + item + " is not one of 1.." +
                       std::to_string(steps) + " (--steps)");
    out.insert(k);
  }
  return out;
}

std::string hex16(std::uint16_t bits) {
  char b[8];
  std::snprintf(b, sizeof b, "0x%04x", bits);
  return b;
}

std::string sci(double v) { return format_number(v, 3); }

// ---------------------------------------------------------------------------
// The formats

void landmarks(Context& ctx) {
  std::ostringstream out;
  out << "Chapter 06 - fp16 and loss scaling\n\n"
      << "  format  bits (sign, exponent, mantissa)  largest        smallest normal       smallest "
         "subnormal     epsilon (1 to the next)\n"
      << "  fp32    1, 8, 23                         3.40e+38       2^-126 = 1.18e-38     2^-149 = "
         "1.40e-45       2^-23 = 1.19e-07\n"
      << "  fp16    1, 5, 10                         65504          2^-14  = 6.10e-05     2^-24  = "
         "5.96e-08       2^-10 = 9.77e-04\n"
      << "  bf16    1, 8, 7                          3.39e+38       2^-126 = 1.18e-38     2^-133 = "
         "9.18e-41       2^-7  = 7.81e-03\n";
  ctx.say(out.str());
  // Every landmark from the conversions themselves, not from the table above.
  auto& j = ctx.json()["landmarks"];
  j["fp16_max"] = half_bits_to_float(0x7bff);
  j["fp16_min_normal"] = half_bits_to_float(0x0400);
  j["fp16_min_subnormal"] = half_bits_to_float(0x0001);
  j["fp16_epsilon"] = half_bits_to_float(0x3c01) - 1.0f;
  j["bf16_max"] = bf16_bits_to_float(0x7f7f);
  j["bf16_min_normal"] = bf16_bits_to_float(0x0080);
  j["bf16_min_subnormal"] = bf16_bits_to_float(0x0001);
  j["bf16_epsilon"] = bf16_bits_to_float(0x3f81) - 1.0f;
  ctx.verify(half_bits_to_float(0x7bff) == 65504.0f && half_bits_to_float(0x0001) == std::ldexp(1.0f, -24) &&
                 half_bits_to_float(0x0400) == std::ldexp(1.0f, -14) &&
                 bf16_bits_to_float(0x3f81) - 1.0f == std::ldexp(1.0f, -7),
             "the fp16 / bf16 landmarks differ from the conversions");
}

std::string kind_of_half(std::uint16_t h) {
  const int e = (h >> 10) & 0x1f, f = h & 0x3ff;
  if (e == 0x1f) return f ? "NaN" : "infinity";
  if (e == 0) return f ? "subnormal" : "zero";
  return "normal";
}

void show_half(Context& ctx, const std::string& text) {
  double value = 0;
  std::size_t used = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size())
    throw UsageError("--to-half " + text + ": not a number (try 1e-8, 65519 or 0.1)");
  const auto f = static_cast<float>(value);
  const std::uint16_t h = float_to_half_bits(f), b = float_to_bf16_bits(f);
  const float hv = half_bits_to_float(h), bv = bf16_bits_to_float(b);
  std::ostringstream out;
  out << "--to-half " << text << " (as a float: " << format_number(f, 9)
      << (std::isinf(f) && std::isfinite(value) ? ", beyond even fp32's range" : "") << ")\n"
      << "  fp16 " << hex16(h) << " = " << format_number(hv, 9) << "  (" << kind_of_half(h);
  if (std::isfinite(hv) && hv != f && f != 0) out << ", relative error " << sci(std::fabs(hv - f) / std::fabs(f));
  if (hv == 0 && f != 0) out << ": below half of 2^-24, the value is gone";
  if (std::isinf(hv) && std::isfinite(f)) out << ": above 65504 (rounded: 65520 and up), overflow";
  out << ")\n  bf16 " << hex16(b) << " = " << format_number(bv, 9);
  if (std::isfinite(bv) && bv != f && f != 0) out << "  (relative error " << sci(std::fabs(bv - f) / std::fabs(f)) << ")";
  ctx.say(out.str());
  auto& j = ctx.json();
  j["value"] = text;
  j["fp16_bits"] = hex16(h);
  j["bf16_bits"] = hex16(b);
  j["fp16_value"] = std::isfinite(hv) ? nlohmann::json(hv) : nlohmann::json(std::isnan(hv) ? "nan" : (hv > 0 ? "inf" : "-inf"));
  j["bf16_value"] = std::isfinite(bv) ? nlohmann::json(bv) : nlohmann::json(std::isnan(bv) ? "nan" : (bv > 0 ? "inf" : "-inf"));
  j["fp16_kind"] = kind_of_half(h);
}

// ---------------------------------------------------------------------------
// The three runs

/// log2|g| in bins of one power of two, from 2^-60 to 2^0, as text bars.
std::string histogram(const std::vector<float>& g, float scale, std::vector<std::pair<int, std::size_t>>& bins) {
  bins.clear();
  for (int lo = -60; lo < 0; ++lo) bins.push_back({lo, 0});
  std::size_t below = 0;
  for (float x : g) {
    if (x == 0) continue;
    const double l = std::log2(std::fabs(static_cast<double>(x)));
    if (l < -60) {
      ++below;
      continue;
    }
    const int at = std::min(59, static_cast<int>(std::floor(l + 60)));
    ++bins[static_cast<std::size_t>(at)].second;
  }
  std::size_t most = 1;
  for (const auto& b : bins) most = std::max(most, b.second);
  const int shift = static_cast<int>(std::lround(std::log2(scale)));
  // The text shows the bins from the first to the last that holds a value.
  std::size_t first = bins.size(), last = 0;
  for (std::size_t i = 0; i < bins.size(); ++i)
    if (bins[i].second) first = std::min(first, i), last = i;
  std::ostringstream out;
  for (std::size_t i = first; i <= last && i < bins.size(); ++i) {
    const auto& [lo, n] = bins[i];
    // fp16 keeps |x| >= 2^-25 (rounding up to 2^-24; exactly 2^-25 ties to 0, a bin's
    // lower edge only), subnormal below 2^-14, inf from 2^16.
    const char* zone = lo + 1 <= -25 ? "0 in fp16" : lo < -14 ? "subnormal" : "normal";
    const int scaled = lo + shift;
    const char* szone = scaled + 1 <= -25 ? "0" : scaled < -14 ? "subnormal" : scaled >= 16 ? "inf" : "normal";
    char line[160];
    std::snprintf(line, sizeof line, "  2^%-4d..2^%-4d %7zu  %-40s  %-10s  x scale: %s\n", lo, lo + 1, n,
                  std::string(static_cast<std::size_t>(40.0 * static_cast<double>(n) / static_cast<double>(most)), '#').c_str(),
                  zone, szone);
    out << line;
  }
  if (below) out << "  (" << below << " values below 2^-60)\n";
  return out.str();
}

double at(const std::vector<double>& v, double fraction) {
  const auto i = static_cast<std::size_t>(std::lround(fraction * static_cast<double>(v.size() - 1)));
  return v[i];
}

void three_runs(Context& ctx, const Settings& s) {
  const int N = ctx.size();
  RunConfig fp32 = s.run, unscaled = s.run, scaled = s.run;
  fp32.fp16 = false;
  fp32.inject_overflow.clear();
  unscaled.scaler = Scaler::none;
  unscaled.inject_overflow.clear();
  const RunResult a = train(ctx.comm(), s.model, fp32, ctx.memory());
  const RunResult b = train(ctx.comm(), s.model, unscaled, ctx.memory());
  const RunResult c = train(ctx.comm(), s.model, scaled, ctx.memory());
  const auto chosen = static_cast<float>(c.scales.front());
  std::vector<std::pair<int, std::size_t>> bins;
  std::ostringstream out;
  out << "One model trained three ways on " << N << " data-parallel ranks (" << ctx.comm().backend()
      << "): out = tanh(x W1) W2, " << s.model.in << " -> " << s.model.hidden << " -> " << s.model.out
      << ", a batch of " << s.model.rows << " rows shared out, targets of size " << format_number(s.model.target_scale)
      << ", Adam (lr " << format_number(s.run.lr) << "), " << s.run.steps << " steps\n\n"
      << "Step 1's gradients (of the fp32 run: dL/dout, dL/dh, dL/d(x W1), dL/dW1, dL/dW2; "
      << a.first_gradients.size() << " values), by magnitude:\n"
      << histogram(a.first_gradients, chosen, bins);
  const double lost = underflow_fraction(a.first_gradients, 1.0f);
  const double lost_scaled = underflow_fraction(a.first_gradients, chosen);
  out << "  become 0 in fp16: " << format_number(100 * lost, 3) << "% of the nonzero values unscaled, "
      << format_number(100 * lost_scaled, 3) << "% times the scale " << format_number(chosen) << " (2^"
      << std::lround(std::log2(chosen)) << ")\n"
      << "  the fp16 runs' weight gradients at step 1 that are exactly 0: "
      << format_number(100 * b.first_zero_weight_grads, 3) << "% unscaled, "
      << format_number(100 * c.first_zero_weight_grads, 3) << "% scaled\n\n";
  out << "Loss (relative to the first step's " << sci(a.losses.front()) << "):\n";
  char line[200];
  std::snprintf(line, sizeof line, "  %-22s %12s %12s %12s %12s\n", "run", "step 1", "25%", "50%", "final");
  out << line;
  for (const auto& [name, r] : {std::pair{"fp32", &a}, {"fp16, no scaling", &b}, {"fp16, loss scaling", &c}}) {
    const double first = a.losses.front();
    std::snprintf(line, sizeof line, "  %-22s %12s %12s %12s %12s\n", name, sci(r->losses.front() / first).c_str(),
                  sci(at(r->losses, 0.25) / first).c_str(), sci(at(r->losses, 0.5) / first).c_str(),
                  sci(r->losses.back() / first).c_str());
    out << line;
  }
  out << "  fp16 without scaling ends at " << format_number(b.losses.back() / a.losses.back(), 3)
      << "x the fp32 loss; with scaling at " << format_number(c.losses.back() / a.losses.back(), 3) << "x\n\n";
  // The scale over time: its changes.
  out << "Loss scale (" << s.scaler << "): " << format_number(c.scales.front());
  for (std::size_t t = 1; t < c.scales.size(); ++t)
    if (c.scales[t] != c.scales[t - 1])
      out << ", step " << t + 1 << ": " << format_number(c.scales[t]);
  out << "\nSkipped steps (non-finite gradients): ";
  if (c.skipped.empty()) out << "none";
  for (std::size_t i = 0; i < c.skipped.size(); ++i) out << (i ? ", " : "") << c.skipped[i];
  out << "\nGradient allreduce per step, bytes each rank received: " << a.grad_bytes_per_step
      << " in fp32, " << c.grad_bytes_per_step << " in fp16 ("
      << (c.grad_traffic_modeled ? "modeled" : "measured") << ")\n";
  ctx.say(out.str());

  // Checks: what must hold whatever the flags.
  ctx.verify(2 * c.grad_bytes_per_step == a.grad_bytes_per_step,
             "the fp16 gradients' allreduce moved " + std::to_string(c.grad_bytes_per_step) +
                 " bytes, not half of fp32's " + std::to_string(a.grad_bytes_per_step));
  ctx.verify(c.skips_agreed, "some ranks skipped a step that others took: the replicas went apart");
  ctx.verify(std::isfinite(a.losses.back()), "the fp32 run's loss is not finite");
  if (s.run.scaler != Scaler::none)
    ctx.verify(std::isfinite(c.losses.back()), "the scaled fp16 run's loss is not finite");
  for (const RunResult* r : {&a, &b, &c}) {
    const auto mine = r->weights;
    Tensor first = mine.clone();
    ctx.comm().broadcast(first, 0);
    ctx.verify(ctx.comm().all_true(first.bitwise_equal(mine)),
               "the ranks' weights differ after training: the replicas went apart");
  }
  std::vector<int> expected(s.run.inject_overflow.begin(), s.run.inject_overflow.end());
  if (s.run.scaler != Scaler::none)
    for (int k : expected)
      ctx.verify(std::count(c.skipped.begin(), c.skipped.end(), k) == 1,
                 "step " + std::to_string(k) + " had its gradients made non-finite but was not skipped");

  auto& j = ctx.json();
  j["underflow_fraction_unscaled"] = lost;
  j["underflow_fraction_scaled"] = lost_scaled;
  j["final_loss"] = {{"fp32", a.losses.back()}, {"fp16_unscaled", b.losses.back()}, {"fp16_scaled", c.losses.back()}};
  j["scale_history"] = c.scales;
  j["skipped_steps"] = c.skipped;
  j["grad_bytes_per_step"] = {{"fp32", a.grad_bytes_per_step}, {"fp16", c.grad_bytes_per_step}};
  j["traffic_modeled"] = c.grad_traffic_modeled;
  j["zero_weight_grads_step1"] = {{"fp16_unscaled", b.first_zero_weight_grads}, {"fp16_scaled", c.first_zero_weight_grads}};

  if (!s.csv) return;
  CsvTable hist({"log2_from", "log2_to", "count", "scale", "fp16_zone"});
  for (const auto& [lo, n] : bins)
    hist.add({std::to_string(lo), std::to_string(lo + 1), std::to_string(n), format_number(chosen),
              lo + 1 <= -25 ? "zero" : lo < -14 ? "subnormal" : "normal"});
  ctx.save_csv(hist, "06_fp16_loss_scaling_histogram");
  CsvTable curves({"step", "run", "loss", "scale", "skipped"});
  for (const auto& [name, r] : {std::pair{"fp32", &a}, {"fp16_unscaled", &b}, {"fp16_scaled", &c}})
    for (std::size_t t = 0; t < r->losses.size(); ++t)
      curves.add({std::to_string(t + 1), name, format_number(r->losses[t], 9), format_number(r->scales[t]),
                  std::count(r->skipped.begin(), r->skipped.end(), static_cast<int>(t + 1)) ? "1" : "0"});
  ctx.save_csv(curves, "06_fp16_loss_scaling");
}

}  // namespace

int main(int argc, char** argv) {
  Program program("ch06_fp16_loss_scaling",
                  "Chapter 06: fp16 and loss scaling - why small gradients vanish, and how scaling brings them back");
  Settings s;
  auto& cli = program.cli();
  cli.add_option("--to-half", s.to_half, "show a value's fp16 and bf16 bits, and what it becomes");
  cli.add_option("--scaler", s.scaler, "the scaled run's scaler: none, static or dynamic")
      ->check(CLI::IsMember({"none", "static", "dynamic"}))
      ->capture_default_str();
  cli.add_option("--scale", s.scale_text, "static scaler: the loss scale (65536 or 2^16)")->capture_default_str();
  cli.add_option("--init-scale", s.init_scale_text, "dynamic scaler: the first scale")->capture_default_str();
  cli.add_option("--growth-factor", s.growth_factor, "dynamic scaler: x this after --growth-interval finite steps")
      ->check(cli::between(1.0, 1e6))
      ->capture_default_str();
  cli.add_option("--backoff-factor", s.backoff_factor, "dynamic scaler: x this on an inf or NaN")
      ->check(cli::between(0.0, 1.0))
      ->capture_default_str();
  cli.add_option("--growth-interval", s.growth_interval, "dynamic scaler: finite steps before growing")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  cli.add_option("--inject-overflow", s.inject, "make the gradients non-finite at these steps (30,31)");
  cli.add_option("--steps", s.run.steps, "training steps")->check(CLI::Range(1, 100000))->capture_default_str();
  cli.add_option("--lr", s.run.lr, "Adam's learning rate")->check(cli::between(1e-9, 1.0))->capture_default_str();
  cli.add_option("--target-scale", s.model.target_scale, "size of the targets (small: small gradients)")
      ->check(cli::between(1e-30, 1e4))
      ->capture_default_str();
  cli.add_option("--batch", s.model.rows, "rows of the batch, all ranks together")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cli.add_option("--hidden", s.model.hidden, "hidden width")->check(CLI::Range(1, 4096))->capture_default_str();
  cli.add_flag("--csv", s.csv, "write the histogram and the loss curves as CSV (for the notebook)");

  program.validate([&](const Options& o) {
    s.model.seed = o.seed;
    if (cli.count("--to-half") && s.to_half.empty())
      throw UsageError("--to-half needs a value to convert, like 1e-8 or 65520");
    if (!s.to_half.empty())
      for (const char* flag : {"--scaler", "--scale", "--init-scale", "--growth-factor", "--backoff-factor",
                               "--growth-interval", "--inject-overflow", "--steps", "--lr", "--target-scale",
                               "--batch", "--hidden", "--csv"})
        if (cli.count(flag))
          throw UsageError(std::string("--to-half only converts a value: drop ") + flag);
    if (s.growth_factor <= 1.0f)
      throw UsageError("--growth-factor " + format_number(s.growth_factor) + ": must be above 1");
    if (s.backoff_factor <= 0.0f || s.backoff_factor >= 1.0f)
      throw UsageError("--backoff-factor " + format_number(s.backoff_factor) + ": must be between 0 and 1, exclusive");
    s.run.static_scale = parse_scale(s.scale_text, "--scale");
    s.run.dynamic = {parse_scale(s.init_scale_text, "--init-scale"), s.growth_factor, s.backoff_factor,
                     s.growth_interval};
    s.run.scaler = s.scaler == "none" ? Scaler::none : s.scaler == "static" ? Scaler::fixed : Scaler::dynamic;
    if (cli.count("--scale") && s.run.scaler != Scaler::fixed)
      throw UsageError("--scale is the static scaler's: add --scaler static");
    s.run.inject_overflow = parse_steps(s.inject, s.run.steps);
    if (s.run.scaler == Scaler::none && !s.run.inject_overflow.empty())
      throw UsageError("--inject-overflow shows a scaler skipping steps: with --scaler none nothing would skip "
                       "them and the weights would turn to NaN");
    if (s.to_half.empty() && s.model.rows < o.ranks && o.backend != "mpi")
      throw UsageError("--batch " + std::to_string(s.model.rows) + " cannot give " + std::to_string(o.ranks) +
                       " ranks a row each");
  });
  // Three runs' tensors per rank (all small next to the data set every rank draws).
  program.memory_estimate([&](const Options& o) {
    if (!s.to_half.empty()) return 0.0;
    const double ranks = o.backend == "threads" || o.backend == "auto" ? o.ranks : 1;
    const double rows = s.model.rows;
    const double per = 4.0 * (rows * (s.model.in + 2.0 * s.model.out) + 8.0 * static_cast<double>(s.model.params()) +
                               6.0 * rows / o.ranks * s.model.hidden) +
                       8.0 * s.run.steps * 4;
    return ranks * per;
  });
  program.writes_csv([&] { return s.csv; });
  program.supports_cuda();

  return program.run(argc, argv, [&](Context& ctx) {
    ctx.json()["chapter"] = "06_fp16_loss_scaling";
    if (!s.to_half.empty()) {
      if (ctx.rank() == 0) show_half(ctx, s.to_half);
      return;
    }
    if (s.model.rows < ctx.size())  // under mpirun: the processes it started
      throw UsageError("--batch " + std::to_string(s.model.rows) + " cannot give " + std::to_string(ctx.size()) +
                       " ranks a row each");
    if (ctx.rank() == 0) landmarks(ctx);
    three_runs(ctx, s);
  });
}
