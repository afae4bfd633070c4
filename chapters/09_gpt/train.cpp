// Chapter 09's training (train.hpp).
#include "train.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <numeric>

#include "profile.hpp"
#include "shardlab/check.hpp"
#include "shardlab/format.hpp"
#include "shardlab/memory.hpp"
#include "shardlab/results.hpp"

namespace ch09 {

namespace memory = shardlab::memory;
using shardlab::CommStats;
using shardlab::ReduceOp;
using shardlab::require;
using shardlab::require_usage;
using shardlab::shard_range;

namespace {

std::uint64_t sent_since(Communicator& comm, const CommStats& before) {
  return comm.stats().since(before).total().bytes_sent;
}

}  // namespace

namespace {
/// --precision's names of the element types.
const char* precision_name(shardlab::DType type) {
  return type == shardlab::DType::f16 ? "fp16" : type == shardlab::DType::bf16 ? "bf16" : "fp32";
}
}  // namespace

void set_precision(TrainConfig& c, const std::string& precision, const std::string& scaler) {
  c.precision = shardlab::DType::f32;
  for (shardlab::DType type : {shardlab::DType::f16, shardlab::DType::bf16})
    if (precision == precision_name(type)) c.precision = type;
  const std::string kind =
      !scaler.empty() ? scaler : (c.precision == shardlab::DType::f16 ? "dynamic" : "none");
  c.scaler = kind == "dynamic"  ? ch06::Scaler::dynamic
             : kind == "static" ? ch06::Scaler::fixed
                                : ch06::Scaler::none;
  require_usage(
      c.scaler == ch06::Scaler::none || c.precision != shardlab::DType::f32,
      "--scaler " + kind + ": a loss scaler is for 16-bit products (add --precision fp16)");
}

void check_config(const TrainConfig& c) {
  check_shape(c.model, c.mesh, c.chunks, c.context.get());
  require_usage(c.chunks == 1 || c.schedule == "interleaved",
                "--chunks " + std::to_string(c.chunks) +
                    ": only the interleaved schedule runs "
                    "several chunks per stage");
  ch04::require_shape(c.schedule, c.mesh.pp, c.microbatches, c.chunks, c.model.layers);
  const std::int64_t tokens = c.model.context / c.mesh.cp;  // of a sequence, on one cp rank
  require_usage(!c.sequence_parallel || tokens % c.mesh.tp == 0,
                "--sequence-parallel splits each sequence's " + std::to_string(tokens) +
                    " tokens" + (c.mesh.cp > 1 ? " on a cp rank" : "") + " over the tp ranks: --tp " +
                    std::to_string(c.mesh.tp) + " must divide " +
                    (c.mesh.cp > 1 ? "--context / --cp" : "--context"));
  const std::string replicas = c.mesh.ep > 1 ? "dp x ep x m" : "dp x m";
  require_usage(c.batch >= static_cast<std::int64_t>(c.replicas()) * c.microbatches,
                "--batch " + std::to_string(c.batch) +
                    " must give every replica's microbatches a sequence: at least " + replicas +
                    " = " + std::to_string(c.replicas() * c.microbatches));
}

Trainer::Trainer(Mesh& mesh, GptModel& model, const TrainConfig& c, const Corpus& data)
    : mesh_(mesh),
      model_(model),
      c_(c),
      data_(data),
      schedule_(ch04::make_schedule(c.schedule, c.mesh.pp, c.microbatches, c.chunks)),
      pipeline_(mesh.pp()),
      scaler_(c.scaler, c.scaler_config) {
  const Coords& at = mesh.coords();
  // The embedding group: the first and the last stage of each place on the other axes
  // share wte (its colour: the first stage's rank there).
  const bool ends = at.pp == 0 || at.pp == c.mesh.pp - 1;
  Coords first_stage = at;
  first_stage.pp = 0;
  const int world = mesh.world().size();
  embedding_group_ = mesh.world().split(
      ends ? ch08::rank_of(c.mesh, first_stage) : world + mesh.world().rank(), at.pp);
  memory::Scope scope(memory::Category::optimizer);
  replicas_ = std::make_unique<ch08::ReplicaOptimizer>(mesh.replicas(), model.store(), c.zero,
                                                       c.adam, false, c.memory);
}

Trainer::~Trainer() = default;

StepResult Trainer::step(int step) {
  const Coords& at = mesh_.coords();
  const std::int64_t T = c_.model.context, C = c_.model.channels;
  const std::vector<std::int64_t> all = data_.batch(step, c_.batch, c_.model.seed);
  const shardlab::ShardRange mine = shard_range(c_.batch, c_.replicas(), c_.replica(at));
  const std::vector<std::int64_t>& positions = model_.positions();  // of each sequence
  auto starts_of = [&](int j) {
    const shardlab::ShardRange mb = shard_range(mine.length, c_.microbatches, j);
    const auto begin = all.begin() + mine.offset + mb.offset;
    return std::vector<std::int64_t>(begin, begin + mb.length);
  };
  const double tokens = static_cast<double>(c_.batch * T);

  // A profile (profile_next_step), or nothing: every span from the step's common start.
  StepRecorder recorder(profile_, mesh_.world(),
                        {{&mesh_.tp(), "tp"},
                         {&mesh_.replicas(), "dp"},
                         {embedding_group_.get(), "pp"},
                         {&mesh_.cp(), "cp"}});
  profile_ = nullptr;
  ch04::Stage stage;
  for (int c = 0; c < model_.chunks(); ++c) stage.chunks.push_back(recorder.wrap(model_.chunk(c)));
  stage.input = [&](int j) { return data_.ids(starts_of(j), 0, positions); };  // host ids
  stage.memory = c_.memory;
  const std::int64_t split = model_.sequence_parallel() ? c_.mesh.tp : 1;  // rows held: n / split
  const auto held = static_cast<std::int64_t>(positions.size());  // tokens of a sequence
  stage.boundary = [&](int j, int) {
    return ch04::Boundary{{static_cast<std::int64_t>(starts_of(j).size()) * held / split, C}};
  };
  stage.loss = [&](const Tensor& out, int j) {
    const auto start = StepRecorder::Clock::now();
    TiedHead& head = *model_.head();
    nn::Forward logits = head.forward(out);
    const VocabLoss loss =
        vocab_parallel_cross_entropy(mesh_.tp(), logits.out.to(Memory::host),
                                     data_.ids(starts_of(j), 1, positions), model_.vocab(), tokens);
    Tensor dlogits = vocab_parallel_cross_entropy_backward(loss).to(c_.memory);
    if (c_.scaler != ch06::Scaler::none) scale_in_place(dlogits, scaler_.scale());
    Tensor dx = head.backward(dlogits, logits.saved);
    recorder.note("loss", "compute", start);
    return ch04::MicrobatchLoss{loss.value, std::move(dx)};
  };
  ch04::Hooks hooks;
  replicas_->accumulate(hooks);

  const CommStats tp0 = mesh_.tp().stats(), dp0 = mesh_.replicas().stats(),
                  emb0 = embedding_group_->stats(), cp0 = mesh_.cp().stats();
  model_.store().zero_grad();
  ch04::StageRun ran;
  {
    memory::Scope scope(memory::Category::activations);
    ran = pipeline_.run(schedule_, stage, hooks);
  }
  // Sequence parallel: a weight every tp rank holds whole has each rank's rows' gradient.
  if (model_.sequence_parallel()) sum_replicated_gradients();
  // The two copies of wte are one weight: each gets the sum of both gradients.
  if (c_.mesh.pp > 1 && model_.tied()) embedding_group_->allreduce(model_.tied()->grad);
  StepResult result;
  replicas_->reduce();
  // The summed gradients: unscaled and checked (every rank agrees to skip a step with an
  // inf or NaN anywhere), their norm taken and clipped. ZeRO-1 without either reduces
  // inside its update (chapter 05's zero1_step): no norm then.
  const bool scaled = c_.scaler != ch06::Scaler::none;
  result.loss_scale = scaler_.scale();
  if (c_.zero == 0 || c_.clip > 0 || scaled) {
    ch08::ReplicaOptimizer::Reduced reduced = replicas_->reduced();
    if (scaled) {
      Tensor unscaled(Shape{reduced.grads.size()}, shardlab::DType::f32, reduced.grads.memory());
      result.skipped = scaler_.unscale_and_check(mesh_.world(), reduced.grads, unscaled);
      reduced.grads.copy_from(unscaled);
    }
    if (!result.skipped) result.grad_norm = clip_gradients(reduced);
  }
  if (result.skipped)
    replicas_->skip();
  else
    replicas_->update();
  scaler_.update(result.skipped);
  recorder.finish();
  result.bytes = {.tp = sent_since(mesh_.tp(), tp0),
                  .dp = sent_since(mesh_.replicas(), dp0),
                  .pp = ran.bytes_sent + sent_since(*embedding_group_, emb0),
                  .cp = sent_since(mesh_.cp(), cp0)};
  result.events = std::move(ran.events);
  // The batch's loss: the last stage's shares, once per replica (tp rank 0), summed.
  const bool counts = model_.last() && at.tp == 0;
  result.loss = mesh_.world().agree(counts ? ran.loss : 0.0, ReduceOp::sum);
  return result;
}

void Trainer::sum_replicated_gradients() {
  // One allreduce over tp of them all, packed (Megatron-LM's sequence-parallel gradients).
  const std::vector<nn::Parameter*> params = model_.store().parameters();
  std::int64_t n = 0;
  for (std::size_t i = 0; i < params.size(); ++i)
    if (model_.pieces()[i].cut == Cut::whole) n += params[i]->grad.size();
  Tensor packed(Shape{n}, shardlab::DType::f32, c_.memory);
  for (int way : {0, 1}) {  // pack, then unpack
    std::int64_t at = 0;
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (model_.pieces()[i].cut != Cut::whole) continue;
      Tensor grad = params[i]->grad.flat(), slot = packed.slice(at, grad.size());
      way == 0 ? slot.copy_from(grad) : grad.copy_from(slot);
      at += grad.size();
    }
    if (way == 0) mesh_.tp().allreduce(packed);
  }
}

