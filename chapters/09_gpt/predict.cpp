// Chapter 09's step on paper, from a machine's profile: see calibrate.hpp.
//
// Every rank's step is written out as the program runs it: its stage's ops in chapter 04's
// schedule order, each op its layers' computations and the collectives between them (tp's
// sums by parts, cp's ring, ep's all-to-alls, pp's messages), then dp's gradient sums, the
// tied embedding's, the norm's, and Adam. Then the ranks run together on paper, an event at
// a time: a collective starts when the last member of its group arrives, a receive ends
// when its message has come, and the ranks (and the communication --overlap started in the
// background) that have work share the machine's cores evenly (processor sharing: k of
// them on P cores each go at min(1, P/k) of a core). Everything the profile measured on one
// core is work a core does; a collective's time, measured with all the ranks at once, is
// work too, as much as makes all of them take that time together.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>

#include "calibrate.hpp"
#include "measurements.hpp"  // benchmark_meshes
#include "schedule.hpp"      // chapter 04
#include "shardlab/check.hpp"

namespace ch09 {

using ch08::Axis;
using ch08::MachineProfile;

namespace {

// ---------------------------------------------------------------------------
// A rank's step as a program

enum class Kind {
  compute,     ///< `work` seconds of one core
  collective,  ///< with its group (`group`, the n-th of this rank's there): `work` once all came
  start,       ///< `work` in the background (an overlapped collective's); the rank goes on
  wait,        ///< until the rank's background work of `axis` is done (all of it: peer 1)
  send,        ///< a message to `peer` (arrives `work` seconds later); the rank goes on
  recv         ///< until the next message from `peer` has come
};

struct Item {
  Kind kind;
  double work = 0;
  Axis axis = Axis::dp;
  long group = 0;
  int peer = 0;
};

/// A rank's place on the mesh, tp fastest (Megatron-LM's order, the mesh's rank_of).
struct At {
  int pp, dp, ep, cp, tp;
};
At at_of(const MeshShape& m, int rank) {
  At a{};
  a.tp = rank % m.tp, rank /= m.tp;
  a.cp = rank % m.cp, rank /= m.cp;
  a.ep = rank % m.ep, rank /= m.ep;
  a.dp = rank % m.dp, rank /= m.dp;
  a.pp = rank;
  return a;
}
int rank_of(const MeshShape& m, const At& a) {
  return (((a.pp * m.dp + a.dp) * m.ep + a.ep) * m.cp + a.cp) * m.tp + a.tp;
}

/// Builds every rank's program for one step of `c` on `m`.
class Programs {
 public:
  Programs(const TrainConfig& c, const MachineProfile& m) : c_(c), m_(m), s_(shard_of(c)) {
    sharing_ = m.costs.count("sharing") ? m.costs.at("sharing") : 1.0;
    turns_ = m.core_groups(c.mesh.ranks()).turns();
    per_host_ = m.ranks_per_host > 0 ? m.ranks_per_host : c.mesh.ranks();
  }

  std::vector<Item> of(int rank) {
    const MeshShape& mesh = c_.mesh;
    const At a = at_of(mesh, rank);
    out_.clear();
    const ch04::Schedule schedule =
        ch04::make_schedule(c_.schedule, mesh.pp, c_.microbatches, c_.chunks);
    const std::vector<ch04::Op>& ops = schedule.ops[a.pp];
    // The last B of the stage: dp's buckets go out while it runs (--overlap dp).
    std::size_t last_b = 0;
    for (std::size_t i = 0; i < ops.size(); ++i)
      if (ops[i].kind == ch04::OpKind::backward) last_b = i;
    // ZeRO-1 overlapping: the last step's update comes by bucket, the first layers' bucket
    // waited for before they run, the others under the forward.
    if (dp_overlaps() && c_.zero) {
      const int buckets = std::max(1, c_.buckets);
      collective(Axis::dp, group_of(Axis::dp, a), dp_work(a, buckets, "allgather"));
      background(Axis::dp, (buckets - 1) * dp_work(a, buckets, "allgather"));
    }
    for (std::size_t i = 0; i < ops.size(); ++i) op(a, ops[i], i == last_b);
    finish(a);
    return out_;
  }

