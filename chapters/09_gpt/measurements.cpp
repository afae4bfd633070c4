// Chapter 09's measurements next to their predictions (measurements.hpp).
#include "measurements.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>

#include "calibrate.hpp"
#include "mesh_checks.hpp"
#include "shardlab/bench.hpp"
#include "shardlab/cuda.hpp"
#include "shardlab/format.hpp"
#include "timeline.hpp"
#include "zero.hpp"

namespace ch09 {

using shardlab::Communicator;
using shardlab::Context;
using shardlab::Table;
using shardlab::Tensor;
namespace memory = shardlab::memory;

namespace {

/// The activations' peak equal to its model on every rank (`where`: the table or mesh). The
/// model follows the reference code's allocations: in the learner's build, whose code may
/// allocate otherwise and be right, a difference is said, not a failure.
void check_modelled_peak(Context& ctx, bool equal, const std::string& where) {
#if defined(SHARDLAB_LEARNER_BUILD)
  if (!equal)
    ctx.say(where +
            ": a rank's activations' peak differs from the model of the step, which "
            "follows the reference code's allocations (yours may allocate otherwise)");
#else
  ctx.verify(equal, where + ": a rank's activations' peak differs from the model of the step");
#endif
}

/// Every rank's value of each of `mine`, on every rank: every[k][r].
std::vector<std::vector<std::int64_t>> gather(Context& ctx,
                                              const std::vector<std::uint64_t>& mine) {
  std::vector<std::vector<std::int64_t>> every;
  for (std::uint64_t v : mine)
    every.push_back(ctx.comm().gather_values(static_cast<std::int64_t>(v)));
  return every;
}

}  // namespace

void report_bytes(Context& ctx, const TrainConfig& c, const StepResult& last,
                  const DpBuckets& buckets) {
  const Coords at = ch08::coords_of(c.mesh, ctx.rank());
  // The MoE blocks' all-to-alls and experts follow from the step's routing: its ep group's.
  const RoutingCounts routing =
      c.model.experts > 0 ? ep_routing(ctx.comm(), c.mesh, at, last) : RoutingCounts{};
  ch08::report_axis_bytes(
      ctx, c.mesh, last.bytes, formula_bytes(c, at, routing, buckets),
      "\nbytes each rank sent in the last step, per axis, and the formulas (train.hpp)");
}

double block_activation_floats(const GptShape& g, int tp, Recompute recompute,
                               bool sequence_parallel, const ContextParallel* context) {
  const auto C = static_cast<double>(g.channels), t = static_cast<double>(tp);
  const double whole = sequence_parallel ? C / t : C;  // a row every tp rank would hold
  if (recompute == Recompute::full) return whole;
  const double per_head =
      context ? context->kept_per_token_and_head(g.context) : static_cast<double>(g.context);
  const double softmax =
      recompute == Recompute::none ? static_cast<double>(g.heads) * per_head / t : 0;
  return 4 * whole + 12 * C / t + softmax;
}

std::optional<double> modelled_activation_peak(const TrainConfig& c, const Coords& at,
                                               std::int64_t held, std::int64_t vocab_rows) {
  using ch08::Axis;
  const bool modelled = (c.schedule == "1f1b" || c.schedule == "gpipe") && c.chunks == 1 &&
                        c.recompute == Recompute::none && !(c.sequence_parallel && c.mesh.tp > 1) &&
                        c.model.experts == 0 && c.precision == shardlab::DType::f32 &&
                        c.memory == Memory::host && c.overlap[Axis::dp] &&
                        (c.mesh.pp == 1 || c.overlap[Axis::pp]);
  if (!modelled) return std::nullopt;
  // Floats a token of the microbatch on this rank, unless said.
  const auto C = static_cast<double>(c.model.channels), t = static_cast<double>(c.mesh.tp),
             V = static_cast<double>(vocab_rows);
  const int p = c.mesh.pp, s = at.pp;
  const bool first = s == 0, last = s == p - 1, sends = !last;
  // What an F keeps: its blocks' (and their LayerNorms' mean and rstd), the first stage's
  // ids (4 bytes a token), the last stage's ln_f input, output, mean and rstd.
  const double kept =
      (c.model.layers / p) * (block_activation_floats(c.model, c.mesh.tp, Recompute::none, false,
                                                      c.mesh.cp > 1 ? c.context.get() : nullptr) +
                              4) +
      (first ? 1 : 0) + (last ? 2 * C + 2 : 0);
  // A B's working set over what its stage held, n tokens: the last block's MLP backward at
  // its largest (fc2's input gradient and GELU's, with the row-parallel layer's copy of dy;
  // or the residual's sum, with fc1's input gradient and LayerNorm's; or fc2's weight
  // gradient, 4C x C/t, a weight's worth whatever the tokens); on the last stage one C
  // more (the head's dx beside ln_f's, less ln_f's input and its mean and rstd), and the
  // loss's moment (the head's input copy, the logits, their softmax and gradient, the
  // head's dx, its weight gradient V x C/t).
  auto working = [&](double n) {
    double w = std::max({C + 8 * C / t, 4 * C + 4 * C / t, 3 * C + 4 * C / t + 4 * C * C / t / n});
    if (last) w = std::max(w + C - 2, 2 * C + 3 * V + 1 + V * C / n);
    return w;
  };
  const ch04::Schedule schedule = ch04::make_schedule(c.schedule, p, c.microbatches, c.chunks);
  const std::vector<ch04::Op>& ops = schedule.ops[static_cast<std::size_t>(s)];
  const std::int64_t replica = shardlab::shard_range(c.batch, c.replicas(), c.replica(at)).length;
  auto tokens = [&](const ch04::Op& op) {
    return static_cast<double>(
        shardlab::shard_range(replica, c.microbatches, op.microbatch).length * held);
  };
  // A receive: an F's input (not on the first stage), a B's gradient (not on the last).
  auto receives = [&](const ch04::Op& op) {
    return p > 1 && (op.kind == ch04::OpKind::forward ? !first : !last);
  };
  double live = 0, peak = 0;  // bytes
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const ch04::Op& op = ops[i];
    const double n = tokens(op), bytes = 4 * n;
    // The next op's receive, posted by this one (the first op posts its own, in its F).
    const double posted =
        i + 1 < ops.size() && receives(ops[i + 1]) ? 4 * C * tokens(ops[i + 1]) : 0;
    if (op.kind == ch04::OpKind::forward) {
      // Its input came in a buffer posted by the op before (counted there), save the
      // first op's; its output's copy kept until its B on a stage that sends; for a
      // moment the output and that copy both.
      const double input = !first && i > 0 ? C : 0, out = sends ? C : 0;
      peak = std::max(peak, live + bytes * (kept - input + 2 * out) + posted);
      live += bytes * (kept - input + out) + posted;
    } else {
      peak = std::max(peak, live + bytes * working(n) + posted);
      // Its microbatch's kept tensors (its input's buffer too) and its output's copy go;
      // the gradient it sends (not on the first stage) stays to the end of the step.
      live += bytes * (-kept - (sends ? C : 0) + (first ? 0 : C)) + posted;
    }
  }
  return peak;
}

