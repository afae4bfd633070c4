// Chapter 08 on paper: a real model's training planned on a real cluster (plan_report.hpp,
// planner.hpp: Narayanan et al. 2021's and Korthikanti et al. 2022's formulas), no ranks
// doing any work.
//
// Run:
//   build/default/bin/ch08_plan                          GPT-3 175B on 1024 A100s, 8 x 8 x 16
//   build/default/bin/ch08_plan --model 1t               NVIDIA's 1T model: 84 days
//   build/default/bin/ch08_plan --search                 every (dp, tp, pp, m), fastest first
//   build/default/bin/ch08_plan --dp 128 --tp 8 --pp 1   a layout that does not fit
//
// Expected: 33.8 days for GPT-3 and 83.9 for the 1T model (Narayanan et al. 2021, Table 1
// and eq. 4); a plan that does not fit says so (exit 0).
#include <nlohmann/json.hpp>

#include "plan_report.hpp"
#include "shardlab/cli.hpp"
#include "shardlab/launch.hpp"

using namespace shardlab;
using namespace ch08;

int main(int argc, char** argv) {
  Program program("ch08_plan",
                  "Chapter 08 on paper: a model's training planned over dp x tp x pp GPUs "
                  "(memory, step time, days)");
  program.on_paper();
  PlanSettings s;
  add_plan_options(program.cli(), s);
  program.validate([&](const Options&) {
    require_usage(!s.csv || s.search, "--csv writes --search's ranking: add --search");
    validate_plan(s);
  });
  program.writes_csv([&] { return s.csv; });
  return program.run(argc, argv, [&](Context& ctx) {
    ctx.json()["chapter"] = "08_hybrid_mesh";
    report_plan(ctx, s);
  });
}
