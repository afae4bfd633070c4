// Chapter 09's model (gpt.hpp), and the blocks attention_and_loss.hpp declares for it.
#include "gpt.hpp"

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
  if (mesh.cp == 1) return;
  require_usage(context != nullptr, "--cp " + std::to_string(mesh.cp) +
                                        " needs an attention across the cp ranks (chapter "
                                        "10's ring attention: ch10::ring_context)");
  context->check(s.context, mesh.cp);
}

std::vector<Piece> pieces_of(const GptShape& s, const MeshShape& mesh, const Coords& at,
                             int chunks) {
  const std::int64_t C = s.channels;
  const int t = mesh.tp, r = at.tp;
  const bool first = at.pp == 0, lead = r == 0;
  std::vector<Piece> out;
  auto whole = [&](std::string name, Shape shape) {  // the same on every tp rank
    out.push_back({std::move(name), shape, Cut::whole, {0, 0}, false, lead});
  };
  auto cut = [&](std::string name, Shape shape, Cut how, bool qkv = false) {
    const std::int64_t n = how == Cut::rows ? shape[0] : shape[1];
    out.push_back({std::move(name), shape, how, shard_range(n, t, r), qkv, true});
  };
  const int per = s.layers / (mesh.pp * chunks), last_k = mesh.pp * chunks - 1;
  for (int c = 0; c < chunks; ++c) {
    const int k = c * mesh.pp + at.pp;  // the virtual stage
    if (k == 0) {
      cut("transformer.wte.weight", {s.vocab, C}, Cut::rows);
      whole("transformer.wpe.weight", {s.context, C});
    }
    for (int b = k * per; b < (k + 1) * per; ++b) {
      const std::string h = "transformer.h." + std::to_string(b) + ".";
      whole(h + "ln_1.weight", {1, C});
      whole(h + "ln_1.bias", {1, C});
      cut(h + "attn.c_attn.weight", {C, 3 * C}, Cut::columns, true);
      cut(h + "attn.c_attn.bias", {1, 3 * C}, Cut::columns, true);
      cut(h + "attn.c_proj.weight", {C, C}, Cut::rows);
      whole(h + "attn.c_proj.bias", {1, C});
      whole(h + "ln_2.weight", {1, C});
      whole(h + "ln_2.bias", {1, C});
      cut(h + "mlp.c_fc.weight", {C, 4 * C}, Cut::columns);
      cut(h + "mlp.c_fc.bias", {1, 4 * C}, Cut::columns);
      cut(h + "mlp.c_proj.weight", {4 * C, C}, Cut::rows);
      whole(h + "mlp.c_proj.bias", {1, C});
    }
    if (k == last_k) {
      whole("transformer.ln_f.weight", {1, C});
      whole("transformer.ln_f.bias", {1, C});
      if (!first) {  // the head's copy of wte: the first stage counts the weight
        cut("transformer.wte.weight", {s.vocab, C}, Cut::rows);
        out.back().counted = false;
      }
    }
  }
  return out;
}

GptModel::GptModel(Mesh& mesh, const GptShape& shape, const ModelOptions& options)
    : shape_(shape),
      vocab_(shard_range(shape.vocab, mesh.shape().tp, mesh.coords().tp)),
      first_(mesh.coords().pp == 0),
      last_(mesh.coords().pp == mesh.shape().pp - 1),
      sequence_parallel_(options.sequence_parallel && mesh.shape().tp > 1) {
  const auto& [recompute, chunks, sequence_parallel, compute, memory, context] = options;
  const bool split = mesh.shape().cp > 1;  // each sequence cut over the cp ranks
  check_shape(shape, mesh.shape(), chunks, context.get());
  const Coords& at = mesh.coords();
  const int p = mesh.shape().pp, per = shape.layers / (p * chunks);
  Communicator& tp = mesh.tp();
  if (split)
    positions_ = context->positions(shape.context, mesh.shape().cp, at.cp);
  else
    for (std::int64_t t = 0; t < shape.context; ++t) positions_.push_back(t);
  const BlockOptions blocks{.tp = {.sequence_parallel = sequence_parallel_, .compute = compute},
                            .recompute_core = recompute == Recompute::selective,
                            .context = split ? context.get() : nullptr,
                            .cp = split ? &mesh.cp() : nullptr};
  for (int c = 0; c < chunks; ++c) {
    chunks_.push_back(std::make_unique<nn::Sequential>());
    nn::Sequential& chunk = *chunks_.back();
    const int k = c * p + at.pp;  // the virtual stage
    if (k == 0) {
      auto& embedding =
          chunk.add<VocabParallelEmbedding>(store_, tp, shape, sequence_parallel_, positions_);
      tied_ = &embedding.wte();
    }
    for (int b = k * per; b < (k + 1) * per; ++b) {
      const std::string name = "transformer.h." + std::to_string(b);
      auto attention =
          std::make_shared<nn::Residual>(parallel_attention(store_, tp, name, shape, b, blocks));
      auto mlp = std::make_shared<nn::Residual>(
          ch08::parallel_mlp(store_, tp, mlp_spec(name, shape, b), blocks.tp));
      if (recompute == Recompute::full) {
        auto both = std::make_shared<nn::Sequential>();
        both->add(attention);
        both->add(mlp);
        chunk.add(std::make_shared<nn::Checkpoint>(both));
      } else {
        chunk.add(attention);
        chunk.add(mlp);
      }
    }
    if (k == p * chunks - 1) {
      chunk.add<nn::LayerNorm>(store_, "transformer.ln_f", shape.channels);
      if (!first_) tied_ = &store_.add("lm_head.weight", wte_init(shape, tp.size(), tp.rank()));
      head_ = std::make_unique<TiedHead>(tp, *tied_, blocks.tp);
    }
  }
  store_.allocate(memory);
  pieces_ = pieces_of(shape, mesh.shape(), at, chunks);
  const std::vector<nn::Parameter*> params = store_.parameters();
  require(params.size() == pieces_.size(), "GptModel: the store and pieces_of() disagree");
  for (std::size_t i = 0; i < params.size(); ++i)
    require(params[i]->value.size() == pieces_[i].size(), [&] {
      return "GptModel: " + params[i]->name + " holds " + std::to_string(params[i]->value.size()) +
             " elements, pieces_of() says " + pieces_[i].name + " has " +
             std::to_string(pieces_[i].size());
    });
}

}  // namespace ch09
