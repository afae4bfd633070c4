// Chapter 05's optimizer: ZeRO stages 0-3 over a ParameterStore (see zero.hpp).
#include "zero.hpp"

#include <algorithm>
#include <string>

#include "shardlab/check.hpp"
#include "shardlab/memory.hpp"

using namespace shardlab;
using memory::Category;
using Scope = memory::Scope;

namespace ch05 {

namespace {

std::string group_name(int g) { return "group " + std::to_string(g); }

}  // namespace

std::vector<std::int64_t> group_sizes(const std::vector<std::vector<nn::Parameter*>>& groups,
                                      const nn::ParameterStore& store) {
  // From the offsets: a group ends where the next begins (the views may be empty now).
  std::vector<std::int64_t> sizes;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const std::int64_t end = g + 1 < groups.size() ? groups[g + 1].front()->offset : store.size();
    sizes.push_back(end - groups[g].front()->offset);
  }
  if (sizes.empty()) sizes.push_back(store.size());
  return sizes;
}

std::int64_t zero_shard_elements(const std::vector<std::int64_t>& groups, int stage, int ranks,
                                 int rank, bool by_group) {
  std::int64_t P = 0, S = 0;
  for (std::int64_t n : groups) {
    P += n;
    S += shard_range(n, ranks, rank).length;
  }
  if (stage == 0) return P;
  if (stage == 1 && !by_group) return shard_range(P, ranks, rank).length;
  return S;
}

StateBytes zero_state_bytes(const std::vector<std::int64_t>& groups, const ZeroConfig& config,
                            DType type, int ranks, int rank) {
  const auto S = static_cast<std::uint64_t>(
      zero_shard_elements(groups, config.stage, ranks, rank, config.by_group));
  const auto P = static_cast<std::uint64_t>(zero_shard_elements(groups, 0, ranks, rank));
  const std::uint64_t w = dtype_size(type);  // bytes of a weight or a gradient
  StateBytes b;
  b.params = w * (config.stage >= 3 ? S : P);
  b.grads = w * (config.stage >= 2 ? S : P);
  b.master = type == DType::f32 ? 0 : 4 * S;  // S = P at stage 0
  b.optimizer = config.sgd ? 0 : 8 * S;
  return b;
}

std::uint64_t zero_comm_bytes(const std::vector<std::int64_t>& groups, int stage, DType type,
                              int ranks, int rank, bool by_group) {
  if (ranks == 1) return 0;
  const auto P = static_cast<std::uint64_t>(zero_shard_elements(groups, 0, ranks, rank));
  // The shard a reduce-scatter leaves on this rank: of the flat buffer (stage 0's
  // allreduce cuts it as stage 1 does), or of each group (stages 2, 3).
  const auto S = static_cast<std::uint64_t>(
      zero_shard_elements(groups, std::max(stage, 1), ranks, rank, by_group));
  std::uint64_t elements = (static_cast<std::uint64_t>(ranks) - 1) * S + (P - S);
  if (stage == 3) elements += P - S;  // the values gathered twice: forward and backward
  return dtype_size(type) * elements;
}

// ---------------------------------------------------------------------------
// The optimizer