 private:
  double cost(const std::string& what) const { return sharing_ * m_.cost(cost_key(what, s_)); }
  bool overlap(Axis axis) const { return c_.overlap[axis]; }
  /// A collective's work on one core: its time with every rank at once, as a share of
  /// turns; over the link between hosts when its group crosses it (`across`).
  double comm(const std::string& op, int group, double bytes, bool across = false) const {
    const std::string name = across && m_.links.count(op + "_across") ? op + "_across" : op;
    return m_.link(name, group).seconds(bytes) * turns_;
  }
  /// Whether `x` and `y` run on different hosts (the profile's ranks_per_host
  /// consecutive ranks a host).
  bool apart(const At& x, const At& y) const {
    return rank_of(c_.mesh, x) / per_host_ != rank_of(c_.mesh, y) / per_host_;
  }
  /// Whether the group of `axis` through `a` has ranks on more than one host.
  bool across(Axis axis, const At& a) const {
    for (int r = 0; r < c_.mesh.ranks(); ++r) {
      const At other = at_of(c_.mesh, r);
      if (group_of(axis, other) == group_of(axis, a) && apart(other, a)) return true;
    }
    return false;
  }
  void compute(double work) { out_.push_back({Kind::compute, work}); }
  void collective(Axis axis, long group, double work) {
    out_.push_back({Kind::collective, work, axis, group});
  }
  void background(Axis axis, double work) { out_.push_back({Kind::start, work, axis}); }

  long group_of(Axis axis, At a) const {
    a.tp = axis == Axis::tp ? 0 : a.tp;
    a.cp = axis == Axis::cp || axis == Axis::dp ? 0 : a.cp;
    a.ep = axis == Axis::ep || axis == Axis::dp ? 0 : a.ep;
    a.dp = axis == Axis::dp ? 0 : a.dp;
    return long(rank_of(c_.mesh, a)) * 8 + long(axis);
  }

  double bsh() const { return double(s_.rows) * double(c_.model.channels) * 4.0; }  // f32

  /// Where a tp group (or a cp ring) meets: its members wait for each other there (the
  /// communication itself is in the layers' measured costs).
  void meet(Axis axis, const At& a) {
    if (c_.mesh.size(axis) > 1) collective(axis, group_of(axis, a), 0.0);
  }

  /// ep's all-to-all of a MoE block's k choices a token: by local expert with --overlap ep.
  void ep_exchange(const At& a) {
    const int local = std::max(1, c_.model.experts / c_.mesh.ep);
    const double all = comm("alltoall", c_.mesh.ep, c_.model.top_k * bsh(), across(Axis::ep, a));
    if (overlap(Axis::ep) && local > 1) {
      background(Axis::ep, all * (local - 1) / local);
      collective(Axis::ep, group_of(Axis::ep, a), all / local);
      out_.push_back({Kind::wait, 0, Axis::ep});
    } else {
      collective(Axis::ep, group_of(Axis::ep, a), all);
    }
  }

  /// One block's forward: its attention half (cp's ring and tp's sum inside), its MLP half
  /// (a MoE's: k experts' work and the all-to-alls).
  void block_forward(const At& a, int block) {
    compute(cost("attention_forward"));
    meet(Axis::cp, a);
    meet(Axis::tp, a);
    const bool moe = c_.model.moe(block) && c_.mesh.ep > 1;
    if (moe) ep_exchange(a);
    compute((c_.model.moe(block) ? c_.model.top_k : 1) * cost("mlp_forward"));
    if (moe) ep_exchange(a);
    meet(Axis::tp, a);
  }

  /// One block's input gradient (and its weight gradient unless the schedule splits W
  /// off), the forward again first under full recomputation, the attention's core again
  /// under selective.
  void block_backward(const At& a, int block, bool with_weight) {
    if (c_.recompute == Recompute::full) block_forward(a, block);
    const double k = c_.model.moe(block) ? c_.model.top_k : 1;
    const bool moe = c_.model.moe(block) && c_.mesh.ep > 1;
    if (moe) ep_exchange(a);
    compute(k * (cost("mlp_backward_input") + (with_weight ? cost("mlp_backward_weight") : 0.0)));
    if (moe) ep_exchange(a);
    meet(Axis::tp, a);
    if (c_.recompute == Recompute::selective) compute(c_.mesh.cp * cost("core_attention_forward"));
    compute(cost("attention_backward_input") +
            (with_weight ? cost("attention_backward_weight") : 0.0));
    meet(Axis::cp, a);
    meet(Axis::tp, a);
  }

