// Chapter 08's planner on paper: its flags and its tables (plan_report.hpp).
#include "plan_report.hpp"

#include <CLI/CLI.hpp>
#include <climits>
#include <cmath>
#include <nlohmann/json.hpp>

#include "calculator.hpp"  // ch05::gb
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
  ClusterSpec c = *preset;
  if (s.gpu_memory_gb != 0) c.gpu_memory_bytes = s.gpu_memory_gb * 1e9;
  if (s.gpus_per_node != 0) c.gpus_per_node = s.gpus_per_node;
  // The preset's measured X was on A100s; elsewhere the cluster's own.
  if (s.achieved_tflops != 0)
    c.achieved_tflops = s.achieved_tflops;
  else if (m.run.achieved_tflops > 0 && c.name == "a100-80gb")
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

void add_plan_options(CLI::App& cli, PlanSettings& s) {
  namespace sc = shardlab::cli;
  std::vector<std::string> models = model_names();
  models.push_back("custom");
  cli.add_option("--model", s.model, "a model (" + joined(models) + ")")
      ->check(CLI::IsMember(models))
      ->capture_default_str();
  cli.add_option("--layers", s.layers, "layers l (custom, or to change the preset's)")
      ->check(sc::between(1, 1e5));
  cli.add_option("--hidden", s.hidden, "hidden size h (default: the model's)")
      ->check(sc::between(1, 1e6));
  cli.add_option("--heads", s.heads, "attention heads a")->check(sc::between(1, 1e5));
  cli.add_option("--seq", s.seq, "sequence length s (preset: 2048)")
      ->transform(sc::quantity())
      ->check(sc::between(1, 1 << 27));
  cli.add_option("--vocab", s.vocab, "vocabulary V (preset: 51200)")
      ->transform(sc::quantity())
      ->check(sc::between(1, 1e8));
  cli.add_option("--experts", s.experts,
                 "E: a Mixture-of-Experts MLP in every --moe-every-th layer (0: dense; default: "
                 "the model's)")
      ->check(sc::between(0, 1e5));
  cli.add_option("--top-k", s.top_k, "k: the experts a token goes to (default: the model's, 2)")
      ->check(sc::between(1, 1e5));
  cli.add_option("--moe-every", s.moe_every, "every this many layers a MoE one (default: 1)")
      ->check(sc::between(1, 1e5));
  cli.add_option("--cluster", s.cluster, "the GPUs (" + joined(cluster_names()) + ")")
      ->check(CLI::IsMember(cluster_names()))
      ->capture_default_str();
  cli.add_option("--gpus", s.gpus, "GPUs n (1024, 3K, 2^12; default: the preset's run)")
      ->transform(sc::quantity())
      ->check(sc::between(1, double(kMaxGpus)));
  cli.add_option("--tokens", s.tokens, "training tokens T (300B; default: the preset's)")
      ->transform(sc::quantity())
      ->check(sc::between(1, 1e16));
  cli.add_option("--batch", s.batch, "global batch B in sequences (default: the preset's)")
      ->transform(sc::quantity())
      ->check(sc::between(1, INT_MAX));
  cli.add_option("--microbatch-size", s.microbatch_size,
                 "microbatch size b (default: the preset's run's, else 1)")
      ->check(sc::between(1, 1 << 20));
  cli.add_option("--achieved-tflops", s.achieved_tflops,
                 "X, TFLOP/s a GPU (default: the preset's run on A100s, else the cluster's)")
      ->check(sc::between(1e-3, 1e6));
  cli.add_option("--gpu-memory-gb", s.gpu_memory_gb, "GB (1e9 bytes) a GPU (default: 80)")
      ->check(sc::between(1e-3, 1e6));
  cli.add_option("--gpus-per-node", s.gpus_per_node, "GPUs a node (default: the cluster's, 8)")
      ->check(sc::between(1, 1 << 20));
  cli.add_option("--zero", s.zero, "ZeRO stage over dp, 0-3")
      ->check(sc::between(0, 3))
      ->capture_default_str();
  cli.add_option("--recompute", s.recompute, "activation recomputation")
      ->check(CLI::IsMember({"none", "selective", "full"}))
      ->capture_default_str();
  cli.add_flag("--sequence-parallel", s.sequence_parallel,
               "split LayerNorm and dropout over tp too (Korthikanti et al. 2022)");
  cli.add_option("--dp", s.dp, "data-parallel replicas (default: the preset's run's)")
      ->check(sc::between(1, 1 << 20));
  cli.add_option("--tp", s.tp, "tensor-parallel GPUs per layer")->check(sc::between(1, 1 << 20));
  cli.add_option("--pp", s.pp, "pipeline stages")->check(sc::between(1, 1 << 20));
  cli.add_option("--cp", s.cp, "context-parallel GPUs: each sequence over a ring of them")
      ->check(sc::between(1, 1 << 20));
  cli.add_option("--ep", s.ep, "expert-parallel GPUs: the experts over them (carved out of dp)")
      ->check(sc::between(1, 1 << 20));
  cli.add_option("--microbatches", s.microbatches, "microbatches m a step and replica")
      ->check(sc::between(1, 1 << 20));
  cli.add_flag("--search", s.search, "rank every (dp, ep, cp, tp, pp, m) of the GPUs");
  cli.add_flag("--csv", s.csv, "with --search: also write the ranking as CSV");
}