ZeroOptimizer::ZeroOptimizer(Communicator& dp, nn::ParameterStore& store, ZeroConfig config,
                             std::vector<std::vector<nn::Parameter*>> groups)
    : comm_(dp), store_(store), config_(config), type_(store.dtype()) {
  const int N = comm_.size(), r = comm_.rank();
  require(config.stage >= 0 && config.stage <= 3, [&] {
    return "ZeroOptimizer: stage " + std::to_string(config.stage) + " (stages are 0, 1, 2, 3)";
  });
  require(store.allocated() && store.values().defined() && store.grads().defined(),
          "ZeroOptimizer: the store must be allocated (and not taken over already)");
  require(!config.sgd || (config.stage == 0 && type_ == DType::f32),
          "ZeroOptimizer: SGD runs at stage 0 in fp32 only");
  // The groups: runs of consecutive parameters, in the store's order, covering it.
  if (groups.empty()) groups.push_back(store.parameters());
  std::int64_t offset = 0;
  for (std::size_t i = 0; i < groups.size(); ++i) {
    Group g;
    g.params = std::move(groups[i]);
    g.offset = offset;
    for (const nn::Parameter* p : g.params) {
      g.shapes.push_back(p->value.shape());
      require(p->offset == offset, [&] {
        return "ZeroOptimizer: " + group_name(static_cast<int>(i)) + "'s parameter " + p->name +
               " is not the next one of the store (groups are runs of consecutive parameters)";
      });
      offset += p->value.size();
    }
    g.size = offset - g.offset;
    g.own = shard_range(g.size, N, r);
    g.shard_offset = shard_size_;
    g.counts = shard_counts(g.size, N);
    shard_size_ += g.own.length;
    groups_.push_back(std::move(g));
  }
  require(offset == store.size(), [&] {
    return "ZeroOptimizer: the groups cover " + std::to_string(offset) + " of the store's " +
           std::to_string(store.size()) + " elements";
  });
  for (int i = 0; i < static_cast<int>(groups_.size()); ++i) order_.push_back(i);
  for (int i = static_cast<int>(groups_.size()) - 1; i >= 0; --i) order_.push_back(i);

  Tensor& values = store.values();
  const Memory memory = memory_ = values.memory();
  if (config.stage == 0) {
    shard_size_ = store.size();
    if (type_ == DType::f32) {
      master_ = values;  // fp32: Adam updates the values themselves
    } else {
      Scope scope(Category::master);
      master_ = cast(values, DType::f32);
    }
    if (config.sgd) return;
    Scope scope(Category::optimizer);
    m_ = zeros(Shape{shard_size_}, DType::f32, memory);
    v_ = zeros(Shape{shard_size_}, DType::f32, memory);
    return;
  }
  if (config.stage == 1 && !config.by_group) {
    shard1_.push_back(make_shard(comm_, values, type_));
    shard_size_ = shard1_[0].range.length;
    return;
  }
  // Stages 2 and 3 (and 1 by group): this rank's range of every group, back to back.
  const Shape shape{shard_size_};
  {
    // Stage 1 keeps the whole gradients: its shard of them is where the sum arrives.
    Scope scope(config.stage == 1 ? Category::comm : Category::grads);
    grads_ = zeros(shape, type_, memory);
  }
  if (config.stage == 3) {
    Scope scope(Category::params);
    values_ = empty(shape, type_, memory);
    for (const Group& g : groups_)
      shard_of(values_, g).copy_from(values.slice(g.offset + g.own.offset, g.own.length));
  }
  if (type_ == DType::f32) {
    if (config.stage == 3) master_ = values_;  // stages 1, 2 in fp32: views of the values
  } else {
    Scope scope(Category::master);
    master_ = empty(shape, DType::f32, memory);
    for (const Group& g : groups_)  // through a temporary the size of one group's range
      shard_of(master_, g)
          .copy_from(cast(values.slice(g.offset + g.own.offset, g.own.length), DType::f32));
  }
  {
    Scope scope(Category::optimizer);
    m_ = zeros(shape, DType::f32, memory);
    v_ = zeros(shape, DType::f32, memory);
  }
  if (config.stage == 1) return;
  store.release_grads();
  if (config.stage == 3) store.release_values();
}

ZeroOptimizer::~ZeroOptimizer() {
  // A prefetch, reduce-scatter or all-gather still in flight (a step left half done by an
  // error, or the last step's values): its buffers belong to the collective until it
  // completes. After an error the job is ending on it anyway.
  std::vector<shardlab::Request*> flying{&pending_};
  for (Group& g : groups_) flying.insert(flying.end(), {&g.reducing, &g.gathering});
  for (shardlab::Request* r : flying) {
    if (!r->pending()) continue;
    try {
      comm_.wait(*r);
    } catch (...) {
    }
  }
}

Tensor ZeroOptimizer::shard_of(const Tensor& buffer, const Group& g) const {
  return buffer.slice(g.shard_offset, g.own.length);
}

Tensor ZeroOptimizer::optimizer_weights(const Group& g) {
  // Stage 2 (or 1 by group) in fp32: this rank's range of the (whole) values; else its
  // range of master.
  if (config_.stage <= 2 && type_ == DType::f32)
    return store_.values().slice(g.offset + g.own.offset, g.own.length);
  return shard_of(master_, g);
}

void ZeroOptimizer::point(Group& g, const Tensor& flat, bool grads) {
  for (std::size_t i = 0; i < g.params.size(); ++i) {
    nn::Parameter& p = *g.params[i];
    (grads ? p.grad : p.value) =
        flat.defined() ? flat.view(p.offset - g.offset, g.shapes[i]) : Tensor();
  }
}