  void op(const At& a, const ch04::Op& o, bool last_backward) {
    const MeshShape& mesh = c_.mesh;
    const int p = mesh.pp, v = c_.chunks;
    const int per_chunk = c_.model.layers / (p * v);
    const int first_block = (o.chunk * p + a.pp) * per_chunk;
    const bool first = a.pp == 0 && o.chunk == 0, last = a.pp == p - 1 && o.chunk == v - 1;
    const bool split_w = c_.schedule == "zb1";
    At prev = a, next = a;
    prev.pp = (a.pp + p - 1) % p, next.pp = (a.pp + 1) % p;
    const double message = bsh() / (c_.sequence_parallel ? mesh.tp : 1);
    auto latency = [&](const At& to) {
      // Across hosts, the stage's ranks on this host send at once, sharing the link.
      const double sharing_link = std::min(per_host_, mesh.ranks() / p);
      return apart(to, a) && m_.links.count("link")
                 ? m_.link("link", 2).seconds(message * sharing_link)
                 : m_.link("sendrecv", 2).seconds(message);
    };
    switch (o.kind) {
      case ch04::OpKind::forward:
        if (!first) out_.push_back({Kind::recv, 0, Axis::pp, 0, rank_of(mesh, prev)});
        if (first) compute(cost("first_stage_forward"));
        for (int b = 0; b < per_chunk; ++b) block_forward(a, first_block + b);
        if (last) compute(cost("last_stage_forward"));
        if (!last) out_.push_back({Kind::send, latency(next), Axis::pp, 0, rank_of(mesh, next)});
        break;
      case ch04::OpKind::backward: {
        if (!last) out_.push_back({Kind::recv, 0, Axis::pp, 0, rank_of(mesh, next)});
        if (last)
          compute(cost("last_stage_backward_input") +
                  (split_w ? 0.0 : cost("last_stage_backward_weight")));
        const int buckets = std::max(1, c_.buckets);
        for (int b = per_chunk - 1; b >= 0; --b) {
          block_backward(a, first_block + b, !split_w);
          // dp's buckets, the last layers' first, as their gradients are made.
          const int done = per_chunk - b;
          if (last_backward && dp_overlaps() && !zero_after_tp() &&
              done * buckets / per_chunk != (done - 1) * buckets / per_chunk && done < per_chunk)
            background(Axis::dp, dp_work(a, buckets));
        }
        if (first && !split_w) compute(cost("first_stage_backward_weight"));
        if (!first) out_.push_back({Kind::send, latency(prev), Axis::pp, 0, rank_of(mesh, prev)});
        break;
      }
      case ch04::OpKind::weight:
        for (int b = per_chunk - 1; b >= 0; --b)
          compute(cost("attention_backward_weight") +
                  (c_.model.moe(first_block + b) ? c_.model.top_k : 1) *
                      cost("mlp_backward_weight"));
        if (last) compute(cost("last_stage_backward_weight"));
        if (first) compute(cost("first_stage_backward_weight"));
        break;
    }
  }

  bool dp_overlaps() const { return overlap(Axis::dp) && replicas() > 1; }
  /// ZeRO-1 under sequence parallelism: every bucket holds a norm whose gradient is summed
  /// over tp after backward, so the reduce-scatters all come after it.
  bool zero_after_tp() const { return c_.zero != 0 && c_.sequence_parallel && c_.mesh.tp > 1; }
  int replicas() const { return c_.replicas() * c_.mesh.cp; }

