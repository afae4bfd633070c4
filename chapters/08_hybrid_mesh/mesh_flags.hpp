// Chapter 08: the mesh from a command line. Every program that takes a mesh (ch08_hybrid_mesh,
// ch08_layout, ch08_plan, ch09_gpt) declares its axes' flags here, one per axis of kAxisInfo,
// and settles dp from the ranks the same way. Programs include it; the libraries do not (it
// brings CLI11).
#pragma once

#include <string_view>
#include <vector>

#include "mesh.hpp"

namespace CLI {
class App;
}

namespace ch08 {

/// The largest size a mesh flag takes: 2^20.
inline constexpr int kMaxAxisSize = 1 << 20;

/// Declares --pp, --dp, --ep, --cp and --tp (those of `axes`, in the grid's order) on `cli`,
/// each setting `shape`'s size along its axis, described by kAxisInfo: a whole number from 1
/// to kMaxAxisSize ("1.5" is "not a whole number"), or 0 where `shape` holds 0 before the
/// flags are read, 0 then meaning `zero_means` ("the ranks the other axes leave").
void add_mesh_flags(CLI::App& cli, MeshShape& shape, const std::vector<Axis>& axes,
                    std::string_view zero_means = "");

/// The mesh of `ranks` ranks for the flags' `shape`: dp 0 takes the ranks the other axes
/// leave; UsageError (one line) when their product does not divide the ranks or the
/// product of all is not the ranks. The products are taken without overflow (product()).
MeshShape mesh_for_ranks(MeshShape shape, int ranks);

}  // namespace ch08
