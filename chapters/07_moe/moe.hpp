// Chapter 07's Mixture-of-Experts layer, on one device and expert-parallel on ranks.
//
//   y = x + sum over t's kept choices j of gate_j * expert_{e_j}(x)
//   expert_e(x) = tanh(x W1_e) W2_e           (d -> h -> d, no biases)
//   router: p = softmax(x Wr) over E experts  (d x E), then route() (routing.hpp)
//   aux loss: each rank's alpha E sum_i f_i P_i over its own tokens (Switch Transformer
//     eqs. 4-6, DeepSpeed's l_aux per rank): f_i the fraction of the rank's tokens whose
//     first choice is expert i, P_i the mean of p_i over them; the layer's is their mean,
//     each weighted by the rank's share of the T tokens
//
// Backward: given dL/dy (any cotangent), dL/dx, dL/dWr (through the gates, their
// renormalisation, the softmax, and the aux loss with f held constant, as in Switch) and
// every expert's dL/dW1, dL/dW2.
//
// On ranks (MoeLayer): rank q holds the router (replicated), experts q E/N ..
// (q + 1) E/N - 1 and tokens shard_range(T, N, q). As in Megatron-LM and DeepSpeed, each
// rank routes its own tokens, with a capacity from their number; the ranks exchange how
// many rows each expert gets from each (an all-to-all of counts), then the rows (an
// all-to-all(v)); the rows come back in another, and the backward does the same with the
// gradients. The one-device reference routes each rank's tokens the same way, so that the
// two are the same computation.
//
// Also here: the all-to-all's bytes as formulas, the pairwise all-to-all(v) the benchmark
// times against the backend's, and the training loop of `--train`.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "routing.hpp"
#include "shardlab/comm.hpp"
#include "shardlab/nn.hpp"
#include "shardlab/tensor.hpp"

namespace shardlab::bench {
struct Case;  // bench.hpp
}

