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
  double worst = 0;
  for (double a : alone) worst = nan_max(worst, a);
  Table vs({"what", "one_device", "mesh", "diff", "order_alone", "tolerance"});
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Agreement& row = rows[i];
    const double within =
        std::max(tolerance.least, tolerance.times * (tolerance.worst_of_all ? worst : alone[i]));
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
  std::vector<std::vector<std::int64_t>> every;
  for (std::uint64_t v : {sent.tp, formula.tp, sent.dp, formula.dp, sent.pp, formula.pp})
    every.push_back(ctx.comm().gather_values(static_cast<std::int64_t>(v)));
  Table bytes({"rank", "pp", "dp", "tp", "tp_bytes", "tp_formula", "dp_bytes", "dp_formula",
               "pp_bytes", "pp_formula"});
  for (int r = 0; r < ctx.size(); ++r) {
    const Coords q = coords_of(mesh, r);
    const auto i = static_cast<std::size_t>(r);
    bytes.add({r, q.pp, q.dp, q.tp, every[0][i], every[1][i], every[2][i], every[3][i], every[4][i],
               every[5][i]});
  }
  ctx.report(bytes, "bytes_per_axis", caption);
  ctx.verify(every[0] == every[1] && every[2] == every[3] && every[4] == every[5],
             "a rank sent other than its axis' formula (bytes_per_axis)");
}

}  // namespace ch08