double Trainer::clip_gradients(ch08::ReplicaOptimizer::Reduced& reduced) {
  // Each parameter once: one replica's gradients (or, under ZeRO-1, each replica's own
  // range of them), tp rank 0's copy of what every tp rank holds, and not the head's copy
  // of wte (pieces_of says which).
  const std::int64_t first = reduced.offset, end = first + reduced.grads.size();
  const Tensor grads = reduced.grads.to(Memory::host);  // a copy under --device cuda
  double squares = 0;
  if (!reduced.every_replica || mesh_.replicas().rank() == 0) {
    const std::vector<nn::Parameter*> params = model_.store().parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      const std::int64_t from = std::max(first, params[i]->offset),
                         to = std::min(end, params[i]->offset + params[i]->value.size());
      if (!model_.pieces()[i].counted || from >= to) continue;
      for (float g : grads.slice(from - first, to - from).span())
        squares += static_cast<double>(g) * g;
    }
  }
  const double norm = std::sqrt(mesh_.world().agree(squares, ReduceOp::sum));
  if (c_.clip > 0) {
    const float coef = static_cast<float>(c_.clip / (norm + 1e-6));
    if (coef < 1.0f) scale_in_place(reduced.grads, coef);
  }
  return norm;
}

Tensor Trainer::forward_only(const Tensor& ids) {
  // Virtual stage k = c p + s runs on stage s as its chunk c; each passes its output to
  // the next (on this stage itself when p = 1).
  Communicator& pp = mesh_.pp();
  const int s = pp.rank(), p = pp.size(), last = p * model_.chunks() - 1;
  const std::int64_t n = ids.size() / (model_.sequence_parallel() ? c_.mesh.tp : 1),
                     C = c_.model.channels;  // the rows this rank holds between stages
  constexpr int kTag = 9000;                 // apart from the pipeline runtime's own channels
  Tensor x = ids;  // this rank's tokens of each sequence
  for (int k = s; k <= last; k += p) {
    if (k > 0 && p > 1) {
      x = Tensor(Shape{n, C}, shardlab::DType::f32, c_.memory);
      pp.recv(x, (k - 1) % p, kTag + k);
    }
    x = model_.chunk(k / p).forward(x).out;
    if (k < last && p > 1) pp.send(x, (k + 1) % p, kTag + k + 1);
  }
  return model_.last() ? x : Tensor();
}