ZeroOptimizer::Group& ZeroOptimizer::group(int g, const char* who) {
  require(g >= 0 && g < static_cast<int>(groups_.size()), [&] {
    return std::string("ZeroOptimizer::") + who + "(" + std::to_string(g) + "): there are " +
           std::to_string(groups_.size()) + " groups";
  });
  return groups_[static_cast<std::size_t>(g)];
}

// ---------------------------------------------------------------------------
// Stage 3: a group's values, gathered before use and freed after

void ZeroOptimizer::start_gather(int g) {
  Group& grp = groups_[static_cast<std::size_t>(g)];
  {
    Scope scope(Category::comm);
    ahead_ = empty(Shape{grp.size}, type_, memory_);
  }
  ahead_group_ = g;
  pending_ = comm_.iallgatherv(shard_of(values_, grp), ahead_, grp.counts);
}

void ZeroOptimizer::gather(int g) {
  Group& grp = group(g, "gather");
  if (config_.stage != 3) return;
  require(!grp.gathered.defined(), [&] {
    return "ZeroOptimizer::gather(" + std::to_string(g) + "): already gathered (release it first)";
  });
  if (!config_.prefetch) {
    Scope scope(Category::comm);
    grp.gathered = empty(Shape{grp.size}, type_, memory_);
    comm_.allgatherv(shard_of(values_, grp), grp.gathered, grp.counts);
  } else {
    // The order of use is fixed (FSDP records it on the first step): 0 .. G-1, G-1 .. 0.
    require(next_ < order_.size() && order_[next_] == g, [&] {
      return "ZeroOptimizer::gather(" + std::to_string(g) + "): with prefetch the groups are " +
             "gathered in forward order, then backward order, once each per step; expected " +
             (next_ < order_.size() ? group_name(order_[next_]) : std::string("step()"));
    });
    if (!pending_.pending()) start_gather(g);  // the step's first: nothing was prefetched
    comm_.wait(pending_);
    grp.gathered = std::move(ahead_);
    ahead_ = Tensor();
    ahead_group_ = -1;
    if (++next_ < order_.size()) start_gather(order_[next_]);  // the next, while this one runs
  }
  point(grp, grp.gathered, false);
}

void ZeroOptimizer::release(int g) {
  Group& grp = group(g, "release");
  if (config_.stage != 3) return;
  point(grp, Tensor(), false);
  grp.gathered = Tensor();
}

// ---------------------------------------------------------------------------
// Gradients: whole (stages 0, 1) or reduce-scattered group by group (stages 2, 3)

void ZeroOptimizer::prepare_gradients(int g) {
  Group& grp = group(g, "prepare_gradients");
  if (config_.stage <= 1) return store_.grads().slice(grp.offset, grp.size).zero();
  require(!grp.bucket.defined(), [&] {
    return "ZeroOptimizer::prepare_gradients(" + std::to_string(g) +
           "): called twice without reduce_gradients";
  });
  {
    Scope scope(Category::comm);
    grp.bucket = zeros(Shape{grp.size}, type_, memory_);
  }
  point(grp, grp.bucket, true);
}

void ZeroOptimizer::reduce_gradients(int g) {
  Group& grp = group(g, "reduce_gradients");
  if (config_.stage <= 1) return;
  require(grp.bucket.defined(), [&] {
    return "ZeroOptimizer::reduce_gradients(" + std::to_string(g) +
           "): no gradients to reduce (prepare_gradients first)";
  });
  // Only this rank's range of the sum arrives: (N-1)/N n_g elements in.
  comm_.reduce_scatter(grp.bucket, shard_of(grads_, grp), ReduceOp::sum);
  point(grp, Tensor(), true);
  grp.bucket = Tensor();
}

// ---------------------------------------------------------------------------
// The step

