// Chapter 09's training: one step of the whole mesh, and the validation loss (the data:
// corpus.hpp; text sampled from the model: sample.hpp).
//
// A step, on every rank (chapter 08's hybrid training, with a language model's ends):
//   1. the global batch: B sequences of T + 1 bytes at places a seeded generator picks
//      in the training text; replica d (of dp x ep: expert parallelism is carved out of
//      data parallelism) takes sequences shard_range(B, dp ep, d) and cuts them into m
//      microbatches; under context parallelism each cp rank holds its tokens of each;
//   2. chapter 04's pipeline runs the schedule: stage 0 embeds the bytes, each stage its
//      blocks, the last stage ln_f, the tied LM head and the vocabulary-parallel
//      cross-entropy (attention_and_loss.hpp), each microbatch's loss its share of the batch's
//      mean;
//   3. the two copies of wte (first and last stage) add up their gradients (pp > 1);
//      chapter 02's sync sums the replicas' gradients, over dp x ep x cp (or chapter 05's
//      ZeRO-1 does, in its step);
//   4. the gradients are clipped to a global norm (PyTorch's clip_grad_norm_: all of them
//      scaled by max_norm / (norm + 1e-6) when that is below 1), the norm taken over the
//      whole model, each parameter once (Megatron-LM's rule: a tensor every tp rank holds
//      counted on tp rank 0 only, a replica's gradient on the replicas' first rank only,
//      the head's copy of wte not at all);
//   5. Adam (the library's, PyTorch's update).
// The one-device reference is the same code on a 1 x 1 x 1 mesh with the whole batch in
// one microbatch.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "corpus.hpp"
#include "gpt.hpp"
#include "loss_scaler.hpp"
#include "mlp_stack.hpp"
#include "pipeline.hpp"
#include "replica_optimizer.hpp"

