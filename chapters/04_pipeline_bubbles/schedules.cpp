// Chapter 04: the schedules other than the exercise's 1F1B, and the checks every schedule
// must pass.
#include <algorithm>
#include <map>

#include "schedule.hpp"
#include "shardlab/check.hpp"
#include "shardlab/format.hpp"

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
    // The warm-up of Megatron-LM (get_pp_rank_microbatches, microbatch groups of p) and
    // of PyTorch's ScheduleInterleaved1F1B: (v - 1) p forwards on every stage, enough for
    // the first microbatches to come back round to chunk v - 1, and 2 (p - 1 - s) more
    // on stage s, so that its first backward finds its input there. Also when m = p
    // (earlier Megatron-LM ran all forwards first then, holding all of them everywhere).
    const int warmup = std::min((p - st - 1) * 2 + (v - 1) * p, total);
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

std::vector<std::string> schedules_to_show(const std::string& choice, int stages, int microbatches,
                                           int chunks, int layers,
                                           std::vector<std::string>& skipped) {
  if (choice != "all") return {choice};
  const int p = stages;
  std::vector<std::string> names;
  for (const std::string name : {"naive", "gpipe", "1f1b", "interleaved", "zb1"}) {
    if (name == "interleaved" && microbatches % p != 0) {
      skipped.push_back("interleaved (--microbatches " + std::to_string(microbatches) +
                        " is not a multiple of " + std::to_string(p) + " stages)");
      continue;
    }
    if (name == "interleaved" && layers > 0 && layers < p * chunks) {
      skipped.push_back("interleaved (--layers " + std::to_string(layers) + " cannot give " +
                        std::to_string(p) + " stages x " + std::to_string(chunks) +
                        " chunks a block each)");
      continue;
    }
    names.push_back(name);
  }
  return names;
}

void require_shape(const std::string& schedule, int stages, int microbatches, int chunks,
                   int layers) {
  const int p = stages, m = microbatches;
  const bool chunked = schedule == "interleaved";
  const int pieces = p * (chunked ? chunks : 1);
  if (layers > 0 && layers < pieces)
    throw UsageError("--layers " + std::to_string(layers) + " cannot give " +
                     (chunked
                          ? std::to_string(p) + " stages x " + std::to_string(chunks) + " chunks"
                          : std::to_string(p) + " stages") +
                     " a block each: use --layers " + std::to_string(pieces) + " or more");
  // Each op is an event to simulate, draw and keep: a million is plenty to look at.
  const double ops = 3.0 * p * m * chunks;
  if (ops > 1e6)
    throw UsageError(shardlab::format_number(ops, 3) +
                     " ops (stages x microbatches x chunks x 3): more than a million; use fewer");
  if (schedule == "interleaved" && m % p != 0)
    throw UsageError("the interleaved schedule takes microbatches p at a time: --microbatches " +
                     std::to_string(m) + " is not a multiple of " + std::to_string(p) + " stages");
}

// ---------------------------------------------------------------------------
// The formulas

std::string costs_text(const Schedule& s, const Costs& c) {
  using shardlab::format_number;
  std::string t = "t_f = " + format_number(c.forward) + ", ";
  if (s.split_backward())
    t += "t_b = " + format_number(c.backward) + " (B), t_w = " + format_number(c.weight) + " (W)";
  else
    t += "t_b = " + format_number(c.backward + c.weight) + " (B and W as one op)";
  return t;
}

double bubble_fraction_formula(int stages, int microbatches) {
  return static_cast<double>(stages - 1) / static_cast<double>(microbatches + stages - 1);
}

Formula formula_for(const Schedule& s, const Costs& c, int batch_microbatches) {
  const int p = s.stages, m = s.microbatches, v = s.chunks;
  Formula f;
  if (s.name == "naive" || s.name == "gpipe" || s.name == "1f1b") {
    f.text = s.name == "naive" ? "p-1" : "(p-1)/m";
    f.over_ideal = static_cast<double>(p - 1) / m;
    for (int st = 0; st < p; ++st)
      f.peak.push_back(s.name == "1f1b" ? std::min(p - st, m) : batch_microbatches);
  } else if (s.name == "interleaved" && c.backward == 2 * c.forward && c.weight == 0) {
    f.text = "(p-1)/(v m)";
    f.over_ideal = static_cast<double>(p - 1) / (v * m);
  } else if (s.name == "zb1" && c.forward == c.backward && c.backward == c.weight && m >= p) {
    f.text = "(p-1)/(3m)";
    f.over_ideal = static_cast<double>(p - 1) / (3.0 * m);
    f.peak.assign(static_cast<std::size_t>(p), static_cast<double>(p));
  }
  return f;
}

}  // namespace ch04
