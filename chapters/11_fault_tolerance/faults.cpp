// Chapter 11: the failures injected, and the goodput of a run that recovered.
#include "faults.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "shardlab/check.hpp"
#include "shardlab/format.hpp"
#include "shardlab/launch.hpp"
#include "shardlab/results.hpp"

namespace ch11 {

using shardlab::require_usage;

namespace {

/// `text` as a whole number from 0 with at most six digits and no leading zero; -1 when it
/// is not one.
int whole(const std::string& text) {
  if (text.empty() || text.size() > 6 || (text.size() > 1 && text[0] == '0') ||
      text.find_first_not_of("0123456789") != std::string::npos)
    return -1;
  return std::stoi(text);
}

/// `text` as a factor: digits, at most three before a point and six after; -1 when not.
double factor(const std::string& text) {
  const std::size_t point = text.find('.');
  const std::string in = text.substr(0, point),
                    frac = point == std::string::npos ? "0" : text.substr(point + 1);
  const bool digits = !in.empty() && in.size() <= 3 && !frac.empty() && frac.size() <= 6 &&
                      in.find_first_not_of("0123456789") == std::string::npos &&
                      frac.find_first_not_of("0123456789") == std::string::npos;
  return digits ? std::stod(in + "." + frac) : -1;
}

}  // namespace

Fault parse_fault(const std::string& spec) {
  const std::string forms =
      "--inject " + spec +
      ": kill@RANK@STEP, hang@RANK@STEP, stall@RANK@STEP, nan@RANK@STEP, flip@RANK@STEP or "
      "slow@RANK@FACTOR "
      "(RANK and STEP whole numbers from 0, FACTOR from 1 to 100: kill@3@10, slow@2@3), or none";
  // KIND@RANK@VALUE: exactly two @.
  const std::size_t first = spec.find('@'), second = spec.find('@', first + 1);
  require_usage(first != std::string::npos && second != std::string::npos &&
                    spec.find('@', second + 1) == std::string::npos,
                forms);
  const std::string kind = spec.substr(0, first), rank = spec.substr(first + 1, second - first - 1),
                    value = spec.substr(second + 1);
  Fault f;
  f.spec = spec;
  f.rank = whole(rank);
  require_usage(f.rank >= 0, forms);
  if (kind == "slow") {
    f.kind = Fault::Kind::slow;
    f.factor = factor(value);
    require_usage(f.factor >= 1 && f.factor <= 100, forms);
    return f;
  }
  require_usage(
      kind == "kill" || kind == "hang" || kind == "stall" || kind == "nan" || kind == "flip",
      forms);
  f.kind = kind == "kill"    ? Fault::Kind::kill
           : kind == "hang"  ? Fault::Kind::hang
           : kind == "stall" ? Fault::Kind::stall
           : kind == "nan"   ? Fault::Kind::nan
                             : Fault::Kind::flip;
  f.step = whole(value);
  require_usage(f.step >= 0, forms);
  return f;
}

std::vector<Fault> parse_faults(const std::vector<std::string>& specs, int ranks, int steps) {
  std::vector<Fault> out;
  if (specs.size() == 1 && specs[0] == "none") return out;
  for (const std::string& spec : specs) {
    const Fault f = parse_fault(spec);
    require_usage(f.rank < ranks, "--inject " + spec + ": rank " + std::to_string(f.rank) +
                                      ", but the run has ranks 0 to " + std::to_string(ranks - 1));
    require_usage(f.step < steps, "--inject " + spec + ": step " + std::to_string(f.step) +
                                      ", but the run has steps 0 to " + std::to_string(steps - 1));
    out.push_back(f);
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const Fault& a, const Fault& b) { return a.step < b.step; });
  return out;
}

