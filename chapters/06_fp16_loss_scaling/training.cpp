// Chapter 06's training loop: the same model in fp32, in fp16 without scaling, and in
// fp16 with a loss scale; and the tables of fp16's range the chapter prints.
#include "training.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>
#include <string>

#include "shardlab/check.hpp"
#include "shardlab/half.hpp"
#include "shardlab/nn.hpp"
#include "shardlab/results.hpp"
#include "shardlab/toy.hpp"
#include "trainer.hpp"

using namespace shardlab;

namespace ch06 {

double underflow_fraction(const std::vector<float>& gradients, float scale) {
  std::size_t nonzero = 0, lost = 0;
  for (float g : gradients) {
    if (g == 0.0f) continue;
    ++nonzero;
    const std::uint16_t h = float_to_half_bits(g * scale);
    if ((h & 0x7fff) == 0) ++lost;  // +0 or -0: the value is gone
  }
  return nonzero ? static_cast<double>(lost) / static_cast<double>(nonzero) : 0.0;
}

namespace {

void append(std::vector<float>& into, const Tensor& t) {
  const Tensor f = cast(t, DType::f32).to(Memory::host);
  into.insert(into.end(), f.begin(), f.end());
}

/// Where [2^lo, 2^(lo+1)) lies in fp16: it keeps |x| >= 2^-25 (rounding up to 2^-24;
/// exactly 2^-25 ties to 0, a bin's lower edge only), subnormal below 2^-14, inf from 2^16.
const char* fp16_zone(int lo) {
  return lo + 1 <= -25 ? "0" : lo < -14 ? "subnormal" : lo >= 16 ? "inf" : "normal";
}

std::string hex16(std::uint16_t bits) {
  char b[8];
  std::snprintf(b, sizeof b, "0x%04x", bits);
  return b;
}

/// Whole numbers (fp16's 65504, a scale of 65536) as integers: the text shows every digit.
Cell number(double v) {
  if (v == std::floor(v) && std::fabs(v) < 1e15) return static_cast<std::int64_t>(v);
  return v;
}

/// A value as a cell: as number() does, or "inf" / "-inf" / "nan" (JSON has no infinities).
Cell value_cell(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return number(v);
}

}  // namespace

// ---------------------------------------------------------------------------
// Training

RunResult train(Communicator& comm, const ModelConfig& model, const RunConfig& run, Memory memory) {
  const int N = comm.size(), r = comm.rank();
  require(model.rows >= N, [&] {
    return "ch06: " + std::to_string(model.rows) + " rows cannot give " + std::to_string(N) +
           " ranks one each";
  });
  const std::int64_t R = model.rows, O = model.out;
  const ShardRange mine = shard_range(R, N, r);
  const DType type = run.fp16 ? DType::f16 : DType::f32;
  // This rank's rows of one data set: y = s tanh(x T), the teacher's T.
  const toy::Teacher teacher(
      toy::MlpConfig{.widths = {model.in, model.out}, .bias = false, .tanh_last = true}, model.seed,
      model.target_scale);
  const toy::Batch all = teacher.batch(R, 0);
  const Tensor x = cast(all.x.slice(mine.offset, mine.length), type).to(memory);
  const Tensor y = all.y.slice(mine.offset, mine.length).clone().to(memory);
  // The model, the same on every rank: W2 starts at the targets' size, so the outputs are
  // small from the first step. The store holds the compute type (f16: the fp32 master
  // weights rounded); the fp32 run's master weights are the store's values themselves.
  nn::ParameterStore store;
  nn::Sequential net = toy::mlp(
      store, {.widths = {model.in, model.hidden, model.out}, .bias = false, .seed = model.seed});
  nn::Parameter& w2 = *store.parameters()[1];
  scale_in_place(w2.value, static_cast<float>(model.target_scale));
  store.allocate(memory, type);
  Tensor master = run.fp16 ? cast(store.values(), DType::f32) : store.values();
  const std::int64_t P = store.size();
  nn::Adam adam(P, {.lr = run.lr}, memory);
  Tensor unscaled(Shape{P}, DType::f32, memory);
  LossScaler scaler(run.fp16 ? run.scaler : Scaler::none, run.dynamic, run.static_scale);
  RunResult result;
  const double count = static_cast<double>(R * O);
  for (int t = 1; t <= run.steps; ++t) {
    const float loss_scale = scaler.scale();
    result.scales.push_back(loss_scale);
    if (run.fp16) store.values().copy_from(cast(master, type));
    store.zero_grad();
    // Forward, in the compute type (matmuls add in f32 and round once, as tensor cores).
    nn::Forward f = net.forward(x);
    // The loss in fp32; its gradient, times the scale, rounded to the compute type:
    // where fp16 loses the small ones.
    const Tensor out32 = cast(f.out, DType::f32);
    result.losses.push_back(comm.agree(nn::squared_error(out32, y), ReduceOp::sum) / (2.0 * count));
    const Tensor dout = cast(scale(sub(out32, y), static_cast<float>(loss_scale / count)), type);
    // Backward, layer by layer (step 1's histogram shows each gradient), into the store.
    const Tensor dh = net[2].backward(dout, f.saved.children[2]);
    const Tensor da = net[1].backward(dh, f.saved.children[1]);
    net[0].backward(da, f.saved.children[0]);
    Tensor& grads = store.grads();
    if (t == 1) {
      if (!run.fp16)
        for (const Tensor* g : std::initializer_list<const Tensor*>{
                 &dout, &dh, &da, &store.parameters()[0]->grad, &w2.grad})
          append(result.first_gradients, *g);
      std::vector<float> weight_grads;
      append(weight_grads, grads);
      const auto zero = std::count(weight_grads.begin(), weight_grads.end(), 0.0f);
      result.first_zero_weight_grads =
          static_cast<double>(zero) / static_cast<double>(weight_grads.size());
    }
    // The gradients of every rank's rows, summed in the compute type: fp16 moves half
    // the bytes of fp32.
    const CommStats before = comm.stats();
    comm.allreduce(grads, ReduceOp::sum);
    const CommStats moved = comm.stats().since(before);
    result.grad_bytes_per_step = moved[Op::allreduce].bytes_received;
    result.grad_traffic_modeled = moved.is_modeled(Op::allreduce);
    // --inject-overflow: one rank's gradients turn non-finite (as one rank's shard would
    // under ZeRO or FSDP); the others' stay finite.
    if (run.inject_overflow.count(t) && r == N - 1)
      grads.slice(0, 1).fill(std::numeric_limits<double>::infinity());
    const bool skip = scaler.unscale_and_check(comm, grads, unscaled);
    if (skip)
      result.skipped.push_back(t);
    else
      adam.step(master, unscaled);
    scaler.update(skip);
    // A rank that stepped while another skipped would leave the replicas apart for good.
    const int skips = comm.agree(skip ? 1 : 0, ReduceOp::sum);
    if (skips != 0 && skips != N) result.skips_agreed = false;
  }
  result.weights = master.to(Memory::host);
  return result;
}

// ---------------------------------------------------------------------------
// The tables

Table gradient_histogram(const std::vector<float>& gradients, float scale) {
  int first = std::numeric_limits<int>::max(), last = std::numeric_limits<int>::min();
  std::vector<int> bin_of;
  for (float g : gradients) {
    if (g == 0) continue;
    const int lo = static_cast<int>(std::floor(std::log2(std::fabs(static_cast<double>(g)))));
    bin_of.push_back(lo);
    first = std::min(first, lo);
    last = std::max(last, lo);
  }
  Table t({"log2_from", "log2_to", "count", "histogram", "fp16_zone", "scaled_zone", "scale"});
  if (bin_of.empty()) return t;
  std::vector<std::size_t> counts(static_cast<std::size_t>(last - first + 1), 0);
  for (int lo : bin_of) ++counts[static_cast<std::size_t>(lo - first)];
  const std::size_t most = *std::max_element(counts.begin(), counts.end());
  const int shift = static_cast<int>(std::lround(std::log2(scale)));
  for (int lo = first; lo <= last; ++lo) {
    const std::size_t n = counts[static_cast<std::size_t>(lo - first)];
    const auto bar =
        static_cast<std::size_t>(40.0 * static_cast<double>(n) / static_cast<double>(most));
    t.add({lo, lo + 1, n, std::string(bar, '#'), fp16_zone(lo), fp16_zone(lo + shift),
           number(scale)});
  }
  return t;
}

Table format_landmarks() {
  Table t({"format", "bits (sign, exponent, mantissa)", "largest", "smallest_normal",
           "smallest_subnormal", "epsilon", "as powers of 2"});
  t.add({"fp32", "1, 8, 23", number(std::numeric_limits<float>::max()),
         number(std::numeric_limits<float>::min()),
         number(std::numeric_limits<float>::denorm_min()),
         number(std::numeric_limits<float>::epsilon()), "2^-126, 2^-149, 2^-23"});
  t.add({"fp16", "1, 5, 10", number(half_bits_to_float(0x7bff)), number(half_bits_to_float(0x0400)),
         number(half_bits_to_float(0x0001)), number(half_bits_to_float(0x3c01) - 1.0f),
         "2^-14, 2^-24, 2^-10"});
  t.add({"bf16", "1, 8, 7", number(bf16_bits_to_float(0x7f7f)), number(bf16_bits_to_float(0x0080)),
         number(bf16_bits_to_float(0x0001)), number(bf16_bits_to_float(0x3f81) - 1.0f),
         "2^-126, 2^-133, 2^-7"});
  return t;
}

Table to_half_table(double value) {
  const auto f = static_cast<float>(value);
  const std::uint16_t h = float_to_half_bits(f), b = float_to_bf16_bits(f);
  const float hv = half_bits_to_float(h), bv = bf16_bits_to_float(b);
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const char* kind = e == 0x1f ? (m ? "NaN" : "infinity")
                     : e == 0  ? (m ? "subnormal" : "zero")
                               : "normal";
  std::string note;  // what was lost, "; " between the parts
  auto add = [&](const std::string& part) { note += (note.empty() ? "" : "; ") + part; };
  auto error = [&](float rounded) {
    return format_number(std::fabs(rounded - f) / std::fabs(f), 3);
  };
  if (std::isinf(f) && std::isfinite(value)) add("beyond even fp32's range");
  if (f == 0 && value != 0)
    add("below half of fp32's smallest subnormal (2^-149): 0 in fp32 already");
  if (hv == 0 && f != 0)
    add(std::fabs(f) == 0x1p-25f ? "fp16: exactly half of 2^-24, a tie, rounds to even: 0"
                                 : "fp16: below half of 2^-24, the value is gone");
  if (std::isinf(hv) && std::isfinite(f)) add("fp16: above 65504 (65520 and up), overflow");
  if (std::isfinite(hv) && hv != 0 && hv != f && f != 0) add("fp16 relative error " + error(hv));
  if (std::isfinite(bv) && bv != f && f != 0) add("bf16 relative error " + error(bv));
  Table t({"value", "fp16_bits", "fp16_value", "fp16_kind", "bf16_bits", "bf16_value", "note"});
  // The value as given (a double: 1e-300 is not 0 until it becomes a float).
  t.add({value_cell(value), hex16(h), value_cell(hv), kind, hex16(b), value_cell(bv), note});
  return t;
}

std::set<int> parse_steps(const std::string& text, int steps, const std::string& flag) {
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
    require_usage(used != 0 && used == item.size(),
                  flag + " " + text + ": a list of step numbers like 30,31");
    require_usage(k >= 1 && k <= steps, flag + " " + text + ": step " + item +
                                            " is not one of 1.." + std::to_string(steps) +
                                            " (--steps)");
    out.insert(k);
  }
  return out;
}

