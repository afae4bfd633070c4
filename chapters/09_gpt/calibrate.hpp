// Chapter 09 measures its machine once, and predicts its meshes from what it measured.
//
//   ch09_gpt --calibrate FILE             this machine's profile (chapter 08's machine.hpp)
//   ch09_gpt --benchmark --predict FILE   every mesh measured, beside its prediction
//
// The calibration times, on one core with the other ranks waiting: the GEMM at the
// capstone's products, STREAM's triad, the elementwise kernels and Adam's update. Then,
// every rank at once as training runs them, chapter 09's own layers at each shard shape
// the meshes of the ranks give (rows of a microbatch, tp, cp): a block's attention half
// (its cp ring inside) and MLP half (their tp sums inside), scaled to what a block takes
// in a stack of the model's L blocks (a stage's backward reads what its forward kept long
// before), the first stage's embedding, the last stage's head and loss; forward, input
// gradient and weight gradient apart. How much slower the ranks compute together than
// their turns on the cores would make them ("sharing"). And each collective's time over
// four sizes, fitted to alpha + S/beta, per group size, on the run's backend (threads, or
// MPI under mpirun; across hosts, the link between them too).
//
// The prediction (predict.cpp) writes out every rank's step as the program runs it: its
// stage's ops in chapter 04's schedule order, each op its layers' measured costs with the
// points where its tp group or cp ring meets, pp's messages, ep's all-to-alls, then dp's
// gradient sums (with --overlap, all but the last bucket in the background during the
// last backward), the tied embedding's and the norm's sums, and Adam. Then the ranks run
// together on paper: a collective starts when the last member of its group comes, a
// receive ends when its message has, and whatever has work (ranks, and the communication
// overlap put in the background) shares the machine's cores evenly. The step is when the
// last rank is done.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "machine.hpp"
#include "shardlab/launch.hpp"
#include "train.hpp"

namespace ch09 {

/// The sizes one rank's compute has on a mesh: the rows of its microbatch (its tokens,
/// b T / c), and the tp and cp it is cut by.
struct Shard {
  std::int64_t rows = 0;  ///< tokens of a microbatch on the rank, b T / c
  int tp = 1;             ///< the tensor-parallel ranks its layers are cut over
  int cp = 1;             ///< the context-parallel ranks its sequences are cut over
  /// Ordered (a set of shards), equal when all three are.
  auto operator<=>(const Shard&) const = default;
};
/// The Shard of `c`'s model on `c`'s mesh.
Shard shard_of(const TrainConfig& c);
/// The name a cost of `what` for `s` has in the profile: "block_forward r512 t2 c1".
std::string cost_key(const std::string& what, const Shard& s);

/// --calibrate FILE: the machine's profile, for `c`'s model on every mesh of the ranks
/// (benchmark_meshes), written to `path` by rank 0; a summary table.
void calibrate(shardlab::Context& ctx, const TrainConfig& c, const std::string& path);

/// The ranks' core groups (m.core_group, m.group_cores) from each rank's machine
/// (`kernels`, any name) and CPUs (`cpus`, "0,1"): ranks on one machine whose CPUs overlap
/// share a group, its cores the CPUs of all of them. None where a rank's CPUs are unknown.
void group_cores(const std::vector<std::string>& kernels, const std::vector<std::string>& cpus,
                 ch08::MachineProfile& m);

/// One mesh's step on paper: its parts, seconds.
struct StepPrediction {
  double step_s = 0;      ///< the prediction: the ranks together on the machine's cores
  double pipeline_s = 0;  ///< the same with a core for every rank
  double shared_s = 0;    ///< every rank's computation over the cores: the step's floor
  double compute_s = 0;   ///< the busiest rank's computation
  double exposed_s = 0;   ///< the ranks' mean time blocked by communication, every axis
  /// Per axis, the ranks' mean time blocked by it: waiting for their group, a message, or
  /// in the collective.
  ch08::PerAxis<double> exposed{};
};
/// The prediction for `c` (its mesh, schedule, recomputation, overlap) on machine `m`;
/// Error when `m` lacks a cost this mesh needs (calibrated for another model).
StepPrediction predict_step(const TrainConfig& c, const ch08::MachineProfile& m);

/// --mesh auto: every mesh of the ranks that can run `c`'s model (benchmark_meshes),
/// predicted on `machine`; sets c.mesh to the fastest, and rank 0 says why (the five
/// fastest and their predicted steps; JSON mesh_auto).
void choose_mesh(shardlab::Context& ctx, TrainConfig& c, const ch08::MachineProfile& machine);

/// Spearman's rank correlation of two lists (ties at their mean rank); 0 below 2 items.
double spearman(const std::vector<double>& a, const std::vector<double>& b);

}  // namespace ch09
