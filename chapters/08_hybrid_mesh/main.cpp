// Chapter 08 — the hybrid mesh: data x tensor x pipeline parallel training for real (GPT-3
// 175B and NVIDIA's 1T model planned on paper are ch08_plan, plan_main.cpp; a mesh's ranks
// and groups drawn for any size ch08_layout, layout_main.cpp).
//
// The course (so-large-lm's distributed-training chapter §6 "混合并行"; CS336 lecture 7
// §5): data parallelism across hosts, tensor parallelism inside a host (NVLink), pipeline
// parallelism to cut the rest into stages. A stack of Megatron MLP blocks trains on a
// pp x dp x tp mesh: chapter 04's pipeline runs the stages, this chapter's layers cut each
// block over tp, chapter 02's sync (or chapter 05's ZeRO-1) keeps the dp replicas together;
// every rank also trains the model on one device, and the two must agree.
//
// Run:
//   build/default/bin/ch08_hybrid_mesh                       8 ranks: pp 2 x dp 2 x tp 2
//   build/default/bin/ch08_hybrid_mesh --ranks 8 --dp 1 --tp 4 --pp 2 --zero 1
//   mpirun -np 8 build/default/bin/ch08_hybrid_mesh
//
// Expected: the loss of every step and the final weights equal one device's to rounding;
// the bytes each rank sends on each axis equal the axis' formula exactly.
#include <cmath>
#include <nlohmann/json.hpp>

#include "mesh_checks.hpp"
#include "mesh_flags.hpp"
#include "mlp_stack.hpp"
#include "shardlab/cli.hpp"
#include "trainer.hpp"
#include "zero.hpp"

using namespace shardlab;
using namespace ch08;

namespace {

struct Settings {
  HybridConfig run;
  MeshShape mesh{.pp = 2, .dp = 0, .tp = 2};  // dp 0: the ranks left over by tp x pp
};

void train(Context& ctx, const Settings& s) {
  const HybridConfig& c = s.run;
  Mesh mesh(ctx.comm(), c.mesh);
  const Coords& at = mesh.coords();

  // 1. The reference: the same blocks on one device, the whole batch (every rank); and
  // one device again with the batch in the mesh's pieces: only the order of additions
  // differs, and how far that alone moves the training is the yardstick below.
  Reference ref, pieces;
  train_reference(c, ref);
  train_reference(c, pieces, true);

  // 2. The mesh: this rank's stage of blocks, its tp shard of each, its dp replica's rows.
  memory::Tracker tracker;
  HybridModel model(mesh, c, ctx.memory());
  const HybridRun run = train_hybrid(mesh, model, c, ctx.memory());
  const memory::Usage used = tracker.usage();
  // 3. The comparison: the loss of every step, then every weight, and the replicas.
  compare_with_one_device(ctx, c, ref, pieces, mesh, model, run);

  // 4. Bytes per axis in the last step, next to each axis' formula (mlp_stack.hpp).
  report_axis_bytes(ctx, c.mesh, run.bytes, formula_bytes(c, at),
                    "\nbytes each rank sent in one step, per axis; formulas: tp 2 L/pp allreduces "
                    "of b x h per microbatch, dp one allreduce of the rank's parameters, pp b x h "
                    "to each neighbour per microbatch (ring allreduce: 2 (N-1)/N of S)");

  // Where the ranks run on several hosts: which groups cross between them, and the bytes
  // and time of a step there.
  report_hosts(ctx, c.mesh, run.bytes, run.step);

  // 5. The bubble of the last step, next to chapter 04's simulation of the same schedule.
  ctx.report(
      ch04::bubble_table(ch04::make_schedule(c.schedule, c.mesh.pp, c.microbatches, 1), run.events),
      "bubble", "\n" + ch04::bubble_caption());

  // 6. Memory per rank: the model states chapter 05's formula predicts, and the ledger's.
  report_memory(ctx, c, at, run, used);
}

}  // namespace

int main(int argc, char** argv) {
  Program program("ch08_hybrid_mesh",
                  "Chapter 08: data x tensor x pipeline parallel training on a 3-D mesh, equal to "
                  "one device");
  program.default_ranks(8);
  Settings s;
  HybridConfig& c = s.run;
  auto& cli = program.cli();
  add_mesh_flags(cli, s.mesh, {Axis::pp, Axis::dp, Axis::tp}, "the ranks / (tp x pp)");
  cli::option(cli, "--microbatches", c.microbatches, "microbatches per step and replica",
              cli::whole(1, 4096));
  cli::option(cli, "--blocks", c.blocks, "MLP blocks L (pp must divide them)", cli::whole(1, 1024));
  cli::option(cli, "--ffn", c.ffn, "the blocks' inner width", cli::whole(1, 16384));
  cli::option(cli, "--steps", c.steps, "training steps", cli::whole(1, 10000));
  cli.add_flag("--sgd", c.sgd, "plain SGD instead of Adam");
  cli::option(cli, "--lr", c.adam.lr, "Adam's learning rate", cli::between(1e-9, 1.0));
  // The schedules with one chunk per stage that cut the batch into microbatches.
  cli::option(cli, "--schedule", c.schedule, "pipeline schedule (chapter 04)",
              CLI::IsMember(ch04::schedule_names(false, false)));
  cli::option(cli, "--hidden", c.hidden, "the blocks' width h (tp must divide it)",
              cli::whole(1, 4096));
  cli::option(cli, "--batch", c.batch, "rows a step, all replicas together",
              cli::whole(1, 1 << 16));
  cli::option(cli, "--zero", c.zero,
              "0: chapter 02's GradSync and Adam; 1: chapter 05's ZeRO-1 over dp",
              cli::whole(0, 1));

  program.validate([&](const Options& o) { c.seed = o.seed; });
  program.world_size([&](const Options&, int ranks) {  // runs before validate()
    c.mesh = mesh_for_ranks(s.mesh, ranks);
    check_config(c);
  });
  program.memory_estimate([&](const Options& o) {
    return (o.backend == "threads" || o.backend == "auto" ? o.ranks : 1) * run_bytes(c);
  });
  program.supports_cuda();

  return program.run(argc, argv, [&](Context& ctx) {
    ctx.json()["chapter"] = "08_hybrid_mesh";
    train(ctx, s);
  });
}