namespace ch09 {

struct Profile;  // profile.hpp

/// --overlap's value: "all", "none", or axes by name, comma-separated ("dp,pp"); UsageError
/// for any other name.
ch08::PerAxis<bool> overlap_of(const std::string& list);
/// "dp,pp", "none": the axes that overlap.
std::string overlap_name(const ch08::PerAxis<bool>& overlap);

/// The tensor-parallel products summed over tp go in this many parts of rows, overlapping
/// (--overlap tp) or not: the same parts either way, so the same sums. Two: with eight
/// ranks on two cores every part's allreduce is a handoff to a busy core, and four parts
/// made the default run 9 % slower than no overlap where two make it 3 % faster.
inline constexpr int kTpParts = 2;

/// A training run: the model, the mesh, the batch, the schedule, the optimizer and the
/// precision.
struct TrainConfig {
  GptShape model;                         ///< the model's shape
  MeshShape mesh;                         ///< its five axes
  std::int64_t batch = 16;                ///< B sequences per step, all replicas together
  int microbatches = 2;                   ///< m per replica
  std::string schedule = "1f1b";          ///< chapter 04's pipeline schedule, by name
  int chunks = 1;                         ///< v: model chunks per stage (the interleaved schedule)
  int zero = 0;                           ///< 0: GradSync + Adam; 1: ZeRO-1 over dp
  nn::AdamConfig adam{.lr = 3e-3f};       ///< Adam's settings
  float clip = 1.0f;                      ///< max global gradient norm; 0: no clipping
  Recompute recompute = Recompute::none;  ///< what the blocks recompute in the backward
  bool sequence_parallel = false;         ///< the rows split over tp between its regions (gpt.hpp)
  /// Mixed precision: f16 or bf16 products (torch.autocast, gpt.hpp) on f32 master
  /// weights, with chapter 06's loss scaler (GradScaler: the loss's gradient times the
  /// scale, the summed gradients unscaled and checked for inf before clipping, the step
  /// skipped on every rank when any has one).
  shardlab::DType precision = shardlab::DType::f32;
  ch06::Scaler scaler = ch06::Scaler::none;  ///< the loss scaler: none, static or dynamic
  ch06::ScalerConfig scaler_config;          ///< the dynamic scaler's (GradScaler's defaults)
  /// Where the mesh's tensors live: Memory::device under --device cuda (each rank's GPU;
  /// the embedding's row picking, the loss and the norm run on host copies).
  Memory memory = Memory::host;
  /// The axes whose communication runs under the computation (--overlap): dp's gradient
  /// buckets reduced while backward goes on, pp's receives posted before they are needed,
  /// tp's summed products by parts of rows, ep's all-to-alls by local expert, cp's ring
  /// passing blocks while it computes. Only when things happen changes, never what is
  /// computed.
  ch08::PerAxis<bool> overlap = overlap_of("all");
  /// dp's gradients travel in this many buckets per store, the last layers' first
  /// (overlapping or not: the same buckets either way).
  int buckets = 4;
  /// A step whose gradient norm is not finite (an inf or a NaN in any gradient) is skipped
  /// on every rank, no update made, as GradScaler skips one, even without a loss scaler
  /// (chapter 11's recovery from a NaN). Taken where the norm is: with clipping or a scaler.
  bool skip_nonfinite = false;
  /// The attention across the cp ranks when mesh.cp > 1 (context.hpp; chapter 10's ring).
  std::shared_ptr<const ContextParallel> context;
  /// What GptModel needs of it besides the shape.
  ModelOptions model_options() const {
    return {recompute,
            chunks,
            sequence_parallel,
            precision,
            memory,
            context,
            false,
            kTpParts,
            overlap[ch08::Axis::tp],
            overlap[ch08::Axis::ep]};
  }
  /// The replicas of the data: ep x dp, each on its own sequences of the batch (the cp
  /// ranks of a replica share its sequences, the tp and pp ranks its tokens).
  int replicas() const { return mesh.dp * mesh.ep; }
  /// Which of them the rank at `at` is: dp_i ep + ep_i.
  int replica(const Coords& at) const { return at.dp * mesh.ep + at.ep; }
};

/// --precision (fp32, fp16 or bf16) and --scaler (none, static or dynamic; "": dynamic
/// with fp16, none otherwise) into `c`. UsageError for a scaler on fp32 products.
void set_precision(TrainConfig& c, const std::string& precision, const std::string& scaler);

/// UsageError unless `c` can run: check_shape, every replica's microbatch a sequence, a
/// schedule with one chunk per stage, tp dividing a cp rank's tokens of a sequence under
/// sequence parallelism.
void check_config(const TrainConfig& c);

/// Per rank of an ep group, per call of its MoE layers' backward (in the order the ranks
/// make them, the same on each), the kept choices per expert it dispatched: what the
/// all-to-alls' and the experts' bytes follow from (ch07::MoeLog::kept).
using RoutingCounts = std::vector<std::vector<std::vector<std::int64_t>>>;

/// What one step did.
struct StepResult {
  double loss = 0;                  ///< the batch's mean loss (every rank): the cross-entropy
  double grad_norm = 0;             ///< the global norm before clipping (every rank; ZeRO-1: 0)
  float loss_scale = 1;             ///< what the loss's gradient was multiplied by
  bool skipped = false;             ///< an inf or NaN in the gradients: no update (the scaler)
  ch08::AxisBytes bytes;            ///< this rank sent, per axis
  std::vector<ch04::Event> events;  ///< this rank's ops
  /// With experts: the whole batch's routing, every MoE block's (every rank), its aux_loss
  /// the load-balancing loss the step added to `loss` (each block's mean over the batch's
  /// sequences, summed over the blocks).
  ch07::RoutingStats routing;
  /// With experts: this rank's kept choices per expert, per MoE backward (MoeLog::kept).
  std::vector<std::vector<std::int64_t>> dispatched;
};

/// Every rank's `dispatched` of `result` gathered (a collective over `world`, uncounted),
/// and rank `at`'s ep group's taken out, ep rank by ep rank: formula_bytes's `routing`.
RoutingCounts ep_routing(Communicator& world, const MeshShape& mesh, const Coords& at,
                         const StepResult& result);

/// The elements of each bucket the replicas' gradients travel in, the dense weights' and
/// the experts' (ReplicaOptimizer::bucket_elements); empty: one bucket, the rank's store.
struct DpBuckets {
  std::vector<std::int64_t> dense;    ///< the dense weights' buckets
  std::vector<std::int64_t> experts;  ///< the experts' (over the expert replicas)
};

/// One rank's part of the training: the steps of the whole mesh, the validation loss, and
/// what a checkpoint saves besides the model.
class Trainer {
 public:
  /// A trainer of `model` on `mesh` as `c` says, on `data` (the three kept by reference:
  /// they must outlive it). Every rank of the mesh constructs it: it splits the world into
  /// the embedding groups.
  Trainer(Mesh& mesh, GptModel& model, const TrainConfig& c, const Corpus& data);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;
  /// Trains global step `step` (0, 1, ...: which batch). Every rank of the mesh calls it.
  StepResult step(int step);
  /// The mean loss over `starts`' sequences, forward only (each replica its share of
  /// them, the stages passing activations on). Every rank calls it; every rank gets it.
  double evaluate(const std::vector<std::int64_t>& starts);
  /// The next step() records where this rank's time went into `out` (profile.hpp).
  void profile_next_step(Profile* out) { profile_ = out; }
  /// The data-parallel optimizer, whose state a checkpoint saves and restores.
  ch08::ReplicaOptimizer& optimizer() { return *replicas_; }
  /// The experts' (over the expert replicas), alike; nullptr in a dense model.
  ch08::ReplicaOptimizer* expert_optimizer() { return experts_.get(); }
  /// The buckets the replicas' gradients travel in (the optimizers' bucket_elements).
  DpBuckets dp_buckets() const;
  /// The loss scaler (Scaler::none in fp32 and, by default, bf16), saved alike.
  ch06::LossScaler& scaler() { return scaler_; }
  /// What a hook on this rank's gradients gets: parameters whose gradients its backward
  /// has finished for the step, not yet summed with the other ranks'.
  using GradientHook = std::function<void(const std::vector<nn::Parameter*>&)>;
  /// Calls `hook` with the parameters whose gradients this rank's backward has finished,
  /// before they are summed over the replicas: layer by layer as backward goes on (under
  /// --overlap dp, where they leave as soon as they are made), or all of them after it.
  /// Chapter 11 looks there for a NaN, and puts one there on purpose. Empty: none.
  void on_local_gradients(GradientHook hook) { local_gradients_ = std::move(hook); }