// ---------------------------------------------------------------------------
// The settings made concrete

ResolvedPlan resolve_plan(const PlanSettings& s) {
  ResolvedPlan p;
  p.model = resolve_model(s);
  p.cluster = resolve_cluster(s, p.model);
  const ReferenceRun& run = p.model.run;  // custom: none (gpus = 0)
  for (const auto& [flag, value] : {std::pair{"--dp", s.dp},
                                    {"--tp", s.tp},
                                    {"--pp", s.pp},
                                    {"--cp", s.cp},
                                    {"--ep", s.ep},
                                    {"--microbatches", s.microbatches},
                                    {"--microbatch-size", s.microbatch_size}})
    require_usage(value >= 0, std::string(flag) + " " + str(value) + ": it must be at least 1");
  p.layout_given = s.dp != 0 || s.tp != 0 || s.pp != 0 || s.cp != 0 || s.ep != 0;
  const int tp = s.tp != 0 ? s.tp : run.gpus != 0 ? run.tp : 1;
  const int pp = s.pp != 0 ? s.pp : run.gpus != 0 ? run.pp : 1;
  const int cp = s.cp != 0 ? s.cp : 1;
  const int ep = s.ep != 0 ? s.ep : run.gpus != 0 && p.model.experts > 0 ? run.ep : 1;
  const std::int64_t others = std::int64_t{tp} * pp * cp * ep;  // the GPUs of a replica
  if (s.gpus != 0)
    p.gpus = whole("--gpus", s.gpus, 1, double(kMaxGpus), "a number of GPUs");
  else if (s.dp != 0)
    p.gpus = std::int64_t{s.dp} * others;
  else if (run.gpus != 0)
    p.gpus = run.gpus;
  else
    throw shardlab::UsageError("--model custom: give --gpus (or --dp, --tp and --pp)");
  require_usage(p.gpus <= kMaxGpus, "dp x tp x pp = " + str(p.gpus) + " GPUs: a plan has 1 to " +
                                        str(kMaxGpus) + " (2^24)");
  p.tokens = s.tokens != 0 ? s.tokens : run.tokens;
  require_usage(std::isfinite(p.tokens) && p.tokens > 0,
                "--tokens " + num(p.tokens) + ": a positive number");
  const int b = s.microbatch_size != 0 ? s.microbatch_size
                : run.gpus != 0        ? run.microbatch_size
                                       : 1;
  const std::int64_t given_batch =
      s.batch != 0 ? whole("--batch", s.batch, 1, INT_MAX, "a number of sequences") : 0;
  Layout& L = p.layout;
  L = {.tp = tp,
       .pp = pp,
       .microbatch_size = b,
       .zero = s.zero,
       .recompute = parse_recompute(s.recompute),
       .sequence_parallel = s.sequence_parallel,
       .cp = cp,
       .ep = ep};
  require_usage(s.zero >= 0 && s.zero <= 3, "--zero " + str(s.zero) + ": the stages are 0 to 3");

  if (s.search) {
    const std::int64_t B = given_batch != 0 ? given_batch : run.batch;
    require_usage(B != 0, "--search: give --batch (sequences a step)");
    p.candidates = search(p.model, p.cluster,
                          {.gpus = p.gpus,
                           .batch = B,
                           .microbatch_size = b,
                           .zero = s.zero,
                           .recompute = L.recompute,
                           .sequence_parallel = L.sequence_parallel});
    require_usage(!p.candidates.empty(), "--search: no layout of " + str(p.gpus) + " GPUs splits " +
                                             str(B) + " sequences into microbatches of " + str(b) +
                                             " with tp dividing " + str(p.model.heads) +
                                             " heads and pp dividing " + str(p.model.layers) +
                                             " layers");
    if (!p.layout_given && s.microbatches == 0) {  // plan the fastest that fits
      const Candidate* pick = &p.candidates.front();
      for (const Candidate& k : p.candidates)
        if (k.fits) {
          pick = &k;
          break;
        }
      L = pick->layout;
      return p;
    }
  }

  const std::string named = "tp " + str(tp) + " x pp " + str(pp) +
                            (cp > 1 ? " x cp " + str(cp) : std::string()) +
                            (ep > 1 ? " x ep " + str(ep) : std::string());
  require_usage(s.dp != 0 || p.gpus % others == 0,
                str(p.gpus) + " GPUs: " + named + " = " + str(others) +
                    " does not divide them; give --dp --tp --pp, or --search");
  const std::int64_t dp = s.dp != 0 ? s.dp : p.gpus / others;
  require_usage(dp <= kMaxGpus, "--dp " + str(dp) + ": too many GPUs");
  L.dp = int(dp);
  const std::int64_t replicas = dp * ep;  // each its own sequences
  std::int64_t B = given_batch;
  if (B == 0) B = s.microbatches != 0 ? replicas * s.microbatches * b : run.batch;
  require_usage(B != 0, "--model custom: give --batch (sequences a step) or --microbatches");
  require_usage(B <= INT_MAX, "a batch of " + str(B) + " sequences: at most 2^31 - 1");
  const std::string dp_words = "dp " + str(dp) + (ep > 1 ? " x ep " + str(ep) : std::string());
  if (s.microbatches != 0) {
    L.microbatches = s.microbatches;
    require_usage(L.batch() == B, "--batch " + str(B) + " but " + dp_words + " x " +
                                      str(s.microbatches) + " microbatches x b " + str(b) + " = " +
                                      str(L.batch()));
  } else {
    require_usage(B % (replicas * b) == 0, "a batch of " + str(B) +
                                               " sequences is no whole number " +
                                               "of microbatches of b = " + str(b) + " on " +
                                               dp_words + ": give --batch or --microbatches");
    L.microbatches = int(B / (replicas * b));
  }
  check_layout(p.model, L, p.gpus);
  return p;
}