void ZeroOptimizer::step() {
  for (std::size_t i = 0; i < groups_.size(); ++i)
    require(!groups_[i].gathered.defined() && !groups_[i].bucket.defined(), [&] {
      return "ZeroOptimizer::step: " + group_name(static_cast<int>(i)) +
             " is still gathered or its gradients unreduced (release / reduce_gradients first)";
    });
  require(!pending_.pending(), [&] {
    return "ZeroOptimizer::step: " + group_name(ahead_group_) +
           "'s prefetch is still in flight: gather every group in the backward too";
  });
  next_ = 0;
  ++steps_;
  Tensor& values = store_.values();
  if (config_.stage == 0) {
    Tensor& grads = store_.grads();
    comm_.allreduce(grads, ReduceOp::sum);
    if (config_.sgd) return nn::sgd_step(master_, grads, config_.adam.lr);
    nn::adam_update(master_, grads, m_, v_, steps_, config_.adam);
    if (type_ != DType::f32) values.copy_from(cast(master_, type_));
    return;
  }
  if (by_group()) {  // then as stage 2, each group's all-gather left in flight with overlap
    wait_values();   // the last step's (a group no forward read)
    if (!reduced_) reduce_groups();
    reduced_ = false;
  } else if (config_.stage == 1 && !reduced_) {
    return zero1_step(comm_, values, store_.grads(), shard1_[0], config_.adam);
  } else if (config_.stage == 1) {  // zero1_step's steps 2 and 3, its reduce by reduce_now()
    reduced_ = false;
    Shard& shard = shard1_[0];
    nn::adam_update(shard.master, shard.grad, shard.m, shard.v, ++shard.step, config_.adam);
    {
      Scope scope(Category::comm);
      shard.send.copy_from(type_ == DType::f32 ? shard.master : cast(shard.master, type_));
    }
    return comm_.allgatherv(shard.send, values, shard_counts(values.size(), comm_.size()));
  }
  for (Group& g : groups_) {
    Tensor w = optimizer_weights(g), m = shard_of(m_, g), v = shard_of(v_, g);
    nn::adam_update(w, shard_of(grads_, g), m, v, steps_, config_.adam);
    if (config_.stage == 3) {  // this rank's values are its shard: nothing to exchange
      if (type_ != DType::f32) shard_of(values_, g).copy_from(cast(w, type_));
      continue;
    }
    {
      Scope scope(Category::comm);
      g.send = cast(w, type_);  // the all-gather's until it completes
    }
    g.gather_due = true;  // with overlap, start_gathers() as the next step begins
    if (!by_group() || !config_.overlap) finish_gather(g);
  }
}

void ZeroOptimizer::start_gathers() {
  Tensor& values = store_.values();
  for (Group& g : groups_) {
    if (!g.gather_due) continue;
    g.gather_due = false;
    g.gathering = comm_.iallgatherv(g.send, values.slice(g.offset, g.size), g.counts);
  }
}

Tensor ZeroOptimizer::reduce_now() {
  require(config_.stage == 1 && !reduced_,
          "ZeroOptimizer::reduce_now: stage 1 only, once before each step()");
  if (by_group()) {
    reduce_groups();
    reduced_ = true;
    return grads_;
  }
  reduced_ = true;
  comm_.reduce_scatter(store_.grads(), shard1_[0].grad, ReduceOp::sum);
  return shard1_[0].grad;
}

void ZeroOptimizer::reduce_group(int g) {
  Group& grp = group(g, "reduce_group");
  require(by_group() && !reduced_ && !grp.reduce_started, [&] {
    return "ZeroOptimizer::reduce_group(" + std::to_string(g) +
           "): stage 1 by group only, each group once before each step's reduce";
  });
  grp.reduce_started = true;
  // Only this rank's range of the sum arrives: (N-1)/N n_g elements in. The non-blocking
  // collective whether or not it overlaps: the same sums, in the same order.
  grp.reducing = comm_.ireduce_scatter(store_.grads().slice(grp.offset, grp.size),
                                       shard_of(grads_, grp), ReduceOp::sum);
}

void ZeroOptimizer::reduce_groups() {
  for (int g = static_cast<int>(groups_.size()) - 1; g >= 0; --g)
    if (!groups_[static_cast<std::size_t>(g)].reduce_started) reduce_group(g);
  for (Group& g : groups_) {
    comm_.wait(g.reducing);
    g.reduce_started = false;
  }
}

void ZeroOptimizer::finish_gather(Group& g) {
  if (g.gather_due) start_gathers();  // every group's, in order, as on every rank
  if (!g.gathering.pending()) return;
  comm_.wait(g.gathering);
  g.send = Tensor();
}

void ZeroOptimizer::wait_values(int g) { finish_gather(group(g, "wait_values")); }

void ZeroOptimizer::wait_values() {
  for (int g = 0; g < static_cast<int>(groups_.size()); ++g) wait_values(g);
}