std::vector<Fault> draw_failures(double mtbf_steps, std::uint64_t seed, int ranks, int steps) {
  std::mt19937_64 draw(seed);
  auto uniform = [&] { return static_cast<double>(draw() >> 11) * 0x1.0p-53; };  // [0, 1)
  std::vector<Fault> out;
  for (double at = -std::log(1 - uniform()) * mtbf_steps; at < steps;
       at += -std::log(1 - uniform()) * mtbf_steps) {
    Fault f;
    f.rank = static_cast<int>(uniform() * ranks);
    f.step = static_cast<int>(at);
    f.spec = "kill@" + std::to_string(f.rank) + "@" + std::to_string(f.step);
    out.push_back(f);
  }
  return out;
}

std::uint64_t checksum(const shardlab::Tensor& t) {
  const shardlab::Tensor host = t.to(shardlab::Memory::host);
  const auto* bytes = static_cast<const unsigned char*>(host.raw());
  const std::size_t n = static_cast<std::size_t>(host.size()) * shardlab::dtype_size(host.dtype());
  // FNV-1a's offset basis and prime, over 8 bytes at a time (then the last few).
  std::uint64_t h = 14695981039346656037ull, word = 0;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    std::memcpy(&word, bytes + i, 8);
    h = (h ^ word) * 1099511628211ull;
  }
  for (; i < n; ++i) h = (h ^ bytes[i]) * 1099511628211ull;
  return h;
}

