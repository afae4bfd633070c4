// Chapter 09's profile of one training step (profile.hpp).
#include "profile.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "shardlab/format.hpp"
#include "timeline.hpp"

namespace ch09 {

using shardlab::Context;
using shardlab::Table;

namespace {

double total(const std::vector<Span>& spans, const std::string& axis) {
  double sum = 0;
  for (const Span& s : spans)
    if (s.axis == axis) sum += s.end - s.start;
  return sum;
}

/// Whether the spans of `axis` ("compute", "tp", ...) happen inside a layer's pass, so
/// inside a compute span: tp's allreduces, cp's ring, ep's all-to-alls.
bool nested(const std::string& axis) {
  for (const ch08::AxisInfo& info : ch08::kAxisInfo)
    if (info.name == axis) return info.inside_layer;
  return false;
}

/// The spans that do not nest in another (compute, dp, pp), in time order.
std::vector<Span> outer(const std::vector<Span>& spans) {
  std::vector<Span> out;
  for (const Span& s : spans)
    if (!nested(s.axis)) out.push_back(s);
  std::sort(out.begin(), out.end(), [](const Span& a, const Span& b) { return a.start < b.start; });
  return out;
}

std::int64_t ns(StepRecorder::Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

/// A chunk as the pipeline runs it, each pass recorded: F, B and W.
class Timed final : public nn::Layer {
 public:
  Timed(nn::Layer& inner, StepRecorder& recorder) : inner_(inner), recorder_(recorder) {}
  std::string name() const override { return inner_.name(); }
  nn::Forward forward(const Tensor& x) const override {
    const auto start = StepRecorder::Clock::now();
    nn::Forward f = inner_.forward(x);
    recorder_.note("F", "compute", start);
    return f;
  }
  Tensor backward_input(const Tensor& dy, nn::Saved& saved) const override {
    const auto start = StepRecorder::Clock::now();
    Tensor dx = inner_.backward_input(dy, saved);
    recorder_.note("B", "compute", start);
    return dx;
  }
  void backward_weight(nn::Saved& saved) override {
    const auto start = StepRecorder::Clock::now();
    inner_.backward_weight(saved);
    recorder_.note("W", "compute", start);
  }

 private:
  nn::Layer& inner_;
  StepRecorder& recorder_;
};

}  // namespace

StepRecorder::StepRecorder(Profile* profile, Communicator& world,
                           std::vector<std::pair<ch08::Axis, Communicator*>> axes)
    : profile_(profile), axes_(std::move(axes)) {
  // Every rank takes part in the agreement, recording or not: they all call it or none.
  if (!profile_) return;
  origin_ = world.agree(ns(Clock::now()), shardlab::ReduceOp::min);
  profile_->spans.clear();
  for (auto [axis, comm] : axes_) {
    const char* name = ch08::axis_name(axis).data();
    comm->time_calls([this, name](const Communicator::CallTimes& t) {
      if (!profile_) return;
      const std::string op(t.op == shardlab::Op::count_ ? "wait" : shardlab::op_name(t.op));
      Span s{std::string(name) + " " + op + (t.blocking ? "" : " wait"), name, seconds(t.waited),
             seconds(t.returned)};
      s.work_start = seconds(t.began);
      s.work_end = seconds(t.done);
      profile_->spans.push_back(std::move(s));
    });
  }
}

StepRecorder::~StepRecorder() {
  if (profile_)
    for (auto [axis, comm] : axes_) comm->time_calls({});
}

nn::Layer* StepRecorder::wrap(nn::Layer& chunk) {
  if (!profile_) return &chunk;
  timed_.push_back(std::make_unique<Timed>(chunk, *this));
  return timed_.back().get();
}

double StepRecorder::seconds(Clock::time_point t) const {
  return static_cast<double>(ns(t) - origin_) * 1e-9;
}

void StepRecorder::note(std::string name, const char* axis, Clock::time_point start) {
  if (!profile_) return;
  const double from = seconds(start), to = seconds(Clock::now());
  profile_->spans.push_back({std::move(name), axis, from, to, from, to});
}

void StepRecorder::finish() {
  if (!profile_) return;
  profile_->step = static_cast<double>(ns(Clock::now()) - origin_) * 1e-9;
  for (auto [axis, comm] : axes_) comm->time_calls({});
  profile_ = nullptr;
}

double Profile::seconds(ch08::Axis axis) const {
  return total(spans, std::string(ch08::axis_name(axis)));
}

namespace {

/// Disjoint intervals, in order.
using Intervals = std::vector<std::pair<double, double>>;

/// `v`'s union, as disjoint intervals in order.
Intervals merged(Intervals v) {
  std::sort(v.begin(), v.end());
  Intervals out;
  for (const auto& [a, b] : v) {
    if (b <= a) continue;
    if (!out.empty() && a <= out.back().second)
      out.back().second = std::max(out.back().second, b);
    else
      out.emplace_back(a, b);
  }
  return out;
}

/// The parts of `a` in `b` (keep = true) or not in `b` (keep = false); both merged.
Intervals overlay(const Intervals& a, const Intervals& b, bool keep) {
  Intervals out;
  for (auto [from, to] : a) {
    double at = from;
    for (const auto& [c, d] : b) {
      if (d <= at || c >= to) continue;
      if (!keep && c > at) out.emplace_back(at, c);
      if (keep) out.emplace_back(std::max(at, c), std::min(to, d));
      at = std::max(at, d);
    }
    if (!keep && at < to) out.emplace_back(at, to);
  }
  return out;
}

double length(const Intervals& v) {
  double sum = 0;
  for (const auto& [a, b] : v) sum += b - a;
  return sum;
}

/// The compute spans' union, and the union of the waits (every axis' calls).
std::pair<Intervals, Intervals> computing_and_waiting(const std::vector<Span>& spans) {
  Intervals computing, waiting;
  for (const Span& s : spans)
    (s.axis == "compute" ? computing : waiting).emplace_back(s.start, s.end);
  return {merged(computing), merged(waiting)};
}

}  // namespace

double Profile::hidden(ch08::Axis axis) const {
  // The axis' operations at work (a union: buckets in flight together count once) while
  // the rank computed: in a compute span, and not waiting on any axis inside it.
  Intervals work;
  for (const Span& s : spans)
    if (s.axis == ch08::axis_name(axis)) work.emplace_back(s.work_start, s.work_end);
  const auto [computing, waiting] = computing_and_waiting(spans);
  const Intervals busy = overlay(computing, waiting, false);
  return length(overlay(merged(work), busy, true));
}

double Profile::compute() const {
  // The compute spans less the waits inside them: tp's, cp's and ep's inside a layer's
  // pass, and dp's where a layer or Adam waits for a bucket (ZeRO-1's all-gathers).
  const auto [computing, waiting] = computing_and_waiting(spans);
  return length(overlay(computing, waiting, false));
}

double Profile::wait() const {
  auto [computing, waiting] = computing_and_waiting(spans);
  computing.insert(computing.end(), waiting.begin(), waiting.end());
  return std::max(0.0, step - length(merged(computing)));
}

void write_profile_trace(Context& ctx, const MeshShape& mesh, const Profile& mine,
                         const std::string& path) {
  const int r = ctx.rank();
  nlohmann::json events = nlohmann::json::array();
  const int comm_track = ctx.size() + r;  // under the rank's own
  auto add = [&](const std::string& name, const std::string& axis, double start, double end,
                 int tid) {
    events.push_back({{"name", name},
                      {"cat", axis},
                      {"ph", "X"},
                      {"pid", 0},
                      {"tid", tid},
                      {"ts", start * 1e6},
                      {"dur", (end - start) * 1e6}});
  };
  double at = 0;  // the gaps between the outer spans are waits
  for (const Span& s : outer(mine.spans)) {
    if (s.start > at) add("wait", "wait", at, s.start, r);
    at = std::max(at, s.end);
  }
  if (mine.step > at) add("wait", "wait", at, mine.step, r);
  for (const Span& s : mine.spans) {
    add(s.name, s.axis, s.start, s.end, r);
    if (s.axis != "compute" && s.work_end > s.work_start)
      add(s.name.substr(0, s.name.rfind(" wait")), s.axis, s.work_start, s.work_end, comm_track);
  }
  const Coords q = ch08::coords_of(mesh, r);
  std::string where;  // "pp 0, dp 1, tp 0"
  for (ch08::Axis a : ch08::shown_axes(mesh))
    where += (where.empty() ? "" : ", ") + std::string(ch08::axis_name(a)) + " " +
             std::to_string(q.at(a));
  events.push_back({{"name", "thread_name"},
                    {"ph", "M"},
                    {"pid", 0},
                    {"tid", r},
                    {"args", {{"name", "rank " + std::to_string(r) + " (" + where + ")"}}}});
  events.push_back({{"name", "thread_name"},
                    {"ph", "M"},
                    {"pid", 0},
                    {"tid", comm_track},
                    {"args", {{"name", "rank " + std::to_string(r) + " communication"}}}});
  for (int tid : {r, comm_track})
    events.push_back({{"name", "thread_sort_index"},
                      {"ph", "M"},
                      {"pid", 0},
                      {"tid", tid},
                      {"args", {{"sort_index", 2 * r + (tid == comm_track)}}}});
  const std::vector<std::string> all = ctx.comm().gather_strings(events.dump());
  if (r != 0) return;
  nlohmann::json trace = nlohmann::json::array();
  for (const std::string& text : all)
    for (auto& e : nlohmann::json::parse(text)) trace.push_back(std::move(e));
  ch04::write_trace(path, trace);
  ctx.say("wrote " + path + " (open it in ui.perfetto.dev or chrome://tracing)");
}

namespace {

/// The profile's diagnosis (the CS336 notes' two rules of thumb): the axes whose
/// communication takes over 30 % of some rank's step (`most`: each shown axis's largest
/// share), and the rank that computes under 70 % of its step.
std::string diagnosis(const std::vector<ch08::Axis>& axes, const std::vector<double>& most,
                      double worst_busy, int idlest) {
  std::string out;
  for (std::size_t k = 0; k < axes.size(); ++k)
    if (most[k] > 0.3)
      out += "\n  " + std::string(ch08::axis_name(axes[k])) + " communication takes " +
             shardlab::format_number(100 * most[k], 3) +
             " % of a rank's step (over 30 %): look at the " +
             std::string(ch08::axis_name(axes[k])) + " " +
             std::string(ch08::kAxisInfo[ch08::index_of(axes[k])].sends);
  if (worst_busy < 0.7)
    out += "\n  rank " + std::to_string(idlest) + " computes " +
           shardlab::format_number(100 * worst_busy, 3) +
           " % of its step (under 70 %): more microbatches, or another schedule";
  return out.empty() ? std::string("\n  nothing over 30 % or under 70 %") : out;
}

}  // namespace

void report_profile(Context& ctx, const MeshShape& mesh, const Profile& mine) {
  // The coordinates and the communication columns: the axes the mesh shows.
  const std::vector<ch08::Axis> shown = ch08::shown_axes(mesh);
  std::vector<double> values{mine.step, mine.compute(), mine.wait()};
  for (ch08::Axis a : shown) values.push_back(mine.seconds(a));
  for (ch08::Axis a : shown) values.push_back(mine.hidden(a));
  std::vector<std::vector<double>> every;
  for (double v : values) every.push_back(ctx.comm().gather_values(v));
  std::vector<std::string> columns{"rank"};
  for (ch08::Axis a : shown) columns.emplace_back(ch08::axis_name(a));
  columns.insert(columns.end(), {"step_ms", "compute"});
  for (ch08::Axis a : shown) {
    columns.push_back(std::string(ch08::axis_name(a)) + "_exposed");
    columns.push_back(std::string(ch08::axis_name(a)) + "_hidden");
  }
  columns.emplace_back("wait");
  Table t(columns);
  double worst_busy = 1;
  int idlest = 0;
  std::vector<double> most(shown.size(), 0.0);  // per axis: the largest share of any rank
  for (int r = 0; r < ctx.size(); ++r) {
    const auto i = static_cast<std::size_t>(r);
    const double step = every[0][i];
    const Coords q = ch08::coords_of(mesh, r);
    auto share = [&](std::size_t k) { return step > 0 ? every[k][i] / step : 0; };
    std::vector<shardlab::Cell> row{r};
    for (ch08::Axis a : shown) row.emplace_back(q.at(a));
    row.insert(row.end(), {1e3 * step, share(1)});
    for (std::size_t k = 0; k < shown.size(); ++k) {
      row.emplace_back(share(3 + k));
      row.emplace_back(share(3 + shown.size() + k));
      most[k] = std::max(most[k], share(3 + k));
    }
    row.emplace_back(share(2));
    t.add(row);
    if (share(1) < worst_busy) worst_busy = share(1), idlest = r;
  }
  ctx.report(t, "profile",
             "\nthe last step, rank by rank: the shares of its time spent computing, waiting "
             "for each axis' communication (exposed), and waiting for a neighbour stage or for "
             "the others; and the share of each axis' communication that ran while the rank "
             "computed (hidden, --overlap)");
  ctx.say("the profile's diagnosis (CS336 notes §6.1):" +
          diagnosis(shown, most, worst_busy, idlest));
}

}  // namespace ch09
