// Chapter 09's model (gpt.hpp), and the blocks attention_and_loss.hpp declares for it.
#include "gpt.hpp"

#include <algorithm>
#include <cmath>

#include "shardlab/check.hpp"
#include "tensor_parallel.hpp"

namespace ch09 {

using shardlab::require;
using shardlab::require_usage;
using shardlab::shard_range;

std::uint64_t param_seed(const GptShape& shape, int block, int which) {
  return shape.seed * 1000003ULL + static_cast<std::uint64_t>(block + 1) * 8 +
         static_cast<std::uint64_t>(which);
}

float residual_scale(const GptShape& shape) {
  return 1.0f / std::sqrt(2.0f * static_cast<float>(shape.layers));
}

nn::Residual attention_block(nn::ParameterStore& store, const std::string& name,
                             const GptShape& shape, int block) {
  const std::int64_t C = shape.channels;
  nn::Sequential inner;
  inner.add<nn::LayerNorm>(store, name + ".ln_1", C);
  inner.add<nn::Linear>(store, name + ".attn.c_attn", C, 3 * C, param_seed(shape, block, 0));
  inner.add<nn::CausalSelfAttention>(shape.heads, shape.context);
  nn::Linear& proj =
      inner.add<nn::Linear>(store, name + ".attn.c_proj", C, C, param_seed(shape, block, 1));
  proj.weight().value = scale(proj.weight().value, residual_scale(shape));
  return nn::Residual(std::move(inner));
}

std::shared_ptr<nn::Layer> attention_core(std::int64_t heads, const GptShape& shape,
                                          const BlockOptions& options) {
  std::shared_ptr<nn::Layer> core =
      options.context ? options.context->core(*options.cp, heads, shape.context)
                      : std::make_shared<nn::CausalSelfAttention>(heads, shape.context);
  if (!options.recompute_core) return core;
  return std::make_shared<nn::Checkpoint>(core);
}

ch08::MlpSpec mlp_spec(const std::string& name, const GptShape& shape, int block) {
  return {.hidden = shape.channels,
          .ffn = 4 * shape.channels,
          .norm = name + ".ln_2",
          .fc1 = name + ".mlp.c_fc",
          .fc2 = name + ".mlp.c_proj",
          .seed1 = param_seed(shape, block, 2),
          .seed2 = param_seed(shape, block, 3),
          .out_scale = residual_scale(shape)};
}

std::uint64_t expert_seed(const GptShape& shape, int block, int expert, int which) {
  return param_seed(shape, block, 5) * 7919 + 2 * static_cast<std::uint64_t>(expert) +
         static_cast<std::uint64_t>(which);
}

namespace {

/// A layer that runs on all n rows of a microbatch while the tp ranks hold n/t each
/// (sequence parallelism): the rows gathered from the tp ranks before it, this rank's
/// rows of its output kept after, which every tp rank computes whole; backward, dL/dy's
/// rows gathered, this rank's rows of dL/dx kept. Around the MoE layer, whose experts are
/// tensor parallel inside it.
class AllRows final : public nn::Layer {
 public:
  AllRows(Communicator& tp, std::shared_ptr<nn::Layer> inner) : tp_(tp), inner_(std::move(inner)) {}
  std::string name() const override { return inner_->name(); }
  nn::Forward forward(const Tensor& x) const override {
    nn::Forward inner = inner_->forward(ch08::gather_rows(tp_, x));
    nn::Forward f{mine(inner.out), {}};
    f.saved.children.push_back(std::move(inner.saved));
    return f;
  }
  Tensor backward_input(const Tensor& dy, nn::Saved& saved) const override {
    return mine(inner_->backward_input(ch08::gather_rows(tp_, dy), saved.children.at(0)));
  }
  void backward_weight(nn::Saved& saved) override { inner_->backward_weight(saved.children.at(0)); }
  std::vector<nn::Parameter*> parameters() const override { return inner_->parameters(); }

