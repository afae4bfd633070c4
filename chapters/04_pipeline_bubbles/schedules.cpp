// Chapter 04: the schedules other than the exercise's 1F1B, and the checks every schedule
// must pass.
#include <algorithm>
#include <map>

#include "schedule.hpp"
#include "shardlab/check.hpp"

namespace ch04 {

using shardlab::UsageError;

bool Schedule::split_backward() const {
  for (const auto& stage : ops)
    for (const Op& op : stage)
      if (op.kind == Kind::weight) return true;
  return false;
}

Schedule naive(int stages) {
  Schedule s = gpipe(stages, 1);
  s.name = "naive";
  return s;
}

Schedule gpipe(int stages, int microbatches) {
  Schedule s{"gpipe", stages, microbatches, 1, {}};
  s.ops.resize(static_cast<std::size_t>(stages));
  for (auto& stage : s.ops) {
    for (int j = 0; j < microbatches; ++j) stage.push_back({Kind::forward, j});
    for (int j = 0; j < microbatches; ++j) stage.push_back({Kind::backward, j});
  }
  return s;
}

Schedule interleaved(int stages, int microbatches, int chunks) {
  const int p = stages, m = microbatches, v = chunks;
  if (m % p != 0)
    throw UsageError("the interleaved schedule takes microbatches p at a time: --microbatches " +
                     std::to_string(m) + " is not a multiple of " + std::to_string(p) + " stages");
  Schedule s{"interleaved", p, m, v, {}};
  s.ops.resize(static_cast<std::size_t>(p));
  // The k-th forward of every stage: microbatches p at a time through chunk 0, the same p
  // through chunk 1, ..., then the next p. Backwards go through the chunks in reverse.
  const int total = m * v;
  auto microbatch = [&](int k) { return (k / (p * v)) * p + k % p; };
  auto forward = [&](int k) { return Op{Kind::forward, microbatch(k), (k / p) % v}; };
  auto backward = [&](int k) { return Op{Kind::backward, microbatch(k), v - 1 - (k / p) % v}; };
  for (int st = 0; st < p; ++st) {
    // Megatron-LM's warm-up: enough forwards that the first backward's inputs have come
    // back round the ring of stages; all of them when m = p.
    const int warmup = m == p ? total : std::min((p - st - 1) * 2 + (v - 1) * p, total);
    auto& ops = s.ops[static_cast<std::size_t>(st)];
    for (int k = 0; k < warmup; ++k) ops.push_back(forward(k));
    for (int k = 0; k < total - warmup; ++k) {
      ops.push_back(forward(warmup + k));
      ops.push_back(backward(k));
    }
    for (int k = total - warmup; k < total; ++k) ops.push_back(backward(k));
  }
  return s;
}

Schedule zb_h1(int stages, int microbatches) {
  const int p = stages, m = microbatches;
  Schedule s{"zb1", p, m, 1, {}};
  s.ops.resize(static_cast<std::size_t>(p));
  for (int st = 0; st < p; ++st) {
    auto& ops = s.ops[static_cast<std::size_t>(st)];
    for (int x = 0; x < m + p - 1; ++x) {
      if (x < m) ops.push_back({Kind::forward, x});
      if (const int b = x - (p - 1 - st); b >= 0 && b < m) ops.push_back({Kind::backward, b});
      if (const int w = x - (p - 1); w >= 0 && w < m) ops.push_back({Kind::weight, w});
    }
  }
  return s;
}

Schedule make_schedule(const std::string& name, int stages, int microbatches, int chunks) {
  if (stages < 1) throw UsageError("a pipeline needs at least 1 stage");
  if (microbatches < 1) throw UsageError("--microbatches must be at least 1");
  if (chunks < 1) throw UsageError("--chunks must be at least 1");
  if (name == "naive") return naive(stages);
  if (name == "gpipe") return gpipe(stages, microbatches);
  if (name == "1f1b") {
    Schedule s = one_f_one_b(stages, microbatches);
    s.name = "1f1b";
    return s;
  }
  if (name == "interleaved") return interleaved(stages, microbatches, chunks);
  if (name == "zb1") return zb_h1(stages, microbatches);
  throw UsageError("unknown schedule '" + name + "' (naive, gpipe, 1f1b, interleaved, zb1)");
}

std::string label(const Op& op, int chunks) {
  const char kind = op.kind == Kind::forward ? 'F' : op.kind == Kind::backward ? 'B' : 'W';
  std::string text = kind + std::to_string(op.microbatch);
  if (chunks > 1) text += "." + std::to_string(op.chunk);
  return text;
}

std::string validate(const Schedule& s) {
  if (s.stages < 1 || s.microbatches < 1 || s.chunks < 1)
    return "a schedule needs at least one stage, microbatch and chunk";
  if (static_cast<int>(s.ops.size()) != s.stages)
    return "the schedule has " + std::to_string(s.ops.size()) + " lists of ops for " +
           std::to_string(s.stages) + " stages";
  const bool split = s.split_backward();
  for (int st = 0; st < s.stages; ++st) {
    const std::string where = "stage " + std::to_string(st) + ": ";
    // 0 nothing yet, 1 after F, 2 after B, 3 after W.
    std::map<std::pair<int, int>, int> state;
    const auto& ops = s.ops[static_cast<std::size_t>(st)];
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const Op& op = ops[i];
      const std::string what = where + "op " + std::to_string(i) + ", " + label(op, s.chunks);
      if (op.microbatch < 0 || op.microbatch >= s.microbatches)
        return what + ": microbatch " + std::to_string(op.microbatch) +
               " does not exist (microbatches 0.." + std::to_string(s.microbatches - 1) + ")";
      if (op.chunk < 0 || op.chunk >= s.chunks)
        return what + ": chunk " + std::to_string(op.chunk) + " does not exist (chunks 0.." +
               std::to_string(s.chunks - 1) + ")";
      int& at = state[{op.microbatch, op.chunk}];
      const int want = op.kind == Kind::forward ? 0 : op.kind == Kind::backward ? 1 : 2;
      if (at == want) {
        ++at;
        continue;
      }
      const std::string first = op.kind == Kind::forward    ? "the forward"
                                : op.kind == Kind::backward ? "the backward"
                                                            : "the weight gradient";
      if (at > want)
        return what + ": " + first + " of this microbatch is already done (an op twice)";
      return what + ": comes before " +
             (want == 1 ? std::string("its forward") : std::string("its backward (B)")) +
             " on this stage";
    }
    const int last = split ? 3 : 2;
    for (int j = 0; j < s.microbatches; ++j)
      for (int c = 0; c < s.chunks; ++c) {
        const auto it = state.find({j, c});
        const int at = it == state.end() ? 0 : it->second;
        if (at == last) continue;
        const Op missing{at == 0 ? Kind::forward : at == 1 ? Kind::backward : Kind::weight, j, c};
        return where + "no " + label(missing, s.chunks) + ": microbatch " + std::to_string(j) +
               (s.chunks > 1 ? " of chunk " + std::to_string(c) : std::string()) +
               (at == 0   ? " never goes forward"
                : at == 1 ? " never goes backward"
                          : " never gets its weight gradient (W), though other B ops have one");
      }
  }
  return "";
}

double bubble_fraction_formula(int stages, int microbatches) {
  return static_cast<double>(stages - 1) / static_cast<double>(microbatches + stages - 1);
}

}  // namespace ch04
