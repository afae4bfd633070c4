// Chapter 04: the schedules other than the exercise's 1F1B, and the checks every schedule
// must pass.
#include <algorithm>
#include <map>

#include "schedule.hpp"
#include "shardlab/check.hpp"
#include "shardlab/format.hpp"

namespace ch04 {

using shardlab::UsageError;

namespace {
std::string interleaved_cannot(int stages, int microbatches);
}  // namespace

bool Schedule::split_backward() const {
  for (const auto& stage : ops)
    for (const Op& op : stage)
      if (op.kind == OpKind::weight) return true;
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
    for (int j = 0; j < microbatches; ++j) stage.push_back({OpKind::forward, j});
    for (int j = 0; j < microbatches; ++j) stage.push_back({OpKind::backward, j});
  }
  return s;
}

Schedule interleaved(int stages, int microbatches, int chunks) {
  const int p = stages, m = microbatches, v = chunks;
  if (const std::string why = interleaved_cannot(p, m); !why.empty()) throw UsageError(why);
  Schedule s{"interleaved", p, m, v, {}};
  s.ops.resize(static_cast<std::size_t>(p));
  // The k-th forward of every stage: microbatches p at a time through chunk 0, the same p
  // through chunk 1, ..., then the next p. Backwards go through the chunks in reverse.
  const int total = m * v;
  auto microbatch = [&](int k) { return (k / (p * v)) * p + k % p; };
  auto forward = [&](int k) { return Op{OpKind::forward, microbatch(k), (k / p) % v}; };
  auto backward = [&](int k) { return Op{OpKind::backward, microbatch(k), v - 1 - (k / p) % v}; };
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
      if (x < m) ops.push_back({OpKind::forward, x});
      if (const int b = x - (p - 1 - st); b >= 0 && b < m) ops.push_back({OpKind::backward, b});
      if (const int w = x - (p - 1); w >= 0 && w < m) ops.push_back({OpKind::weight, w});
    }
  }
  return s;
}

Schedule make_schedule(const std::string& name, int stages, int microbatches, int chunks) {
  if (stages < 1) throw UsageError("a pipeline needs at least 1 stage");
  if (microbatches < 1) throw UsageError("--microbatches must be at least 1");
  if (chunks < 1) throw UsageError("--chunks must be at least 1");
  const ScheduleInfo& info = schedule_info(name);
  if (info.cannot)
    if (const std::string why = info.cannot(stages, microbatches); !why.empty())
      throw UsageError(why);
  Schedule s = info.build(stages, microbatches, chunks);
  s.name = info.name;
  return s;
}

std::string label(const Op& op, int chunks) {
  const char kind = op.kind == OpKind::forward ? 'F' : op.kind == OpKind::backward ? 'B' : 'W';
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
      const int want = op.kind == OpKind::forward ? 0 : op.kind == OpKind::backward ? 1 : 2;
      if (at == want) {
        ++at;
        continue;
      }
      const std::string first = op.kind == OpKind::forward    ? "the forward"
                                : op.kind == OpKind::backward ? "the backward"
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
        const Op missing{at == 0   ? OpKind::forward
                         : at == 1 ? OpKind::backward
                                   : OpKind::weight,
                         j, c};
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
  for (const ScheduleInfo& info : schedules()) {
    const std::string name = info.name;
    if (const std::string why = info.cannot ? info.cannot(p, microbatches) : ""; !why.empty()) {
      skipped.push_back(name + " (" + why + ")");
      continue;
    }
    if (info.chunked && layers > 0 && layers < p * chunks) {
      skipped.push_back(name + " (--layers " + std::to_string(layers) + " cannot give " +
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
  const bool chunked = schedule != "all" && schedule_info(schedule).chunked;
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
  if (schedule == "all") return;
  if (const ScheduleInfo& info = schedule_info(schedule); info.cannot)
    if (const std::string why = info.cannot(p, m); !why.empty()) throw UsageError(why);
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
  const ScheduleInfo& info = schedule_info(s.name);
  return info.formula ? info.formula(s, c, batch_microbatches) : Formula{};
}

// ---------------------------------------------------------------------------
// Every schedule, one row each

namespace {

/// GPipe's and 1F1B's bubble, (p - 1)/m whatever t_b / t_f (the naive schedule's m is 1),
/// with `held(stage)` microbatches in flight on each stage.
template <class Held>
Formula flush_formula(const Schedule& s, const char* text, Held held) {
  Formula f{text, static_cast<double>(s.stages - 1) / s.microbatches, {}};
  for (int st = 0; st < s.stages; ++st) f.peak.push_back(held(st));
  return f;
}

Formula naive_formula(const Schedule& s, const Costs&, int batch_microbatches) {
  return flush_formula(s, "p-1", [&](int) { return batch_microbatches; });
}

Formula gpipe_formula(const Schedule& s, const Costs&, int batch_microbatches) {
  return flush_formula(s, "(p-1)/m", [&](int) { return batch_microbatches; });
}

Formula one_f_one_b_formula(const Schedule& s, const Costs&, int) {
  return flush_formula(s, "(p-1)/m",
                       [&](int st) { return std::min(s.stages - st, s.microbatches); });
}

/// Megatron-LM §2.2.2: (p - 1)/(v m) with t_b = 2 t_f and no W.
Formula interleaved_formula(const Schedule& s, const Costs& c, int) {
  if (c.backward != 2 * c.forward || c.weight != 0) return {};
  return {"(p-1)/(v m)", static_cast<double>(s.stages - 1) / (s.chunks * s.microbatches), {}};
}

/// Zero Bubble §2.1: (p - 1)/(3 m) with t_f = t_b = t_w and m >= p; p held everywhere.
Formula zb_h1_formula(const Schedule& s, const Costs& c, int) {
  const int p = s.stages, m = s.microbatches;
  if (c.forward != c.backward || c.backward != c.weight || m < p) return {};
  return {"(p-1)/(3m)", static_cast<double>(p - 1) / (3.0 * m),
          std::vector<double>(static_cast<std::size_t>(p), static_cast<double>(p))};
}

std::string interleaved_cannot(int stages, int microbatches) {
  if (microbatches % stages == 0) return "";
  return "the interleaved schedule takes microbatches p at a time: --microbatches " +
         std::to_string(microbatches) + " is not a multiple of " + std::to_string(stages) +
         " stages";
}

}  // namespace

const std::vector<ScheduleInfo>& schedules() {
  static const std::vector<ScheduleInfo> all = {
      {"naive", [](int p, int, int) { return naive(p); }, naive_formula, false, true},
      {"gpipe", [](int p, int m, int) { return gpipe(p, m); }, gpipe_formula},
      {"1f1b", [](int p, int m, int) { return one_f_one_b(p, m); }, one_f_one_b_formula},
      {"interleaved", interleaved, interleaved_formula, true, false, interleaved_cannot},
      {"zb1", [](int p, int m, int) { return zb_h1(p, m); }, zb_h1_formula},
  };
  return all;
}

const ScheduleInfo& schedule_info(const std::string& name) {
  for (const ScheduleInfo& info : schedules())
    if (name == info.name) return info;
  std::string names;
  for (const std::string& n : schedule_names()) names += (names.empty() ? "" : ", ") + n;
  throw UsageError("unknown schedule '" + name + "' (" + names + ")");
}

std::vector<std::string> schedule_names(bool chunked, bool whole_batch) {
  std::vector<std::string> out;
  for (const ScheduleInfo& info : schedules())
    if ((chunked || !info.chunked) && (whole_batch || !info.whole_batch)) out.push_back(info.name);
  return out;
}

}  // namespace ch04
