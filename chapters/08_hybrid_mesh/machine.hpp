// A machine as measured: chapter 09's `--calibrate` times this computer once (its cores,
// its GEMM at the capstone's shapes, its memory's bandwidth, the capstone's own layers, and
// each collective's latency and bandwidth on the backend it ran) and writes the profile as
// JSON; the planner reads it back (`ch08_plan --machine FILE`, `ch09_gpt --predict FILE`)
// instead of a GPU preset's datasheet numbers.
//
// A link's time is Hockney's α-β model: t(S) = α + S / β for S bytes a rank hands to the
// collective (the buffer's size, as nccl-tests' -b/-e give it), α the latency, β the
// rate S / t tends to; fitted per operation and group size.
#pragma once

#include <map>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "planner.hpp"  // ClusterSpec

namespace ch08 {

/// Hockney's t(S) = α + S / β.
struct LinkFit {
  double alpha_s = 0;    ///< α, seconds
  double beta_GBps = 0;  ///< β, GB/s (1e9 bytes)
  /// α + bytes / β, seconds (0 bytes: 0, nothing sent).
  double seconds(double bytes) const;
};

/// The least-squares line through (bytes, seconds) points, each weighted by 1/seconds^2
/// (their relative errors alike): α its intercept (at least 0),
/// β its slope's inverse. Two points at least, of two sizes.
LinkFit fit_link(const std::vector<std::pair<double, double>>& bytes_seconds);

/// One product's measured rate: C (m x n) = A (m x k) B (k x n), best of a few rounds.
struct GemmRate {
  int m = 0;          ///< rows of A and C
  int n = 0;          ///< columns of B and C
  int k = 0;          ///< the summed dimension
  double gflops = 0;  ///< 2 m n k / seconds / 1e9
};

/// The ranks as they share cores: ranks whose CPU sets overlap (on one machine) take turns
/// on that set's cores; ranks in different groups never slow each other down.
struct CoreGroups {
  std::vector<int> of;     ///< rank -> its group
  std::vector<int> cores;  ///< group -> its cores
  std::vector<int> ranks;  ///< group -> its ranks
  /// The share of a core each rank of the most crowded group gets while every rank
  /// computes: min over the groups of min(ranks, cores) / ranks.
  double turns() const;
  /// The cores the ranks keep busy while all compute: the sum of min(ranks, cores).
  int cores_in_use() const;
};

/// What `ch09_gpt --calibrate` measured (see the top).
struct MachineProfile {
  std::string cpu;             ///< the processor's name (/proc/cpuinfo)
  int cores = 0;               ///< the cores this process may run on
  double clock_ghz = 0;        ///< the highest clock the processor reports
  int fp32_lanes = 0;          ///< float lanes of its widest FMA (AVX-512 16, AVX2 8, else 4)
  int fma_units = 2;           ///< FMA units a core (not read from the CPU: 2 on current x86)
  double memory_bytes = 0;     ///< the machine's memory
  double gemm_gflops = 0;      ///< one core's best GEMM (512^3), GFLOP/s
  double triad_GBps = 0;       ///< STREAM's triad a = b + s c on one core, GB/s
  std::vector<GemmRate> gemm;  ///< the capstone's products, one core
  std::map<std::string, double> elementwise;  ///< kernel -> GB/s read and written, one core
  std::map<std::string, double> costs;        ///< named measured times, seconds (one core)
  std::string backend;                        ///< the collectives' backend: threads or mpi
  int ranks = 0;                              ///< the ranks the links were measured with
  int ranks_per_host = 0;                     ///< of them on one host (its network name)
  int ranks_per_machine = 0;     ///< of them on one machine (its kernel): sharing its cores
  int first_elsewhere = 0;       ///< the first rank on another host than rank 0's; 0: none
  std::vector<int> core_group;   ///< rank -> its core group as it ran (empty: see core_groups)
  std::vector<int> group_cores;  ///< core group -> its cores
  std::map<std::string, std::map<int, LinkFit>> links;  ///< operation -> group size -> fit
  std::string model;  ///< the model the costs are of (chapter 09's describe)

  /// cores x clock x lanes x FMA units x 2: FLOP/s / 1e9 of the cores at their peak,
  /// the denominator of PaLM's MFU.
  double peak_gflops() const { return cores * peak_gflops_per_core(); }
  /// clock x lanes x FMA units x 2.
  double peak_gflops_per_core() const { return clock_ghz * fp32_lanes * fma_units * 2; }
  /// The measured rate of the product nearest m x n x k (in log space); gemm_gflops
  /// without any.
  double gemm_rate(double m, double n, double k) const;
  /// The fit of `op` over `group` ranks, or over the nearest group measured; Error when
  /// `op` was never measured.
  const LinkFit& link(const std::string& op, int group) const;
  /// costs[name]; Error naming the calibration to run when it is missing.
  double cost(const std::string& name) const;
  /// How `R` ranks share cores: as measured where the profile holds R ranks' groups; else
  /// ranks_per_machine consecutive ranks (all R without it) a machine of `cores` cores.
  CoreGroups core_groups(int R) const;
};

/// The profile as JSON (the file --calibrate writes; links' alpha in microseconds).
nlohmann::json to_json(const MachineProfile& m);
/// UsageError (one line, naming `where`) when a field is missing or not a positive number.
MachineProfile machine_from_json(const nlohmann::json& j, const std::string& where);
/// Reads and checks a profile; UsageError (naming `flag` and the file) when the file is
/// missing or not one.
MachineProfile load_machine(const std::string& path, const std::string& flag = "--machine");
/// Writes the profile, indented.
void save_machine(const MachineProfile& m, const std::string& path);

/// The machine as the planner's cluster: a core per "GPU" (its measured GEMM rate the
/// achieved X, its peak the theoretical one), the host's ranks a node, the allreduce's β
/// inside it and the cluster link's ("link") between hosts when measured (else the same),
/// the memory shared by the cores.
ClusterSpec cluster_of(const MachineProfile& m);

}  // namespace ch08
