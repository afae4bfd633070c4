// Chapter 07's MoE layer as an nn layer over the ranks: rank q holds E/N experts and T/N
// tokens, which travel to their experts' ranks in an all-to-all and back in another,
// forward and backward (moe.hpp's MoeLayer).
#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>

#include "combine.hpp"
#include "moe.hpp"
#include "shardlab/check.hpp"

using namespace shardlab;

namespace ch07 {

namespace {

// The layer's Saved tensors, by position (children: one Saved per local expert).
enum SavedAt : Index {
  saved_x,                       // this rank's tokens, in the layer's memory
  saved_probs,                   // its tokens' router probabilities, T_r x E (host)
  saved_expert,                  // its routing, T_r k each (host): i32
  saved_gate,                    //   f32
  saved_slot,                    //   i32
  saved_send_order,              // the dispatch plan (host): i32
  saved_per_expert,              //   i64, rows to each expert
  saved_send_counts,             //   i64, rows to each rank
  saved_received,                //   i64, the counts the exchange brought (N x E/N)
  saved_returned,                // the experts' outputs back at this rank, in send order
  saved_fractions,               // f_i of each routing group (its first choices), G x E (host)
  saved_group_stats,             // the groups' routing stats, for the log (host, f64)
  forward_saved,                 // how many the forward keeps;
  saved_dlogits = forward_saved  // backward_input adds dL/dlogits of this rank's tokens
};

template <class T, class From>
Tensor as_tensor(const std::vector<From>& v) {
  return Tensor::from_vector(std::vector<T>(v.begin(), v.end()));
}
template <class To, class T>
std::vector<To> as_vector(const Tensor& t) {
  const std::span<const T> s = t.span<T>();
  return std::vector<To>(s.begin(), s.end());
}

Routing routing_of(const MoeConfig& c, const nn::Saved& s, int capacity) {
  Routing r{0,
            c.experts,
            c.k,
            capacity,
            as_vector<int, std::int32_t>(s.tensors.at(saved_expert)),
            as_vector<float, float>(s.tensors.at(saved_gate)),
            as_vector<int, std::int32_t>(s.tensors.at(saved_slot))};
  r.tokens = static_cast<int>(r.expert.size()) / c.k;
  return r;
}
Dispatch plan_of(const nn::Saved& s) {
  return Dispatch{as_vector<std::size_t, std::int64_t>(s.tensors.at(saved_per_expert)),
                  as_vector<std::size_t, std::int64_t>(s.tensors.at(saved_send_counts)),
                  as_vector<int, std::int32_t>(s.tensors.at(saved_send_order))};
}

/// Where every row is on this rank: each of its choices' row in the send buffer (send
/// order; -1 dropped), the token of each row sent (a row of this rank's x), each local
/// expert's rows in the receive buffer (plan_arrivals), and the counts x d.
struct Places {
  std::vector<int> send_row, send_tokens;
  std::vector<Tensor> expert_rows;
  std::vector<std::size_t> send_elems, recv_elems;
};
/// Checks of the two plans (the exercise's), so that a wrong one is named
/// here and not found later as a bad row index inside index_rows.
void check_plans(const Routing& r, const Dispatch& plan, const Arrivals& arrivals,
                 const std::vector<std::int64_t>& received, int rank, int ranks) {
  const std::string who = "rank " + std::to_string(rank) + ": ";
  const auto E = static_cast<std::size_t>(r.experts), per = E / static_cast<std::size_t>(ranks);
  require(plan.per_expert.size() == E && plan.send_counts.size() == static_cast<std::size_t>(ranks),
          [&] {
            return who + "plan_dispatch gave " + std::to_string(plan.per_expert.size()) +
                   " counts per expert and " + std::to_string(plan.send_counts.size()) +
                   " per rank, for " + std::to_string(E) + " experts on " + std::to_string(ranks) +
                   " ranks";
          });
  std::vector<int> seen(idx(r.tokens * r.k), 0);
  for (int c : plan.send_order) {
    require(c >= 0 && c < r.tokens * r.k && r.slot[idx(c)] >= 0 && seen[idx(c)]++ == 0, [&] {
      return who + "plan_dispatch sends choice " + std::to_string(c) +
             (c < 0 || c >= r.tokens * r.k ? ", which does not exist"
              : r.slot[idx(c)] < 0         ? ", which was dropped"
                                           : " twice");
    });
  }
  std::size_t kept = 0, by_expert = 0, by_rank = 0;
  for (std::size_t c = 0; c < seen.size(); ++c) kept += r.slot[c] >= 0;
  for (std::size_t e = 0; e < E; ++e) by_expert += plan.per_expert[e];
  for (std::size_t q = 0; q < static_cast<std::size_t>(ranks); ++q) {
    std::size_t experts = 0;
    for (std::size_t l = 0; l < per; ++l) experts += plan.per_expert[q * per + l];
    require(plan.send_counts[q] == experts, [&] {
      return who + "plan_dispatch sends " + std::to_string(plan.send_counts[q]) + " rows to rank " +
             std::to_string(q) + ", but counts " + std::to_string(experts) + " for its experts";
    });
    by_rank += plan.send_counts[q];
  }
  require(plan.send_order.size() == kept && by_expert == kept && by_rank == kept, [&] {
    return who + "plan_dispatch sends " + std::to_string(plan.send_order.size()) +
           " choices and counts " + std::to_string(by_expert) + ", but the routing kept " +
           std::to_string(kept);
  });
  std::size_t coming = 0;
  for (std::int64_t n : received) coming += static_cast<std::size_t>(n);
  std::size_t told = 0;
  for (std::size_t n : arrivals.recv_counts) told += n;
  require(arrivals.recv_counts.size() == static_cast<std::size_t>(ranks) && told == coming &&
              arrivals.expert_rows.size() == per,
          [&] {
            return who + "plan_arrivals expects " + std::to_string(told) + " rows from " +
                   std::to_string(arrivals.recv_counts.size()) + " ranks for " +
                   std::to_string(arrivals.expert_rows.size()) + " experts; the counts say " +
                   std::to_string(coming) + " rows from " + std::to_string(ranks) + " ranks for " +
                   std::to_string(per);
          });
  std::vector<int> used(coming, 0);
  for (std::size_t l = 0; l < per; ++l)
    for (int row : arrivals.expert_rows[l])
      require(row >= 0 && static_cast<std::size_t>(row) < coming && used[idx(row)]++ == 0, [&] {
        return who + "plan_arrivals gives local expert " + std::to_string(l) + " row " +
               std::to_string(row) +
               (row < 0 || static_cast<std::size_t>(row) >= coming
                    ? " of a receive buffer of " + std::to_string(coming)
                    : ", which another expert takes too");
      });
}

Places places_of(const MoeConfig& c, const Routing& r, const Dispatch& plan,
                 const Arrivals& arrivals, Memory memory) {
  Places p;
  p.send_row.assign(idx(r.tokens * c.k), -1);
  for (std::size_t i = 0; i < plan.send_order.size(); ++i) {
    p.send_row[idx(plan.send_order[i])] = static_cast<int>(i);
    p.send_tokens.push_back(plan.send_order[i] / c.k);
  }
  for (const std::vector<int>& rows : arrivals.expert_rows)
    p.expert_rows.push_back(index_of(rows, memory));
  for (auto n : plan.send_counts) p.send_elems.push_back(n * static_cast<std::size_t>(c.hidden));
  for (auto n : arrivals.recv_counts)
    p.recv_elems.push_back(n * static_cast<std::size_t>(c.hidden));
  return p;
}

/// The all-to-alls split by local expert (MoeOptions::by_expert): part l moves the rows of
/// every rank's l-th local expert, so that expert l can run once its part has arrived
/// while the next part travels. The send side's rows (send order: by destination rank,
/// then by its local expert, then slot) are packed part by part; the expert side's part l
/// is expert l's input exactly as the one exchange's receive buffer gives it (by source
/// rank, then slot: Arrivals::expert_rows).
struct Parts {
  Tensor pack;    // send-order rows, part by part: index_rows(send, pack) is the packed buffer
  Tensor unpack;  // the inverse: index_rows(packed, unpack) is in send order again
  std::vector<std::int64_t> send_offset, send_rows, recv_rows;   // per part, rows
  std::vector<std::vector<std::size_t>> send_elems, recv_elems;  // per part, per rank
};
Parts parts_of(const Dispatch& plan, const std::vector<std::int64_t>& received, int ranks,
               std::int64_t d, Memory memory) {
  const auto N = static_cast<std::size_t>(ranks), per = plan.per_expert.size() / N;
  Parts p;
  std::vector<int> pack, unpack(plan.send_order.size());
  p.send_elems.assign(per, std::vector<std::size_t>(N));
  p.recv_elems = p.send_elems;
  for (std::size_t l = 0; l < per; ++l) {
    p.send_offset.push_back(static_cast<std::int64_t>(pack.size()));
    std::int64_t recv = 0;
    std::size_t block = 0;  // where destination q's rows start in send order
    for (std::size_t q = 0; q < N; ++q) {
      std::size_t at = block;
      for (std::size_t e = 0; e < l; ++e) at += plan.per_expert[q * per + e];
      const std::size_t n = plan.per_expert[q * per + l];
      for (std::size_t i = 0; i < n; ++i) {
        unpack[at + i] = static_cast<int>(pack.size());
        pack.push_back(static_cast<int>(at + i));
      }
      for (std::size_t e = 0; e < per; ++e) block += plan.per_expert[q * per + e];
      p.send_elems[l][q] = n * static_cast<std::size_t>(d);
      const auto from_q = static_cast<std::size_t>(received[q * per + l]);
      p.recv_elems[l][q] = from_q * static_cast<std::size_t>(d);
      recv += static_cast<std::int64_t>(from_q);
    }
    p.send_rows.push_back(static_cast<std::int64_t>(pack.size()) - p.send_offset.back());
    p.recv_rows.push_back(recv);
  }
  p.pack = index_of(pack, memory);
  p.unpack = index_of(unpack, memory);
  return p;
}

/// Moves `from`'s rows through the exchange part by part and back: each part l of `sent`
/// (send-order rows) goes to the experts' side, `work(l, rows)` makes what goes back, and
/// the returned rows come back in send order. With `overlap` every part's first move is
/// started at once and each part's return as soon as it is made, so that part l + 1
/// travels while part l is worked on; without, each move is waited for as it starts (the
/// same moves, in the same order, so the same rows).
Tensor exchange_by_part(Communicator& comm, const Parts& p, const Tensor& sent, bool overlap,
                        const std::function<Tensor(std::size_t, const Tensor&)>& work) {
  const std::size_t parts = p.send_rows.size();
  const std::int64_t d = sent.cols();
  const Memory memory = sent.memory();
  const Tensor packed = index_rows(sent, p.pack);
  Tensor back(Shape{packed.rows(), d}, DType::f32, memory);
  std::vector<Tensor> arrived;
  std::vector<Request> going(parts), coming(parts);
  for (std::size_t l = 0; l < parts; ++l) {
    arrived.emplace_back(Shape{p.recv_rows[l], d}, DType::f32, memory);
    going[l] = comm.ialltoallv(packed.slice(p.send_offset[l], p.send_rows[l]), p.send_elems[l],
                               arrived[l], p.recv_elems[l]);
    if (!overlap) comm.wait(going[l]);
  }
  std::vector<Tensor> made(parts);
  for (std::size_t l = 0; l < parts; ++l) {
    comm.wait(going[l]);
    made[l] = work(l, arrived[l]);
    Tensor into = back.slice(p.send_offset[l], p.send_rows[l]);
    coming[l] = comm.ialltoallv(made[l], p.recv_elems[l], into, p.send_elems[l]);
    if (!overlap) comm.wait(coming[l]);
  }
  comm.wait_all(coming);
  return index_rows(back, p.unpack);
}

}  // namespace

namespace {

/// Chapter 07's experts from `init`: expert e is Linear d -> h, tanh, Linear h -> d, no
/// biases, with init's W1 and W2 of it. Error unless `init` holds this rank's E/N.
MoeOptions tanh_experts(const MoeConfig& config, const Weights& init, const Communicator& comm,
                        const std::string& name) {
  const int N = comm.size(), per = config.experts / N;
  require(config.experts % N == 0 && static_cast<int>(init.w1.size()) == per &&
              init.w2.size() == init.w1.size() && init.first == comm.rank() * per,
          [&] {
            return name + ": " + std::to_string(config.experts) + " experts over " +
                   std::to_string(N) + " ranks; rank " + std::to_string(comm.rank()) +
                   " was given " + std::to_string(init.w1.size()) + " from expert " +
                   std::to_string(init.first);
          });
  MoeOptions options;
  options.name = name;
  options.expert = [config, init, name](nn::ParameterStore& store, int e) {
    const std::int64_t d = config.hidden, h = config.ffn;
    const std::string prefix = name + ".expert" + std::to_string(e);
    const Index l = idx(e - init.first);
    auto net = std::make_shared<nn::Sequential>();
    net->add<nn::Linear>(store, prefix + ".w1", d, h, expert_seed(config, e), false)
        .weight()
        .value.copy_from(init.w1[l]);
    net->add<nn::Tanh>();
    net->add<nn::Linear>(store, prefix + ".w2", h, d, expert_seed(config, e) + 1, false)
        .weight()
        .value.copy_from(init.w2[l]);
    return std::shared_ptr<nn::Layer>(std::move(net));
  };
  return options;
}

}  // namespace

MoeLayer::MoeLayer(nn::ParameterStore& store, Communicator& comm, const MoeConfig& config,
                   const std::string& name)
    : MoeLayer(store, comm, config,
               make_weights(config, comm.rank() * (config.experts / comm.size()),
                            config.experts / comm.size()),
               name) {}

MoeLayer::MoeLayer(nn::ParameterStore& store, Communicator& comm, const MoeConfig& config,
                   const Weights& init, const std::string& name)
    : MoeLayer(store, comm, config, init.router, tanh_experts(config, init, comm, name)) {}

MoeLayer::MoeLayer(nn::ParameterStore& store, Communicator& comm, const MoeConfig& config,
                   const Tensor& router, MoeOptions options)
    : comm_(comm), config_(config), options_(std::move(options)) {
  const int N = comm.size(), per = config.experts / N;
  const std::string& name = options_.name;
  require(config.experts % N == 0 && router.ndim() == 2 && router.rows() == config.hidden &&
              router.cols() == config.experts,
          [&] {
            return name + ": " + std::to_string(config.experts) + " experts over " +
                   std::to_string(N) + " ranks, a router " + router.describe() + " for tokens of " +
                   std::to_string(config.hidden);
          });
  const MoeGroups& g = options_.groups;
  require(
      !g.split || (g.tokens > 0 && g.positions.size() == static_cast<std::size_t>(g.split->size())),
      [&] { return name + ": a group split over ranks needs every rank's positions in it"; });
  first_ = comm.rank() * per;
  router_ = &store.add(name + ".router", router.clone());
  nn::ParameterStore& expert_store = options_.expert_store ? *options_.expert_store : store;
  for (int l = 0; l < per; ++l) experts_.push_back(options_.expert(expert_store, first_ + l));
}

nn::Parameter& MoeLayer::w1(int l) {
  return dynamic_cast<nn::Linear&>(dynamic_cast<nn::Sequential&>(*experts_.at(idx(l)))[0]).weight();
}
nn::Parameter& MoeLayer::w2(int l) {
  return dynamic_cast<nn::Linear&>(dynamic_cast<nn::Sequential&>(*experts_.at(idx(l)))[2]).weight();
}

std::vector<nn::Parameter*> MoeLayer::parameters() const {
  std::vector<nn::Parameter*> out = {router_};
  for (const auto& net : experts_)
    for (nn::Parameter* p : net->parameters()) out.push_back(p);
  return out;
}

Weights MoeLayer::weights() const {
  Weights w;
  w.first = first_;
  w.router = router_->value.to(Memory::host).clone();
  for (const auto& net : experts_) {
    const auto params = net->parameters();  // W1, W2
    w.w1.push_back(params.at(0)->value.to(Memory::host).clone());
    w.w2.push_back(params.at(1)->value.to(Memory::host).clone());
  }
  return w;
}

Routing MoeLayer::routing(const nn::Saved& saved) const {
  require(saved.tensors.size() >= forward_saved, [&] {
    return options_.name + ": the routing of a Saved that is not this layer's forward's";
  });
  return routing_of(config_, saved, config_.capacity(comm_.rank(), comm_.size()));
}

RoutingStats MoeLayer::stats(const nn::Saved& saved) const {
  return routing_stats(config_, routing(saved), saved.tensors.at(saved_probs));
}

struct MoeLayer::Routed {
  Routing routing;   // this rank's rows' choices; group g's slots offset by g C
  Tensor fractions;  // G x E: f_i of each group, from the whole group's first choices
  Tensor stats;      // f64: the groups' stats added up (wanted, kept: E each; dropped,
                     // passed through, aux), on the first rank of a split group only
};

namespace {

std::size_t stats_width(int experts) { return 2 * idx(experts) + 3; }

Tensor pack(const RoutingStats& s, int experts) {
  std::vector<double> v(stats_width(experts), 0.0);
  for (std::size_t e = 0; e < s.wanted.size(); ++e) v[e] = s.wanted[e];
  for (std::size_t e = 0; e < s.kept.size(); ++e) v[idx(experts) + e] = s.kept[e];
  v[2 * idx(experts)] = s.dropped;
  v[2 * idx(experts) + 1] = s.passed_through;
  v[2 * idx(experts) + 2] = s.aux_loss;
  return Tensor::from_vector(v);
}

RoutingStats unpack(const Tensor& t, int experts) {
  const std::span<const double> v = t.span<double>();
  RoutingStats s;
  for (Index e = 0; e < idx(experts); ++e) {
    s.wanted.push_back(static_cast<int>(v[e]));
    s.kept.push_back(static_cast<int>(v[idx(experts) + e]));
  }
  s.dropped = static_cast<int>(v[2 * idx(experts)]);
  s.passed_through = static_cast<int>(v[2 * idx(experts) + 1]);
  s.aux_loss = v[2 * idx(experts) + 2];
  return s;
}

}  // namespace

MoeLayer::Routed MoeLayer::route_rows(const Tensor& probs) const {
  const MoeConfig& c = config_;
  const MoeGroups& g = options_.groups;
  Routed out;
  if (g.tokens == 0) {  // chapter 07: the rank's rows are one group
    out.routing = route(probs, c.k, c.capacity(comm_.rank(), comm_.size()));
    out.fractions =
        Tensor::from_vector(first_choice_fractions(out.routing)).reshape(Shape{1, c.experts});
    out.stats = pack(routing_stats(c, out.routing, probs), c.experts);
    return out;
  }
  // Each group (a sequence) routed whole with a capacity from its T tokens; a rank that
  // holds part of each gathers the others' probabilities of it first (every part is n
  // rows: its positions there).
  const int E = c.experts;
  const int me = g.split ? g.split->rank() : 0;
  const auto n = g.split ? static_cast<std::int64_t>(g.positions[idx(me)].size()) : g.tokens;
  const std::int64_t G = n > 0 ? probs.rows() / n : 0;
  const int capacity = expert_capacity(static_cast<int>(g.tokens), c.k, E, c.capacity_factor);
  Tensor every;  // every rank's probabilities of its parts, rank by rank
  if (g.split) {
    every = Tensor(Shape{g.split->size() * probs.rows(), E}, DType::f32);
    g.split->allgather(probs, every);
  }
  MoeConfig group = c;
  group.tokens = static_cast<int>(g.tokens);
  Routing& r = out.routing;
  r = Routing{static_cast<int>(G * n), E, c.k, static_cast<int>(G) * capacity, {}, {}, {}};
  out.fractions = Tensor(Shape{G, E}, DType::f32);
  RoutingStats stats;
  stats.wanted.assign(idx(E), 0);
  stats.kept.assign(idx(E), 0);
  for (std::int64_t q = 0; q < G; ++q) {
    Tensor whole(Shape{g.tokens, E}, DType::f32);
    if (g.split) {
      for (int rank = 0; rank < g.split->size(); ++rank)
        for (std::int64_t i = 0; i < n; ++i)
          whole.slice(g.positions[idx(rank)][idx(static_cast<int>(i))], 1)
              .copy_from(every.slice((rank * G + q) * n + i, 1));
    } else {
      whole.copy_from(probs.slice(q * n, n));
    }
    const Routing group_routing = route(whole, c.k, capacity);
    for (std::int64_t i = 0; i < n; ++i) {
      const auto t = static_cast<int>(g.split ? g.positions[idx(me)][idx(static_cast<int>(i))] : i);
      for (int j = 0; j < c.k; ++j) {
        const Index ch = idx(group_routing.at(t, j));
        r.expert.push_back(group_routing.expert[ch]);
        r.gate.push_back(group_routing.gate[ch]);
        const int slot = group_routing.slot[ch];
        r.slot.push_back(slot < 0 ? -1 : static_cast<int>(q) * capacity + slot);
      }
    }
    const std::vector<float> f = first_choice_fractions(group_routing);
    std::copy(f.begin(), f.end(), out.fractions.data() + q * E);
    if (me == 0) stats += routing_stats(group, group_routing, whole);
  }
  out.stats = pack(stats, E);
  return out;
}

nn::Forward MoeLayer::forward(const Tensor& x_in) const {
  const MoeConfig& c = config_;
  const int N = comm_.size(), rank = comm_.rank();
  const MoeGroups& g = options_.groups;
  const ShardRange tokens = shard_range(c.tokens, N, rank);
  const std::int64_t part =  // a group's rows on this rank
      g.split ? static_cast<std::int64_t>(g.positions[idx(g.split->rank())].size()) : g.tokens;
  require(x_in.ndim() == 2 && x_in.cols() == c.hidden &&
              (g.tokens == 0 ? x_in.rows() == tokens.length : part > 0 && x_in.rows() % part == 0),
          [&] {
            return options_.name + ": rank " + std::to_string(rank) + " has x " + x_in.describe() +
                   (g.tokens == 0
                        ? "; shard_range gives it " + std::to_string(tokens.length) + " of the " +
                              std::to_string(c.tokens) + " tokens, "
                        : "; expected whole groups of " + std::to_string(part) + " rows, ") +
                   std::to_string(c.hidden) + " wide";
          });
  const Memory memory = router_->value.memory();
  const Tensor x = x_in.to(memory);
  const std::int64_t d = c.hidden;
  // 1. Route this rank's tokens, with a capacity from their number (or each group's).
  const Tensor probs = router_probs(x, router_->value);
  const Routed routed = route_rows(probs);
  const Routing& r = routed.routing;
  const Dispatch plan = plan_dispatch(r, N);
  // 2. The exchange of counts: rank q learns how many rows each of its experts gets from
  // this rank (E/N counts each way between every pair).
  const std::vector<std::int64_t> per_expert(plan.per_expert.begin(), plan.per_expert.end());
  std::vector<std::int64_t> received(per_expert.size());
  comm_.alltoall(per_expert, received);
  const Arrivals arrivals =
      plan_arrivals(std::vector<std::size_t>(received.begin(), received.end()), N);
  check_plans(r, plan, arrivals, received, rank, N);
  const Places p = places_of(c, r, plan, arrivals, memory);
  const auto n_send = static_cast<std::int64_t>(plan.send_order.size());
  std::int64_t n_recv = 0;
  for (std::size_t n : arrivals.recv_counts) n_recv += static_cast<std::int64_t>(n);
  // 3. Dispatch: this rank's token rows, in send order, to their experts' ranks.
  const Tensor send = index_rows(x, index_of(p.send_tokens, memory));
  nn::Forward f;
  Tensor back(Shape{n_send, d}, DType::f32, memory);
  if (options_.by_expert) {  // 3.-5. part by part, one local expert's rows a part
    f.saved.children.resize(experts_.size());
    back = exchange_by_part(comm_, parts_of(plan, received, N, d, memory), send, options_.overlap,
                            [&](std::size_t l, const Tensor& rows) {
                              nn::Forward e = experts_[l]->forward(rows);
                              f.saved.children[l] = std::move(e.saved);
                              return e.out;
                            });
  } else {
    Tensor recv(Shape{n_recv, d}, DType::f32, memory);
    comm_.alltoallv(send, p.send_elems, recv, p.recv_elems);
    // 4. Each local expert runs its rows: by source rank, then slot (as on one device).
    Tensor outs(Shape{n_recv, d}, DType::f32, memory);
    for (std::size_t l = 0; l < experts_.size(); ++l) {
      nn::Forward e = experts_[l]->forward(index_rows(recv, p.expert_rows[l]));
      if (e.out.rows()) scatter_add_rows(outs, p.expert_rows[l], e.out);
      f.saved.children.push_back(std::move(e.saved));
    }
    // 5. Combine: the outputs go back the way they came.
    comm_.alltoallv(outs, p.recv_elems, back, p.send_elems);
  }
  // y = x + gate x output.
  f.out = combine(options_.residual ? x : zeros(x.shape()), r, 0, p.send_row, back).to(memory);
  f.saved.tensors = {x,
                     probs,
                     as_tensor<std::int32_t>(r.expert),
                     as_tensor<float>(r.gate),
                     as_tensor<std::int32_t>(r.slot),
                     as_tensor<std::int32_t>(plan.send_order),
                     as_tensor<std::int64_t>(plan.per_expert),
                     as_tensor<std::int64_t>(plan.send_counts),
                     as_tensor<std::int64_t>(received),
                     back,
                     routed.fractions,
                     routed.stats};
  return f;
}

Tensor MoeLayer::backward_input(const Tensor& dy_in, nn::Saved& saved) const {
  const MoeConfig& c = config_;
  const int N = comm_.size(), per = experts_here();
  require(saved.tensors.size() == forward_saved && saved.children.size() == idx(per), [&] {
    return options_.name + " backward: a Saved from this layer's forward (" +
           std::to_string(saved.tensors.size()) + " tensors), before any backward_input";
  });
  const Tensor& x = saved.tensors[saved_x];
  require(dy_in.same_shape(x), [&] {
    return options_.name + " backward: dy is " + dy_in.describe() + ", x " + x.describe();
  });
  const Memory memory = router_->value.memory();
  const Routing r = routing(saved);
  const Dispatch plan = plan_of(saved);
  const Arrivals arrivals =
      plan_arrivals(as_vector<std::size_t, std::int64_t>(saved.tensors[saved_received]), N);
  const Places p = places_of(c, r, plan, arrivals, memory);
  const auto n_send = static_cast<std::int64_t>(plan.send_order.size());
  std::int64_t n_recv = 0;
  for (std::size_t n : arrivals.recv_counts) n_recv += static_cast<std::int64_t>(n);
  const std::int64_t d = c.hidden;
  // A rank may hold no tokens (T < N): it still joins every all-to-all.
  // 1. gate x dy to the experts, the way the tokens went.
  const Tensor dy = dy_in.to(Memory::host);
  const std::vector<float> dgate = gate_grads(dy, r, 0, p.send_row, saved.tensors[saved_returned]);
  Tensor scaled(n_send, d);
  for (std::int64_t i = 0; i < n_send; ++i) {
    const float g = r.gate[idx(plan.send_order[idx(static_cast<int>(i))])];
    const std::int64_t t = p.send_tokens[idx(static_cast<int>(i))];
    for (std::int64_t e = 0; e < d; ++e) scaled(i, e) = g * dy(t, e);
  }
  Tensor dins(Shape{n_send, d}, DType::f32, memory);
  if (options_.by_expert) {  // 1.-2. part by part, one local expert's rows a part
    dins = exchange_by_part(
        comm_,
        parts_of(plan, as_vector<std::int64_t, std::int64_t>(saved.tensors[saved_received]), N, d,
                 memory),
        scaled.to(memory), options_.overlap, [&](std::size_t l, const Tensor& rows) {
          return experts_[l]->backward_input(rows, saved.children[l]);
        });
  } else {
    Tensor grads(Shape{n_recv, d}, DType::f32, memory);
    comm_.alltoallv(scaled.to(memory), p.send_elems, grads, p.recv_elems);
    // 2. Each local expert's B; their dL/dx rows go back.
    Tensor dins_recv(Shape{n_recv, d}, DType::f32, memory);
    for (int l = 0; l < per; ++l) {
      const Tensor dxe = experts_[idx(l)]->backward_input(index_rows(grads, p.expert_rows[idx(l)]),
                                                          saved.children[idx(l)]);
      if (dxe.rows()) scatter_add_rows(dins_recv, p.expert_rows[idx(l)], dxe);
    }
    comm_.alltoallv(dins_recv, p.recv_elems, dins, p.send_elems);
  }
  // 3. Through the router (gates and the aux loss, group by group), and the residual.
  const MoeGroups& g = options_.groups;
  const std::shared_ptr<MoeLog>& log = options_.log;
  MoeConfig aux = c;  // the aux loss weighed and scaled as the model's loss is
  if (log) aux.aux_alpha *= log->weight * log->grad_scale;
  if (g.tokens > 0) aux.tokens = static_cast<int>(g.tokens);
  const Tensor& probs = saved.tensors[saved_probs];
  const Tensor& fractions = saved.tensors[saved_fractions];
  Tensor dlogits(probs.rows(), c.experts);
  const std::int64_t G = fractions.rows(), n = G > 0 ? probs.rows() / G : 0;
  for (std::int64_t q = 0; q < G; ++q) {
    const std::span<const float> f =
        fractions.span().subspan(idx(static_cast<int>(q * c.experts)), idx(c.experts));
    dlogits.slice(q * n, n).copy_from(router_grad(aux, r, q * n, probs.slice(q * n, n), dgate,
                                                  std::vector<float>(f.begin(), f.end())));
  }
  if (log) {
    RoutingStats stats = unpack(saved.tensors[saved_group_stats], c.experts);
    stats.aux_loss *= log->weight;
    log->stats += stats;
    log->kept.emplace_back(plan.per_expert.begin(), plan.per_expert.end());
  }
  saved.dy = dy_in;
  saved.tensors.push_back(dlogits);
  const Tensor through = options_.residual ? dy : zeros(dy.shape());
  return input_grad(through, r, 0, p.send_row, dins, dlogits, router_->value).to(memory);
}

double MoeLayer::expert_grad_diff(const Result& reference) {
  double diff = 0;
  for (int l = 0; l < experts_here(); ++l) {
    const auto e = static_cast<std::size_t>(first_ + l);
    diff = std::max({diff, max_abs_diff(w1(l).grad.to(Memory::host), reference.dw1[e]),
                     max_abs_diff(w2(l).grad.to(Memory::host), reference.dw2[e])});
  }
  return diff;
}

void MoeLayer::backward_weight(nn::Saved& saved) {
  require(saved.tensors.size() == forward_saved + 1 && saved.dy.defined() &&
              saved.children.size() == experts_.size(),
          [&] {
            return options_.name +
                   ": backward_weight needs backward_input first (or was called twice)";
          });
  for (std::size_t l = 0; l < experts_.size(); ++l) experts_[l]->backward_weight(saved.children[l]);
  // The router is every rank's: its gradient is the sum over every rank's tokens.
  Tensor drouter =
      matmul(saved.tensors[saved_x].to(Memory::host), saved.tensors[saved_dlogits], true, false);
  if (options_.sum_router) comm_.allreduce(drouter, ReduceOp::sum);
  axpy(1.0f, drouter.to(router_->grad.memory()), router_->grad);
  saved = nn::Saved{};
}

Result moe_parallel(Communicator& comm, const MoeConfig& config, const Weights& mine,
                    const Tensor& x, const Tensor& dy, Memory memory) {
  nn::ParameterStore store;
  MoeLayer layer(store, comm, config, mine);
  store.allocate(memory);
  const CommStats before = comm.stats();
  nn::Forward f = layer.forward(x);
  Result out;
  out.y = f.out.to(Memory::host);
  out.routings = {layer.routing(f.saved)};
  out.stats = combined(comm, layer.stats(f.saved));
  if (dy.defined()) {
    out.dx = layer.backward(dy, f.saved).to(Memory::host);
    auto host = [](const nn::Parameter& p) { return p.grad.to(Memory::host).clone(); };
    out.drouter = host(layer.router());
    for (int l = 0; l < layer.experts_here(); ++l) {
      out.dw1.push_back(host(layer.w1(l)));
      out.dw2.push_back(host(layer.w2(l)));
    }
  }
  const CommStats moved = comm.stats().since(before);
  out.alltoall_received = moved[Op::alltoall].bytes_received;
  out.traffic_modeled = moved.is_modeled(Op::alltoall);
  return out;
}

}  // namespace ch07
