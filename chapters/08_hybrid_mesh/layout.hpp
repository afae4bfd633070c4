// Chapter 08: a mesh's layout on paper, for any size (no ranks started): each rank's
// coordinates and node, every group per axis (five: pp, dp, ep, cp, tp), and which groups
// stay inside a node.
#pragma once

#include "mesh.hpp"
#include "shardlab/launch.hpp"

namespace ch08 {

/// The node of `rank` when each node holds `gpus_per_node` consecutive ranks.
inline int node_of(int rank, int gpus_per_node) { return rank / gpus_per_node; }

/// Prints (rank 0) the ranks' coordinates and nodes, every group per axis with the nodes
/// it spans (cp and ep only where the mesh has them), a warning for each tp group that
/// crosses nodes (its allreduces, two per block and step, would leave NVLink) and a note
/// for each cp group that does (its ring passes keys and values every block); JSON:
/// `groups` {tp, (cp, ep,) dp, pp: lists of rank lists}, `ranks` (coordinates),
/// `tp_crosses_nodes` (and `cp_crosses_nodes` with cp > 1); with `csv`, the ranks' table as
/// 08_hybrid_mesh_layout.csv. Communicates nothing.
void report_layout(shardlab::Context& ctx, const MeshShape& shape, int gpus_per_node, bool csv);

}  // namespace ch08
