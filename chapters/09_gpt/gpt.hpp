// Chapter 09's model: GPT-2 (Radford et al. 2019; Hugging Face's GPT2LMHeadModel) built from
// the common layers and chapter 08's tensor-parallel ones, cut over chapter 08's five-axis mesh.
//
//   ids -> wte[id] + wpe[position] -> L x ( x + attn(ln_1(x)),  x + mlp(ln_2(x)) )
//       -> ln_f -> logits = x wte^T -> cross-entropy against the next byte
//
// On the mesh (Megatron-LM's layout, Shoeybi et al. 2019; Narayanan et al. 2021):
//   pp  stage s holds blocks [s L/pp, (s + 1) L/pp); stage 0 also the embeddings, the last
//       stage ln_f and the LM head. The head is tied to wte: with pp > 1 the last stage
//       keeps its own copy of wte, and the two copies' gradients are summed over the
//       "embedding group" (first and last stage) every step, so they stay one weight.
//   tp  attention by heads (attention_and_loss.hpp), the MLP column then row (chapter 08), wte and
//       the LM head by vocabulary rows: each tp rank holds V/tp tokens' embeddings and
//       logits (a vocabulary-parallel cross-entropy). LayerNorms, wpe and the
//       row-parallel biases are whole on every tp rank. Optionally sequence parallel:
//       between those regions each tp rank holds n/t of the n rows (tensor_parallel.hpp).
//   dp  replicas, each on its own sequences of the batch (chapter 02's sync, or chapter
//       05's ZeRO-1).
//   cp  every sequence cut over the cp ranks (context.hpp): each runs every layer on its
//       own tokens, the attention's core reaches the others (chapter 10's ring); their
//       gradients are summed with the replicas'.
//   ep  with experts (GptShape::experts): the MoE blocks' experts split over the ep ranks,
//       which are replicas of everything else, each on its own sequences (moe_mlp).
//
// Every parameter of a rank is a piece of one tensor of the whole model, named as Hugging
// Face names it (transformer.h.0.attn.c_attn.weight, ...): pieces_of() lists them, for
// the checkpoint (checkpoint.hpp), the gradient norm (each counted once) and the tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attention_and_loss.hpp"
#include "mesh.hpp"
#include "moe.hpp"
#include "planner.hpp"
#include "schedule.hpp"  // ch04::virtual_stage
#include "shardlab/memory.hpp"