std::uint64_t ZeroOptimizer::values_in_flight_sent() const {
  // A backend that models its traffic (MPI, NCCL) counts a collective when it starts; the
  // threads backend counts what it moved when it is waited for.
  const bool counted_at_start = comm_.stats().is_modeled(Op::allgather);
  std::uint64_t sent = 0;
  for (const Group& g : groups_)
    if (g.gather_due || (g.gathering.pending() && !counted_at_start))
      sent += collective_traffic(Op::allgather, g.counts, dtype_size(type_), comm_.rank()).sent;
  return sent;
}

std::vector<shardlab::ShardRange> ZeroOptimizer::shard_ranges() const {
  require(config_.stage == 1, "ZeroOptimizer::shard_ranges: stage 1 only");
  if (!by_group()) return {shard1_[0].range};
  std::vector<shardlab::ShardRange> out;
  for (const Group& g : groups_) out.push_back({g.offset + g.own.offset, g.own.length});
  return out;
}

ZeroOptimizer::RangeState ZeroOptimizer::range_state() {
  require(config_.stage == 1, "ZeroOptimizer::range_state: stage 1 only");
  if (!by_group()) {
    const Shard& s = shard1_[0];
    return {s.m, s.v, s.range, s.step};
  }
  // Each group's m and v gathered whole, this rank's range of the flat order kept.
  Communicator::Uncounted not_counted(comm_);
  const ShardRange range = shard_range(store_.size(), comm_.size(), comm_.rank());
  RangeState out{Tensor(Shape{range.length}, DType::f32, memory_),
                 Tensor(Shape{range.length}, DType::f32, memory_), range, steps_};
  for (auto [mine, state] : {std::pair{&m_, &out.m}, std::pair{&v_, &out.v}})
    for (Group& g : groups_) {
      const std::int64_t from = std::max(g.offset, range.offset),
                         to = std::min(g.offset + g.size, range.offset + range.length);
      Tensor whole(Shape{g.size}, DType::f32, memory_);
      comm_.allgatherv(shard_of(*mine, g), whole, g.counts);
      if (from < to)
        state->slice(from - range.offset, to - from)
            .copy_from(whole.slice(from - g.offset, to - from));
    }
  return out;
}

std::int64_t ZeroOptimizer::shard_offset() const {
  require(config_.stage == 1 && !by_group(),
          "ZeroOptimizer::shard_offset: stage 1 only, one range (by group: shard_ranges)");
  return shard1_[0].range.offset;
}

const Shard& ZeroOptimizer::shard() const {
  require(config_.stage == 1 && !by_group(),
          "ZeroOptimizer::shard: stage 1 only, one range (by group: range_state)");
  return shard1_[0];
}

void ZeroOptimizer::restore(const Tensor& m, const Tensor& v, int steps) {
  require(config_.stage == 1 && m.size() == store_.size() && v.size() == store_.size(),
          "ZeroOptimizer::restore: stage 1, with m and v of the whole store");
  if (by_group()) {
    for (Group& g : groups_) {
      const std::int64_t at = g.offset + g.own.offset;
      shard_of(m_, g).copy_from(m.slice(at, g.own.length));
      shard_of(v_, g).copy_from(v.slice(at, g.own.length));
      if (type_ != DType::f32)
        shard_of(master_, g).copy_from(cast(store_.values().slice(at, g.own.length), DType::f32));
    }
    steps_ = steps;
    return;
  }
  Shard& shard = shard1_[0];
  const ShardRange r = shard.range;
  shard.m.copy_from(m.slice(r.offset, r.length));
  shard.v.copy_from(v.slice(r.offset, r.length));
  if (type_ != DType::f32)
    shard.master.copy_from(cast(store_.values().slice(r.offset, r.length), DType::f32));
  shard.step = steps_ = steps;
}

Tensor ZeroOptimizer::weights() {
  wait_values();  // stage 1 by group: the last step's all-gathers, whose buffers these are
  Communicator::Uncounted not_counted(comm_);
  const std::int64_t P = store_.size();
  if (config_.stage == 0) return master_.clone();
  Tensor all(Shape{P}, DType::f32, memory_);
  if (config_.stage == 1 && !by_group()) {
    comm_.allgatherv(shard1_[0].master, all, shard_counts(P, comm_.size()));
    return all;
  }
  for (Group& g : groups_)
    comm_.allgatherv(optimizer_weights(g), all.slice(g.offset, g.size), g.counts);
  return all;
}

}  // namespace ch05
