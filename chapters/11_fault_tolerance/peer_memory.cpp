// Chapter 11: checkpoints in memory, on the rank and on a peer (peer_memory.hpp).
#include "peer_memory.hpp"

#include <algorithm>

#include "shardlab/format.hpp"

namespace ch11 {

using namespace shardlab;
using namespace ch09;

namespace {

/// One rank's state, packed: the flat numbers (the store's values, Adam's m and v of the
/// whole store, then the experts' alike) and what else it needs.
struct Copy {
  int step = -1;             ///< the steps done (-1: nothing kept)
  Tensor data;               ///< f32
  std::vector<double> meta;  ///< step, Adam's steps (dense, experts), loss scale, tracker
};

/// Each rank's memory (a host's, here): its own state, and the copy it keeps for the rank
/// whose peer it is. Rank r touches slot r alone.
struct Slot {
  Copy own, held;
};
std::vector<Slot> slots;

int peer_of(int rank, int n) { return (rank + n / 2) % n; }
int held_for(int rank, int n) { return (rank - n / 2 + n) % n; }

/// The store's values, and m and v of the whole store (ZeRO-1's range in place, zeros
/// elsewhere: restore() takes its range back), appended to `parts`.
void pack_store(nn::ParameterStore& store, const ch08::ReplicaOptimizer* o,
                std::vector<Tensor>& parts, std::vector<double>& meta) {
  const Tensor values = store.values().to(Memory::host);
  parts.push_back(values.clone());
  const ch08::ReplicaOptimizer::State st = o ? o->state() : ch08::ReplicaOptimizer::State{};
  meta.push_back(st.steps);
  if (!st.m.defined()) return;
  for (const Tensor& moment : {st.m, st.v}) {
    Tensor whole(Shape{values.size()}, DType::f32);  // zeros
    whole.slice(st.offset, moment.size()).copy_from(moment.to(Memory::host));
    parts.push_back(whole);
  }
}

Copy pack(GptModel& model, Trainer& trainer, int step) {
  std::vector<Tensor> parts;
  Copy c;
  c.step = step;
  c.meta.push_back(step);
  pack_store(model.store(), &trainer.optimizer(), parts, c.meta);
  if (!model.expert_pieces().empty())
    pack_store(model.expert_store(), trainer.expert_optimizer(), parts, c.meta);
  c.meta.push_back(trainer.scaler().scale());
  c.meta.push_back(trainer.scaler().kind() == ch06::Scaler::none
                       ? 0
                       : trainer.scaler().dynamic().growth_tracker());
  std::int64_t n = 0;
  for (const Tensor& t : parts) n += t.size();
  c.data = Tensor(Shape{n}, DType::f32);
  std::int64_t at = 0;
  for (const Tensor& t : parts) {
    c.data.slice(at, t.size()).copy_from(t);
    at += t.size();
  }
  return c;
}

/// The inverse of pack_store, from `data` at `at`.
void unpack_store(nn::ParameterStore& store, ch08::ReplicaOptimizer* o, const Tensor& data,
                  std::int64_t& at, int adam_steps) {
  const std::int64_t n = store.values().size();
  store.values().copy_from(data.slice(at, n));
  at += n;
  if (!o || !o->state().m.defined()) return;
  o->restore(data.slice(at, n), data.slice(at + n, n), adam_steps);
  at += 2 * n;
}

void unpack(const Copy& c, GptModel& model, Trainer& trainer) {
  std::int64_t at = 0;
  unpack_store(model.store(), &trainer.optimizer(), c.data, at, int(c.meta[1]));
  const bool experts = !model.expert_pieces().empty();
  if (experts)
    unpack_store(model.expert_store(), trainer.expert_optimizer(), c.data, at, int(c.meta[2]));
  const std::size_t s = experts ? 3 : 2;
  if (trainer.scaler().kind() != ch06::Scaler::none)
    trainer.scaler().restore(static_cast<float>(c.meta[s]), int(c.meta[s + 1]));
}

/// A copy on its way to another rank: its sizes first (the ranks' states differ in size
/// from stage to stage), its numbers, its meta; wait for `sent` before `c` changes.
struct Outgoing {
  std::int64_t sizes[2] = {0, 0};
  std::vector<Request> sent;
};

void send_copy(Communicator& world, const Copy& c, int to, Outgoing& out) {
  out.sizes[0] = c.data.size();
  out.sizes[1] = std::int64_t(c.meta.size());
  out.sent.push_back(world.isend(std::span<const std::int64_t>(out.sizes, 2), to, 74));
  out.sent.push_back(world.isend(c.data, to, 75));
  out.sent.push_back(world.isend(std::span<const double>(c.meta), to, 76));
}

Copy recv_copy(Communicator& world, int from) {
  std::int64_t sizes[2] = {0, 0};
  world.recv(std::span<std::int64_t>(sizes, 2), from, 74);
  Copy got;
  got.data = Tensor(Shape{sizes[0]}, DType::f32);
  got.meta.resize(std::size_t(sizes[1]));
  world.recv(got.data, from, 75);
  world.recv(std::span<double>(got.meta), from, 76);
  got.step = int(got.meta.at(0));
  return got;
}

void wait_sent(Communicator& world, Outgoing& out) {
  for (Request& q : out.sent) world.wait(q);
  out.sent.clear();
}

}  // namespace

void clear_memory(int ranks) { slots.assign(std::size_t(ranks), Slot{}); }

std::int64_t keep_in_memory(Communicator& world, GptModel& model, Trainer& trainer, int step) {
  Communicator::Uncounted not_counted(world);
  Slot& mine = slots.at(std::size_t(world.rank()));
  mine.own = pack(model, trainer, step);
  const int n = world.size();
  if (n == 1) return 0;
  Outgoing out;
  send_copy(world, mine.own, peer_of(world.rank(), n), out);
  mine.held = recv_copy(world, held_for(world.rank(), n));
  wait_sent(world, out);
  return 4 * mine.own.data.size();
}

void lose_memory(int rank) {
  if (std::size_t(rank) < slots.size()) slots[std::size_t(rank)] = Slot{};
}

int restore_from_memory(Communicator& world, GptModel& model, Trainer& trainer, std::string& how) {
  Communicator::Uncounted not_counted(world);
  const int n = world.size(), r = world.rank();
  if (world.agree(int(slots.size()) == n ? 0 : 1, ReduceOp::max) != 0) return -1;
  const Slot& mine = slots[std::size_t(r)];
  // The newest step kept anywhere; each rank's: its own copy, or its peer's.
  const std::vector<int> own = world.gather_values(mine.own.step);
  const std::vector<int> held = world.gather_values(mine.held.step);
  const int step = *std::max_element(own.begin(), own.end());
  std::vector<int> from_peer;
  bool whole = step >= 0;
  for (int q = 0; q < n && whole; ++q) {
    if (own[std::size_t(q)] == step) continue;
    if (n > 1 && held[std::size_t(peer_of(q, n))] == step)
      from_peer.push_back(q);
    else
      whole = false;
  }
  if (!whole) return -1;
  // The copies travel to the ranks that lost their own (each rank sends at most one,
  // the one it keeps, and receives at most one, its own).
  const int lost_to = held_for(r, n);  // the rank whose copy this one keeps
  const bool send =
      n > 1 && std::find(from_peer.begin(), from_peer.end(), lost_to) != from_peer.end();
  const bool receive = std::find(from_peer.begin(), from_peer.end(), r) != from_peer.end();
  Outgoing out;
  if (send) send_copy(world, mine.held, lost_to, out);
  const Copy restored = receive ? recv_copy(world, peer_of(r, n)) : mine.own;
  wait_sent(world, out);
  unpack(restored, model, trainer);
  if (receive) slots[std::size_t(r)].own = restored;  // its memory holds it again
  for (int q : from_peer)
    how += (how.empty() ? "" : ", ") + std::string("rank ") + std::to_string(q) + "'s from rank " +
           std::to_string(peer_of(q, n)) + "'s copy";
  if (how.empty()) how = "every rank's from its own";
  return step;
}

}  // namespace ch11