void report_memory(Context& ctx, const TrainConfig& c, Mesh& mesh, GptModel& model,
                   const memory::Usage& used, const DpBuckets& buckets) {
  const Coords& at = mesh.coords();
  const ch05::ZeroConfig zc{.stage = c.zero, .adam = c.adam, .by_group = true};
  // ZeRO-1 shards Adam's state over the ranks that hold the same weights, each bucket on
  // its own: the replicas, and for the experts the expert replicas (no buckets: none).
  ch05::StateBytes states = ch05::zero_state_bytes(buckets.dense, zc, shardlab::DType::f32,
                                                   mesh.replicas().size(), mesh.replicas().rank());
  const ch05::StateBytes experts =
      ch05::zero_state_bytes(buckets.experts, zc, shardlab::DType::f32,
                             mesh.expert_replicas().size(), mesh.expert_replicas().rank());
  states.params += experts.params;
  states.grads += experts.grads;
  states.master += experts.master;
  states.optimizer += experts.optimizer;
  using memory::Category;
  // The blocks' activations for the microbatches in flight on this stage (the largest
  // microbatch's tokens on this rank, the stage's blocks).
  const std::int64_t replica = shardlab::shard_range(c.batch, c.replicas(), c.replica(at)).length;
  const std::int64_t tokens = shardlab::shard_range(replica, c.microbatches, 0).length *
                              static_cast<std::int64_t>(model.positions().size());
  // How many microbatches' worth of this stage's blocks the schedule keeps at once (chapter
  // 04's simulation: min(p - s, m) under 1F1B, a chunk counting 1/v).
  const ch04::Schedule sched = ch04::make_schedule(c.schedule, c.mesh.pp, c.microbatches, c.chunks);
  const double in_flight =
      ch04::simulate(sched, ch04::Costs{}).peak_in_flight[static_cast<std::size_t>(at.pp)];
  const double blocks =
      4.0 *
      block_activation_floats(c.model, c.mesh.tp, c.recompute, c.sequence_parallel && c.mesh.tp > 1,
                              c.mesh.cp > 1 ? c.context.get() : nullptr) *
      static_cast<double>(tokens) * (c.model.layers / c.mesh.pp) * in_flight;
  const std::optional<double> modelled = modelled_activation_peak(
      c, at, static_cast<std::int64_t>(model.positions().size()), model.vocab().length);
  const auto every =
      gather(ctx, {states.params, used.live(Category::params), states.grads,
                   used.live(Category::grads), states.optimizer + states.master,
                   used.live(Category::optimizer) + used.live(Category::master),
                   static_cast<std::uint64_t>(blocks), used.peak(Category::activations),
                   static_cast<std::uint64_t>(modelled.value_or(0))});
  Table mem({"rank", "params", "params_measured", "grads", "grads_measured", "optimizer",
             "optimizer_measured", "activations_blocks", "activations_model", "activations_peak"});
  for (std::size_t r = 0; r < every[0].size(); ++r)
    mem.add({r, every[0][r], every[1][r], every[2][r], every[3][r], every[4][r], every[5][r],
             every[6][r], modelled ? shardlab::Cell(every[8][r]) : shardlab::Cell(""),
             every[7][r]});
  ctx.report(
      mem, "memory_per_rank",
      "\nmemory per rank, bytes: the model states by chapter 05's formula over the rank's "
      "shard, and the ledger's; the activations of the stage's blocks for the microbatches "
      "the schedule keeps in flight (4C + 12C/t + HT/t floats a token and block; selective "
      "recompute: 4C + 12C/t; full: C; sequence parallel: each C over t); the peak the step's "
      "ops reach as this program allocates (the blocks, the messages, the loss's logits "
      "and the backward's gradients op by op: modelled_activation_peak, blank where it "
      "does not reach), and the ledger's peak" +
          std::string(c.mesh.cp > 1 ? "; cp: H/t log-sum-exps a token for the HT/t" : "") +
          (c.model.experts > 0 ? "; a MoE block counted as a dense one (its experts "
                                 "keep k rows' worth a token, and its routing)"
                               : ""));
  ctx.verify(every[0] == every[1] && every[2] == every[3] && every[4] == every[5],
             "a rank's model states differ from the formula (memory_per_rank)");
  if (modelled) check_modelled_peak(ctx, every[7] == every[8], "memory_per_rank");
}