double Trainer::evaluate(const std::vector<std::int64_t>& starts) {
  const Coords& at = mesh_.coords();
  const shardlab::ShardRange mine =
      shard_range(static_cast<std::int64_t>(starts.size()), c_.replicas(), c_.replica(at));
  const std::vector<std::int64_t> part(starts.begin() + mine.offset,
                                       starts.begin() + mine.offset + mine.length);
  const std::vector<std::int64_t>& positions = model_.positions();
  double loss = 0;
  if (!part.empty()) {
    const Tensor out = forward_only(data_.ids(part, 0, positions));
    if (model_.last()) {
      const Tensor logits = model_.head()->forward(out).out.to(Memory::host);
      loss = vocab_parallel_cross_entropy(
                 mesh_.tp(), logits, data_.ids(part, 1, positions), model_.vocab(),
                 static_cast<double>(starts.size() * static_cast<std::size_t>(c_.model.context)))
                 .value;
    }
  }
  return mesh_.world().agree(model_.last() && at.tp == 0 ? loss : 0.0, ReduceOp::sum);
}

double run_bytes(const TrainConfig& c, bool threads) {
  const GptShape& g = c.model;
  const double C = static_cast<double>(g.channels), T = static_cast<double>(g.context),
               B = static_cast<double>(c.batch), L = g.layers, H = static_cast<double>(g.heads);
  // Weights, gradients and Adam's m and v (4 floats a parameter); the activations a
  // block keeps for its backward (some 16 C a token, and the attention's T x T per
  // head), the logits and their softmax.
  const double states = 4.0 * 4 * static_cast<double>(parameter_count(g));
  const double activations =
      4.0 * B * T * (L * (16 * C + 2 * H * T) + 3.0 * static_cast<double>(g.vocab));
  // One device's run; the mesh's ranks together hold about as much (each its share of
  // the batch, the layers and the heads), after the reference has freed its own. Measured
  // (peak RSS over this): 1.33 GB over 1.43 (B 64, T 256, one rank), 0.18 over 0.09 at the
  // defaults, where the program itself is most of it.
  const double one = 1.25 * (states + activations);
  return threads ? one + states : one;
}