std::string format_steps(const std::vector<int>& steps) {
  std::string out;
  for (std::size_t i = 0; i < steps.size();) {
    std::size_t j = i;  // steps[i..j] consecutive
    while (j + 1 < steps.size() && steps[j + 1] == steps[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    if (j >= i + 2) {
      out += std::to_string(steps[i]) + "-" + std::to_string(steps[j]);
      i = j + 1;
    } else {
      out += std::to_string(steps[i++]);
    }
  }
  return out.empty() ? "none" : out;
}

std::vector<std::string> failed_checks(const RunConfig& run, const RunResult& a,
                                       const RunResult& c) {
  std::vector<std::string> out;
  auto check = [&](bool ok, const std::string& what) {
    if (!ok) out.push_back(what);
  };
  check(2 * c.grad_bytes_per_step == a.grad_bytes_per_step,
        "the fp16 gradients' allreduce moved " + std::to_string(c.grad_bytes_per_step) +
            " bytes, not half of fp32's " + std::to_string(a.grad_bytes_per_step));
  check(c.skips_agreed, "some ranks skipped a step that others took: the replicas went apart");
  check(a.divergence().empty(), "the fp32 run " + a.divergence());  // never "ok"
  if (run.scaler == Scaler::none) return out;
  check(c.divergence().empty(), "the fp16 run " + c.divergence());
  // GradScaler has no lowest scale, and neither has this one: backing off often enough
  // takes it to 0, where every gradient unscales to NaN and every later step is skipped.
  // That is a dead run, never "ok"; so is one whose every step was skipped.
  if (const auto zero = std::find(c.scales.begin(), c.scales.end(), 0.0f); zero != c.scales.end())
    out.push_back("the loss scale backed off to 0 at step " +
                  std::to_string(zero - c.scales.begin() + 1) +
                  ": every step after it is skipped (no scale is left to grow)");
  else if (const std::string dead = no_step_taken(run.scaler, static_cast<int>(c.skipped.size()),
                                                  run.steps, c.scales.front());
           !dead.empty())
    out.push_back("the fp16 run: " + dead);
  for (int k : run.inject_overflow)
    check(std::count(c.skipped.begin(), c.skipped.end(), k) == 1,
          "step " + std::to_string(k) + " had its gradients made non-finite but was not skipped");
  return out;
}

std::string RunResult::divergence() const {
  // A hundredfold: Adam's first steps may raise the loss a few times over; a run that
  // diverges grows it by 10^5 and more, at some step if not at the last (at --lr 1 the
  // loss rises 10^6 times and falls back below its start by step 300).
  const std::string why = ch02::divergence(losses, 100);
  return why.empty() ? "" : why + ": lower --lr or --target-scale";
}

}  // namespace ch06