double report_bubble(Context& ctx, const TrainConfig& c, Mesh& mesh,
                     const std::vector<ch04::Event>& mine) {
  const Table bubble =
      ch04::bubble_table(ch04::make_schedule(c.schedule, c.mesh.pp, c.microbatches, c.chunks),
                         ch04::gather_events(mesh.pp(), mine));
  ctx.report(bubble, "bubble", "\n" + ch04::bubble_caption());
  return bubble.at(0, 1).number();
}

void report_planner(Context& ctx, const TrainConfig& c, const StepResult& last,
                    const memory::Usage& used, double measured_bubble) {
  const GptShape& g = c.model;
  ch08::ModelSpec model;
  model.name = "this GPT";
  model.layers = g.layers;
  model.hidden = static_cast<int>(g.channels);
  model.heads = static_cast<int>(g.heads);
  model.seq = static_cast<int>(g.context);
  model.vocab = static_cast<int>(g.vocab);
  model.experts = g.experts;
  model.top_k = g.top_k;
  model.moe_every = g.moe_every;
  const ch08::Layout layout{.mesh = c.mesh,
                            .microbatches = c.microbatches,
                            .microbatch_size = static_cast<int>(std::max<std::int64_t>(
                                1, c.batch / (c.replicas() * c.microbatches))),
                            .zero = c.zero,
                            .recompute = c.recompute,
                            .sequence_parallel = c.sequence_parallel && c.mesh.tp > 1};
  const ch08::MemoryEstimate mem = ch08::memory_per_gpu(model, layout, ch05::Precision::fp32);
  const ch08::StepEstimate step = ch08::step_time(model, *ch08::find_cluster("a100-80gb"), layout);
  using memory::Category;
  Table t({"what", "planner", "measured", "measured_over_planner"});
  auto row = [&](const std::string& what, double planned, double measured) {
    // Nothing planned and nothing measured (dp bytes with one replica) agree: 1.
    const shardlab::Cell ratio = planned > 0     ? shardlab::Cell(measured / planned)
                                 : measured == 0 ? shardlab::Cell(1.0)
                                                 : shardlab::Cell("");
    t.add({what, planned, measured, ratio});
  };
  row("params bytes", mem.params, static_cast<double>(used.live(Category::params)));
  row("grads bytes", mem.grads, static_cast<double>(used.live(Category::grads)));
  row("optimizer bytes", mem.optimizer,
      static_cast<double>(used.live(Category::optimizer) + used.live(Category::master)));
  row("activation bytes (x2: fp32)", 2 * mem.activations,
      static_cast<double>(used.peak(Category::activations)));
  for (ch08::Axis a : ch08::shown_axes(c.mesh))
    row(std::string(ch08::axis_name(a)) + " bytes sent (x2: fp32)", 2 * step.axes[a].bytes,
        static_cast<double>(last.bytes[a]));
  row("bubble (idle / busy)", step.bubble_fraction, measured_bubble);
  ctx.report(t, "planner",
             "\nchapter 08's planner on this model and mesh, for rank 0 (the first stage), next to "
             "what it measured: the planner counts 16-bit activations with dropout masks and "
             "only the blocks' allreduces (not the embedding's, the head's, the loss's, nor "
             "wte's between the first and last stage), and its bubble is (p-1)/m");
}