ReplicaVote vote(const std::vector<std::uint64_t>& sums) {
  ReplicaVote v;
  const int n = static_cast<int>(sums.size());
  for (int i = 0; i < n && v.healthy < 0; ++i)
    if (2 * std::count(sums.begin(), sums.end(), sums[static_cast<std::size_t>(i)]) > n)
      v.healthy = i;
  for (int i = 0; i < n; ++i)
    if (v.healthy < 0 ? std::count(sums.begin(), sums.end(), sums[std::size_t(i)]) < n
                      : sums[std::size_t(i)] != sums[std::size_t(v.healthy)])
      v.odd.push_back(i);
  return v;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  if (n == 0) return 0;
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

std::vector<int> stragglers(const std::vector<double>& busy, double over) {
  const double typical = median(busy);
  std::vector<int> out;
  for (std::size_t r = 0; r < busy.size(); ++r)
    if (busy[r] > over * typical) out.push_back(static_cast<int>(r));
  return out;
}

Goodput goodput_of(const std::vector<Attempt>& attempts) {
  Goodput g;
  if (attempts.empty()) return g;
  g.wall = attempts.back().end - attempts.front().start;
  // The attempt whose result of each step stands: the last that completed it.
  std::map<int, std::size_t> kept;
  for (std::size_t a = 0; a < attempts.size(); ++a)
    for (int step : attempts[a].steps) kept[step] = a;
  for (std::size_t a = 0; a < attempts.size(); ++a) {
    const Attempt& at = attempts[a];
    for (std::size_t i = 0; i < at.steps.size(); ++i) {
      const bool skipped =
          std::find(at.skipped.begin(), at.skipped.end(), at.steps[i]) != at.skipped.end();
      (kept[at.steps[i]] == a && !skipped ? g.useful : g.lost) += at.step_s[i];
    }
    for (double c : at.checkpoint_s) g.checkpoints += c;
    g.checks += at.check_s;
  }
  // The rest: noticing a failure (a --timeout for a rank that hangs), starting the ranks
  // again, building the model, loading the checkpoint.
  g.restart = std::max(0.0, g.wall - g.useful - g.lost - g.checkpoints - g.checks);
  return g;
}

std::vector<int> skipped_steps(const std::vector<Attempt>& attempts) {
  std::map<int, bool> skipped;  // the last attempt that trained each step has the say
  for (const Attempt& at : attempts)
    for (int step : at.steps)
      skipped[step] = std::find(at.skipped.begin(), at.skipped.end(), step) != at.skipped.end();
  std::vector<int> out;
  for (const auto& [step, yes] : skipped)
    if (yes) out.push_back(step);
  return out;
}

void report_goodput(shardlab::Context& ctx, const std::vector<Attempt>& attempts) {
  shardlab::Table table(
      {"attempt", "went_on_from", "steps_trained", "checkpoints", "seconds", "ended"});
  for (std::size_t a = 0; a < attempts.size(); ++a) {
    const Attempt& at = attempts[a];
    table.add({int(a), at.resumed, int(at.steps.size()), int(at.checkpoint_s.size()),
               at.end - at.start, at.failure.empty() ? "finished" : at.failure});
  }
  ctx.report(table, "attempts",
             "\nthe attempts: the step each went on from, what it did, how it ended");
  const Goodput g = goodput_of(attempts);
  shardlab::Table time({"part", "seconds", "share"});
  for (const auto& [part, seconds] : {std::pair{"useful steps", g.useful},
                                      {"steps lost (trained again, or skipped)", g.lost},
                                      {"checkpoints", g.checkpoints},
                                      {"replica checks", g.checks},
                                      {"starting, noticing, restarting, loading", g.restart}})
    time.add({part, seconds, g.wall > 0 ? seconds / g.wall : 0.0});
  time.add({"wall", g.wall, 1.0});
  ctx.report(time, "goodput",
             "\nwhere the wall time went: the goodput (useful steps over wall time) is " +
                 shardlab::format_number(100 * g.fraction(), 3) + " %");
  ctx.json()["goodput_fraction"] = g.fraction();
  // δ, the checkpoint's cost to the training, as this run paid it.
  std::vector<double> blocked, written;
  for (const Attempt& at : attempts) {
    blocked.insert(blocked.end(), at.checkpoint_s.begin(), at.checkpoint_s.end());
    written.insert(written.end(), at.written_s.begin(), at.written_s.end());
  }
  if (blocked.empty()) return;
  const std::string each = shardlab::format_number(1e3 * median(blocked), 3) + " ms";
  ctx.say(written.empty()
              ? "a checkpoint stopped training for " + each +
                    " (the median; written there and then)"
              : "a checkpoint stopped training for " + each +
                    " (the median: the copy to memory, and any wait for the save before it); "
                    "written in " +
                    shardlab::format_number(1e3 * median(written), 3) + " ms in the background");
  ctx.json()["checkpoint_blocked_s"] = median(blocked);
  if (!written.empty()) ctx.json()["checkpoint_written_s"] = median(written);
}

shardlab::FlightVerdict compare_flight_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::map<int, shardlab::FlightRecord> found;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    const std::string file = entry.path().filename().string();  // rank_R.json
    const bool named = file.size() > 10 && file.rfind("rank_", 0) == 0 &&
                       file.compare(file.size() - 5, 5, ".json") == 0;
    const int rank = named ? whole(file.substr(5, file.size() - 10)) : -1;
    if (rank < 0) continue;
    std::ifstream in(entry.path());
    nlohmann::json j;
    try {
      in >> j;
    } catch (const nlohmann::json::exception& e) {
      throw shardlab::UsageError("--compare-flights: " + entry.path().string() + " is not JSON (" +
                                 e.what() + ")");
    }
    found[rank] = shardlab::flight_record_from_json(j);
  }
  require_usage(!error && !found.empty(),
                "--compare-flights " + dir + ": no flight records (rank_R.json) there");
  // The job's size: the largest world rank any record's groups hold.
  int ranks = 0;
  for (const auto& [rank, record] : found) {
    ranks = std::max(ranks, rank + 1);
    for (const auto& [group, members] : record.groups)
      for (int q : members) ranks = std::max(ranks, q + 1);
  }
  std::vector<std::optional<shardlab::FlightRecord>> records(static_cast<std::size_t>(ranks));
  for (auto& [rank, record] : found) records[static_cast<std::size_t>(rank)] = std::move(record);
  return shardlab::compare_flights(records);
}

std::string first_difference(const std::string& a, const std::string& b) {
  namespace fs = std::filesystem;
  auto bytes = [](const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  for (const auto& entry : fs::directory_iterator(a)) {
    const fs::path other = fs::path(b) / entry.path().filename();
    if (!fs::exists(other) || bytes(entry.path()) != bytes(other))
      return entry.path().filename().string();
  }
  return "";
}

}  // namespace ch11