 private:
  class Meter;  // what a step measures besides its work (train.cpp)

  /// 1. The starts of this replica's sequences of step `step`'s batch, microbatch by
  /// microbatch.
  std::vector<std::vector<std::int64_t>> microbatches_of(int step) const;
  /// 2. The pipeline over `microbatches`, each microbatch's loss its share of the batch's
  /// mean (its gradient times the loss scale), the chunks timed by `meter`.
  ch04::StageRun run_pipeline(const std::vector<std::vector<std::int64_t>>& microbatches,
                              Meter& meter);
  /// 3. The gradients summed: sequence parallel's over tp, wte's two copies, the replicas'
  /// (and the experts' replicas').
  void sync_gradients();
  /// 4. The summed gradients unscaled and checked (every rank skips a step with an inf or
  /// NaN anywhere), their norm taken and clipped, into `result`.
  void unscale_and_clip(StepResult& result);
  /// 5. Adam, or the skipped step; the loss scale's update.
  void update(const StepResult& result);
  /// Forward only through the stages for `ids` (whole sequences, every replica the same
  /// or its own): the last stage's ln_f output (empty elsewhere).
  Tensor forward_only(const Tensor& ids);
  /// Sequence parallel: the gradients of the weights every tp rank holds whole, summed
  /// over tp (each rank has its rows' part).
  void sum_replicated_gradients();
  /// The norm of the summed gradients (each parameter once: of the store and of the
  /// experts' store), and their clipping.
  double clip_gradients(ch08::ReplicaOptimizer::Reduced& reduced,
                        ch08::ReplicaOptimizer::Reduced* experts);