std::vector<MeshShape> benchmark_meshes(const TrainConfig& c, int ranks) {
  std::vector<MeshShape> out;
  for (const MeshShape& mesh :
       ch08::meshes_of(ranks, {std::begin(ch08::kAxes), std::end(ch08::kAxes)})) {
    TrainConfig t = c;
    t.mesh = mesh;
    try {
      check_config(t);
      out.push_back(mesh);
    } catch (const shardlab::UsageError&) {
      // this model cannot be cut this way
    }
  }
  return out;
}

void run_benchmark(Context& ctx, const TrainConfig& base, const Corpus& data, int steps,
                   const ch08::MachineProfile* machine) {
  std::vector<std::string> columns{"mesh"};
  for (ch08::Axis a : ch08::kAxes) columns.emplace_back(ch08::axis_name(a));
  for (const char* column : {"tokens_per_second", "step_ms", "first_loss", "last_loss",
                             "activations_model", "activations_peak"})
    columns.emplace_back(column);
  if (machine)
    for (const char* column : {"predicted_ms", "error", "pipeline_ms", "shared_ms", "exposed_ms"})
      columns.emplace_back(column);
  std::vector<double> measured, predicted, errors;
  Table rate(columns);
  Table curve({"mesh", "step", "loss"});
  for (const MeshShape& shape : benchmark_meshes(base, ctx.size())) {
    TrainConfig c = base;
    c.mesh = shape;
    const std::string name = ch08::mesh_name(shape);
    memory::Tracker tracker;  // this mesh's memory, from its first tensor
    Mesh mesh(ctx.comm(), c.mesh);
    GptModel model(mesh, c.model, c.model_options());
    Trainer trainer(mesh, model, c, data);
    std::vector<double> loss;
    auto start = std::chrono::steady_clock::now();
    for (int t = 0; t < steps; ++t) {
      if (t == 1) start = std::chrono::steady_clock::now();  // the first step warms up
      loss.push_back(trainer.step(t).loss);
      curve.add({name, t + 1, loss.back()});
    }
    const double seconds = ctx.comm().agree(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
        shardlab::ReduceOp::max);
    const double timed = std::max(1, steps - 1);
    // The activations' peak, the largest rank's, and the model of it on every rank.
    const auto peak = static_cast<double>(tracker.usage().peak(memory::Category::activations));
    const std::optional<double> modelled = modelled_activation_peak(
        c, mesh.coords(), static_cast<std::int64_t>(model.positions().size()),
        model.vocab().length);
    if (modelled) check_modelled_peak(ctx, ctx.comm().all_true(*modelled == peak), name);
    std::vector<shardlab::Cell> row{name};
    for (ch08::Axis a : ch08::kAxes) row.emplace_back(shape.size(a));
    for (shardlab::Cell cell : std::vector<shardlab::Cell>{
             timed * static_cast<double>(c.batch * c.model.context) / seconds,
             1e3 * seconds / timed, loss.front(), loss.back()})
      row.push_back(cell);
    row.push_back(modelled ? shardlab::Cell(ctx.comm().agree(*modelled, shardlab::ReduceOp::max))
                           : shardlab::Cell(""));
    row.emplace_back(ctx.comm().agree(peak, shardlab::ReduceOp::max));
    if (machine) {
      const StepPrediction p = predict_step(c, *machine);
      const double step = seconds / timed, error = p.step_s / step - 1;
      measured.push_back(step), predicted.push_back(p.step_s), errors.push_back(std::fabs(error));
      for (double x :
           {1e3 * p.step_s, error, 1e3 * p.pipeline_s, 1e3 * p.shared_s, 1e3 * p.exposed_s})
        row.emplace_back(x);
    }
    rate.add(row);
  }
  ctx.report(rate, "throughput",
             "Chapter 09 - every mesh of " + std::to_string(ctx.size()) +
                 " ranks over the five axes, " + std::to_string(steps) +
                 " steps each (the first not timed); " +
                 describe(base, ctx.comm().backend(), false));
  ctx.save_csv(rate, "09_gpt_throughput");
  ctx.save_csv(curve, "09_gpt_loss");
  if (!machine || errors.empty()) return;
  std::vector<double> sorted = errors;
  std::sort(sorted.begin(), sorted.end());
  const std::size_t n = sorted.size();
  const double median = n % 2 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
  const double worst = sorted.back(), rho = spearman(measured, predicted);
  ctx.json()["prediction"] = {{"median_error", median},
                              {"max_error", worst},
                              {"spearman", rho},
                              {"meshes", n},
                              {"machine", machine->cpu}};
  ctx.say("\nthe prediction (--predict, from " + machine->cpu + ", " +
          std::to_string(machine->cores) + " cores): median |predicted - measured| / measured " +
          shardlab::format_number(100 * median, 3) + " %, largest " +
          shardlab::format_number(100 * worst, 3) + " %, Spearman's rho of the meshes' order " +
          shardlab::format_number(rho, 3) + " (" + std::to_string(n) + " meshes)");
}