 private:
  /// This rank's rows of a whole microbatch's.
  Tensor mine(const Tensor& all) const {
    const ShardRange rows = shard_range(all.rows(), tp_.size(), tp_.rank());
    return all.slice(rows.offset, rows.length).clone();
  }
  Communicator& tp_;
  std::shared_ptr<nn::Layer> inner_;
};

}  // namespace

nn::Residual moe_mlp(nn::ParameterStore& store, nn::ParameterStore& experts, Mesh& mesh,
                     const GptShape& shape, int block, const ch08::TpOptions& options,
                     const std::shared_ptr<ch07::MoeLog>& log,
                     const std::vector<std::vector<std::int64_t>>& cp_positions, bool ep_overlap) {
  const std::int64_t C = shape.channels;
  const std::string name = "transformer.h." + std::to_string(block) + ".mlp";
  Communicator& tp = mesh.tp();
  const ch07::MoeConfig config{.tokens = 0,
                               .hidden = static_cast<int>(C),
                               .ffn = static_cast<int>(4 * C),
                               .experts = shape.experts,
                               .k = shape.top_k,
                               .capacity_factor = shape.capacity_factor,
                               .aux_alpha = shape.aux_alpha,
                               .seed = shape.seed};
  ch07::MoeOptions moe;
  moe.name = name;
  moe.residual = false;    // the block's Residual adds x
  moe.sum_router = false;  // the replicas' sync sums it, with the other dense weights
  moe.expert_store = &experts;
  // Each expert a GPT-2 MLP on the tp ranks: every tp rank holds the microbatch's rows
  // whole inside the layer, so f and g (not sequence parallelism's gather and scatter).
  const ch08::TpOptions inside{.sequence_parallel = false,
                               .compute = options.compute,
                               .chunks = options.chunks,
                               .overlap = options.overlap};
  moe.expert = [&tp, shape, block, name, inside](nn::ParameterStore& into, int e) {
    // Chapter 08's parallel MLP without a norm, and without its residual (the block's).
    const std::string prefix = name + ".experts." + std::to_string(e);
    const ch08::MlpSpec spec{.hidden = shape.channels,
                             .ffn = 4 * shape.channels,
                             .norm = "",
                             .fc1 = prefix + ".c_fc",
                             .fc2 = prefix + ".c_proj",
                             .seed1 = expert_seed(shape, block, e, 0),
                             .seed2 = expert_seed(shape, block, e, 1),
                             .out_scale = residual_scale(shape)};
    return std::shared_ptr<nn::Layer>(
        std::make_shared<nn::Sequential>(ch08::parallel_mlp(into, tp, spec, inside).inner()));
  };
  moe.groups.tokens = shape.context;  // a sequence
  if (mesh.shape().cp > 1) {
    moe.groups.split = &mesh.cp();
    moe.groups.positions = cp_positions;
  }
  moe.log = log;
  // One all-to-all per local expert over ep, overlapping or not (the same parts either way).
  moe.by_expert = mesh.shape().ep > 1;
  moe.overlap = ep_overlap;
  const Tensor router =
      scale(shardlab::randn(Shape{C, shape.experts}, param_seed(shape, block, 4)), 0.02f);
  nn::Sequential inner;
  inner.add<nn::LayerNorm>(store, "transformer.h." + std::to_string(block) + ".ln_2", C);
  auto layer = std::make_shared<ch07::MoeLayer>(store, mesh.ep(), config, router, std::move(moe));
  if (options.sequence_parallel && tp.size() > 1)
    inner.add(std::make_shared<AllRows>(tp, layer));
  else
    inner.add(layer);
  return nn::Residual(std::move(inner));
}

namespace {

/// GPT-2's initial embeddings, N(0, 0.02^2); rank `part` of `parts` takes its rows.
Tensor wte_init(const GptShape& shape, int parts, int part) {
  return shard(scale(shardlab::randn(Shape{shape.vocab, shape.channels}, param_seed(shape, -1, 0)),
                     0.02f),
               parts, 0, part)
      .clone();
}

}  // namespace

VocabParallelEmbedding::VocabParallelEmbedding(nn::ParameterStore& store, Communicator& tp,
                                               const GptShape& shape, bool sequence_parallel,
                                               std::vector<std::int64_t> positions)
    : region_(tp, sequence_parallel),
      positions_(std::move(positions)),
      vocab_(shard_range(shape.vocab, tp.size(), tp.rank())),
      wte_(&store.add("transformer.wte.weight", wte_init(shape, tp.size(), tp.rank()))),
      wpe_(&store.add(
          "transformer.wpe.weight",
          scale(shardlab::randn(Shape{shape.context, shape.channels}, param_seed(shape, -1, 1)),
                0.02f))) {
  if (positions_.empty())
    for (std::int64_t t = 0; t < shape.context; ++t) positions_.push_back(t);
}

nn::Forward VocabParallelEmbedding::forward(const Tensor& ids) const {
  const std::int64_t n = ids.size(), C = wpe_->value.cols(), V = vocab_.length;
  const auto P = static_cast<std::int64_t>(positions_.size());
  require(ids.dtype() == shardlab::DType::i32 && n % P == 0, [&] {
    return "embedding: ids are " + ids.describe() + "; expected i32, " + std::to_string(P) +
           " tokens of each sequence";
  });
  // The rows are picked on the host (the ids are host data; under --device cuda from a
  // host copy of this rank's wte) and summed where the weights live. tp rank 0 adds each
  // row's wpe[position] before the sum: every other rank's part of a row is its token's
  // row or zeros, so the sum is token + position, rounded once, on any number of ranks.
  const Memory memory = wte_->value.memory();
  const Tensor wte = wte_->value.to(Memory::host), wpe = wpe_->value.to(Memory::host);
  Tensor rows = shardlab::zeros(Shape{n, C});
  const std::int32_t* id = ids.data<std::int32_t>();
  const float *w = wte.data(), *p = wpe.data();
  float* y = rows.data();
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t row = id[i] - vocab_.offset;
    if (row >= 0 && row < V) std::copy(w + row * C, w + (row + 1) * C, y + i * C);
    const std::int64_t position = positions_[static_cast<std::size_t>(i % P)];
    if (region_.comm().rank() == 0)
      for (std::int64_t c = 0; c < C; ++c) y[i * C + c] += p[position * C + c];
  }
  // Each token's row from the one rank that holds it: summed over tp, whole on every rank
  // or (sequence parallel) this rank's rows of the sum.
  nn::Forward f{region_.leave(rows.to(memory)), {}};
  f.saved.tensors = {ids};
  return f;
}