void validate_plan(const PlanSettings& settings) { resolve_plan(settings); }

// ---------------------------------------------------------------------------
// The report

namespace {

std::string layout_words(const Layout& L) {
  return "dp " + str(L.dp) + (L.ep > 1 ? " x ep " + str(L.ep) : std::string()) +
         (L.cp > 1 ? " x cp " + str(L.cp) : std::string()) + " x tp " + str(L.tp) + " x pp " +
         str(L.pp) + " = " + str(L.gpus()) + " GPUs, m = " + str(L.microbatches) +
         " microbatches of b = " + str(L.microbatch_size) + " (B = " + str(L.batch()) + ")";
}

std::string group_words(const AxisCost& a) {
  return a.size == 1 ? "-" : a.crosses_nodes ? "crosses nodes" : "inside a node";
}

Table memory_table(const ModelSpec& m, const Layout& L, const MemoryEstimate& e) {
  const double psi = stage_parameters(m, L.tp, L.pp),
               experts = expert_parameters(m, L.tp, L.pp, L.ep);
  // With cp or ep the dense weights' copies are d e c, the experts' d c.
  const std::string d = L.cp * L.ep > 1 ? "(d e c = " + str(L.dp * L.ep * L.cp) + ")" : str(L.dp);
  const std::string of =
      " of " + num(psi) + " parameters" +
      (experts > 0 ? " (and " + num(experts) + " experts' over d c = " + str(L.dp * L.cp) + ")"
                   : std::string());
  std::string acts =
      L.recompute == Recompute::full ? "2 s b h"
      : L.recompute == Recompute::selective
          ? (L.sequence_parallel ? "s b h 34/t" : "s b h (10 + 24/t)")
          : (L.sequence_parallel ? "s b h (34 + 5as/h)/t" : "s b h (10 + 24/t + 5as/(ht))");
  if (L.recompute == Recompute::full && L.sequence_parallel) acts += "/t";
  if (L.cp > 1) acts = "(" + acts + ")/c";
  if (m.experts > 0 && L.recompute != Recompute::full)
    acts += ", + (k-1) 16 s b h/(t c) a MoE layer";
  Table t({"category", "bytes", "GB", "formula"});
  t.add({"params", e.params, ch05::gb(e.params),
         "2 bytes" + of + (L.zero >= 3 ? ", / dp " + d : std::string())});
  t.add({"grads", e.grads, ch05::gb(e.grads),
         "2 bytes" + of + (L.zero >= 2 ? ", / dp " + d : std::string())});
  t.add({"optimizer", e.optimizer, ch05::gb(e.optimizer),
         "12 bytes (fp32 master, m, v)" + of + (L.zero >= 1 ? ", / dp " + d : std::string())});
  t.add({"activations", e.activations, ch05::gb(e.activations),
         acts + " a layer (recompute " + recompute_name(L.recompute) + ") x " +
             str(m.layers / L.pp) + " layers x " + str(std::min(L.pp, L.microbatches)) +
             " microbatches in flight"});
  t.add({"total", e.total(), ch05::gb(e.total()), "ZeRO stage " + str(L.zero)});
  return t;
}

Table step_table(const ResolvedPlan& p, const StepEstimate& st) {
  const Layout& L = p.layout;
  Table t({"part", "size", "group", "link_GBps", "bytes", "seconds", "formula"});
  t.add({"compute", p.gpus, "-", 0.0, 0.0, st.compute_s,
         "F / (n X), F = " + num(st.flops) + " (recompute " + recompute_name(L.recompute) +
             "), X = " + num(p.cluster.achieved_tflops) + " TFLOP/s"});
  t.add({"bubble", L.pp, "-", 0.0, 0.0, st.bubble_s,
         "(p - 1)/m = " + num(st.bubble_fraction, 3) + " of compute (1F1B)"});
  const auto axis = [&](const char* name, const AxisCost& a, const std::string& formula) {
    t.add({name, a.size, group_words(a), a.size > 1 ? a.link_GBps : 0.0, a.bytes, a.seconds,
           a.size > 1 ? formula : std::string("-")});
  };
  axis("tp", st.tp,
       str(tp_allreduces_per_layer(L)) + " allreduces of b s h x " + str(p.model.layers / L.pp) +
           " layers x " + str(L.microbatches) + " microbatches, 2(t-1)/t each" +
           (L.sequence_parallel ? " (sp: the backward's 2 all-gathers are the 5th)" : ""));
  const std::string factor = L.zero == 3 ? "3" : "2";
  const double experts = expert_parameters(p.model, L.tp, L.pp, L.ep);
  axis("dp", st.dp,
       L.cp * L.ep > 1 || experts > 0
           ? factor + "(n-1)/n x " + num(stage_parameters(p.model, L.tp, L.pp)) +
                 " gradients, n = d e c = " + str(L.dp * L.ep * L.cp) +
                 (experts > 0 ? "; " + factor + "(n-1)/n x " + num(experts) +
                                    " experts', n = d c = " + str(L.dp * L.cp)
                              : std::string()) +
                 " (ZeRO " + str(L.zero) + ")"
           : factor + "(d-1)/d x " + num(stage_parameters(p.model, L.tp, L.pp)) +
                 " gradients (ZeRO " + str(L.zero) + ")");
  axis("pp", st.pp,
       std::string(L.pp == 2 ? "b s h" : "2 b s h") + (L.sequence_parallel ? "/t" : "") +
           (L.cp > 1 ? "/c" : "") + " a microbatch x " + str(L.microbatches));
  if (L.cp > 1)
    axis("cp", st.cp,
         "blocks of k or v, s/c b h/t: " +
             std::string(L.recompute == Recompute::none ? "2 (c-1)" : "2 x 2 (c-1)") +
             " forward + 4 (c-1) + 2 backward, x " + str(p.model.layers / L.pp) + " layers x " +
             str(L.microbatches) + " microbatches (chapter 10's ring)");
  if (L.ep > 1)
    axis("ep", st.ep,
         std::string(L.recompute == Recompute::full ? "6" : "4") +
             " passes of k b s/c h x (e-1)/e (an even router) x " +
             str(p.model.moe_layers(0, p.model.layers / L.pp)) + " MoE layers x " +
             str(L.microbatches) + " microbatches");
  t.add({"step", L.gpus(), "-", 0.0,
         st.tp.bytes + st.dp.bytes + st.pp.bytes + st.cp.bytes + st.ep.bytes, st.total_s(),
         std::string("compute + bubble + tp + dp + pp") + (L.cp > 1 ? " + cp" : "") +
             (L.ep > 1 ? " + ep" : "") + " (no overlap)"});
  return t;
}

Table search_table(const std::vector<Candidate>& found) {
  Table t({"rank", "dp", "ep", "cp", "tp", "pp", "microbatches", "step_time_s", "bubble",
           "communication_s", "memory_gb", "fits", "tp_crosses_nodes", "memory_per_gpu_bytes"});
  int rank = 0;
  for (const Candidate& k : found)
    t.add({++rank, k.layout.dp, k.layout.ep, k.layout.cp, k.layout.tp, k.layout.pp,
           k.layout.microbatches, k.step.total_s(), k.step.bubble_fraction,
           k.step.communication_s(), k.memory.total() / 1e9, k.fits, k.crossings.tp,
           k.memory.total()});
  return t;
}

// The seeds' two layouts, each as its preset's defaults lay it out (on A100s, as run).
Table seeds_table() {
  struct Seed {
    const char* seed;
    const char* says;
    const char* model;
    const char* mesh;
    const char* truth;
  };
  const Seed seeds[] = {
      {"so-large-lm ch. 8, sec. 6", "GPT-3", "1t", "64 pp x 6 dp x 8 tp",
       "NVIDIA's 1T model (Narayanan et al. 2021, Table 1's last row), not GPT-3"},
      {"CS336 lecture 7, sec. 5.1", "GPT-3 175B", "gpt3-175b", "8 dp x 8 tp x 16 pp",
       "GPT-3 175B as the notes lay it out (no layout was published); days: an estimate"},
  };
  Table t({"seed", "says", "mesh", "gpus", "is", "params", "memory_gb", "fits", "training_days"});
  for (const Seed& s : seeds) {
    PlanSettings settings;
    settings.model = s.model;
    const ResolvedPlan p = resolve_plan(settings);
    const double P = parameters(p.model), total = memory_per_gpu(p.model, p.layout).total();
    t.add({s.seed, s.says, s.mesh, p.gpus, s.truth, P, total / 1e9,
           total <= p.cluster.gpu_memory_bytes,
           training_days(P, p.tokens, double(p.gpus), p.cluster.achieved_tflops * 1e12, true)});
  }
  return t;
}

}  // namespace

