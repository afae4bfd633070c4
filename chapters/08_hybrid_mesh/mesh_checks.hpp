// The two checks every mesh run prints (chapters 08 and 09): the mesh against one device,
// held to what the order of the additions alone does there; and the bytes each rank sent
// on each axis against the axis' formula. And, when the ranks run on several hosts, which
// groups cross between them and what a step sends over the links.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlp_stack.hpp"
#include "shardlab/launch.hpp"

namespace ch08 {

/// One quantity of a run, on the mesh against one device.
struct Agreement {
  std::string what;                       ///< for the table and the verdict: "the final weights"
  double diff = 0;                        ///< the mesh's against one device's, relative
  double order_alone = 0;                 ///< one device's against itself, the batch in pieces
  std::optional<double> one_device = {};  ///< one device's value, when one number says it
  std::optional<double> mesh = {};        ///< the mesh's value, when one number says it
  /// Held to its own order alone, and to at least this (0: exactly equal), whatever the
  /// table's Tolerance says (a quantity of another kind than the rest: a count).
  std::optional<double> own_least = {};
};

/// How close is equal: within `times` x what the order alone does, never closer than
/// `least`; `worst_of_all`: every row held to the worst row's order alone.
struct Tolerance {
  double least;               ///< the closest a quantity is ever held to
  double times;               ///< how many times the order alone's difference is allowed
  bool worst_of_all = false;  ///< every row held to the worst row's order alone
};

/// The table "vs_single_device" (what, one_device, mesh, diff, order_alone, tolerance)
/// under `caption`, and each row's verdict (Context::verify_close). Every rank calls it with
/// its own rows: the differences and orders alone are the worst over the ranks, the values
/// rank 0's.
void report_vs_one_device(shardlab::Context& ctx, const std::vector<Agreement>& rows,
                          const Tolerance& tolerance, const std::string& caption);

/// The table "bytes_per_axis": every rank's bytes sent per axis and by formula (each rank
/// gives its own), under `caption`; a verdict that they are equal.
void report_axis_bytes(shardlab::Context& ctx, const MeshShape& mesh, const AxisBytes& sent,
                       const AxisBytes& formula, const std::string& caption);

/// Bytes `rank` sends to ranks on other hosts in one step, by axis, from what it sent on
/// each (`sent`), `host` being every rank's host: a group's collective runs as a ring, all
/// of it to the next rank of the group (exact for a group of two, the ring's share for
/// more: MPI's own algorithm is hidden); dp's group is the replicas (dp x ep x cp);
/// the pipeline sends half to each neighbouring stage (activations forward, gradients
/// back; all of it where there is one); ep's all-to-all sends evenly to the group.
AxisBytes between_hosts(const MeshShape& mesh, int rank, const AxisBytes& sent,
                        const std::vector<int>& host);

/// When the ranks run on more than one host (shardlab::host_names): the ranks of each
/// host, which groups of each axis cross between hosts, the table "between_hosts" (per
/// axis, every rank's bytes of the last step that went to another host, by
/// between_hosts; what the hosts' network interfaces sent in that step), and the step time
/// (the slowest rank's). JSON: `hosts`, `between_hosts`, `wire_bytes`, `step_ms`. Every rank
/// calls it; on one host it prints nothing, and the JSON has `wire_bytes` and `step_ms`.
void report_hosts(shardlab::Context& ctx, const MeshShape& mesh, const AxisBytes& sent,
                  const StepMeasure& step);

}  // namespace ch08