Tensor VocabParallelEmbedding::backward_input(const Tensor& dy, nn::Saved& saved) const {
  // wte's rows here may be read by any row of the microbatch: every row's gradient.
  saved.dy = region_.leave_backward(dy);
  return Tensor();  // token ids have no gradient
}

void VocabParallelEmbedding::backward_weight(nn::Saved& saved) {
  require(saved.dy.defined(), "embedding: backward_weight before backward_input");
  const Tensor& ids = saved.tensors.at(0);
  const std::int64_t n = ids.size(), C = wpe_->value.cols(), V = vocab_.length;
  const std::int32_t* id = ids.data<std::int32_t>();
  // On the host (under --device cuda: copies, added back below).
  const Tensor dy = saved.dy.to(Memory::host);
  Tensor wte_grad = wte_->grad.to(Memory::host), wpe_grad = wpe_->grad.to(Memory::host);
  const float* d = dy.data();
  float* gw = wte_grad.data();
  float* gp = wpe_grad.data();
  // wpe: every row, or (sequence parallel) this rank's rows only, summed over tp later.
  const ShardRange mine = region_.rows(n);
  const auto P = static_cast<std::int64_t>(positions_.size());
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t row = id[i] - vocab_.offset;
    if (row >= 0 && row < V)
      for (std::int64_t c = 0; c < C; ++c) gw[row * C + c] += d[i * C + c];
    const std::int64_t position = positions_[static_cast<std::size_t>(i % P)];
    if (i >= mine.offset && i < mine.offset + mine.length)
      for (std::int64_t c = 0; c < C; ++c) gp[position * C + c] += d[i * C + c];
  }
  if (wte_->grad.on_device()) {
    wte_->grad.copy_from(wte_grad);
    wpe_->grad.copy_from(wpe_grad);
  }
  saved = nn::Saved{};
}

