// A machine as measured: see machine.hpp.
#include "machine.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "shardlab/check.hpp"
#include "shardlab/format.hpp"

namespace ch08 {

using nlohmann::json;
using shardlab::require_usage;

double LinkFit::seconds(double bytes) const {
  return bytes <= 0 ? 0.0 : alpha_s + bytes / (beta_GBps * 1e9);
}

LinkFit fit_link(const std::vector<std::pair<double, double>>& points) {
  shardlab::require(points.size() >= 2, "fit_link: two points at least");
  // Weighted by 1/t^2: each point's relative error counts alike, so that the small sizes
  // (alpha) weigh as much as the large (beta).
  double sw = 0, sx = 0, sy = 0;
  for (auto [x, y] : points) {
    const double w = 1 / (y * y);
    sw += w, sx += w * x, sy += w * y;
  }
  const double mx = sx / sw, my = sy / sw;
  double sxx = 0, sxy = 0;
  for (auto [x, y] : points) {
    const double w = 1 / (y * y);
    sxx += w * (x - mx) * (x - mx), sxy += w * (x - mx) * (y - my);
  }
  shardlab::require(sxx > 0, "fit_link: the points need two sizes");
  // A slope at or below 0 (a noisy small range): the largest size's own rate.
  double slope = sxy / sxx;
  if (!(slope > 0)) {
    auto largest = *std::max_element(points.begin(), points.end());
    slope = largest.second / largest.first;
  }
  return {.alpha_s = std::max(0.0, my - slope * mx), .beta_GBps = 1.0 / slope / 1e9};
}

double MachineProfile::gemm_rate(double m, double n, double k) const {
  double best = std::numeric_limits<double>::infinity(), rate = gemm_gflops;
  for (const GemmRate& g : gemm) {
    const double d = std::pow(std::log(m / g.m), 2) + std::pow(std::log(n / g.n), 2) +
                     std::pow(std::log(k / g.k), 2);
    if (d < best) best = d, rate = g.gflops;
  }
  return rate;
}

const LinkFit& MachineProfile::link(const std::string& op, int group) const {
  auto it = links.find(op);
  shardlab::require(it != links.end() && !it->second.empty(),
                    "the machine profile has no " + op + " (run ch09_gpt --calibrate again)");
  const LinkFit* best = nullptr;
  double distance = 0;
  for (const auto& [size, fit] : it->second) {
    const double d = std::fabs(std::log(double(size) / group));
    if (!best || d < distance) best = &fit, distance = d;
  }
  return *best;
}

double MachineProfile::cost(const std::string& name) const {
  auto it = costs.find(name);
  shardlab::require(it != costs.end(), "the machine profile has no cost '" + name +
                                           "': calibrate with this model (ch09_gpt --calibrate)");
  return it->second;
}

double CoreGroups::turns() const {
  double share = 1;
  for (std::size_t g = 0; g < cores.size(); ++g)
    if (ranks[g] > 0) share = std::min(share, double(std::min(ranks[g], cores[g])) / ranks[g]);
  return share;
}

int CoreGroups::cores_in_use() const {
  int n = 0;
  for (std::size_t g = 0; g < cores.size(); ++g) n += std::min(ranks[g], cores[g]);
  return std::max(1, n);
}

CoreGroups MachineProfile::core_groups(int R) const {
  CoreGroups out;
  if (int(core_group.size()) == R && !group_cores.empty()) {
    out.of = core_group;
    out.cores = group_cores;
  } else {
    const int per_machine = std::clamp(ranks_per_machine > 0 ? ranks_per_machine : R, 1, R);
    for (int r = 0; r < R; ++r) out.of.push_back(r / per_machine);
    out.cores.assign(std::size_t((R + per_machine - 1) / per_machine), std::max(1, cores));
  }
  out.ranks.assign(out.cores.size(), 0);
  for (int g : out.of) ++out.ranks[std::size_t(g)];
  return out;
}

json to_json(const MachineProfile& m) {
  json j;
  j["cpu"] = m.cpu;
  j["cores"] = m.cores;
  j["clock_ghz"] = m.clock_ghz;
  j["fp32_lanes"] = m.fp32_lanes;
  j["fma_units"] = m.fma_units;
  j["peak_gflops_per_core"] = m.peak_gflops_per_core();
  j["memory_bytes"] = m.memory_bytes;
  j["gemm_gflops"] = m.gemm_gflops;
  j["triad_GBps"] = m.triad_GBps;
  j["gemm"] = json::array();
  for (const GemmRate& g : m.gemm)
    j["gemm"].push_back({{"m", g.m}, {"n", g.n}, {"k", g.k}, {"gflops", g.gflops}});
  j["elementwise_GBps"] = m.elementwise;
  j["costs_s"] = m.costs;
  j["model"] = m.model;
  j["backend"] = m.backend;
  j["ranks"] = m.ranks;
  j["ranks_per_host"] = m.ranks_per_host;
  j["ranks_per_machine"] = m.ranks_per_machine;
  if (!m.core_group.empty()) {
    j["core_group"] = m.core_group;
    j["group_cores"] = m.group_cores;
  }
  json links = json::object();
  for (const auto& [op, groups] : m.links)
    for (const auto& [size, fit] : groups)
      links[op][std::to_string(size)] = {{"alpha_us", fit.alpha_s * 1e6},
                                         {"beta_GBps", fit.beta_GBps}};
  j["links"] = links;
  return j;
}

namespace {

double positive(const json& j, const std::string& key, const std::string& where) {
  require_usage(j.contains(key) && j[key].is_number(), where + ": no number '" + key + "'");
  const double x = j[key].get<double>();
  require_usage(std::isfinite(x) && x > 0, where + ": '" + key + "' must be positive (got " +
                                               shardlab::format_number(x) + ")");
  return x;
}

int whole(const json& j, const std::string& key, const std::string& where) {
  const double x = positive(j, key, where);
  require_usage(x == std::floor(x) && x < 1e6, where + ": '" + key + "' must be a whole number");
  return int(x);
}

}  // namespace

MachineProfile machine_from_json(const json& j, const std::string& where) {
  require_usage(j.is_object(), where + ": not a machine profile (a JSON object)");
  MachineProfile m;
  m.cpu = j.value("cpu", std::string("unknown"));
  m.cores = whole(j, "cores", where);
  m.clock_ghz = positive(j, "clock_ghz", where);
  m.fp32_lanes = whole(j, "fp32_lanes", where);
  m.fma_units = whole(j, "fma_units", where);
  m.memory_bytes = positive(j, "memory_bytes", where);
  m.gemm_gflops = positive(j, "gemm_gflops", where);
  m.triad_GBps = positive(j, "triad_GBps", where);
  if (j.contains("gemm"))
    for (const json& g : j["gemm"])
      m.gemm.push_back({whole(g, "m", where), whole(g, "n", where), whole(g, "k", where),
                        positive(g, "gflops", where)});
  if (j.contains("elementwise_GBps"))
    for (const auto& [name, _] : j["elementwise_GBps"].items())
      m.elementwise[name] = positive(j["elementwise_GBps"], name, where);
  if (j.contains("costs_s"))
    for (const auto& [name, _] : j["costs_s"].items())
      m.costs[name] = positive(j["costs_s"], name, where);
  m.model = j.value("model", std::string());
  m.backend = j.value("backend", std::string("threads"));
  m.ranks = whole(j, "ranks", where);
  m.ranks_per_host = whole(j, "ranks_per_host", where);
  m.ranks_per_machine =
      j.contains("ranks_per_machine") ? whole(j, "ranks_per_machine", where) : m.ranks_per_host;
  if (j.contains("core_group") || j.contains("group_cores")) {
    auto whole_numbers = [&](const std::string& key, int least) {
      require_usage(j.contains(key) && j[key].is_array(),
                    where + ": 'core_group' and 'group_cores' come together, each an array");
      std::vector<int> out;
      for (const json& x : j[key]) {
        require_usage(x.is_number_integer() && x.get<int>() >= least,
                      where + ": '" + key + "' holds whole numbers from " + std::to_string(least));
        out.push_back(x.get<int>());
      }
      return out;
    };
    m.core_group = whole_numbers("core_group", 0);
    m.group_cores = whole_numbers("group_cores", 1);
    require_usage(int(m.core_group.size()) == m.ranks,
                  where + ": 'core_group' must name a group for each of the 'ranks'");
    for (int g : m.core_group)
      require_usage(g < int(m.group_cores.size()),
                    where + ": 'core_group' names a group 'group_cores' does not have");
  }
  require_usage(!j.contains("links") || j["links"].is_object(),
                where + ": 'links' must be an object (operation -> group size -> fit)");
  const json links = j.value("links", json::object());
  for (const auto& [op, groups] : links.items())
    for (const auto& [size, fit] : groups.items()) {
      const std::string at = where + ": links." + op + "." + size;
      int group = 0;
      try {
        group = std::stoi(size);
      } catch (const std::exception&) {
      }
      require_usage(group >= 1, at + ": the group size must be a whole number");
      require_usage(fit.contains("alpha_us") && fit["alpha_us"].is_number() &&
                        fit["alpha_us"].get<double>() >= 0,
                    at + ": 'alpha_us' must be 0 or more");
      m.links[op][group] = {.alpha_s = fit["alpha_us"].get<double>() * 1e-6,
                            .beta_GBps = positive(fit, "beta_GBps", at)};
    }
  return m;
}

MachineProfile load_machine(const std::string& path, const std::string& flag) {
  std::ifstream in(path);
  require_usage(bool(in), flag + " " + path + ": cannot read it");
  json j;
  try {
    in >> j;
  } catch (const json::exception&) {
    throw shardlab::UsageError(flag + " " + path +
                               ": not JSON (write one with ch09_gpt --calibrate)");
  }
  return machine_from_json(j, flag + " " + path);
}

void save_machine(const MachineProfile& m, const std::string& path) {
  std::ofstream out(path);
  require_usage(bool(out), "--calibrate " + path + ": cannot write it");
  out << to_json(m).dump(2) << "\n";
  require_usage(bool(out), "--calibrate " + path + ": writing failed");
}

ClusterSpec cluster_of(const MachineProfile& m) {
  ClusterSpec c;
  c.name = "machine";
  const int per_host = std::max(1, m.ranks_per_host);
  c.gpus_per_node = per_host;
  c.nics_per_node = 1;  // a host's one network card
  c.gpu_memory_bytes = m.memory_bytes / per_host;
  c.peak_tflops = m.peak_gflops_per_core() / 1e3;
  c.achieved_tflops = std::min(m.gemm_gflops, m.peak_gflops_per_core()) / 1e3;
  // Inside a host: the allreduce's beta (one rank measured nothing: memory's triad).
  c.nvlink_GBps = m.links.count("allreduce")
                      ? m.link("allreduce", std::min(per_host, std::max(2, m.ranks))).beta_GBps
                      : m.triad_GBps;
  // Between hosts: the cluster's link shared by the host's ranks; on one host, the same.
  c.network_GBps = m.links.count("link") ? m.link("link", 2).beta_GBps / per_host : c.nvlink_GBps;
  c.cores_per_node = m.cores;
  c.source = "measured: " + m.cpu + ", " + std::to_string(m.cores) + " cores, " + m.backend +
             " (ch09_gpt --calibrate)";
  return c;
}

}  // namespace ch08