std::int64_t parameter_count(const GptShape& s) {
  const std::int64_t C = s.channels;
  return s.vocab * C + s.context * C + s.layers * (12 * C * C + 13 * C) + 2 * C;
}

std::string describe(const TrainConfig& c, std::string_view backend) {
  const GptShape& s = c.model;
  const MeshShape& m = c.mesh;
  auto n = [](auto v) { return std::to_string(v); };
  return "GPT (L " + n(s.layers) + ", C " + n(s.channels) + ", H " + n(s.heads) + ", T " +
         n(s.context) + ", V " + n(s.vocab) + "; " +
         shardlab::format_number(static_cast<double>(parameter_count(s)) / 1e6) +
         "M parameters) on " + ch08::mesh_name(m) + " (" + std::string(backend) + "), " +
         (m.cp > 1 && c.context ? c.context->name() + ", " : "") + c.schedule + ", " +
         n(c.microbatches) +
         " microbatches; batch " + n(c.batch) + " x " + n(s.context) + " bytes, " +
         (c.zero ? "ZeRO-1" : "Adam") + " lr " + shardlab::format_number(c.adam.lr) +
         (c.clip > 0 ? ", clip " + shardlab::format_number(c.clip) : "") +
         (c.sequence_parallel ? ", sequence parallel" : "") +
         (c.precision != shardlab::DType::f32
              ? ", " + std::string(precision_name(c.precision)) + " products (autocast)" +
                    (c.scaler == ch06::Scaler::dynamic ? ", dynamic loss scale"
                     : c.scaler == ch06::Scaler::fixed ? ", static loss scale"
                                                       : "")
              : "");
}