nn::Forward TiedHead::forward(const Tensor& x) const {
  using shardlab::round_to;
  const Tensor whole = round_to(region_.enter(x), compute_);
  nn::Forward f{round_to(matmul(whole, round_to(weight_->value, compute_), false, true), compute_),
                {}};
  f.saved.tensors = {whole};
  return f;
}

Tensor TiedHead::backward_input(const Tensor& dlogits, nn::Saved& saved) const {
  using shardlab::round_to;
  saved.dy = round_to(dlogits, compute_);
  // Every tp rank's vocabulary contributes to dL/dx: summed (sequence parallel: this
  // rank's rows of the sum), then rounded once under autocast.
  const Tensor dx = matmul(saved.dy, round_to(weight_->value, compute_));
  return round_to(region_.enter_backward(dx), compute_);
}

void TiedHead::backward_weight(nn::Saved& saved) {
  require(saved.dy.defined(), "lm_head: backward_weight before backward_input");
  axpy(1.0f, shardlab::round_to(matmul(saved.dy, saved.tensors.at(0), true, false), compute_),
       weight_->grad);
  saved = nn::Saved{};
}

std::int64_t Piece::size() const {
  switch (cut) {
    case Cut::rows:
      return part.length * whole[1];
    case Cut::columns:
      return whole[0] * part.length;
    case Cut::whole:
      break;
  }
  return whole.numel();
}

void check_shape(const GptShape& s, const MeshShape& mesh, int chunks,
                 const ContextParallel* context) {
  const std::string tp = "--tp " + std::to_string(mesh.tp);
  require_usage(s.channels % s.heads == 0, "--heads " + std::to_string(s.heads) +
                                               " must divide --channels " +
                                               std::to_string(s.channels));
  require_usage(s.heads % mesh.tp == 0,
                tp + " must divide the " + std::to_string(s.heads) + " heads");
  require_usage(s.vocab >= mesh.tp, tp + " leaves a rank no tokens of the vocabulary");
  require_usage(s.layers % mesh.pp == 0, "--pp " + std::to_string(mesh.pp) + " must divide the " +
                                             std::to_string(s.layers) + " layers");
  require_usage(s.layers % (mesh.pp * chunks) == 0,
                "--pp " + std::to_string(mesh.pp) + " x --chunks " + std::to_string(chunks) +
                    " must divide the " + std::to_string(s.layers) + " layers");
  require_usage(s.experts >= 0 && s.moe_every >= 1, "--experts and --moe-every must be positive");
  if (s.experts > 0) {
    require_usage(s.top_k >= 1 && s.top_k <= s.experts, "--top-k " + std::to_string(s.top_k) +
                                                            ": a token goes to 1 .. --experts " +
                                                            std::to_string(s.experts) + " experts");
    require_usage(s.experts % mesh.ep == 0, "--ep " + std::to_string(mesh.ep) +
                                                " must divide the " + std::to_string(s.experts) +
                                                " experts");
    require_usage(s.capacity_factor > 0 && s.aux_alpha >= 0,
                  "--capacity-factor must be above 0 and --aux-alpha at least 0");
  } else {
    require_usage(mesh.ep == 1, "--ep " + std::to_string(mesh.ep) +
                                    " splits experts: give the model some (--experts E)");
  }
  if (mesh.cp == 1) return;
  require_usage(context != nullptr, "--cp " + std::to_string(mesh.cp) +
                                        " needs an attention across the cp ranks (chapter "
                                        "10's ring attention: ch10::ring_context)");
  context->check(s.context, mesh.cp);
}