namespace ch09 {

using ch08::Coords;
using ch08::Mesh;
using ch08::MeshShape;
using shardlab::Memory;
using shardlab::Shape;

/// The MLP of block b, named name.ln_2, name.mlp.c_fc, name.mlp.c_proj:
/// x + c_proj(gelu(c_fc(ln_2(x)))), c_fc C x 4C, c_proj 4C x C (its initial weights times
/// residual_scale), seeded param_seed(b, 2) and (b, 3). Chapter 08's parallel_mlp builds it
/// on the tp ranks (tp 1: one device), c_fc column- and c_proj row-parallel.
ch08::MlpSpec mlp_spec(const std::string& name, const GptShape& shape, int block);

/// The seed of parameter `which` (0 c_fc, 1 c_proj) of expert e of block b's MoE MLP.
std::uint64_t expert_seed(const GptShape& shape, int block, int expert, int which);

/// Block b's MLP as a Mixture of Experts (GptShape::moe(b)): x + moe(ln_2(x)), chapter
/// 07's MoeLayer over the mesh's ep ranks, in a GPT as Megatron-LM puts one there (Shazeer
/// et al. 2017; Lepikhin et al. 2020, GShard: top-2 in every other block; Fedus et al.
/// 2021, Switch Transformer: top-1 and the load-balancing loss):
///   router   name.mlp.router.weight, C x E, whole on every rank (its gradient summed with
///            the replicas'), N(0, 0.02^2) from param_seed(b, 4)
///   experts  name.mlp.experts.e.c_fc and .c_proj: each a GPT-2 MLP (C -> 4C, GELU,
///            4C -> C, biases, c_proj's initial weights times residual_scale), on the tp
///            ranks as chapter 08's column- then row-parallel pair; ep rank i holds experts
///            [i E/ep, (i + 1) E/ep), in `experts` (a store of their own: their gradients
///            are summed over the expert replicas, dp x cp, not over ep)
///   routing  every sequence on its own (capacity ceil(k T / E x capacity_factor)), its
///            router probabilities gathered from the cp ranks when they split it, so that
///            the routing, the dropped tokens and the aux loss are one device's whatever the
///            mesh; each group's aux loss reported to `log`, which also weighs it
/// Under sequence parallelism the layer runs on the whole microbatch on every tp rank: its
/// rows are gathered from the tp ranks before it, and each rank keeps its own after.
/// `cp`: the cp communicator and every cp rank's positions (nullptr: whole sequences).
/// Over more than one ep rank the all-to-alls go one local expert's rows at a time
/// (ch07::MoeOptions::by_expert), each under the previous expert's work with `ep_overlap`.
nn::Residual moe_mlp(nn::ParameterStore& store, nn::ParameterStore& experts, Mesh& mesh,
                     const GptShape& shape, int block, const ch08::TpOptions& options,
                     const std::shared_ptr<ch07::MoeLog>& log,
                     const std::vector<std::vector<std::int64_t>>& cp_positions,
                     bool ep_overlap = false);

/// wte[id] + wpe[position] with wte cut by vocabulary rows over tp (Megatron-LM's
/// VocabParallelEmbedding): rank i holds the rows of tokens `vocab()`; each token's row
/// comes from the rank that holds it (zeros elsewhere), summed over tp (one allreduce of
/// n x C); wpe is whole on every rank. x is i32 [n]: whole sequences (position = i % T),
/// or under context parallelism this rank's tokens of each (position = positions[i % P]).
/// There is no dL/dx; backward_weight adds dy's rows into the rows of wte this rank holds
/// and into wpe.
class VocabParallelEmbedding final : public nn::Layer {
 public:
  /// This rank's rows of wte and the whole wpe, as transformer.wte.weight and
  /// transformer.wpe.weight in `store`: N(0, 0.02^2) from param_seed(shape, -1, 0) and (-1, 1).
  /// Sequence parallel: the sum over tp is a reduce-scatter, and this rank's n/t rows come
  /// out (their positions' wpe added); the backward gathers dL/dy's rows for wte, and wpe
  /// gets this rank's rows' gradient only (the caller sums it over tp).
  /// `positions`: the positions in a sequence of the tokens this rank holds of each (empty:
  /// all of them, 0 .. T-1).
  VocabParallelEmbedding(nn::ParameterStore& store, Communicator& tp, const GptShape& shape,
                         bool sequence_parallel = false, std::vector<std::int64_t> positions = {});
  /// "embedding".
  std::string name() const override { return "embedding"; }
  nn::Forward forward(const Tensor& ids) const override;
  Tensor backward_input(const Tensor& dy, nn::Saved& saved) const override;
  void backward_weight(nn::Saved& saved) override;
  /// wte (this rank's rows), then wpe.
  std::vector<nn::Parameter*> parameters() const override { return {wte_, wpe_}; }
  /// This rank's rows of wte, V_i x C: the weight the LM head is tied to.
  nn::Parameter& wte() { return *wte_; }
  /// The tokens whose rows of wte this rank holds: shard_range(V, t, i).
  ShardRange vocab() const { return vocab_; }

 private:
  ch08::TpRegion region_;                // left as a row-parallel layer is: g, or a reduce-scatter
  std::vector<std::int64_t> positions_;  // of the tokens this rank holds of each sequence
  ShardRange vocab_;
  nn::Parameter* wte_;
  nn::Parameter* wpe_;
};

/// The LM head tied to wte: logits_i = x wte_i^T, this rank's V_i columns of the logits,
/// entered as a column-parallel layer is (f, or under sequence parallelism the rows
/// gathered; dL/dx summed over tp in the backward). `weight` is the embedding's wte (pp 1)
/// or the last stage's copy of it.
class TiedHead final : public nn::Layer {
 public:
  /// The head over `tp` with `weight`, V_i x C (not owned). Mixed precision
  /// (options.compute): the logits' product in 16 bits, dL/dx rounded after its sum over tp.
  TiedHead(Communicator& tp, nn::Parameter& weight, const ch08::TpOptions& options = {})
      : region_(tp, options.sequence_parallel), weight_(&weight), compute_(options.compute) {}
  /// "lm_head".
  std::string name() const override { return "lm_head"; }
  nn::Forward forward(const Tensor& x) const override;
  Tensor backward_input(const Tensor& dlogits, nn::Saved& saved) const override;
  void backward_weight(nn::Saved& saved) override;
  /// The tied weight, the one parameter the head adds its gradient to.
  std::vector<nn::Parameter*> parameters() const override { return {weight_}; }

