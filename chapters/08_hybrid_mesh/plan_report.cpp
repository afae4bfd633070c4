// Chapter 08's planner on paper: its flags and its tables (plan_report.hpp).
#include "plan_report.hpp"

#include <CLI/CLI.hpp>
#include <climits>
#include <cmath>
#include <nlohmann/json.hpp>

#include "calculator.hpp"  // ch05::gb
#include "machine.hpp"
#include "mesh_flags.hpp"
#include "shardlab/check.hpp"
#include "shardlab/cli.hpp"
#include "shardlab/launch.hpp"

namespace ch08 {

using shardlab::format_number;
using shardlab::require_usage;
using shardlab::Table;

namespace {

std::string str(std::int64_t n) { return std::to_string(n); }
std::string num(double x, int digits = 4) { return format_number(x, digits); }

std::vector<std::string> model_names() {
  std::vector<std::string> names;
  for (const ModelSpec& m : model_presets()) names.push_back(m.name);
  return names;
}

std::vector<std::string> cluster_names() {
  std::vector<std::string> names;
  for (const ClusterSpec& c : cluster_presets()) names.push_back(c.name);
  return names;
}

std::string joined(const std::vector<std::string>& words) {
  std::string out;
  for (const std::string& w : words) out += (out.empty() ? "" : ", ") + w;
  return out;
}

// A flag's number that must be whole and in [lo, hi] (0 = not given is the caller's).
std::int64_t whole(const char* flag, double value, double lo, double hi, const char* what) {
  require_usage(std::isfinite(value) && value == std::floor(value),
                std::string(flag) + " " + num(value, 6) + ": " + what + " is a whole number");
  require_usage(value >= lo && value <= hi, std::string(flag) + " " + num(value, 6) + ": from " +
                                                num(lo, 10) + " to " + num(hi, 10));
  return static_cast<std::int64_t>(value);
}

ModelSpec resolve_model(const PlanSettings& s) {
  ModelSpec m;
  const bool custom = s.model == "custom";
  if (custom) {
    require_usage(s.layers != 0 && s.hidden != 0 && s.heads != 0,
                  "--model custom needs --layers, --hidden and --heads");
    m.name = "custom";
    m.source = "given on the command line";
  } else {
    const ModelSpec* preset = find_model(s.model);
    require_usage(preset != nullptr,
                  "--model " + s.model + ": not a preset (" + joined(model_names()) + ", custom)");
    m = *preset;
  }
  bool changed = false;
  for (auto [given, field] : {std::pair{s.layers, &m.layers},
                              {s.hidden, &m.hidden},
                              {s.heads, &m.heads},
                              {s.seq, &m.seq},
                              {s.vocab, &m.vocab},
                              {s.experts + 1, &m.experts},  // -1: not given
                              {s.top_k, &m.top_k},
                              {s.moe_every, &m.moe_every}})
    if (given != 0) {
      const int value = field == &m.experts ? given - 1 : given;
      changed |= value != *field;
      *field = value;
    }
  if (changed && !custom) {
    m.name += " (changed)";
    m.source += ", sizes changed on the command line";
  }
  check_model(m);
  return m;
}

ClusterSpec resolve_cluster(const PlanSettings& s, const ModelSpec& m) {
  const ClusterSpec* preset = find_cluster(s.cluster);
  require_usage(preset != nullptr,
                "--cluster " + s.cluster + ": not a preset (" + joined(cluster_names()) + ")");
  ClusterSpec c = s.machine.empty() ? *preset : cluster_of(load_machine(s.machine));
  if (s.gpu_memory_gb != 0) c.gpu_memory_bytes = s.gpu_memory_gb * 1e9;
  if (s.gpus_per_node != 0) c.gpus_per_node = c.nics_per_node = s.gpus_per_node;  // one a GPU
  if (s.nics_per_node != 0) c.nics_per_node = s.nics_per_node;
  // The preset's measured X was on A100s; elsewhere the cluster's own.
  if (s.achieved_tflops != 0)
    c.achieved_tflops = s.achieved_tflops;
  else if (m.run.achieved_tflops > 0 && c.name == "a100-80gb" && s.machine.empty())
    c.achieved_tflops = m.run.achieved_tflops;
  check_cluster(c);
  require_usage(c.achieved_tflops <= c.peak_tflops, "--achieved-tflops " + num(c.achieved_tflops) +
                                                        ": more than the " + c.name + "'s peak, " +
                                                        num(c.peak_tflops) + " TFLOP/s");
  return c;
}

}  // namespace

// ---------------------------------------------------------------------------
// The flags

namespace {

namespace sc = shardlab::cli;

/// The model's flags: a preset or a custom shape, and its experts.
void add_model_flags(CLI::App& cli, PlanSettings& s) {
  std::vector<std::string> models = model_names();
  models.push_back("custom");
  cli.add_option("--model", s.model, "a model (" + joined(models) + ")")
      ->check(CLI::IsMember(models))
      ->capture_default_str();
  cli.add_option("--layers", s.layers, "layers l (custom, or to change the preset's)")
      ->check(sc::whole(1, 100000));
  cli.add_option("--hidden", s.hidden, "hidden size h (default: the model's)")
      ->check(sc::whole(1, 1000000));
  cli.add_option("--heads", s.heads, "attention heads a")->check(sc::whole(1, 100000));
  cli.add_option("--seq", s.seq, "sequence length s (preset: 2048)")
      ->transform(sc::quantity())
      ->check(sc::whole(1, 1 << 27));
  cli.add_option("--vocab", s.vocab, "vocabulary V (preset: 51200)")
      ->transform(sc::quantity())
      ->check(sc::whole(1, 100000000));
  cli.add_option("--experts", s.experts,
                 "E: a Mixture-of-Experts MLP in every --moe-every-th layer (0: dense; default: "
                 "the model's)")
      ->check(sc::whole(0, 100000));
  cli.add_option("--top-k", s.top_k, "k: the experts a token goes to (default: the model's, 2)")
      ->check(sc::whole(1, 100000));
  cli.add_option("--moe-every", s.moe_every, "every this many layers a MoE one (default: 1)")
      ->check(sc::whole(1, 100000));
}

/// The cluster's flags: a preset, and what of it to change.
void add_cluster_flags(CLI::App& cli, PlanSettings& s) {
  cli.add_option("--cluster", s.cluster, "the GPUs (" + joined(cluster_names()) + ")")
      ->check(CLI::IsMember(cluster_names()))
      ->capture_default_str();
  cli.add_option("--machine", s.machine,
                 "a measured machine (ch09_gpt --calibrate FILE) instead of --cluster: a core a "
                 "GPU, the host's ranks a node");
  cli.add_flag("--overlap", s.overlap,
               "each axis's communication under the computation where it can be (chapter 09's "
               "--overlap all)");
  cli.add_option("--gpus", s.gpus, "GPUs n (1024, 3K, 2^12; default: the preset's run)")
      ->transform(sc::quantity())
      ->check(sc::between(1, double(kMaxGpus)));
  cli.add_option("--achieved-tflops", s.achieved_tflops,
                 "X, TFLOP/s a GPU (default: the preset's run on A100s, else the cluster's)")
      ->check(sc::between(1e-3, 1e6));
  cli.add_option("--gpu-memory-gb", s.gpu_memory_gb, "GB (1e9 bytes) a GPU (default: 80)")
      ->check(sc::between(1e-3, 1e6));
  cli.add_option("--gpus-per-node", s.gpus_per_node, "GPUs a node (default: the cluster's, 8)")
      ->check(sc::whole(1, 1 << 20));
  cli.add_option("--nics-per-node", s.nics_per_node,
                 "network cards a node, sharing its GPUs' network bandwidth (default: one a GPU)")
      ->check(sc::whole(1, 1 << 20));
}

/// The run's flags: tokens, batch, memory savers, the layout and the search.
void add_run_flags(CLI::App& cli, PlanSettings& s) {
  cli.add_option("--tokens", s.tokens, "training tokens T (300B; default: the preset's)")
      ->transform(sc::quantity())
      ->check(sc::between(1, 1e16));
  cli.add_option("--batch", s.batch, "global batch B in sequences (default: the preset's)")
      ->transform(sc::quantity())
      ->check(sc::between(1, INT_MAX));
  cli.add_option("--microbatch-size", s.microbatch_size,
                 "microbatch size b (default: the preset's run's, else 1)")
      ->check(sc::whole(1, 1 << 20));
  cli.add_option("--zero", s.zero, "ZeRO stage over dp, 0-3")
      ->check(sc::whole(0, 3))
      ->capture_default_str();
  cli.add_option("--recompute", s.recompute, "activation recomputation")
      ->check(CLI::IsMember({"none", "selective", "full"}))
      ->capture_default_str();
  cli.add_flag("--sequence-parallel", s.sequence_parallel,
               "split LayerNorm and dropout over tp too (Korthikanti et al. 2022)");
  add_mesh_flags(cli, s.mesh, {std::begin(kAxes), std::end(kAxes)},
                 "not given: the preset run's, the search's pick, or the GPUs the others leave");
  cli.add_option("--microbatches", s.microbatches, "microbatches m a step and replica")
      ->check(sc::whole(1, 1 << 20));
  cli.add_flag("--search", s.search, "rank every (dp, ep, cp, tp, pp, m) of the GPUs");
  cli.add_option("--top", s.top, "with --search: how many of the fastest layouts to print (0: all)")
      ->check(sc::whole(0, 1 << 20))
      ->capture_default_str();
  cli.add_flag("--csv", s.csv, "with --search: also write the ranking as CSV");
}

}  // namespace

void add_plan_options(CLI::App& cli, PlanSettings& s) {
  add_model_flags(cli, s);
  add_cluster_flags(cli, s);
  add_run_flags(cli, s);
}

// ---------------------------------------------------------------------------
// The settings made concrete

namespace {

const std::vector<Axis> kAll(std::begin(kAxes), std::end(kAxes));

/// The layout's degrees but dp: the flags', else the preset run's (ep: of a MoE model), else
/// 1; dp the flag's (0: the GPUs the others leave).
MeshShape given_mesh(const PlanSettings& s, const ModelSpec& m) {
  const ReferenceRun& run = m.run;
  MeshShape mesh;
  for (Axis axis : kAxes) {
    const bool from_run = run.gpus() != 0 && (axis != Axis::ep || m.experts > 0);
    mesh.size(axis) = s.mesh.size(axis) != 0 ? s.mesh.size(axis)
                      : from_run             ? run.mesh.size(axis)
                                             : 1;
  }
  mesh.dp = s.mesh.dp;
  return mesh;
}

/// n: --gpus, or the flags' mesh when --dp is given, or the preset run's.
std::int64_t resolve_gpus(const PlanSettings& s, const ModelSpec& m, const MeshShape& mesh) {
  if (s.gpus != 0) return whole("--gpus", s.gpus, 1, double(kMaxGpus), "a number of GPUs");
  if (mesh.dp != 0) {
    check_mesh_size(mesh, double(kMaxGpus));
    return mesh.ranks();
  }
  if (m.run.gpus() != 0) return m.run.gpus();
  throw shardlab::UsageError("--model custom: give --gpus (or --dp, --tp and --pp)");
}

/// With --search: the layouts ranked; the plan is the fastest that fits (or the fastest)
/// unless the flags give a layout. True when the search's pick is the plan.
bool search_layouts(const PlanSettings& s, ResolvedPlan& p, std::int64_t batch) {
  const int b = p.layout.microbatch_size;
  const std::int64_t B = batch != 0 ? batch : p.model.run.batch;
  require_usage(B != 0, "--search: give --batch (sequences a step)");
  p.candidates = search(p.model, p.cluster,
                        {.gpus = p.gpus,
                         .batch = B,
                         .microbatch_size = b,
                         .zero = s.zero,
                         .recompute = p.layout.recompute,
                         .sequence_parallel = p.layout.sequence_parallel,
                         .overlap = s.overlap,
                         .keep = static_cast<std::size_t>(s.top)},
                        &p.counted);
  require_usage(!p.candidates.empty(), "--search: no layout of " + str(p.gpus) + " GPUs splits " +
                                           str(B) + " sequences into microbatches of " + str(b) +
                                           " with tp dividing " + str(p.model.heads) +
                                           " heads and pp dividing " + str(p.model.layers) +
                                           " layers");
  if (p.layout_given || s.microbatches != 0) return false;
  p.layout = p.counted.fastest ? p.counted.fastest->layout : p.candidates.front().layout;
  return true;
}

/// dp (the GPUs the others leave, unless given) and m (B / (d e b), unless given).
void resolve_batch(const PlanSettings& s, ResolvedPlan& p, std::int64_t given_batch) {
  Layout& L = p.layout;
  const int b = L.microbatch_size;
  std::vector<Axis> others;
  for (Axis axis : kAxes)
    if (axis != Axis::dp) others.push_back(axis);
  const double rest = product(L.mesh, others);  // the GPUs of a replica
  require_usage(L.mesh.dp != 0 || (rest <= double(p.gpus) && p.gpus % std::int64_t(rest) == 0),
                str(p.gpus) + " GPUs: " + mesh_name(L.mesh, others) + " = " + num(rest) +
                    " does not divide them; give --dp --tp --pp, or --search");
  if (L.mesh.dp == 0) L.mesh.dp = int(p.gpus / std::int64_t(rest));
  check_mesh_size(L.mesh, double(kMaxGpus));
  const std::int64_t replicas = std::int64_t{L.mesh.dp} * L.mesh.ep;  // each its own sequences
  std::int64_t B = given_batch;
  if (B == 0) B = s.microbatches != 0 ? replicas * s.microbatches * b : p.model.run.batch;
  require_usage(B != 0, "--model custom: give --batch (sequences a step) or --microbatches");
  require_usage(B <= INT_MAX, "a batch of " + str(B) + " sequences: at most 2^31 - 1");
  const std::string dp_words = mesh_name(L.mesh, {Axis::dp, Axis::ep});
  if (s.microbatches != 0) {
    L.microbatches = s.microbatches;
    require_usage(L.batch() == B, "--batch " + str(B) + " but " + dp_words + " x " +
                                      str(s.microbatches) + " microbatches x b " + str(b) + " = " +
                                      str(L.batch()));
    return;
  }
  require_usage(B % (replicas * b) == 0,
                "a batch of " + str(B) + " sequences is no whole number of microbatches of b = " +
                    str(b) + " on " + dp_words + ": give --batch or --microbatches");
  L.microbatches = int(B / (replicas * b));
}

}  // namespace

ResolvedPlan resolve_plan(const PlanSettings& s) {
  ResolvedPlan p;
  p.model = resolve_model(s);
  p.cluster = resolve_cluster(s, p.model);
  require_usage(s.zero >= 0 && s.zero <= 3, "--zero " + str(s.zero) + ": the stages are 0 to 3");
  p.layout_given = s.mesh != PlanSettings{}.mesh;
  Layout& L = p.layout;
  L = {.mesh = given_mesh(s, p.model),
       .microbatch_size = s.microbatch_size != 0    ? s.microbatch_size
                          : p.model.run.gpus() != 0 ? p.model.run.microbatch_size
                                                    : 1,
       .zero = s.zero,
       .recompute = parse_recompute(s.recompute),
       .sequence_parallel = s.sequence_parallel,
       .overlap = s.overlap};
  p.gpus = resolve_gpus(s, p.model, L.mesh);
  p.tokens = s.tokens != 0 ? s.tokens : p.model.run.tokens;
  require_usage(std::isfinite(p.tokens) && p.tokens > 0,
                "--tokens " + num(p.tokens) + ": a positive number");
  const std::int64_t batch =
      s.batch != 0 ? whole("--batch", s.batch, 1, INT_MAX, "a number of sequences") : 0;
  if (s.search && search_layouts(s, p, batch)) return p;
  resolve_batch(s, p, batch);
  check_layout(p.model, L, p.gpus);
  return p;
}

void validate_plan(const PlanSettings& settings) { resolve_plan(settings); }

// ---------------------------------------------------------------------------
// The report

namespace {

std::string layout_words(const Layout& L) {
  return mesh_name(L.mesh) + " = " + str(L.gpus()) + " GPUs, m = " + str(L.microbatches) +
         " microbatches of b = " + str(L.microbatch_size) + " (B = " + str(L.batch()) + ")";
}

std::string group_words(const AxisCost& a) {
  return a.size == 1 ? "-" : a.crosses_nodes ? "crosses nodes" : "inside a node";
}

/// Korthikanti Table 2's row for the layout, as a formula.
std::string activation_formula(const ModelSpec& m, const Layout& L) {
  std::string acts =
      L.recompute == Recompute::full ? "2 s b h"
      : L.recompute == Recompute::selective
          ? (L.sequence_parallel ? "s b h 34/t" : "s b h (10 + 24/t)")
          : (L.sequence_parallel ? "s b h (34 + 5as/h)/t" : "s b h (10 + 24/t + 5as/(ht))");
  if (L.recompute == Recompute::full && L.sequence_parallel) acts += "/t";
  if (L.mesh.cp > 1) acts = "(" + acts + ")/c";
  if (m.experts > 0 && L.recompute != Recompute::full)
    acts += ", + (k-1) 16 s b h/(t c) a MoE layer";
  return acts;
}

Table memory_table(const ModelSpec& m, const Layout& L, const MemoryEstimate& e) {
  const MeshShape& g = L.mesh;
  const double psi = stage_parameters(m, g.tp, g.pp),
               experts = expert_parameters(m, g.tp, g.pp, g.ep);
  // With cp or ep the dense weights' copies are d e c, the experts' d c.
  const std::string d =
      g.cp * g.ep > 1 ? "(d e c = " + num(product(g, kReplicaAxes)) + ")" : str(g.dp);
  const std::string of = " of " + num(psi) + " parameters" +
                         (experts > 0 ? " (and " + num(experts) + " experts' over d c = " +
                                            num(product(g, kExpertReplicaAxes)) + ")"
                                      : std::string());
  Table t({"category", "bytes", "GB", "formula"});
  t.add({"params", e.params, ch05::gb(e.params),
         "2 bytes" + of + (L.zero >= 3 ? ", / dp " + d : std::string())});
  t.add({"grads", e.grads, ch05::gb(e.grads),
         "2 bytes" + of + (L.zero >= 2 ? ", / dp " + d : std::string())});
  t.add({"optimizer", e.optimizer, ch05::gb(e.optimizer),
         "12 bytes (fp32 master, m, v)" + of + (L.zero >= 1 ? ", / dp " + d : std::string())});
  t.add({"activations", e.activations, ch05::gb(e.activations),
         activation_formula(m, L) + " a layer (recompute " + recompute_name(L.recompute) + ") x " +
             str(m.layers / g.pp) + " layers x " + str(std::min(g.pp, L.microbatches)) +
             " microbatches in flight"});
  t.add({"total", e.total(), ch05::gb(e.total()), "ZeRO stage " + str(L.zero)});
  return t;
}

/// The formula of each axis's bytes in the step table.
PerAxis<std::string> step_formulas(const ResolvedPlan& p) {
  const Layout& L = p.layout;
  const MeshShape& g = L.mesh;
  const std::string layers = str(p.model.layers / g.pp), m = str(L.microbatches);
  PerAxis<std::string> f;
  f[Axis::tp] = str(tp_allreduces_per_layer(L)) + " allreduces of b s h x " + layers +
                " layers x " + m + " microbatches, 2(t-1)/t each" +
                (L.sequence_parallel ? " (sp: the backward's 2 all-gathers are the 5th)" : "");
  const std::string factor = L.zero == 3 ? "3" : "2";
  const std::string dense = num(stage_parameters(p.model, g.tp, g.pp));
  const double experts = expert_parameters(p.model, g.tp, g.pp, g.ep);
  f[Axis::dp] =
      g.cp * g.ep > 1 || experts > 0
          ? factor + "(n-1)/n x " + dense +
                " gradients, n = d e c = " + num(product(g, kReplicaAxes)) +
                (experts > 0 ? "; " + factor + "(n-1)/n x " + num(experts) +
                                   " experts', n = d c = " + num(product(g, kExpertReplicaAxes))
                             : std::string()) +
                " (ZeRO " + str(L.zero) + ")"
          : factor + "(d-1)/d x " + dense + " gradients (ZeRO " + str(L.zero) + ")";
  f[Axis::pp] = std::string(g.pp == 2 ? "b s h" : "2 b s h") + (L.sequence_parallel ? "/t" : "") +
                (g.cp > 1 ? "/c" : "") + " a microbatch x " + m;
  f[Axis::cp] = "blocks of k or v, s/c b h/t: " +
                std::string(L.recompute == Recompute::none ? "2 (c-1)" : "2 x 2 (c-1)") +
                " forward + 4 (c-1) + 2 backward, x " + layers + " layers x " + m +
                " microbatches (chapter 10's ring)";
  f[Axis::ep] = std::string(L.recompute == Recompute::full ? "6" : "4") +
                " passes of k b s/c h x (e-1)/e (an even router) x " +
                str(p.model.moe_layers(0, p.model.layers / g.pp)) + " MoE layers x " + m +
                " microbatches";
  return f;
}

Table step_table(const ResolvedPlan& p, const StepEstimate& st) {
  const Layout& L = p.layout;
  Table t({"part", "size", "group", "busbw_GBps", "bytes", "seconds", "formula"});
  t.add({"compute", p.gpus, "-", 0.0, 0.0, st.compute_s,
         "F / (n X), F = " + num(st.flops) + " (recompute " + recompute_name(L.recompute) +
             "), X = " + num(p.cluster.achieved_tflops) + " TFLOP/s"});
  t.add({"bubble", L.mesh.pp, "-", 0.0, 0.0, st.bubble_s,
         "(p - 1)/m = " + num(st.bubble_fraction, 3) + " of compute (1F1B)"});
  const PerAxis<std::string> formulas = step_formulas(p);
  std::string parts = "compute + bubble", bytes_text;
  double bytes = 0;
  for (Axis axis : shown_axes(L.mesh)) {
    const AxisCost& a = st.axes[axis];
    t.add({std::string(axis_name(axis)), a.size, group_words(a), a.size > 1 ? a.busbw_GBps : 0.0,
           a.bytes, a.seconds, a.size > 1 ? formulas[axis] : std::string("-")});
    parts += " + " + std::string(axis_name(axis));
    bytes += a.bytes;
  }
  t.add({"step", L.gpus(), "-", 0.0, bytes, st.total_s(),
         parts + (L.overlap ? " (exposed: " + num(st.exposed_s()) + " s of " +
                                  num(st.communication_s()) + " s communication)"
                            : std::string(" (no overlap)"))});
  return t;
}

Table search_table(const std::vector<Candidate>& found) {
  std::vector<std::string> columns{"rank"};
  for (Axis axis : kAxes) columns.emplace_back(axis_name(axis));
  for (const char* c : {"microbatches", "step_time_s", "bubble", "communication_s", "memory_gb",
                        "fits", "tp_crosses_nodes", "memory_per_gpu_bytes"})
    columns.emplace_back(c);
  Table t(columns);
  int rank = 0;
  for (const Candidate& k : found) {
    std::vector<shardlab::Cell> row{++rank};
    for (Axis axis : kAxes) row.emplace_back(k.layout.mesh.size(axis));
    for (shardlab::Cell cell : std::vector<shardlab::Cell>{
             k.layout.microbatches, k.step.total_s(), k.step.bubble_fraction,
             k.step.communication_s(), k.memory.total() / 1e9, k.fits, bool(k.crossings[Axis::tp]),
             k.memory.total()})
      row.push_back(cell);
    t.add(row);
  }
  return t;
}

// The seeds' two layouts, each as its preset's defaults lay it out (on A100s, as run).
Table seeds_table() {
  struct Seed {
    const char* seed;
    const char* says;
    const char* model;
    const char* truth;
  };
  const Seed seeds[] = {
      {"so-large-lm ch. 8, sec. 6", "GPT-3", "1t",
       "NVIDIA's 1T model (Narayanan et al. 2021, Table 1's last row), not GPT-3"},
      {"CS336 lecture 7, sec. 5.1", "GPT-3 175B", "gpt3-175b",
       "GPT-3 175B as the notes lay it out (no layout was published); days: an estimate"},
  };
  Table t({"seed", "says", "mesh", "gpus", "is", "params", "memory_gb", "fits", "training_days"});
  for (const Seed& s : seeds) {
    PlanSettings settings;
    settings.model = s.model;
    const ResolvedPlan p = resolve_plan(settings);
    const double P = parameters(p.model), total = memory_per_gpu(p.model, p.layout).total();
    t.add({s.seed, s.says, mesh_name(p.layout.mesh), p.gpus, s.truth, P, total / 1e9,
           total <= p.cluster.gpu_memory_bytes,
           training_days(P, p.tokens, double(p.gpus), p.cluster.achieved_tflops * 1e12, true)});
  }
  return t;
}

/// For each ring that crosses nodes with only a share of its bytes: NCCL's rings, and one.
void say_rings(shardlab::Context& ctx, const ResolvedPlan& p, const StepEstimate& st) {
  const ClusterSpec& c = p.cluster;
  for (Axis axis : shown_axes(p.layout.mesh)) {
    const AxisCost& a = st.axes[axis];
    if (a.one_ring_s == a.seconds || a.cross_share >= 1) continue;
    const double edges = a.size, across = a.cross_share * edges;
    ctx.say("  " + std::string(axis_name(axis)) + " crosses nodes: a ring over its " + num(edges) +
            " GPUs has " + num(across) + " edges between nodes; NCCL's rings (one a channel) " +
            "cross at other GPUs, so every GPU sends " + num(a.cross_share, 3) + " of its " +
            std::string(axis_name(axis)) + " bytes over its " + num(c.network_GBps) +
            " GB/s share of the node's " + str(c.nics_per_node) +
            " NICs and the rest over NVLink: " + num(a.seconds) +
            " s. One ring, whose crossing GPU sends them all on one NIC of " + num(c.nic_GBps()) +
            " GB/s: " + num(a.one_ring_s) + " s");
  }
}

/// The plan's first lines: the model, the cluster and the layout.
void say_plan(shardlab::Context& ctx, const PlanSettings& s, const ResolvedPlan& p) {
  const ModelSpec& m = p.model;
  const ClusterSpec& c = p.cluster;
  const Layout& L = p.layout;
  ctx.say("Chapter 08 - the planner, on paper: " + m.name + " on " + str(p.gpus) + " x " + c.name +
          " (Narayanan et al. 2021; Korthikanti et al. 2022)");
  ctx.say("  model: l = " + str(m.layers) + " layers, h = " + str(m.hidden) +
          ", a = " + str(m.heads) + " heads, s = " + str(m.seq) + ", V = " + str(m.vocab) +
          (m.experts > 0 ? ", E = " + str(m.experts) + " experts, k = " + str(m.top_k) + " in " +
                               str(m.moe_layers(0, m.layers)) + " MoE layers"
                         : std::string()) +
          " (" + m.source + ")");
  ctx.say("  cluster: " + num(c.gpu_memory_bytes / 1e9) +
          " GB a GPU, X = " + num(c.achieved_tflops) + " of " + num(c.peak_tflops) + " TFLOP/s, " +
          str(c.gpus_per_node) + " GPUs a node, NVLink " + num(c.nvlink_GBps) + " GB/s, network " +
          num(c.network_GBps) + " GB/s a GPU (" + str(c.nics_per_node) + " NICs of " +
          num(c.nic_GBps()) + " GB/s a node; " + c.source + ")");
  ctx.say("  layout: " + layout_words(L) +
          (s.search && !p.layout_given ? ", the search's pick" : "") + "; ZeRO " + str(L.zero) +
          ", recompute " + recompute_name(L.recompute) + ", sequence parallel " +
          (L.sequence_parallel ? "yes" : "no") + "; tp fastest: rank = " + rank_formula(L.mesh));
}

/// Narayanan et al.'s eqs. 2-4 for the plan.
Table estimate_table(const ResolvedPlan& p) {
  const ModelSpec& m = p.model;
  const Layout& L = p.layout;
  const bool moe = m.experts > 0, recomputation = L.recompute == Recompute::full;
  Table estimate({"quantity", "value", "formula"});
  estimate.add(
      {"parameters P", parameters(m),
       std::string("eq. 2: 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))") +
           (moe ? " + each MoE layer's E - 1 more MLPs (8 h^2 + 5 h) and router h E" : "")});
  estimate.add({"FLOPs per iteration F", flops_per_iteration(m, double(L.batch())),
                "eq. 3: 96 B s l h^2 (1 + s/(6h) + V/(16 l h)), B = " + str(L.batch()) +
                    (moe ? " + (k - 1) 64 B s h^2 a MoE layer" : "")});
  if (moe)
    estimate.add({"parameters a token meets", active_parameters(m),
                  "P with k of each MoE layer's E experts (k - 1 more MLPs, and the router)"});
  estimate.add({"training days", plan_days(p),
                std::string("eq. 4: ") + (recomputation ? "8" : "6") + " T P" +
                    (moe ? "_token" : "") + " / (n X), T = " + num(p.tokens) + " tokens, n = " +
                    str(p.gpus) + ", X = " + num(p.cluster.achieved_tflops) + " TFLOP/s"});
  return estimate;
}

/// The plan's figures under --json.
void plan_json(nlohmann::json& j, const ResolvedPlan& p, const MemoryEstimate& mem,
               const StepEstimate& st) {
  const Layout& L = p.layout;
  j["model"] = p.model.name;
  j["cluster"] = p.cluster.name;
  j["gpus"] = p.gpus;
  nlohmann::json layout = nlohmann::json::object();
  for (Axis axis : kAxes) layout[std::string(axis_name(axis))] = L.mesh.size(axis);
  layout.update({{"microbatches", L.microbatches},
                 {"microbatch_size", L.microbatch_size},
                 {"batch", L.batch()},
                 {"zero", L.zero},
                 {"recompute", recompute_name(L.recompute)},
                 {"sequence_parallel", L.sequence_parallel}});
  j["layout"] = layout;
  j["params"] = parameters(p.model);
  j["flops_per_iteration"] = flops_per_iteration(p.model, double(L.batch()));
  j["training_days"] = plan_days(p);
  j["memory_per_gpu_bytes"] = {{"params", mem.params},
                               {"grads", mem.grads},
                               {"optimizer", mem.optimizer},
                               {"activations", mem.activations},
                               {"total", mem.total()}};
  j["gpu_memory_bytes"] = p.cluster.gpu_memory_bytes;
  j["fits"] = mem.total() <= p.cluster.gpu_memory_bytes;
  for (Axis axis : kAxes) {
    const std::string name(axis_name(axis));
    j["communication_bytes"][name] = st.axes[axis].bytes;
    j["communication_time_s"][name] = st.axes[axis].seconds;
    j["crosses_nodes"][name] = st.axes[axis].crosses_nodes;
    j["cross_node_share"][name] = st.axes[axis].cross_share;
    j["one_ring_time_s"][name] = st.axes[axis].one_ring_s;
    j["hidden_time_s"][name] = st.axes[axis].hidden_s;
  }
  j["compute_time_s"] = st.compute_s;
  j["bubble_fraction"] = st.bubble_fraction;
  j["bubble_time_s"] = st.bubble_s;
  j["step_time_s"] = st.total_s();
}

/// --search's ranking: the fastest `top` layouts, and how many there were.
void report_search(shardlab::Context& ctx, const PlanSettings& s, const ResolvedPlan& p) {
  const Table found = search_table(p.candidates);
  const std::int64_t shown = std::int64_t(p.candidates.size());
  ctx.report(found, "search",
             "\n--search: every dp x ep x cp x tp x pp = " + str(p.gpus) +
                 " with m = B/(dp ep b), B = " + str(p.candidates.front().layout.batch()) + ": " +
                 str(p.counted.layouts) + " layouts, " + str(p.counted.fit) + " fit in " +
                 ch05::gb(p.cluster.gpu_memory_bytes) +
                 (shown < p.counted.layouts ? "; the fastest " + str(shown) + " (--top N for more)"
                                            : std::string("")) +
                 ", fastest first (those that do not fit marked, not hidden)");
  if (s.csv) ctx.save_csv(found, "08_hybrid_mesh_search");
}

}  // namespace

double plan_days(const ResolvedPlan& p) {
  // Eq. 4 counts the FLOPs a token costs: of a MoE model, the parameters a token meets.
  return training_days(active_parameters(p.model), p.tokens, double(p.gpus),
                       p.cluster.achieved_tflops * 1e12,
                       p.layout.recompute == Recompute::full);  // eq. 4's 8 rather than 6
}

void report_plan(shardlab::Context& ctx, const PlanSettings& s) {
  const ResolvedPlan p = resolve_plan(s);
  const MemoryEstimate mem = memory_per_gpu(p.model, p.layout);
  const StepEstimate st = step_time(p.model, p.cluster, p.layout);

  say_plan(ctx, s, p);
  ctx.report(estimate_table(p), "estimate", "\nNarayanan et al. 2021 §5.1:");
  ctx.report(memory_table(p.model, p.layout, mem), "memory",
             "\nMemory of a GPU of the first pipeline stage (states: chapter 05's ZeRO; "
             "activations: Korthikanti et al. Table 2, 1F1B's in-flight microbatches):");
  const double gpu = p.cluster.gpu_memory_bytes;
  const std::string numbers = ch05::gb(mem.total()) + " of the GPU's " + ch05::gb(gpu) +
                              " (model states " + ch05::gb(mem.params + mem.grads + mem.optimizer) +
                              ", activations " + ch05::gb(mem.activations) + ")";
  ctx.say(mem.total() <= gpu ? "  fits: " + numbers : "  does not fit: " + numbers);
  ctx.report(
      step_table(p, st), "step",
      std::string(p.layout.overlap ? "\nOne step, per GPU (with --overlap, each axis's hidden part "
                                     "under the computation, the exposed rest added: hidden_time_s "
                                     "in the JSON; "
                                   : "\nOne step, per GPU (communication all exposed, none "
                                     "overlapped: an upper bound; ") +
          "busbw: bytes over seconds, the speed of the bottleneck as nccl-tests "
          "reports it):");
  say_rings(ctx, p, st);
  plan_json(ctx.json(), p, mem, st);
  if (s.search) report_search(ctx, s, p);
  ctx.report(seeds_table(), "seed_layouts",
             "\nThe seeds' two layouts, as their papers ran them (A100s, full recomputation):");
}

}  // namespace ch08