  /// The first stage's parameters a rank holds (the most of any stage): its blocks' shards
  /// (a MoE block's E/e experts), the embeddings, and, on one stage, the final LayerNorm.
  double parameters() const {
    const GptShape& g = c_.model;
    const double C = double(g.channels), t = c_.mesh.tp;
    const double dense_mlp = 8 * C * C / t + 5 * C;
    double blocks = 0;
    for (int b = 0; b < g.layers / c_.mesh.pp; ++b)
      blocks +=
          4 * C * C / t + 8 * C + (g.moe(b) ? double(g.experts) / c_.mesh.ep : 1.0) * dense_mlp;
    return blocks + double(g.vocab) / t * C + double(g.context) * C +
           (c_.mesh.pp == 1 ? 2 * C : 0.0);
  }
  /// One of `buckets` equal sums of the gradients over the replicas (`op`: allreduce, or
  /// under ZeRO-1 its reduce-scatter; or the all-gather of the updated weights).
  double dp_work(const At& a, int buckets = 1, const std::string& op = "") const {
    const std::string name = !op.empty() ? op : c_.zero ? "reduce_scatter" : "allreduce";
    return replicas() > 1 ? comm(name, replicas(), parameters() * 4 / buckets, across(Axis::dp, a))
                          : 0.0;
  }

  /// After the pipeline: dp's sums (the last bucket, or all of them), ZeRO-1's
  /// reduce-scatter and all-gather instead, the tied embedding between the end stages,
  /// the gradients' norm, Adam.
  void finish(const At& a) {
    const MeshShape& mesh = c_.mesh;
    if (replicas() > 1) {
      const long dp = group_of(Axis::dp, a);
      if (dp_overlaps() && zero_after_tp())    // every reduce-scatter (the all-gathers are
        collective(Axis::dp, dp, dp_work(a));  // the next step's)
      else if (dp_overlaps())                  // the last bucket (ZeRO-1: its reduce-scatter)
        collective(Axis::dp, dp, dp_work(a, std::max(1, c_.buckets)));
      else if (c_.zero)
        collective(Axis::dp, dp, dp_work(a) + dp_work(a, 1, "allgather"));
      else
        collective(Axis::dp, dp, dp_work(a));
    }
    out_.push_back({Kind::wait, 0, Axis::dp, 0, 1});
    if (mesh.pp > 1 && (a.pp == 0 || a.pp == mesh.pp - 1)) {
      At first = a, last = a;
      first.pp = 0, last.pp = mesh.pp - 1;
      collective(Axis::pp, long(rank_of(mesh, first)) * 8 + 7,
                 comm("allreduce", 2, double(c_.model.vocab / mesh.tp * c_.model.channels) * 4,
                      apart(first, last)));
    }
    if (mesh.ranks() > 1) collective(Axis::dp, -1, comm("allreduce", std::min(mesh.ranks(), 8), 8));
    compute(sharing_ * parameters() / (c_.zero ? c_.replicas() : 1) *
            m_.cost("adam_per_parameter"));
  }