namespace ch07 {

/// A vector's index (a token's choice, an expert, a rank); shardlab::idx casts to it.
using Index = std::size_t;
using shardlab::idx;

using shardlab::Communicator;
using shardlab::Memory;

/// The layer's sizes, its routing's settings and its seed (the same on every rank).
struct MoeConfig {
  int tokens = 64;               ///< T, all ranks together
  int hidden = 16;               ///< d, the width of a token
  int ffn = 32;                  ///< h, the hidden width of an expert
  int experts = 8;               ///< E
  int k = 2;                     ///< experts per token (1: Switch, 2: GShard)
  double capacity_factor = 1.0;  ///< C = ceil(k T_r / E x this) (expert_capacity)
  double aux_alpha = 0.01;       ///< alpha, the weight of the load-balancing (aux) loss; 0: none
  std::uint64_t seed = 0;        ///< every initial weight and every batch derives from it
  /// C of rank `rank` of `ranks`: from its shard_range(T, N, rank) tokens.
  int capacity(int rank, int ranks) const {
    return expert_capacity(static_cast<int>(shardlab::shard_range(tokens, ranks, rank).length), k,
                           experts, capacity_factor);
  }
};
/// "8 experts, each an MLP 16 -> 32 -> 16; 64 tokens, top-2 routing"
std::string describe(const MoeConfig& config);
/// About how many bytes a run of the layer on `ranks` ranks (threads of one process) takes,
/// forward and backward, with the one-device reference beside it on every rank (the
/// program's memory estimate).
double layer_run_bytes(const MoeConfig& config, int ranks);

/// The router and the experts `first` .. `first + count - 1` (f32, on the host).
struct Weights {
  Tensor router;           ///< Wr, d x E
  int first = 0;           ///< the first expert held
  std::vector<Tensor> w1;  ///< per expert held: W1, d x h
  std::vector<Tensor> w2;  ///< per expert held: W2, h x d
};
/// The same weights on every rank, in the reference and in MoeLayer: the router from
/// seed * 7919 + 1, expert e's W1 and W2 from its own two seeds (nn::Linear's init).
Weights make_weights(const MoeConfig& config, int first, int count);

/// What a routing did: choices per expert before and after capacity, the drops, and the
/// aux loss. routing_stats gives one rank's (its routing, the probabilities of its tokens,
/// T_r x E; its aux loss weighted by T_r / T); combined() adds every rank's up.
struct RoutingStats {
  std::vector<int> wanted;  ///< per expert: the choices for it, before capacity
  std::vector<int> kept;    ///< per expert: the choices for it that got a slot
  int dropped = 0;          ///< choices dropped, in all
  int passed_through = 0;   ///< tokens none of whose choices was kept
  double aux_loss = 0;      ///< the load-balancing loss, alpha E sum_i f_i P_i
  /// Adds `other`'s counts and aux loss to these (an empty one takes `other`'s size).
  RoutingStats& operator+=(const RoutingStats& other);
};
/// One rank's stats: from its routing and the router's probabilities of its tokens
/// (`probs`, T_r x E); the aux loss weighted by T_r / T.
RoutingStats routing_stats(const MoeConfig& config, const Routing& routing, const Tensor& probs);
/// The sum of every rank's stats, on every rank (uncounted: bookkeeping).
RoutingStats combined(Communicator& comm, const RoutingStats& mine);

// ---------------------------------------------------------------------------
// The layer on one device: the reference

/// One run of the layer, by moe_reference or moe_parallel: the outputs, the routing, its
/// stats and, when a dL/dy was given, the gradients.
struct Result {
  Tensor y;                       ///< the outputs of the tokens given (host, f32)
  std::vector<Routing> routings;  ///< rank q's routing of its tokens (moe_parallel: this rank's)
  RoutingStats stats;             ///< of the whole layer, every rank's tokens
  Tensor dx;                      ///< dL/dx of the tokens given (when a dL/dy was given)
  Tensor drouter;                 ///< dL/dWr, summed over all tokens
  std::vector<Tensor> dw1;        ///< dL/dW1 of each expert held
  std::vector<Tensor> dw2;        ///< dL/dW2 of each expert held
  /// moe_reference only: the experts' outputs, a row per kept choice, by expert, then
  /// source rank, then slot.
  Tensor outs;
  /// moe_reference only: dL/dlogits of every token (when a dL/dy was given).
  Tensor dlogits;
  /// moe_parallel only: the all-to-all bytes this rank received, forward and backward
  /// together.
  std::uint64_t alltoall_received = 0;
  /// Whether the backend modeled the all-to-all's bytes instead of measuring them (MPI's
  /// and NCCL's collectives; shardlab/comm.hpp).
  bool traffic_modeled = false;
};

/// The whole layer on one device, every token, written out loop by loop (no MoeLayer
/// code): what the expert-parallel layer on `ranks` ranks is checked against. The tokens
/// of each rank (shard_range(T, ranks, q)) are routed on their own, with that rank's
/// capacity, as the ranks route them; each expert runs its rows by source rank, then slot.
Result moe_reference(const MoeConfig& config, const Weights& all, const Tensor& x, const Tensor& dy,
                     int ranks);

/// How far the expert-parallel layer may lie from the reference `ref` (max abs, per
/// compared quantity), with the same routing. Derived, not guessed. On the CPU: 0 (the
/// same sums in the same order), except the router's gradient, whose T token terms the
/// ranks sum in parts (Higham's 2 gamma_T |x^T| |dlogits|, matmul_reorder_bound). On a GPU
/// (`gpu`): each matmul (the router's, the experts') summed in cuBLAS's order is within
/// Higham's bound of the host's; tanhf is within 2 ulp; and each step's input error is
/// carried through every later step to first order (a matmul A' B with |A' - A| <= e adds
/// e x the largest column sum of |B|; the softmax, the gates' renormalisation, tanh' and
/// the router's backward by their derivatives). README, "On a GPU", writes the chain out.
struct Tolerance {
  double y = 0;        ///< of the outputs y
  double dx = 0;       ///< of dL/dx
  double drouter = 0;  ///< of the router's gradient dL/dWr
  double dw = 0;       ///< of the experts' dL/dW1 and dL/dW2
};
/// The Tolerance of the layer run on `x` and `dy` from the weights `all` (every expert)
/// against `ref`, moe_reference's Result for the same; `gpu`: the layer ran on a GPU.
Tolerance tolerance(const MoeConfig& config, const Weights& all, const Tensor& x, const Tensor& dy,
                    const Result& ref, bool gpu);

// ---------------------------------------------------------------------------
// The layer expert-parallel, as an nn layer

/// Routing groups for a layer inside a model (chapter 09's GPT routes each sequence on
/// its own, so that the routing is a function of the sequence alone, whatever the mesh
/// cuts it into): every `tokens` tokens are routed together, with the capacity
/// expert_capacity(tokens, k, E, capacity_factor), and the aux loss is each group's own.
struct MoeGroups {
  /// T: the tokens of a group. 0: the rank's rows are one group, shard_range(config.tokens,
  /// N, rank) of them, with config.capacity(rank, N) (chapter 07's layer).
  std::int64_t tokens = 0;
  /// The ranks that each hold part of every group (chapter 10's context parallelism):
  /// they gather the group's router probabilities (an all-gather of E per token) and
  /// route it whole, each keeping its own tokens' choices. nullptr: whole groups here.
  Communicator* split = nullptr;
  /// Per rank of `split`, the positions (0 .. tokens-1) of the group's tokens it holds, in
  /// the order it holds them (a rank's rows are its parts of its groups, group by group).
  std::vector<std::vector<std::int64_t>> positions;
};

/// What the layers of a model report about their routing, and what their aux loss weighs:
/// one per rank, shared by the rank's MoE layers, read and cleared by its trainer.
struct MoeLog {
  /// Each routing group's aux loss enters the model's loss times this (chapter 09: 1/B,
  /// the batch's mean over its B sequences).
  double weight = 1;
  /// The aux loss's gradient times this: the loss scaler's scale, which the rest of the
  /// loss's gradient already carries (Megatron-LM's MoEAuxLossAutoScaler).
  float grad_scale = 1;
  /// Every group's stats added up, by the backward_input of each microbatch (a group
  /// split over ranks: on the first of them), its aux loss times `weight`.
  RoutingStats stats;
  /// Per backward_input, in order: this rank's kept choices per expert (E counts), what it
  /// dispatched (the all-to-alls' formula needs every rank's).
  std::vector<std::vector<std::int64_t>> kept;
  /// Forgets what the layers reported (the weight and scale stay).
  void clear() {
    stats = {};
    kept.clear();
  }
};

/// How a MoeLayer is built besides its config; the defaults are chapter 07's layer.
struct MoeOptions {
  /// The parameters' prefix: NAME.router, NAME.expertE.w1, ...
  std::string name = "moe";
  /// y = x + the experts' weighted sum (chapter 07); false: the sum alone (in a block whose
  /// residual adds x).
  bool residual = true;
  /// backward_weight sums the router's gradient over the layer's ranks (chapter 07: they
  /// hold every token between them); false: the caller's data-parallel sync does, with
  /// the other weights every replica holds.
  bool sum_router = true;
  /// Local expert e's layer (d -> d), its parameters added to the store it is given. Empty:
  /// chapter 07's Linear, tanh, Linear without biases, from make_weights.
  std::function<std::shared_ptr<shardlab::nn::Layer>(shardlab::nn::ParameterStore&, int expert)>
      expert;
  /// Where the experts' parameters go (their gradients are summed over other ranks than
  /// the router's); nullptr: the router's store.
  shardlab::nn::ParameterStore* expert_store = nullptr;
  /// How the tokens are grouped for routing.
  MoeGroups groups;
  /// Where the routing is reported, and the aux loss's weight; nullptr: weight 1, scale 1.
  std::shared_ptr<MoeLog> log;
  /// The dispatch and the combine (and their backward) as one all-to-all per local
  /// expert, each expert's rows a part, instead of one all-to-all of every row: the same
  /// rows to the same experts. With `overlap`, the next part travels while an expert runs
  /// (chapter 09's --overlap ep); without, each all-to-all is waited for as it starts.
  bool by_expert = false;
  bool overlap = false;  ///< with by_expert: the parts' all-to-alls under the experts' work
};

/// The MoE layer over the ranks of `comm` (an expert-parallel group; one rank holds every
/// expert): the router (replicated) and this rank's E/N experts are parameters in
/// `store`, each expert an nn::Sequential of Linear, Tanh, Linear (MoeOptions: any layer,
/// in a store of its own, routed by groups, without the residual: chapter 09's GPT). It
/// goes into an nn::Sequential like any layer.
///
///   x   this rank's tokens: rows shard_range(T, N, rank) of the config's T, d columns
///   y   the same rows, in the memory the store was allocated in (f32 parameters)
///
/// forward and backward_input are collectives over `comm` (the exchange of counts and two
/// all-to-all(v)s forward, two backward), and so is backward_weight (the router's gradient
/// is summed over the ranks: an allreduce); every rank calls them in the same order.
/// Gradients accumulate (+=): the router's is the sum over every rank's tokens, an
/// expert's over the tokens it took, and the aux loss's gradient is included.
///
/// Saved (nothing is kept in the layer, so any number of forwards can be in flight):
///   tensors   this rank's x; the probabilities of its tokens (T_r x E, host); its routing
///             (expert, gate, slot: T_r k each, host); the dispatch plan (send order and
///             counts; the counts received); the experts' outputs back at this rank, in
///             send order; after backward_input, dL/dlogits of this rank's tokens
///   children  per local expert, its Sequential's Saved: the rows it ran (by source rank,
///             then slot), and the activations tanh(x W1)
class MoeLayer final : public shardlab::nn::Layer {
 public:
  /// The weights of make_weights(config, rank E/N, E/N).
  MoeLayer(shardlab::nn::ParameterStore& store, Communicator& comm, const MoeConfig& config,
           const std::string& name = "moe");
  /// Starting from `init` (the router and this rank's experts, rank E/N .. on).
  MoeLayer(shardlab::nn::ParameterStore& store, Communicator& comm, const MoeConfig& config,
           const Weights& init, const std::string& name = "moe");
  /// A layer in a model: the router (d x E) from `router`, this rank's experts E/N made by
  /// options.expert, and the rest as `options` say. A routing group's rows must come whole
  /// to a forward (options.groups).
  MoeLayer(shardlab::nn::ParameterStore& store, Communicator& comm, const MoeConfig& config,
           const Tensor& router, MoeOptions options);