  Mesh& mesh_;
  GptModel& model_;
  TrainConfig c_;
  const Corpus& data_;
  ch04::Schedule schedule_;
  ch04::Pipeline pipeline_;
  std::unique_ptr<Communicator> embedding_group_;     // first and last stage (pp > 1)
  std::unique_ptr<ch08::ReplicaOptimizer> replicas_;  // dp: GradSync + Adam, or ZeRO-1
  std::unique_ptr<ch08::ReplicaOptimizer> experts_;   // the same over the expert replicas
  ch06::LossScaler scaler_;
  Profile* profile_ = nullptr;
  GradientHook local_gradients_;
  // With dp overlapping: the chunks as the pipeline runs them, each layer announcing its
  // gradients to the optimizers as soon as its backward has made them.
  std::vector<std::unique_ptr<nn::Sequential>> announced_;
  /// Chunk c as the pipeline runs it.
  nn::Layer& chunk_to_run(int c);
  /// Tells the optimizers the gradients of `params` are final for the step.
  void announce(const std::vector<nn::Parameter*>& params);
  /// Waits until ZeRO-1's all-gathers of the last update have brought these weights
  /// (--overlap dp: they travel while the earlier layers' forward runs).
  void weights_ready(const std::vector<nn::Parameter*>& params);
  /// The bytes this rank sends in ZeRO-1's all-gathers still in flight.
  std::uint64_t values_in_flight_sent() const;

  friend std::string sample(Trainer&, const std::string&, int, float, int, std::uint64_t,
                            const std::function<void(int)>&);
};

}  // namespace ch09

namespace ch09 {
/// "8 experts, top-2 in every block, capacity factor 1.25, aux 0.01"
std::string describe_experts(const GptShape& shape);
/// The flags that give a model `shape`'s experts: "--experts 8 --top-k 2 --moe-every 1 ...".
std::string experts_flags(const GptShape& shape);
/// "GPT (L 4, C 128, H 4, T 64; 0.8M parameters) on pp x dp x tp = 2 x 2 x 2 (threads), ...";
/// without `with_mesh`, "GPT (...) (threads), ..." (a run of many meshes).
std::string describe(const TrainConfig& c, std::string_view backend, bool with_mesh = true);
/// About how many bytes a run holds at most (the memory check before the ranks start):
/// one device's run, and under threads the mesh's ranks of this process too.
double run_bytes(const TrainConfig& c, bool threads);
/// The whole model's parameters; with `experts_per_token` k, those a token meets (a MoE
/// block's k experts of E: the "active" parameters, the FLOPs' count).
std::int64_t parameter_count(const GptShape& shape, int experts_per_token = -1);
/// What the formulas say rank `at` sends in one training step (ring allreduce: 2 (N-1)/N
/// of S, as shardlab::collective_traffic counts it exactly), per microbatch of n tokens
/// (the rank's: b sequences of T/cp):
///   tp  allreduces of n x C: 4 per block (attention's and the MLP's g forward and f
///       backward; 2 more under full recompute, whose second forward sums again), 1 for
///       the embedding (first stage), 1 for the head's dL/dx (last stage); and the
///       cross-entropy's allreduces of n numbers (last stage)
///   dp  one allreduce of the rank's parameters per step, over the dp x ep x cp replicas
///   pp  n x C activations to the next stage and their gradients to the one before, and
///       the allreduce of wte's gradient between the first and the last stage (pp > 1)
///   cp  the attention's core per block: a forward (twice under recomputation) and a
///       backward of context.hpp's bytes (chapter 10's ring); each MoE block's gather of
///       the router's probabilities, (cp - 1) n E floats a forward
///   ep  each MoE block's all-to-alls (from `routing`, the ep group's kept choices per
///       expert): forward the counts ((ep - 1) E/ep of 8 bytes) and the rows, to the
///       experts' ranks and back (the kept choices whose expert is on another rank, and
///       those of the others for this rank's experts, C floats each); backward the rows
///       again both ways; full recompute's second forward once more
///   tp  in a MoE block the experts' f and g: an allreduce of each local expert's rows
///       forward (twice under full recompute) and backward, instead of the dense MLP's;
///       under sequence parallelism the rows gathered before it and dL/dy's after
/// dp's allreduce (ZeRO-1: reduce-scatter and all-gather) goes bucket by bucket: `buckets`.
ch08::AxisBytes formula_bytes(const TrainConfig& c, const Coords& at,
                              const RoutingCounts& routing = {}, const DpBuckets& buckets = {});
}  // namespace ch09