  const TrainConfig& c_;
  const MachineProfile& m_;
  Shard s_;
  double sharing_ = 1, turns_ = 1;
  int per_host_ = 1;  ///< consecutive ranks a host
  std::vector<Item> out_;
};

// ---------------------------------------------------------------------------
// The ranks together, on paper

struct Run {
  double makespan = 0;
  std::vector<double> compute;                 ///< per rank: its computation's work
  std::vector<ch08::PerAxis<double>> blocked;  ///< per rank and axis: waiting or in a collective
};

/// Runs the programs, each rank on its group's cores.
Run run_together(const std::vector<std::vector<Item>>& programs, const ch08::CoreGroups& groups) {
  const int R = int(programs.size());
  enum class State { running, in_collective, waiting, receiving, draining, done };
  struct Rank {
    std::size_t pc = 0;
    State state = State::running;
    double left = 0;
    Axis axis = Axis::dp;
    std::vector<std::pair<double, Axis>> background;  // work left, its axis
    int draining = -1;                                // the axis waited for; -1: all
  };
  auto pending = [](const Rank& k) {
    return std::any_of(k.background.begin(), k.background.end(), [&](const auto& b) {
      return k.draining < 0 || int(b.second) == k.draining;
    });
  };
  std::vector<Rank> ranks(R);
  Run out;
  out.compute.assign(R, 0.0);
  out.blocked.assign(R, {});
  struct Meeting {
    std::vector<int> arrived;
    double work = 0;
  };
  std::map<long, int> group_size;
  // Group sizes: how many ranks meet at a group's n-th collective = the ranks whose
  // programs name the group.
  for (int r = 0; r < R; ++r) {
    std::map<long, bool> seen;
    for (const Item& it : programs[r])
      if (it.kind == Kind::collective && !seen[it.group])
        seen[it.group] = true, ++group_size[it.group];
  }
  std::map<std::pair<long, int>, Meeting> meetings;
  std::vector<std::map<long, int>> count(R);
  std::map<std::pair<int, int>, std::vector<double>> sent;  // (from, to) -> arrival times
  std::vector<std::map<int, std::size_t>> received(R);
  double now = 0;

  // Moves rank r through items that take no time, to its next wait or work.
  auto advance = [&](int r) {
    Rank& k = ranks[r];
    while (k.state == State::running && k.left <= 0) {
      if (k.pc == programs[r].size()) {
        k.draining = -1;
        k.state = k.background.empty() ? State::done : State::draining;
        return;
      }
      const Item& it = programs[r][k.pc++];
      switch (it.kind) {
        case Kind::compute:
          k.left = it.work, k.axis = Axis::dp;
          out.compute[r] += it.work;
          if (k.left > 0) k.state = State::running;
          break;
        case Kind::start:
          if (it.work > 0) k.background.push_back({it.work, it.axis});
          break;
        case Kind::wait:
          k.draining = it.peer == 1 ? -1 : int(it.axis);
          if (pending(k)) k.state = State::draining;
          break;
        case Kind::send:
          sent[{r, it.peer}].push_back(now + it.work);
          break;
        case Kind::recv: {
          const std::size_t n = received[r][it.peer]++;
          const auto& arrivals = sent[{it.peer, r}];
          k.axis = Axis::pp;
          if (n >= arrivals.size() || arrivals[n] > now) {
            k.state = State::receiving;
            k.left = 0;
            --k.pc;  // looked at again when it may have come
            --received[r][it.peer];
          }
          break;
        }
        case Kind::collective: {
          const int n = count[r][it.group]++;
          Meeting& meet = meetings[{it.group, n}];
          meet.arrived.push_back(r);
          meet.work = std::max(meet.work, it.work);
          k.axis = it.axis;
          if (int(meet.arrived.size()) < group_size[it.group]) {
            k.state = State::waiting;
          } else {
            for (int q : meet.arrived) {
              ranks[q].state = State::in_collective;
              ranks[q].left = meet.work;
            }
            meetings.erase({it.group, n});
          }
          break;
        }
      }
    }
  };
  for (int r = 0; r < R; ++r) advance(r);

  for (int guard = 0; guard < 50'000'000; ++guard) {
    // Receivers whose message has come go on.
    for (int r = 0; r < R; ++r)
      if (ranks[r].state == State::receiving) {
        const Item& it = programs[r][ranks[r].pc];
        const std::size_t n = received[r][it.peer];
        const auto& arrivals = sent[{it.peer, r}];
        if (n < arrivals.size() && arrivals[n] <= now) {
          ranks[r].state = State::running;
          advance(r);
        }
      }
    // Who works, and how fast: each group's cores shared evenly.
    std::vector<int> busy(groups.cores.size(), 0);
    bool all_done = true;
    for (int r = 0; r < R; ++r) {
      const Rank& k = ranks[r];
      if (k.state != State::done) all_done = false;
      busy[std::size_t(groups.of[std::size_t(r)])] +=
          (k.state == State::running || k.state == State::in_collective) + int(k.background.size());
    }
    if (all_done) break;
    auto rate = [&](int r) {
      const std::size_t g = std::size_t(groups.of[std::size_t(r)]);
      return busy[g] <= groups.cores[g] ? 1.0 : double(groups.cores[g]) / busy[g];
    };
    double dt = std::numeric_limits<double>::infinity();
    for (int r = 0; r < R; ++r) {
      const Rank& k = ranks[r];
      if (k.state == State::running || k.state == State::in_collective)
        dt = std::min(dt, k.left / rate(r));
      for (const auto& [left, axis] : k.background) dt = std::min(dt, left / rate(r));
      if (k.state == State::receiving) {
        const Item& it = programs[r][k.pc];
        const auto& arrivals = sent[{it.peer, r}];
        const std::size_t n = received[r][it.peer];
        if (n < arrivals.size()) dt = std::min(dt, std::max(0.0, arrivals[n] - now));
      }
    }
    shardlab::require(std::isfinite(dt),
                      "the predicted step deadlocks: a collective or a message never completes");
    for (int r = 0; r < R; ++r) {
      Rank& k = ranks[r];
      const double go = rate(r) * dt;
      if (k.state == State::running || k.state == State::in_collective) k.left -= go;
      if (k.state == State::in_collective || k.state == State::waiting ||
          k.state == State::receiving)
        out.blocked[r][k.axis] += dt;
      for (auto& [left, axis] : k.background) left -= go;
      std::erase_if(k.background, [](const auto& b) { return b.first <= 1e-15; });
    }
    now += dt;
    for (int r = 0; r < R; ++r) {
      Rank& k = ranks[r];
      if ((k.state == State::running || k.state == State::in_collective) && k.left <= 1e-15) {
        k.state = State::running, k.left = 0;
        advance(r);
      }
      if (k.state == State::draining && !pending(k)) {
        k.state = k.pc == programs[r].size() ? State::done : State::running;
        if (k.state == State::running) advance(r);
      }
    }
  }
  out.makespan = now;
  return out;
}

}  // namespace

StepPrediction predict_step(const TrainConfig& c, const MachineProfile& m) {
  Programs make(c, m);
  const int R = c.mesh.ranks();
  std::vector<std::vector<Item>> programs;
  for (int r = 0; r < R; ++r) programs.push_back(make.of(r));
  const ch08::CoreGroups groups = m.core_groups(R);
  ch08::CoreGroups alone;  // a core a rank
  for (int r = 0; r < R; ++r)
    alone.of.push_back(r), alone.cores.push_back(1), alone.ranks.push_back(1);
  const Run shared = run_together(programs, groups);
  const Run own = run_together(programs, alone);
  StepPrediction out;
  out.step_s = shared.makespan;
  out.pipeline_s = own.makespan;
  double work = 0;
  for (int r = 0; r < R; ++r) {
    work += shared.compute[r];
    out.compute_s = std::max(out.compute_s, shared.compute[r]);
  }
  out.shared_s = work / groups.cores_in_use();
  // Per axis: the ranks' mean time blocked (waiting for the group, or in the collective).
  for (Axis axis : ch08::kAxes) {
    double sum = 0;
    for (int r = 0; r < R; ++r) sum += shared.blocked[r][axis];
    out.exposed[axis] = sum / R;
    out.exposed_s += out.exposed[axis];
  }
  return out;
}

void choose_mesh(shardlab::Context& ctx, TrainConfig& c, const ch08::MachineProfile& machine) {
  std::vector<std::pair<double, MeshShape>> ranked;
  for (const MeshShape& mesh : benchmark_meshes(c, ctx.size())) {
    TrainConfig t = c;
    t.mesh = mesh;
    ranked.emplace_back(predict_step(t, machine).step_s, mesh);
  }
  std::stable_sort(ranked.begin(), ranked.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  c.mesh = ranked.front().second;
  shardlab::Table t({"rank", "mesh", "predicted_step_ms"});
  for (std::size_t i = 0; i < ranked.size() && i < 5; ++i)
    t.add({static_cast<std::int64_t>(i + 1), ch08::mesh_name(ranked[i].second),
           1e3 * ranked[i].first});
  ctx.report(t, "mesh_auto",
             "--mesh auto: " + std::to_string(ranked.size()) + " meshes of " +
                 std::to_string(ctx.size()) + " ranks predicted on " + machine.cpu + " (" +
                 std::to_string(machine.cores) +
                 " cores, the profile's measured layers and "
                 "links), the fastest five; training on the first\n");
  ctx.json()["mesh_auto"] = ch08::mesh_name(c.mesh);
}

}  // namespace ch09