ch08::AxisBytes formula_bytes(const TrainConfig& c, const Coords& at) {
  const GptShape& g = c.model;
  const MeshShape& m = c.mesh;
  const bool first = at.pp == 0, last = at.pp == m.pp - 1;
  auto allreduce = [](std::int64_t elements, int rank, int ranks) {
    return shardlab::collective_traffic(shardlab::Op::allreduce, static_cast<std::size_t>(elements),
                                        4, rank, ranks)
        .sent;
  };
  const shardlab::ShardRange mine = shard_range(c.batch, c.replicas(), c.replica(at));
  ch08::AxisBytes out;
  const bool full = c.recompute == Recompute::full, split = c.sequence_parallel && m.tp > 1;
  // Per microbatch, the collectives of n x C elements: a block's 4 allreduces (f and g,
  // forward and backward; full recompute's second forward 2 more), the embedding's and
  // the head's one each. Sequence parallel, in halves (an all-gather or a reduce-scatter
  // moves half an allreduce): a block's forward all-gathers twice and reduce-scatters
  // twice, its backward the same plus the column-parallel inputs' second gathers (2), and
  // full recompute's forward 4 more; the embedding and the head 2 each.
  const std::int64_t blocks = g.layers / m.pp;
  const std::int64_t halves = split ? (full ? 14 : 10) * blocks + 2 * (first + last)
                                    : 2 * ((full ? 6 : 4) * blocks + first + last);
  // cp: every block's core, a forward and a backward; recomputation (selective: the core,
  // full: the whole block) runs its forward again in the backward.
  const int forwards = c.recompute == Recompute::none ? 1 : 2;
  const std::int64_t tokens = g.context / m.cp;  // of each sequence, on this rank
  for (int j = 0; j < c.microbatches; ++j) {
    const std::int64_t sequences = shard_range(mine.length, c.microbatches, j).length,
                       n = sequences * tokens;
    out.tp += static_cast<std::uint64_t>(halves) * allreduce(n * g.channels, at.tp, m.tp) / 2;
    if (last) out.tp += 3 * allreduce(n, at.tp, m.tp);
    for (int chunk = 0; chunk < c.chunks && m.pp > 1; ++chunk) {  // to other stages only
      const int k = chunk * m.pp + at.pp, last_k = m.pp * c.chunks - 1;
      out.pp += static_cast<std::uint64_t>(((k > 0) + (k < last_k)) * n * g.channels * 4 /
                                           (split ? m.tp : 1));
    }
    if (m.cp > 1) {
      const std::int64_t heads = g.heads / m.tp, head_dim = g.channels / g.heads;
      out.cp += static_cast<std::uint64_t>(blocks) *
                (forwards * c.context->forward_bytes(m.cp, g.context, sequences, heads, head_dim) +
                 c.context->backward_bytes(m.cp, g.context, sequences, heads, head_dim));
    }
  }
  std::int64_t params = 0, whole = 0;
  for (const Piece& p : pieces_of(g, m, at, c.chunks)) {
    params += p.size();
    if (p.cut == Cut::whole) whole += p.size();
  }
  if (split) out.tp += allreduce(whole, at.tp, m.tp);  // the rows' parts of the whole weights
  // The replicas: dp x ep x cp ranks, this one at (dp_i ep + ep_i) cp + cp_i.
  out.dp = allreduce(params, c.replica(at) * m.cp + at.cp, c.replicas() * m.cp);
  if (m.pp > 1 && (first || last))
    out.pp += allreduce(shard_range(g.vocab, m.tp, at.tp).length * g.channels, last, 2);
  return out;
}

}  // namespace ch09
