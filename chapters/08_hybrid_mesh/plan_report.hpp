// Chapter 08's planner on paper (the program ch08_plan, plan_main.cpp): planner.hpp's
// arithmetic for a model on a cluster, printed as tables (and the same rows under --json),
// with no ranks doing any work.
//
//   ch08_plan                       GPT-3 175B on 1024 A100s as dp 8 x tp 8 x pp 16 (CS336
//                                   lecture 7 §5.1): memory, step time, 34 days (eq. 4)
//   ch08_plan --model 1t            NVIDIA's 1T model on 3072 GPUs, 64 x 6 x 8: 84 days
//   ch08_plan --search              every (dp, ep, cp, tp, pp, m) of the GPUs, fastest first;
//                                   the plan printed is the fastest that fits (or the flags')
//   ch08_plan --model 1.3b-moe128   DeepSpeed-MoE's 52B model: 128 experts over ep 128
//   ch08_plan --cp 4 --seq 32768    GPT-3 with 32K tokens a sequence, each over a ring of 4
//   ch08_plan --model custom --layers 32 --hidden 4096 --heads 32 --gpus 64 --batch 512
//
// Every plan ends with the seeds' two layouts side by side (both as their papers ran them
// on A100s, whatever the other flags say): so-large-lm §6's 64 stages x 6 DGX hosts x 8 GPUs
// = 3072, which it calls GPT-3's and which is NVIDIA's 1T model (Narayanan et al. 2021, Table
// 1), and CS336 lecture 7 §5.1's 8 x 8 x 16 = 1024 for GPT-3 175B.
//
// A plan that does not fit the GPU's memory is a result ("does not fit", with the numbers;
// exit 0). Bad input is a UsageError: one line, exit 2.
#pragma once

#include <string>
#include <vector>

#include "planner.hpp"

namespace CLI {
class App;
}
namespace shardlab {
class Context;
}

namespace ch08 {

/// Every flag of the mode. 0 means "not given": the preset's value (or the cluster's).
struct PlanSettings {
  std::string model = "gpt3-175b";    ///< a preset, or "custom"
  int layers = 0;                     ///< l: custom, or to change a preset
  int hidden = 0;                     ///< h: custom, or to change a preset
  int heads = 0;                      ///< a: custom, or to change a preset
  int seq = 0;                        ///< s: custom, or to change a preset
  int vocab = 0;                      ///< V: custom, or to change a preset
  int experts = -1;                   ///< E: a MoE model's experts (0: dense), or -1: the preset's
  int top_k = 0;                      ///< k: the experts a token goes to, or 0: the preset's (2)
  int moe_every = 0;                  ///< every this many layers a MoE one, or 0: the preset's (1)
  std::string cluster = "a100-80gb";  ///< a preset (cluster_presets)
  std::string machine;                ///< a measured machine's profile (machine.hpp), or ""
  bool overlap = false;               ///< each axis's communication under the computation
  double gpus = 0;                    ///< 0: the preset's run, or dp x tp x pp
  double tokens = 0;                  ///< T; 0: the preset's (300B; 1t: 450B)
  double batch = 0;                   ///< B, sequences a step; 0: the preset's, or dp x m x b
  int microbatch_size = 0;            ///< b; 0: the preset's run's (22b: 4), else 1
  double achieved_tflops = 0;         ///< X; 0: the preset's run on A100s, else the cluster's
  double gpu_memory_gb = 0;           ///< 0: the cluster's
  int gpus_per_node = 0;              ///< 0: the cluster's
  int nics_per_node = 0;              ///< 0: the cluster's (one a GPU with --gpus-per-node)
  int zero = 0;                       ///< ZeRO stage over dp, 0-3
  /// none, selective or full (parse_recompute); full as Narayanan's runs (eq. 4's
  /// 8 T P / (n X)).
  std::string recompute = "full";
  bool sequence_parallel = false;  ///< Korthikanti §4.2.2's sequence parallelism
  bool search = false;             ///< rank every (dp, ep, cp, tp, pp, m) of the GPUs (search)
  int top = 20;                    ///< with search: the fastest this many printed; 0: all
  /// The layout's degrees; an axis at 0 was not given: the preset run's (dp: the GPUs the
  /// others leave; cp 1; ep 1 for a dense model), or the search's.
  MeshShape mesh{.pp = 0, .dp = 0, .ep = 0, .cp = 0, .tp = 0};
  int microbatches = 0;  ///< m, or 0: the preset run's (or B / (dp b))
  bool csv = false;      ///< with search: also write 08_hybrid_mesh_search.csv
};

/// Registers every flag of the planner (plan_main.cpp's program).
void add_plan_options(CLI::App& cli, PlanSettings& settings);

/// The settings made concrete: presets looked up, defaults filled in, every size checked.
struct ResolvedPlan {
  ModelSpec model;        ///< the preset (or the custom model) with the flags' changes
  ClusterSpec cluster;    ///< the preset with the flags' changes
  Layout layout;          ///< what is planned: the flags', the preset run's or the search's pick
  std::int64_t gpus = 0;  ///< n
  double tokens = 0;      ///< T
  bool layout_given = false;          ///< --dp, --tp, --pp, --cp or --ep given
  std::vector<Candidate> candidates;  ///< with --search, fastest first (the spec's `keep`)
  SearchCount counted;                ///< with --search, the layouts it considered
};
/// UsageError (one line) on bad input: non-positive sizes, tp not dividing the heads or the
/// hidden size, pp not dividing the layers, the mesh's product not the GPUs, absurd GPU
/// counts, a batch that is no whole number of microbatches, an unknown preset, X above the
/// peak.
ResolvedPlan resolve_plan(const PlanSettings& settings);
/// Eq. 4's days for the plan: 8 T P / (n X) with full recomputation, 6 without; P a MoE
/// model's parameters a token meets.
double plan_days(const ResolvedPlan& plan);
/// resolve_plan's checks alone.
void validate_plan(const PlanSettings& settings);

/// Prints the plan's tables from rank 0 and fills the JSON (every rank may call it; it does
/// not communicate): params, flops_per_iteration, training_days, memory_per_gpu_bytes {params,
/// grads, optimizer, activations, total}, fits, communication_bytes, communication_time_s,
/// crosses_nodes, cross_node_share and one_ring_time_s per axis, compute_time_s, bubble_fraction,
/// bubble_time_s, step_time_s, the tables estimate, memory, step, seed_layouts, and with --search
/// `search` (the fastest `top` rows: the mesh, microbatches, step_time_s, memory_per_gpu_bytes,
/// fits, ...).
void report_plan(shardlab::Context& ctx, const PlanSettings& settings);

}  // namespace ch08
