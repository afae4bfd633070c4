// Chapter 08's planner: a GPT-style model's training run on a GPU cluster, on paper. The
// arithmetic of Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU
// Clusters Using Megatron-LM", SC21: §5.1 eqs. 2-4, Table 1) and Korthikanti et al. 2022
// ("Reducing Activation Recomputation in Large Transformer Models": §4, Table 2), with chapter
// 05's ZeRO calculator for the model states. No ranks are started; every function is pure.
//
// Names, the papers': l layers, h hidden size, a attention heads, s sequence length, V
// vocabulary, B global batch (sequences), b microbatch size, m microbatches per pipeline and
// step, t = tp, p = pp, d = dp (the mesh's degrees), n = d t p GPUs, X achieved FLOP/s per
// GPU, T training tokens, P parameters. Bytes are bytes; GB = 1e9 bytes (chapter 05's).
//
// The two axes chapters 07, 09 and 10 add, written the same way: c = cp, each sequence cut
// over c GPUs (Liu et al. 2023's ring; each GPU holds s/c of every sequence's tokens, so its
// activations are 1/c of the c = 1 count, and its ring passes keys and values), and e = ep,
// a Mixture-of-Experts model's E experts split over e GPUs carved out of data parallelism
// (Megatron-LM, DeepSpeed): the dense weights have d e replicas, each expert d; n = d e c t p,
// B = d e m b. A MoE model (E > 0) has E experts of k a token in every moe_every-th layer's
// MLP, from layer 0; the papers' formulas are for dense models, and each is extended for
// its MoE layers where it says so (their experts' parameters, FLOPs and activations).
//
// Left out, on purpose: the interleaved 1F1B schedule (Narayanan §2.2.2; its first stage
// holds 1 + (p - 1)/(p v) times the activations), Megatron's scatter/gather of the pipeline's
// messages (Narayanan §4.1: 1/t of each crosses the network), the activations of the
// embedding and output layers (Korthikanti §4.3: small next to l layers'), temporary buffers
// and fragmentation (ZeRO §3.2). Overlap of communication with computation is a layout's
// choice (Layout::overlap), as chapter 09 runs it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mesh.hpp"      // MeshShape, PerAxis
#include "training.hpp"  // ch05::Precision