 private:
  ch08::TpRegion region_;
  nn::Parameter* weight_;
  shardlab::DType compute_;
};

/// What the blocks keep for their backward: chapter 08's planner's Recompute (Korthikanti
/// et al. 2022, §4 and §5). none: every activation; selective: not the attention's softmax
/// region (its H T/t weights a token, the largest part at long contexts), recomputed in
/// the backward from q, k and v; full: only each block's input, the whole block
/// recomputed (Megatron-LM's "full").
using ch08::Recompute;

/// How a rank's parameter is cut from the whole model's tensor.
enum class Cut {
  whole,   ///< the whole tensor, on every rank that holds it
  rows,    ///< a range of its rows (dimension 0)
  columns  ///< a range of its columns (dimension 1)
};

/// One parameter of a rank, as a piece of the whole model's tensor.
struct Piece {
  std::string name;      ///< Hugging Face's name of the whole tensor
  Shape whole;           ///< its shape in this model's layout ([in, out], biases 1 x n)
  Cut cut = Cut::whole;  ///< how this rank's parameter is cut from it
  ShardRange part;       ///< the rows or columns this rank holds (Cut::whole: all)
  bool qkv = false;      ///< c_attn: columns per head (q, k, v side by side), not HF's [q|k|v]
  bool counted = true;   ///< in the gradient norm: false for a copy another rank counts
  /// Cut::whole under sequence parallelism: each tp rank's gradient is its rows' part, to
  /// be summed over tp (false: the MoE layer's, which runs whole on every tp rank).
  bool rows_part = true;
  std::int64_t size() const;  ///< elements this rank holds
  /// Under sequence parallelism, whether this rank's gradient is its rows' part, summed
  /// over tp after backward: Cut::whole and rows_part.
  bool summed_over_tp() const { return cut == Cut::whole && rows_part; }
};

/// Chunk c of a rank's pipeline stage: its virtual stage k = ch04::virtual_stage(pp_i, c, p)
/// and the blocks it holds, [first, first + count) with count = L / (p v); virtual stage 0
/// begins with the embedding, the last one (p v - 1) ends with ln_f and the LM head.
struct ChunkBlocks {
  int chunk = 0;         ///< c, 0 .. v - 1
  int stage = 0;         ///< k, the virtual stage
  int first = 0;         ///< its first block
  int count = 0;         ///< its blocks
  bool embeds = false;   ///< k = 0: the embedding first
  bool is_last = false;  ///< k = p v - 1: ln_f and the LM head last
};
/// The `chunks` chunks rank `at` of `mesh` holds, in order: where every walk over a rank's
/// blocks (the model, its pieces, the formulas, the checkpoint) takes them from.
std::vector<ChunkBlocks> chunks_of(const GptShape& shape, const MeshShape& mesh, const Coords& at,
                                   int chunks = 1);

/// Every parameter rank `at` of `mesh` holds, in the order of its store, with `chunks`
/// model chunks per pipeline stage: the dense weights (the experts' are expert_pieces_of).
/// Each block's rows come from one plan (gpt.cpp's kBlockPlan, Megatron-LM's cut written as
/// picotron writes it: a tensor a row, its shape and how tp cuts it), which the model's
/// store is checked against when it is built.
std::vector<Piece> pieces_of(const GptShape& shape, const MeshShape& mesh, const Coords& at,
                             int chunks = 1);
/// The experts' parameters rank `at` holds, in the order of its expert store: of each MoE
/// block of its chunks, its ep rank's experts, each c_fc (columns over tp) and c_proj
/// (rows; the bias whole).
std::vector<Piece> expert_pieces_of(const GptShape& shape, const MeshShape& mesh, const Coords& at,
                                    int chunks = 1);

/// UsageError unless the model can be cut over `mesh` with `chunks` chunks per stage: tp
/// divides H; pp x chunks divides L; a sequence cuts over cp as `context` says (cp > 1
/// needs one); ep divides the experts (ep > 1 needs some), k is at most E.
void check_shape(const GptShape& shape, const MeshShape& mesh, int chunks = 1,
                 const ContextParallel* context = nullptr);

/// How a model is built besides its shape; the defaults: plain fp32 on the host.
struct ModelOptions {
  /// What the blocks recompute in the backward.
  Recompute recompute = Recompute::none;
  /// v > 1 (the interleaved schedule): stage s holds the p v virtual stages k = c p + s,
  /// c = 0 .. v - 1, each L / (p v) blocks: chunk c.
  int chunks = 1;
  /// Korthikanti et al. 2022, §4.2.2: between the tensor-parallel regions each tp rank
  /// holds n/t of a microbatch's n rows (tensor_parallel.hpp); the embedding's output, the
  /// blocks' LayerNorms and residual stream, ln_f and the messages between pipeline stages
  /// are split t ways. Needs t to divide n.
  bool sequence_parallel = false;
  /// f16 or bf16: mixed precision as torch.autocast (nn::Autocast): the Linears' and the
  /// head's products in 16 bits on the f32 weights; the embeddings, LayerNorms, the
  /// attention's core and the loss in f32.
  shardlab::DType compute = shardlab::DType::f32;
  /// Where the parameters (and so the activations) live.
  Memory memory = Memory::host;
  /// Context parallelism over the mesh's cp ranks (context.hpp: chapter 10's ring); needed
  /// when cp > 1, unused on cp 1.
  std::shared_ptr<const ContextParallel> context;
  /// The blocks' attention as one device builds it (attention_block: the library's layers),
  /// not the exercise's parallel_attention: one device's reference, whose verdict on the mesh
  /// must not rest on the learner's code. One tp rank only.
  bool library_attention = false;
  /// The tensor-parallel products summed over tp (and under sequence parallelism those
  /// whose input is gathered) made in this many parts of rows, each part's collective under
  /// another part's product with `tp_overlap` (TpOptions::chunks: the collective matmul),
  /// or waited for at once.
  int tp_chunks = 1;
  bool tp_overlap = false;  ///< with tp_chunks > 1: the parts' collectives overlap
  /// The MoE layers' all-to-alls, one per local expert, each under the previous expert's
  /// work (moe_mlp).
  bool ep_overlap = false;
};

/// This rank's part of the model.
class GptModel {
 public:
  /// This rank's part of the model of `shape` on `mesh`, built as `options` says, its store
  /// allocated in options.memory. UsageError unless check_shape passes.
  GptModel(Mesh& mesh, const GptShape& shape, const ModelOptions& options = {});
  /// This rank's parameters and gradients, in the order of pieces(): all but the experts'.
  nn::ParameterStore& store() { return store_; }
  /// This rank's experts' parameters and gradients, in the order of expert_pieces() (empty
  /// in a dense model, or on a stage without a MoE block).
  nn::ParameterStore& expert_store() { return expert_store_; }
  /// What each parameter of the expert store is of the whole model: expert_pieces_of().
  const std::vector<Piece>& expert_pieces() const { return expert_pieces_; }
  /// Where this rank's MoE layers report their routing and take the aux loss's weight and
  /// scale (a dense model's too: it stays empty).
  const std::shared_ptr<ch07::MoeLog>& moe_log() const { return moe_log_; }
  /// Chunk c's layers: the embedding (virtual stage 0), its blocks (each its attention and
  /// its MLP, or under full recompute one nn::Checkpoint of the two), ln_f (the last).
  nn::Sequential& chunk(int c = 0) { return *chunks_.at(static_cast<std::size_t>(c)); }
  /// The model chunks this rank holds: options.chunks.
  int chunks() const { return static_cast<int>(chunks_.size()); }
  /// The LM head (last stage only; nullptr elsewhere).
  TiedHead* head() { return head_.get(); }
  /// wte or its copy: the parameter the embedding group sums (nullptr on middle stages).
  nn::Parameter* tied() { return tied_; }
  /// What each parameter of the store is of the whole model: pieces_of() for this rank.
  const std::vector<Piece>& pieces() const { return pieces_; }
  /// The whole model's shape.
  const GptShape& shape() const { return shape_; }
  /// Whether this rank is on the first pipeline stage (the embeddings).
  bool first() const { return first_; }
  /// Whether this rank is on the last pipeline stage (ln_f, the LM head and the loss).
  bool last() const { return last_; }
  /// The tokens whose wte rows and logits this rank holds: shard_range(V, t, i).
  ShardRange vocab() const { return vocab_; }
  /// The positions in a sequence of the tokens this rank holds of each: 0 .. T-1, or under
  /// context parallelism its cp rank's (ContextParallel::positions).
  const std::vector<std::int64_t>& positions() const { return positions_; }
  /// Sequence parallel on more than one tp rank: activations hold n/t rows, and the
  /// gradients of the weights every tp rank holds whole (Cut::whole) are each rank's
  /// rows' part, to be summed over tp.
  bool sequence_parallel() const { return sequence_parallel_; }

 private:
  GptShape shape_;
  nn::ParameterStore store_, expert_store_;
  std::vector<Piece> expert_pieces_;
  std::shared_ptr<ch07::MoeLog> moe_log_ = std::make_shared<ch07::MoeLog>();
  std::vector<std::unique_ptr<nn::Sequential>> chunks_;
  std::unique_ptr<TiedHead> head_;
  nn::Parameter* tied_ = nullptr;
  std::vector<Piece> pieces_;
  ShardRange vocab_;
  std::vector<std::int64_t> positions_;
  bool first_, last_;
  bool sequence_parallel_ = false;
};

}  // namespace ch09