  /// The name given at construction ("moe" by default).
  std::string name() const override { return options_.name; }
  shardlab::nn::Forward forward(const Tensor& x) const override;
  /// dL/dx, and (kept in `saved` for backward_weight) every expert's own B.
  Tensor backward_input(const Tensor& dy, shardlab::nn::Saved& saved) const override;
  /// Adds the experts' dL/dW1, dL/dW2 and the router's dL/dWr (allreduced) into the grads.
  void backward_weight(shardlab::nn::Saved& saved) override;
  /// The router, then each local expert's W1 and W2.
  std::vector<shardlab::nn::Parameter*> parameters() const override;

  /// The configuration the layer was built with.
  const MoeConfig& config() const { return config_; }
  /// The first expert this rank holds: rank E/N.
  int first_expert() const { return first_; }
  /// How many experts this rank holds: E/N.
  int experts_here() const { return static_cast<int>(experts_.size()); }
  /// The router's weights Wr (d x E), the same on every rank.
  shardlab::nn::Parameter& router() { return *router_; }
  /// Local expert l's W1, d x h (expert first_expert() + l; chapter 07's experts).
  shardlab::nn::Parameter& w1(int l);
  /// Local expert l's W2, h x d (expert first_expert() + l; chapter 07's experts).
  shardlab::nn::Parameter& w2(int l);
  /// The current weights, copied to the host (chapter 07's experts).
  Weights weights() const;
  /// The largest difference of this rank's experts' dL/dW1 and dL/dW2 from those of the
  /// same experts in `reference` (which holds every expert's: moe_reference).
  double expert_grad_diff(const Result& reference);