namespace ch08 {

/// The most GPUs a plan may have: 2^24, about a hundred times the largest clusters of 2024.
inline constexpr std::int64_t kMaxGpus = std::int64_t{1} << 24;

// ---------------------------------------------------------------------------
// The model and the cluster

/// A run a paper reports for a model: the layout, batch and speed it trained with.
struct ReferenceRun {
  MeshShape mesh{.dp = 0};     ///< its layout (n = d e c t p GPUs); dp 0: no run known
  std::int64_t batch = 0;      ///< B, sequences
  int microbatch_size = 1;     ///< b, sequences a microbatch
  double achieved_tflops = 0;  ///< X on A100s, FLOP/s / 1e12
  double tokens = 300e9;       ///< T, the training tokens
  /// n, the GPUs it ran on; 0: no run known.
  int gpus() const { return mesh.dp == 0 ? 0 : mesh.ranks(); }
};

/// A GPT-style transformer: l layers of width h with a heads, s tokens of context, V words.
struct ModelSpec {
  std::string name;    ///< the preset's name (find_model), or "custom"
  int layers = 0;      ///< l
  int hidden = 0;      ///< h
  int heads = 0;       ///< a
  int seq = 2048;      ///< s, tokens of context
  int vocab = 51200;   ///< V
  std::string source;  ///< where the shape comes from (paper and table)
  ReferenceRun run;    ///< the run the source reports
  int experts = 0;     ///< E: a MoE MLP of E experts in every moe_every-th layer; 0: dense
  int top_k = 2;       ///< k: the experts a token goes to
  int moe_every = 1;   ///< 1: every layer's MLP a MoE; 2: every other layer's
  /// The MoE layers among layers [first, first + count) (layer i has one when i % moe_every
  /// is 0).
  int moe_layers(int first, int count) const;
};

/// The presets: `gpt3-175b` (Brown et al. 2020), every row of Narayanan et al. Table 1 by its
/// parameter column (`1.7b` ... `529.6b`, and `1t` for its last row, 1008.0B),
/// Korthikanti's `22b`, and DeepSpeed-MoE's `350m-moe128` and `1.3b-moe128` (13B and 52B).
const std::vector<ModelSpec>& model_presets();
/// The preset called `name`, or nullptr.
const ModelSpec* find_model(const std::string& name);

/// A cluster of nodes of GPUs: memory, speed and the two links a GPU's traffic can take.
/// Between nodes a node has `nics_per_node` network cards, together network_GBps x
/// gpus_per_node a direction: a DGX A100's 8 HDR cards of 200 Gb/s are 200 GB/s a node,
/// 25 GB/s a GPU.
struct ClusterSpec {
  std::string name;             ///< the preset's name (find_cluster)
  double gpu_memory_bytes = 0;  ///< each GPU's memory, bytes
  double peak_tflops = 0;       ///< dense bf16/fp16, FLOP/s / 1e12
  double achieved_tflops = 0;   ///< X, what a large run gets end to end
  int gpus_per_node = 8;        ///< GPUs per node, joined by NVLink
  double nvlink_GBps = 0;       ///< inside a node, per GPU, one direction
  double network_GBps = 0;      ///< between nodes, per GPU: the node's NICs over its GPUs
  int nics_per_node = 8;        ///< network cards a node, sharing the node's network_GBps x g
  /// Cores a node's GPUs share for their work; 0: each its own (a GPU). A machine's
  /// profile (machine.hpp) makes every rank a "GPU" of one core's rate, and a host with
  /// more ranks than cores runs them in turns: compute_s x ranks / cores.
  int cores_per_node = 0;
  std::string source;  ///< where the numbers come from (datasheets, papers)
  /// One network card's speed, GB/s a direction: network_GBps x gpus_per_node / nics_per_node.
  double nic_GBps() const { return network_GBps * gpus_per_node / nics_per_node; }
};

/// `a100-80gb` (DGX A100) and `h100-80gb` (DGX H100).
const std::vector<ClusterSpec>& cluster_presets();
/// The preset called `name`, or nullptr.
const ClusterSpec* find_cluster(const std::string& name);

// ---------------------------------------------------------------------------
// Narayanan et al. 2021 §5.1

/// Eq. 2: P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h)): per layer 12 h^2 weights and 13 h
/// biases and layer-norm values, plus the word (V h) and position (s h) embeddings. A MoE
/// layer has E MLPs (8 h^2 + 5 h each) for the one, and a router, h E.
double parameters(const ModelSpec& model);
/// The parameters a token meets: P with k of each MoE layer's E experts (eq. 4's P for a
/// MoE model, whose FLOPs follow them, not its size); P itself for a dense one.
double active_parameters(const ModelSpec& model);
/// Eq. 3: F = 96 B s l h^2 (1 + s/(6 h) + V/(16 l h)) FLOPs per iteration of B sequences,
/// with full recomputation (each layer: forward, backward = 2 forwards, forward again; the
/// output layer 6 B s h V, not recomputed). A MoE layer runs k MLPs a token for the one:
/// (k - 1) 64 B s h^2 more.
double flops_per_iteration(const ModelSpec& model, double batch);
/// Eq. 4: the time to train on T tokens with n GPUs at X FLOP/s each, 8 T P / (n X) with
/// recomputation, 6 T P / (n X) without.
double training_seconds(double params, double tokens, double gpus, double flops_per_gpu,
                        bool recomputation);
/// training_seconds in days of 86400 seconds.
double training_days(double params, double tokens, double gpus, double flops_per_gpu,
                     bool recomputation);

// ---------------------------------------------------------------------------
// A layout and its memory

/// What the backward needs that the forward does not keep: nothing (none), the attention's
/// softmax, its dropout and the QK^T it came from (selective, Korthikanti §5), or everything
/// but each layer's input (full).
enum class Recompute {
  none,       ///< every activation kept
  selective,  ///< the attention's softmax region recomputed (Korthikanti §5)
  full        ///< each layer's input kept alone, the layer recomputed
};
/// "none", "selective" or "full": parse_recompute's inverse.
std::string recompute_name(Recompute r);
/// "none", "selective", "full"; UsageError otherwise.
Recompute parse_recompute(const std::string& name);

/// A mesh of GPUs with its microbatches, how much it recomputes and how it shards the
/// states: B = d e m b sequences a step.
struct Layout {
  MeshShape mesh;                         ///< p, d, e, c, t: the mesh's degrees
  int microbatches = 1;                   ///< m, through each pipeline per step
  int microbatch_size = 1;                ///< b, sequences
  int zero = 0;                           ///< ZeRO stage over the replicas, 0-3
  Recompute recompute = Recompute::full;  ///< what the backward recomputes
  bool sequence_parallel = false;  ///< Korthikanti §4.2.2: LayerNorm and dropout split over t
  /// Each axis's communication under the computation where it can be (AxisCost::hidden_s).
  bool overlap = false;
  int buckets = 4;  ///< with overlap: dp's gradients in this many buckets
  /// n = d e c t p, the GPUs of the layout (its sizes checked: see check_mesh_size).
  std::int64_t gpus() const {
    std::int64_t n = 1;
    for (Axis axis : kAxes) n *= mesh.size(axis);
    return n;
  }
  /// B = d e m b, sequences a step: every replica (d e of them) its own.
  std::int64_t batch() const {
    return std::int64_t{mesh.dp} * mesh.ep * microbatches * microbatch_size;
  }
};

/// UsageError (one line) unless the model's sizes are positive and h splits into a heads.
void check_model(const ModelSpec& model);
/// UsageError unless the layout fits the model and the GPU count: positive sizes, t divides
/// a and h, p divides l, c divides s, e divides E (e > 1: a MoE model), d e c t p = gpus,
/// ZeRO 0-3.
void check_layout(const ModelSpec& model, const Layout& layout, std::int64_t gpus);
/// UsageError unless memory, speeds, bandwidths and GPUs per node are positive and finite.
void check_cluster(const ClusterSpec& cluster);

/// Korthikanti Table 2: activation bytes one layer keeps for one microbatch of b sequences
/// (16-bit values, 1-byte dropout masks), on each of its t tensor-parallel GPUs:
///   no parallelism (t = 1)     s b h (34 + 5 a s / h)
///   tensor parallel            s b h (10 + 24/t + 5 a s / (h t))
///   + sequence parallel        s b h (34/t + 5 a s / (h t))
///   selective recomputation    drops the 5 a s / h term: s b h (10 + 24/t), or s b h 34/t
///   full recomputation         the layer's input only: 2 s b h, or 2 s b h / t
/// Context parallel (`cp` c): a GPU holds s/c of each sequence's tokens, 1/c of all of it
/// (the attention's 5 a s / h term so counted is an upper bound: the ring keeps a log-sum-exp
/// a token and head, not its s scores).
double activation_bytes_per_layer(const ModelSpec& model, int microbatch_size, int tp,
                                  bool sequence_parallel, Recompute recompute, int cp = 1);

/// The parameters one GPU of the first pipeline stage holds: its l/p layers, (12 h^2 + 13 h)
/// each, split over t but for the 6 h every tp rank holds whole (Megatron-LM's: the two
/// norms' 4 h, the biases of the attention's projection and of the MLP's second Linear,
/// added once after the row-parallel sums), so (12 h^2 + 7 h)/t + 6 h, and
/// the embeddings: the word embedding V h split over t (Megatron splits it by vocabulary),
/// the position embedding s h whole on every tp rank; with one stage, the final norm's 2 h
/// too. (The last stage holds a tied copy of the word embedding as the output layer, as
/// many; inner stages hold layers only.) With t = p = 1 this is P and the final norm (eq.
/// 2 leaves it out). The dense weights only: a MoE layer counts its attention, norms and
/// router (4 h^2 + 8 h over t, and h E), its experts are expert_parameters'.
double stage_parameters(const ModelSpec& model, int tp, int pp);
/// The experts one GPU of the first stage holds: of its MoE layers, E/e experts each,
/// (8 h^2 + 4 h)/t + h of each (the second bias whole). 0 in a dense model.
double expert_parameters(const ModelSpec& model, int tp, int pp, int ep);

/// Bytes one GPU of the first stage needs, by category. Model states: chapter 05's
/// zero_memory for the stage's parameters over d ranks (mixed precision: 2 + 2 + 12 bytes a
/// parameter at stage 0); with cp and ep, the dense weights over their d e c replicas and
/// the experts over their d c. Activations: the first stage under 1F1B holds min(p, m)
/// microbatches of its l/p layers (Korthikanti §4.2: l layers' worth when m >= p), each MoE
/// layer k times its MLP's 16 s b h / t (its experts' products, kept for every choice). The
/// activation formula is for 16-bit training whatever `precision` says of the states.
struct MemoryEstimate {
  double params = 0;       ///< the parameters
  double grads = 0;        ///< their gradients
  double optimizer = 0;    ///< the optimizer's state: master, m, v
  double activations = 0;  ///< the activations kept for the backward
  /// The four together.
  double total() const { return params + grads + optimizer + activations; }
};
/// The MemoryEstimate of `layout` for `model`, the model states in `precision`.
MemoryEstimate memory_per_gpu(const ModelSpec& model, const Layout& layout,
                              ch05::Precision precision = ch05::Precision::mixed);

// ---------------------------------------------------------------------------
// Communication and time

/// Bytes each GPU sends in a ring allreduce of `bytes` over n GPUs: 2 (n - 1)/n bytes.
double ring_allreduce_bytes(double bytes, double n);

/// Which axes have a group that leaves a node, ranks laid out as Megatron-LM does (tp
/// fastest, then cp, ep, dp, pp: rank = (((pp_i d + dp_i) e + ep_i) c + cp_i) t + tp_i) on
/// nodes of `gpus_per_node` (node = rank / gpus_per_node); dp's group is the replicas
/// (kReplicaAxes), whose sums it carries.
using NodeCrossings = PerAxis<bool>;
/// The NodeCrossings of `layout` on nodes of `gpus_per_node` GPUs.
NodeCrossings crosses_nodes(const Layout& layout, int gpus_per_node);

/// The share of a GPU's bytes of `axis` that leave its node, as NCCL sends them: 0 for a
/// group inside a node. For the rings (tp, cp, dp: its groups the replicas), the ring's
/// edges between nodes over all its edges: NCCL runs one ring a channel, each crossing
/// between the nodes at another GPU and its NIC (NVIDIA/nccl issue #601: "we can use NVLink
/// to split the operations in N parts then balance the traffic onto the N NICs"), so every
/// GPU sends that share of its ring traffic across. A group of s ranks at stride st (the
/// product of the faster axes) on nodes of g: 1 when st is a multiple of g (every member on
/// a node of its own), st/g when st divides g and g divides s st (s st/g nodes, each with
/// g/st members: a ring over k nodes has k of its s edges between them); ep's all-to-all,
/// the members on other nodes over the s - 1 others, (s - g/st)/(s - 1); pp's sends, 1 (a
/// stage boundary's GPUs send all of theirs across). Groups that do not tile the nodes that
/// way (tp 3 on nodes of 8): 1, the single ring's bound.
double cross_node_share(const Layout& layout, Axis axis, int gpus_per_node);

/// One axis's traffic in a step, per GPU, and its time on the links it takes.
struct AxisCost {
  int size = 1;                ///< the axis's degree (the replicas', d e c, for dp)
  double bytes = 0;            ///< sent by one GPU per step
  bool crosses_nodes = false;  ///< some group of the axis leaves its node
  double cross_share = 0;      ///< of the bytes, the share that leaves the node (cross_node_share)
  /// max(share x bytes / network_GBps, (1 - share) x bytes / nvlink_GBps): the bytes that
  /// cross on the GPU's share of the node's NICs, the rest on NVLink at the same time.
  double seconds = 0;
  /// bytes / seconds, GB/s: nccl-tests' bus bandwidth of the axis's collective, the speed of
  /// its bottleneck (NVIDIA/nccl-tests doc/PERFORMANCE.md)
  double busbw_GBps = 0;
  /// The time on one ring instead (tp, cp, dp): its edge between nodes is one GPU's, which
  /// sends all its bytes on one NIC (nic_GBps); pp and ep: `seconds`.
  double one_ring_s = 0;
  /// With Layout::overlap, the part of `seconds` under the computation (hidden_seconds);
  /// the rest, the exposed part, adds to the step.
  double hidden_s = 0;
  /// seconds - hidden_s.
  double exposed_s() const { return seconds - hidden_s; }
};

/// How much of an axis's `seconds` of communication a step can hide under its computation
/// (`compute_s` a GPU, `backward_s` of it the last microbatch's backward), overlapped as
/// chapter 09 does (`ch09_gpt --overlap`), each bounded by the computation it runs under:
///   dp  the gradients' buckets go as the last microbatch's backward makes them: all but
///       the last bucket, under that backward (Megatron-LM's overlap_grad_reduce); with
///       ZeRO-1 or 2, half the bytes so (the reduce-scatter; not under sequence
///       parallelism, whose norms' gradients are summed over tp after the backward) and
///       the other half (the updated weights' all-gather) all but the first bucket under
///       the next step's first forward, half as long as a backward (Megatron-LM's
///       overlap_param_gather)
///   tp  the collective matmul in 2 parts: the first part's sum under the second's product
///   pp  every receive posted ahead: all but the first message of the step's m
///   cp  the ring's blocks pass while the block computes: all of it, under the computation
///   ep  one local expert's tokens travel while another computes: all but one of E/e parts
/// Without overlap: 0.
double hidden_seconds(Axis axis, double seconds, double compute_s, double backward_s,
                      const Layout& layout, int local_experts = 1);

/// Allreduces' worth of b s h values tp sends per layer and microbatch: 4 (2 forward, 2
/// backward), 6 with full recomputation, + 1 with sequence parallelism (step_time). Half of
/// them are the MLP's, which a MoE layer sends k times (its experts' rows).
int tp_allreduces_per_layer(const Layout& L);

/// Per GPU and step (16-bit values on the wire: 2 bytes):
///   tp  per layer of the stage and per microbatch, 4 allreduces of b s h values (2 forward,
///       2 backward; 6 with full recomputation's second forward), each 2 (t-1)/t of them
///       sent; sequence parallelism sends as much as all-gathers and reduce-scatters, and
///       one allreduce's worth more: the backward gathers the input of the two
///       column-parallel products again (tp_allreduces_per_layer)
///   dp  the gradient allreduce of the stage's parameters, once per step: 2 (d-1)/d of them
///       for ZeRO 0-2 (1-2 as a reduce-scatter and an all-gather), 3 (d-1)/d for ZeRO 3
///       (ZeRO §7; chapter 05's zero_comm_elements)
///   pp  each microbatch's b s h activation forward and its gradient backward across every
///       stage boundary: an inner stage sends 2 b s h values a microbatch, the first and the
///       last stage b s h (b s h / t with sequence parallelism: the values are split over t)
///   cp  per layer and microbatch, the ring's keys and values (chapter 10): blocks of
///       s/c b h/t values, 2 (c - 1) forward (again under recomputation) and 4 (c - 1) + 2
///       backward (their gradients, and home)
///   ep  per MoE layer and microbatch, each of the GPU's k b s/c choices that leave it
///       ((e - 1)/e of them, for an even router) sent to its expert and back, forward and
///       backward (and forward again under full recomputation), h values each
/// With cp or ep, a GPU's b s h values are its b s/c tokens', and dp sums the dense weights
/// over d e c GPUs and the experts over d c.
/// Time: compute F / (n X) (x ranks / cores on a node with fewer cores than ranks:
/// ClusterSpec::cores_per_node) (F: eq. 3 with full recomputation, 72 instead of 96 and the output
/// layer's 6 B s h V without, plus the attention's 4 b s^2 h per layer and microbatch with
/// selective); the 1F1B bubble adds (p - 1)/m of it; every axis's communication is exposed
/// (an upper bound) unless the layout overlaps it (hidden_seconds), each on NVLink inside a node
/// and, across nodes, its cross_node_share on the node's NICs (AxisCost::seconds). X is used as the
/// rate of the math alone: papers measure it end to end, bubble and communication included, so with
/// their X the step time counts those twice. It ranks layouts; eq. 4 estimates the days.
struct StepEstimate {
  double flops = 0;            ///< per step, all GPUs, recomputation included
  double compute_s = 0;        ///< F / (n X), seconds
  double bubble_fraction = 0;  ///< the 1F1B bubble over the compute time, (p - 1)/m
  double bubble_s = 0;         ///< the bubble, seconds
  /// Each axis's traffic: tp's allreduces, dp's gradient sums (or ZeRO's collectives),
  /// pp's activations and gradients between stages, cp's ring, ep's all-to-alls.
  PerAxis<AxisCost> axes;
  /// Every axis's seconds, added up (hidden or not).
  double communication_s() const {
    double s = 0;
    for (Axis axis : kAxes) s += axes[axis].seconds;
    return s;
  }
  /// Every axis's exposed seconds: all of communication_s() without overlap.
  double exposed_s() const {
    double s = 0;
    for (Axis axis : kAxes) s += axes[axis].exposed_s();
    return s;
  }
  /// The step: compute, bubble and the exposed communication, seconds.
  double total_s() const { return compute_s + bubble_s + exposed_s(); }
};
/// The FLOPs of one step of `batch` sequences as the layout's recomputation makes them.
double step_flops(const ModelSpec& model, double batch, Recompute recompute);
/// The StepEstimate of one step of `layout` for `model` on `cluster`.
StepEstimate step_time(const ModelSpec& model, const ClusterSpec& cluster, const Layout& layout);

// ---------------------------------------------------------------------------
// The search: a tiny automatic parallelism planner

/// What the search holds fixed.
struct SearchSpec {
  std::int64_t gpus = 0;                  ///< n, the GPUs to lay out
  std::int64_t batch = 0;                 ///< B, sequences a step
  int microbatch_size = 1;                ///< b, sequences
  int zero = 0;                           ///< ZeRO stage over dp, 0-3
  Recompute recompute = Recompute::full;  ///< what the backward recomputes
  bool sequence_parallel = false;         ///< Korthikanti §4.2.2's sequence parallelism
  bool overlap = false;                   ///< Layout::overlap
  std::size_t keep = 0;                   ///< the fastest this many kept; 0: every one
};
/// One layout the search found, with its estimates.
struct Candidate {
  Layout layout;            ///< the layout (the spec's b, ZeRO, recompute and sequence parallelism)
  StepEstimate step;        ///< step_time of the layout
  MemoryEstimate memory;    ///< memory_per_gpu of the layout
  bool fits = false;        ///< memory.total() <= the GPU's memory
  NodeCrossings crossings;  ///< which axes' groups leave a node
};
struct Candidate;
/// How many layouts a search considered, how many of them fit, and the fastest that does.
struct SearchCount {
  std::int64_t layouts = 0;                  ///< every layout of the spec
  std::int64_t fit = 0;                      ///< of them, those that fit the GPU's memory
  std::shared_ptr<const Candidate> fastest;  ///< the fastest that fits; null when none does
};
/// Every (d, e, c, t, p, m) with d e c t p = gpus, t dividing a and h, p dividing l, c
/// dividing s into an even number of chunks (chapter 10's zigzag: s/(2c) whole), e dividing
/// E (1 in a dense model) and B = d e m b (t may cross nodes: crossings[tp] says so),
/// fastest first; the layouts that do not fit the memory are kept, fits = false. Only the
/// fastest spec.keep are returned (0: all); `counted`, when given, gets how many there were.
/// The degrees are taken from gpus' divisors, so the work is the number of layouts, not
/// gpus. UsageError if the spec or the model is bad.
std::vector<Candidate> search(const ModelSpec& model, const ClusterSpec& cluster,
                              const SearchSpec& spec, SearchCount* counted = nullptr);

}  // namespace ch08
