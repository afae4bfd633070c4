// The mesh against one device, and the bytes per axis against their formulas
// (mesh_checks.hpp).
#include "mesh_checks.hpp"

#include <algorithm>

namespace ch08 {

using shardlab::Context;
using shardlab::ReduceOp;
using shardlab::Table;

void report_vs_one_device(Context& ctx, const std::vector<Agreement>& rows,
                          const Tolerance& tolerance, const std::string& caption) {
  std::vector<double> alone;
  for (const Agreement& row : rows)
    alone.push_back(ctx.comm().agree(row.order_alone, ReduceOp::max));
  double worst = 0;  // of the rows held to the worst of all
  for (std::size_t i = 0; i < rows.size(); ++i)
    if (!rows[i].own_least) worst = nan_max(worst, alone[i]);
  Table vs({"what", "one_device", "mesh", "diff", "order_alone", "tolerance"});
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Agreement& row = rows[i];
    const bool own = row.own_least.has_value();
    const double within =
        std::max(own ? *row.own_least : tolerance.least,
                 tolerance.times * (tolerance.worst_of_all && !own ? worst : alone[i]));
    const double diff = ctx.verify_close(row.what, row.diff, within);
    auto cell = [](const std::optional<double>& v) -> shardlab::Cell {
      if (v) return *v;
      return "";
    };
    vs.add({row.what, cell(row.one_device), cell(row.mesh), diff, alone[i], within});
  }
  ctx.report(vs, "vs_single_device", caption);
}

void report_axis_bytes(Context& ctx, const MeshShape& mesh, const AxisBytes& sent,
                       const AxisBytes& formula, const std::string& caption) {
  // The axes the mesh has: tp, dp and pp always, cp and ep where they are more than 1.
  struct Column {
    Axis axis;
    std::uint64_t AxisBytes::*bytes;
  };
  std::vector<Column> columns{
      {Axis::tp, &AxisBytes::tp}, {Axis::dp, &AxisBytes::dp}, {Axis::pp, &AxisBytes::pp}};
  if (mesh.cp > 1) columns.push_back({Axis::cp, &AxisBytes::cp});
  if (mesh.ep > 1) columns.push_back({Axis::ep, &AxisBytes::ep});
  const std::vector<Axis> shown = shown_axes(mesh);  // the coordinates: pp, dp, (ep, cp,) tp
  std::vector<std::string> names{"rank"};
  for (Axis axis : shown) names.emplace_back(axis_name(axis));
  std::vector<std::vector<std::int64_t>> every;  // per column: sent, then formula
  bool equal = true;
  for (const Column& c : columns) {
    names.push_back(std::string(axis_name(c.axis)) + "_bytes");
    names.push_back(std::string(axis_name(c.axis)) + "_formula");
    every.push_back(ctx.comm().gather_values(static_cast<std::int64_t>(sent.*c.bytes)));
    every.push_back(ctx.comm().gather_values(static_cast<std::int64_t>(formula.*c.bytes)));
    equal = equal && every[every.size() - 2] == every.back();
  }
  Table bytes(names);
  for (int r = 0; r < ctx.size(); ++r) {
    const Coords q = coords_of(mesh, r);
    std::vector<shardlab::Cell> row{r};
    for (Axis axis : shown) row.emplace_back(q.at(axis));
    for (const auto& values : every) row.emplace_back(values[static_cast<std::size_t>(r)]);
    bytes.add(row);
  }
  ctx.report(bytes, "bytes_per_axis", caption);
  ctx.verify(equal, "a rank sent other than its axis' formula (bytes_per_axis)");
}

}  // namespace ch08