std::vector<ChunkBlocks> chunks_of(const GptShape& shape, const MeshShape& mesh, const Coords& at,
                                   int chunks) {
  const int p = mesh.pp, per = shape.layers / (p * chunks);
  std::vector<ChunkBlocks> out;
  for (int c = 0; c < chunks; ++c) {
    const int k = ch04::virtual_stage(at.pp, c, p);
    out.push_back({.chunk = c,
                   .stage = k,
                   .first = k * per,
                   .count = per,
                   .embeds = k == 0,
                   .is_last = k == p * chunks - 1});
  }
  return out;
}

namespace {

/// One tensor of a block as tensor parallelism cuts it (Megatron-LM's plan): its name after
/// "transformer.h.B.", its shape in multiples of C (0: 1), and its cut over tp.
struct PlanRow {
  const char* name;
  int rows, cols;
  Cut cut;
  bool qkv = false;  // c_attn: cut by whole heads, q, k, v side by side
};
/// A block's attention and LayerNorms: c_attn column-parallel (f before it), c_proj
/// row-parallel (g after it, its bias whole), the norms whole.
constexpr PlanRow kBlockPlan[] = {
    {"ln_1.weight", 0, 1, Cut::whole},
    {"ln_1.bias", 0, 1, Cut::whole},
    {"attn.c_attn.weight", 1, 3, Cut::columns, true},
    {"attn.c_attn.bias", 0, 3, Cut::columns, true},
    {"attn.c_proj.weight", 1, 1, Cut::rows},
    {"attn.c_proj.bias", 0, 1, Cut::whole},
    {"ln_2.weight", 0, 1, Cut::whole},
    {"ln_2.bias", 0, 1, Cut::whole},
};
/// A dense MLP (after "mlp.") and each expert of a MoE one (after "mlp.experts.e."): c_fc
/// column-parallel, c_proj row-parallel.
constexpr PlanRow kMlpPlan[] = {
    {"c_fc.weight", 1, 4, Cut::columns},
    {"c_fc.bias", 0, 4, Cut::columns},
    {"c_proj.weight", 4, 1, Cut::rows},
    {"c_proj.bias", 0, 1, Cut::whole},
};

/// The pieces of a rank at tp rank r of t.
class PieceList {
 public:
  PieceList(std::int64_t C, int t, int r) : C_(C), t_(t), r_(r) {}
  /// The row's tensor under `prefix`; a whole tensor counted in the norm on tp rank 0 only,
  /// and its gradient a part of each tp rank's rows under sequence parallelism unless the
  /// layer runs whole on every tp rank (`rows_part`).
  void add(const std::string& prefix, const PlanRow& row, bool rows_part = true) {
    const Shape whole{row.rows ? row.rows * C_ : 1, row.cols ? row.cols * C_ : 1};
    add(prefix + row.name, whole, row.cut, row.qkv, rows_part);
  }
  /// A tensor of the given shape and cut.
  void add(std::string name, Shape whole, Cut cut, bool qkv = false, bool rows_part = true) {
    const std::int64_t n = cut == Cut::rows ? whole[0] : whole[1];
    out.push_back({std::move(name), whole, cut,
                   cut == Cut::whole ? ShardRange{0, 0} : shard_range(n, t_, r_), qkv,
                   cut != Cut::whole || r_ == 0, rows_part});
  }
  std::vector<Piece> out;

 private:
  std::int64_t C_;
  int t_, r_;
};

}  // namespace