void report_plan(shardlab::Context& ctx, const PlanSettings& s) {
  const ResolvedPlan p = resolve_plan(s);
  const ModelSpec& m = p.model;
  const ClusterSpec& c = p.cluster;
  const Layout& L = p.layout;
  const double P = parameters(m), n = double(p.gpus), X = c.achieved_tflops * 1e12;
  const bool recomputation = L.recompute == Recompute::full;  // eq. 4's 8 rather than 6
  const double F = flops_per_iteration(m, double(L.batch()));
  // Eq. 4 counts the FLOPs a token costs: of a MoE model, the parameters a token meets.
  const double active = active_parameters(m);
  const double days = training_days(active, p.tokens, n, X, recomputation);
  const MemoryEstimate mem = memory_per_gpu(m, L);
  const bool fits = mem.total() <= c.gpu_memory_bytes;
  const StepEstimate st = step_time(m, c, L);

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
          num(c.network_GBps) + " GB/s a GPU (" + c.source + ")");
  ctx.say("  layout: " + layout_words(L) +
          (s.search && !p.layout_given ? ", the search's pick" : "") + "; ZeRO " + str(L.zero) +
          ", recompute " + recompute_name(L.recompute) + ", sequence parallel " +
          (L.sequence_parallel ? "yes" : "no") +
          (L.cp * L.ep > 1 ? "; mesh order pp, dp, ep, cp, tp (tp fastest): rank = (((pp_i dp + "
                             "dp_i) ep + ep_i) cp + cp_i) tp + tp_i"
                           : "; mesh order pp, dp, tp (tp fastest): rank = (pp_i dp + dp_i) tp + "
                             "tp_i"));

  Table estimate({"quantity", "value", "formula"});
  const bool moe = m.experts > 0;
  estimate.add(
      {"parameters P", P,
       std::string("eq. 2: 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))") +
           (moe ? " + each MoE layer's E - 1 more MLPs (8 h^2 + 5 h) and router h E" : "")});
  estimate.add({"FLOPs per iteration F", F,
                "eq. 3: 96 B s l h^2 (1 + s/(6h) + V/(16 l h)), B = " + str(L.batch()) +
                    (moe ? " + (k - 1) 64 B s h^2 a MoE layer" : "")});
  if (moe)
    estimate.add({"parameters a token meets", active,
                  "P with k of each MoE layer's E experts (k - 1 more MLPs, and the router)"});
  estimate.add({"training days", days,
                std::string("eq. 4: ") + (recomputation ? "8" : "6") + " T P" +
                    (moe ? "_token" : "") + " / (n X), T = " + num(p.tokens) + " tokens, n = " +
                    str(p.gpus) + ", X = " + num(c.achieved_tflops) + " TFLOP/s"});
  ctx.report(estimate, "estimate", "\nNarayanan et al. 2021 §5.1:");

  ctx.report(memory_table(m, L, mem), "memory",
             "\nMemory of a GPU of the first pipeline stage (states: chapter 05's ZeRO; "
             "activations: Korthikanti et al. Table 2, 1F1B's in-flight microbatches):");
  const std::string numbers = ch05::gb(mem.total()) + " of the GPU's " +
                              ch05::gb(c.gpu_memory_bytes) + " (model states " +
                              ch05::gb(mem.params + mem.grads + mem.optimizer) + ", activations " +
                              ch05::gb(mem.activations) + ")";
  ctx.say(fits ? "  fits: " + numbers : "  does not fit: " + numbers);

  ctx.report(step_table(p, st), "step",
             "\nOne step, per GPU (communication all exposed, none overlapped: an upper bound):");

  nlohmann::json& j = ctx.json();
  j["model"] = m.name;
  j["cluster"] = c.name;
  j["gpus"] = p.gpus;
  j["layout"] = {{"dp", L.dp},
                 {"tp", L.tp},
                 {"pp", L.pp},
                 {"cp", L.cp},
                 {"ep", L.ep},
                 {"microbatches", L.microbatches},
                 {"microbatch_size", L.microbatch_size},
                 {"batch", L.batch()},
                 {"zero", L.zero},
                 {"recompute", recompute_name(L.recompute)},
                 {"sequence_parallel", L.sequence_parallel}};
  j["params"] = P;
  j["flops_per_iteration"] = F;
  j["training_days"] = days;
  j["memory_per_gpu_bytes"] = {{"params", mem.params},
                               {"grads", mem.grads},
                               {"optimizer", mem.optimizer},
                               {"activations", mem.activations},
                               {"total", mem.total()}};
  j["gpu_memory_bytes"] = c.gpu_memory_bytes;
  j["fits"] = fits;
  j["communication_bytes"] = {{"tp", st.tp.bytes},
                              {"dp", st.dp.bytes},
                              {"pp", st.pp.bytes},
                              {"cp", st.cp.bytes},
                              {"ep", st.ep.bytes}};
  j["communication_time_s"] = {{"tp", st.tp.seconds},
                               {"dp", st.dp.seconds},
                               {"pp", st.pp.seconds},
                               {"cp", st.cp.seconds},
                               {"ep", st.ep.seconds}};
  j["crosses_nodes"] = {{"tp", st.tp.crosses_nodes},
                        {"dp", st.dp.crosses_nodes},
                        {"pp", st.pp.crosses_nodes},
                        {"cp", st.cp.crosses_nodes},
                        {"ep", st.ep.crosses_nodes}};
  j["compute_time_s"] = st.compute_s;
  j["bubble_fraction"] = st.bubble_fraction;
  j["bubble_time_s"] = st.bubble_s;
  j["step_time_s"] = st.total_s();

  if (s.search) {
    const Table found = search_table(p.candidates);
    int fitting = 0;
    for (const Candidate& k : p.candidates) fitting += k.fits;
    ctx.report(found, "search",
               "\n--search: every dp x ep x cp x tp x pp = " + str(p.gpus) +
                   " with m = B/(dp ep b), B = " + str(p.candidates.front().layout.batch()) +
                   ", fastest first (" + str(std::int64_t(p.candidates.size())) + " layouts, " +
                   str(fitting) + " fit in " + ch05::gb(c.gpu_memory_bytes) +
                   "; the rest marked, not hidden)");
    if (s.csv) ctx.save_csv(found, "08_hybrid_mesh_search");
  }

  ctx.report(seeds_table(), "seed_layouts",
             "\nThe seeds' two layouts, as their papers ran them (A100s, full recomputation):");
}

}  // namespace ch08