  /// What a forward routed on this rank, read from its Saved (before backward_weight
  /// drops it); combined() makes the stats the whole layer's.
  Routing routing(const shardlab::nn::Saved& saved) const;
  /// routing_stats of that routing and the probabilities saved with it: this rank's part
  /// of the layer's stats (one group: chapter 07's layer).
  RoutingStats stats(const shardlab::nn::Saved& saved) const;

 private:
  /// The routing of this rank's rows: one group (chapter 07), or options_.groups'.
  struct Routed;
  Routed route_rows(const Tensor& probs) const;

  Communicator& comm_;
  MoeConfig config_;
  MoeOptions options_;
  int first_ = 0;
  shardlab::nn::Parameter* router_ = nullptr;
  std::vector<std::shared_ptr<shardlab::nn::Layer>> experts_;
};

/// The layer once, as a Result: a MoeLayer over `comm` from the weights `mine`, with its
/// parameters in `memory`, forward on this rank's tokens `x` and, when `dy` is given (a
/// default Tensor(): forward only), backward; the gradients and the all-to-all bytes this
/// rank received.
Result moe_parallel(Communicator& comm, const MoeConfig& config, const Weights& mine,
                    const Tensor& x, const Tensor& dy, Memory memory);

// ---------------------------------------------------------------------------
// What the all-to-alls move

/// The all-to-all bytes rank `rank` receives in one forward and backward, from every
/// rank's routing (`routings[q]`, rank q's): every kept choice whose token and expert live
/// on different ranks, one of them this one, is a row of d floats it receives twice
/// (dispatch or combine) in the forward and twice in the backward: 2 x rows x d x 4; and
/// the exchange of counts brings E/N counts of 8 bytes from each of the N - 1 others.
std::uint64_t formula_alltoall_bytes(const std::vector<Routing>& routings, int rank, int ranks,
                                     int hidden);
/// The same for a perfectly even router with nothing dropped: (N-1)/N of a rank's k T/N
/// choices leave it, four passes, d floats each: 4 x k T/N x (N-1)/N x d x 4; and the
/// counts, (N-1) E/N x 8.
double even_router_alltoall_bytes(const MoeConfig& config, int ranks);

/// All-to-all(v) from point-to-point calls, the pairwise exchange (MPICH's and Open MPI's
/// algorithm for large messages): this rank's own block is copied; then in step
/// s = 1 .. N-1 it sends its block for rank r + s and receives rank r - s's block (mod N),
/// with one sendrecv. `in` and `out` are flat (any shape; counted in elements); blocks are
/// back to back in rank order, as in Communicator::alltoallv.
void pairwise_alltoallv(Communicator& comm, const Tensor& in,
                        std::span<const std::size_t> send_counts, Tensor& out,
                        std::span<const std::size_t> recv_counts);

/// What the benchmark times, as nccl-tests describes a collective: the backend's alltoall
/// and pairwise_alltoallv, over one pair of buffers in `memory` (bus factor (N-1)/N).
/// The data: element i of rank r's input is r 1000003 + i, so after an all-to-all of B
/// elements per peer, element i of block q of rank r's output must be q 1000003 + r B + i;
/// #wrong counts the elements that are not, on fresh output.
std::vector<shardlab::bench::Case> alltoall_cases(Communicator& comm, Memory memory);

// ---------------------------------------------------------------------------
// Training the router (--train)

/// The task of the training: batch `step` is T tokens x ~ N(0, 1) shifted along one
/// direction u (1.5 sqrt(d) u), with targets x + 0.5 tanh(x A) (A from the seed).
struct Batch {
  Tensor x;       ///< the tokens, T x d (every rank's)
  Tensor target;  ///< their targets, T x d
};
/// Batch `step`: a function of the config's seed and the step alone, the same on every rank.
Batch leaning_batch(const MoeConfig& config, std::uint64_t step);

/// How train() trains.
struct TrainSettings {
  int steps = 100;               ///< steps, each on a fresh batch
  float lr = 1e-2f;              ///< Adam's learning rate
  Memory memory = Memory::host;  ///< where the parameters, Adam's state and the activations live
};
/// Per step, over every rank's tokens: tokens kept per expert, the aux loss, the dropped
/// fraction of the choices, and the task's loss (mean squared error / 2); then the
/// trained weights of this rank.
struct TrainRun {
  std::vector<std::vector<int>> kept;    ///< per step: the tokens kept per expert
  std::vector<double> aux_loss;          ///< per step: the aux loss
  std::vector<double> dropped_fraction;  ///< per step: the fraction of the k T choices dropped
  std::vector<double> loss;              ///< per step: the task's loss, before the update
  Weights weights;                       ///< this rank's weights after the last step
};
/// Trains a MoeLayer (router and experts, one Adam over the store's flat buffers) on
/// leaning_batch(config, 1), (config, 2), ..., from a router whose first choice for these
/// tokens is expert 0 (Wr's column 0 plus 2u, the direction the tokens lean along). The
/// aux loss takes part with config.aux_alpha (0: none).
TrainRun train(Communicator& comm, const MoeConfig& config, const TrainSettings& settings);

}  // namespace ch07