std::vector<Piece> pieces_of(const GptShape& s, const MeshShape& mesh, const Coords& at,
                             int chunks) {
  const std::int64_t C = s.channels;
  PieceList list(C, mesh.tp, at.tp);
  for (const ChunkBlocks& chunk : chunks_of(s, mesh, at, chunks)) {
    if (chunk.embeds) {
      list.add("transformer.wte.weight", {s.vocab, C}, Cut::rows);
      list.add("transformer.wpe.weight", {s.context, C}, Cut::whole);
    }
    for (int b = chunk.first; b < chunk.first + chunk.count; ++b) {
      const std::string h = "transformer.h." + std::to_string(b) + ".";
      for (const PlanRow& row : kBlockPlan) list.add(h, row);
      if (s.moe(b))  // the router, whole; the experts are expert_pieces_of's
        list.add(h + "mlp.router.weight", {C, s.experts}, Cut::whole, false, false);
      else
        for (const PlanRow& row : kMlpPlan) list.add(h + "mlp.", row);
    }
    if (chunk.is_last) {
      list.add("transformer.ln_f.weight", {1, C}, Cut::whole);
      list.add("transformer.ln_f.bias", {1, C}, Cut::whole);
      if (at.pp != 0) {  // the head's copy of wte: the first stage counts the weight
        list.add("transformer.wte.weight", {s.vocab, C}, Cut::rows);
        list.out.back().counted = false;
      }
    }
  }
  return std::move(list.out);
}

std::vector<Piece> expert_pieces_of(const GptShape& s, const MeshShape& mesh, const Coords& at,
                                    int chunks) {
  PieceList list(s.channels, mesh.tp, at.tp);
  const int per_rank = s.experts / mesh.ep;
  for (const ChunkBlocks& chunk : chunks_of(s, mesh, at, chunks))
    for (int b = chunk.first; b < chunk.first + chunk.count; ++b) {
      if (!s.moe(b)) continue;
      for (int e = at.ep * per_rank; e < (at.ep + 1) * per_rank; ++e)
        for (const PlanRow& row : kMlpPlan)  // the MoE layer runs whole on every tp rank
          list.add("transformer.h." + std::to_string(b) + ".mlp.experts." + std::to_string(e) + ".",
                   row, false);
    }
  return std::move(list.out);
}

namespace {

/// Every cp rank's positions of a sequence (chapter 10's split; whole sequences: one empty
/// list), for the MoE routing that gathers a sequence from them.
std::vector<std::vector<std::int64_t>> cp_positions_of(const MeshShape& mesh, const GptShape& shape,
                                                       const ContextParallel* context) {
  std::vector<std::vector<std::int64_t>> out;
  for (int q = 0; q < mesh.cp; ++q)
    out.push_back(mesh.cp > 1 ? context->positions(shape.context, mesh.cp, q)
                              : std::vector<std::int64_t>{});
  return out;
}

/// A check that the layers put into `store` what the plan says this rank holds
/// (`pieces`): a parallel_attention holding other parameters than Megatron-LM's cut would
/// save and load checkpoints wrongly.
void check_store(nn::ParameterStore& store, const std::vector<Piece>& pieces) {
  const std::vector<nn::Parameter*> params = store.parameters();
  for (std::size_t i = 0; i < std::max(params.size(), pieces.size()); ++i) {
    const std::string built =
        i < params.size()
            ? params[i]->name + " of " + std::to_string(params[i]->value.size()) + " elements"
            : "nothing";
    const std::string planned =
        i < pieces.size() ? pieces[i].name + " of " + std::to_string(pieces[i].size()) + " elements"
                          : "nothing";
    require(i < params.size() && i < pieces.size() && params[i]->value.size() == pieces[i].size(),
            [&] {
              return "GptModel: parameter " + std::to_string(i) + " of this rank is " + built +
                     ", where Megatron-LM's cut (pieces_of) has " + planned +
                     ": do the blocks (parallel_attention) hold their heads' parameters only?";
            });
  }
}

}  // namespace