void report_throughput(Context& ctx, const TrainConfig& c, int steps, double seconds) {
  const GptShape& g = c.model;
  const double tokens = static_cast<double>(c.batch * g.context) * steps;
  const double rate = tokens / seconds;
  ctx.json()["tokens_per_second"] = rate;
  ctx.say("\n" + shardlab::format_number(rate) + " tokens/s on the mesh (" +
          shardlab::format_number(seconds) + " s for " + std::to_string(steps) + " steps)");
  // PaLM's model FLOPs: 6 per parameter and token (2 forward, 4 backward) for the products,
  // and 12 L H Q T for attention's two products (Q = C / H), recomputation not counted. N is
  // every parameter but wpe's T C (LayerNorms and biases counted, the tied wte once); a MoE
  // block's experts count k times, not E: a token meets k of them (the router once).
  const double N = static_cast<double>(parameter_count(g, g.top_k) - g.context * g.channels);
  const double attention = 12.0 * g.layers * double(g.channels) * double(g.context);
  const double per_token = 6.0 * N + attention;
  // Hardware FLOPs (Korthikanti et al. 2022): what recomputation adds, a second forward of
  // the blocks (2 N_blocks + the attention's forward, a third of its 12 L H Q T), or of
  // the attention's core alone (selective).
  const double blocks =
      N - static_cast<double>(g.vocab * g.channels + 2 * g.channels);  // not wte, ln_f
  const double again = c.recompute == Recompute::full        ? 2.0 * blocks + attention / 3
                       : c.recompute == Recompute::selective ? attention / 3
                                                             : 0.0;
  double peak = 0, achieved = 0, devices = ctx.size();
  std::string of;
  if (ctx.on_gpu()) {
    peak = achieved = shardlab::cuda::peak_fp32_tflops(shardlab::cuda::device_for_rank(0)) * 1e3;
    of = "the GPU's FP32 peak";
  } else {
    const shardlab::bench::HostCpu& cpu = shardlab::bench::host_cpu();
    devices = std::min<double>(ctx.size(), cpu.cores);
    peak = cpu.peak_gflops_per_core();
    achieved = shardlab::bench::host_gemm_peak_gflops();
    of = shardlab::format_number(cpu.clock_ghz, 3) + " GHz x " + std::to_string(cpu.fp32_lanes) +
         " lanes x " + std::to_string(cpu.fma_units) + " FMA unit" +
         (cpu.fma_units > 1 ? "s" : "") + " x 2, " + cpu.name;
    // A clock the kernel reports below the one the cores run at (a virtual machine's
    // nominal clock, turbo): the GEMM measured beats that "peak", which then bounds nothing.
    if (achieved > peak) {
      of +=
          "; the GEMM measured beats that: the cores run faster than the clock reported, "
          "and the measured rate stands in for the peak";
      peak = achieved;
    }
  }
  const double model = rate * per_token, mfu = peak > 0 ? model / (peak * 1e9 * devices) : 0;
  const double hfu = peak > 0 ? rate * (per_token + again) / (peak * 1e9 * devices) : 0;
  const double over_gemm = achieved > 0 ? model / (achieved * 1e9 * devices) : 0;
  ctx.json()["model_flops_per_token"] = per_token;
  ctx.json()["hardware_flops_per_token"] = per_token + again;
  ctx.json()["peak_gflops_per_device"] = peak;
  ctx.json()["peak_is"] = of;
  ctx.json()["mfu"] = mfu;
  ctx.json()["hfu"] = hfu;
  ctx.json()["gemm_gflops_per_device"] = achieved;
  ctx.json()["model_flops_over_gemm"] = over_gemm;
  ctx.say("MFU (PaLM's: the model's FLOPs over the hardware's peak) " +
          shardlab::format_number(100 * mfu, 3) +
          " %: " + shardlab::format_number(per_token / 1e6, 4) +
          " MFLOP a token (6N + 12LHQT, N = " + shardlab::format_number(N, 6) +
          " parameters but wpe's) x tokens/s over " + shardlab::format_number(devices) + " x " +
          shardlab::format_number(peak, 4) + " GFLOP/s (" + of + ")");
  if (!ctx.on_gpu())
    ctx.say("  over what the cores achieve, one core's best 512^3 GEMM measured now (" +
            shardlab::format_number(achieved, 3) +
            " GFLOP/s): " + shardlab::format_number(100 * over_gemm, 3) + " %");
  if (again > 0)
    ctx.say("  HFU (with the FLOPs recomputation adds, " + shardlab::format_number(again / 1e6, 4) +
            " MFLOP a token): " + shardlab::format_number(100 * hfu, 3) + " %");
}

}  // namespace ch09