GptModel::GptModel(Mesh& mesh, const GptShape& shape, const ModelOptions& options)
    : shape_(shape),
      vocab_(shard_range(shape.vocab, mesh.shape().tp, mesh.coords().tp)),
      first_(mesh.coords().pp == 0),
      last_(mesh.coords().pp == mesh.shape().pp - 1),
      sequence_parallel_(options.sequence_parallel && mesh.shape().tp > 1) {
  const auto& [recompute, chunks, sequence_parallel, compute, memory, context, library_attention,
               tp_chunks, tp_overlap, ep_overlap] = options;
  require(!library_attention || mesh.shape().tp == 1,
          "GptModel: one device's attention (library_attention) is for one tp rank");
  const bool split = mesh.shape().cp > 1;  // each sequence cut over the cp ranks
  check_shape(shape, mesh.shape(), chunks, context.get());
  const Coords& at = mesh.coords();
  Communicator& tp = mesh.tp();
  const std::vector<std::vector<std::int64_t>> cp_positions =
      cp_positions_of(mesh.shape(), shape, context.get());
  if (split)
    positions_ = cp_positions[static_cast<std::size_t>(at.cp)];
  else
    for (std::int64_t t = 0; t < shape.context; ++t) positions_.push_back(t);
  const BlockOptions blocks{.tp = {.sequence_parallel = sequence_parallel_,
                                   .compute = compute,
                                   .chunks = tp_chunks,
                                   .overlap = tp_overlap},
                            .recompute_core = recompute == Recompute::selective,
                            .context = split ? context.get() : nullptr,
                            .cp = split ? &mesh.cp() : nullptr};
  for (const ChunkBlocks& blocks_of : chunks_of(shape, mesh.shape(), at, chunks)) {
    nn::Sequential& chunk = *chunks_.emplace_back(std::make_unique<nn::Sequential>());
    if (blocks_of.embeds)
      tied_ = &chunk.add<VocabParallelEmbedding>(store_, tp, shape, sequence_parallel_, positions_)
                   .wte();
    for (int b = blocks_of.first; b < blocks_of.first + blocks_of.count; ++b) {
      const std::string name = "transformer.h." + std::to_string(b);
      auto attention = std::make_shared<nn::Residual>(
          library_attention ? attention_block(store_, name, shape, b)
                            : parallel_attention(store_, tp, name, shape, b, blocks));
      auto mlp = std::make_shared<nn::Residual>(
          shape.moe(b) ? moe_mlp(store_, expert_store_, mesh, shape, b, blocks.tp, moe_log_,
                                 cp_positions, ep_overlap)
                       : ch08::parallel_mlp(store_, tp, mlp_spec(name, shape, b), blocks.tp));
      if (recompute == Recompute::full) {  // the block's input kept alone: one Checkpoint
        auto both = std::make_shared<nn::Sequential>();
        both->add(attention);
        both->add(mlp);
        chunk.add(std::make_shared<nn::Checkpoint>(both));
      } else {
        chunk.add(attention);
        chunk.add(mlp);
      }
    }
    if (blocks_of.is_last) {
      chunk.add<nn::LayerNorm>(store_, "transformer.ln_f", shape.channels);
      if (!first_) tied_ = &store_.add("lm_head.weight", wte_init(shape, tp.size(), tp.rank()));
      head_ = std::make_unique<TiedHead>(tp, *tied_, blocks.tp);
    }
  }
  store_.allocate(memory);
  expert_store_.allocate(memory);
  pieces_ = pieces_of(shape, mesh.shape(), at, chunks);
  expert_pieces_ = expert_pieces_of(shape, mesh.shape(), at, chunks);
  check_store(store_, pieces_);
  check_store(expert_store_, expert_pieces_);
}

}  // namespace ch09
