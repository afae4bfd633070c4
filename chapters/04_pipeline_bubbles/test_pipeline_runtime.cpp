// Chapter 04 tests of the pipeline runtime (pipeline.hpp) over a model that is not the
// chapter's: a small GPT. Token embeddings, then blocks x + proj(attention(qkv(LN(x)))) (a
// residual around LayerNorm, Linear(C, 3C), causal self-attention, Linear(C, C)), then a
// LayerNorm and a Linear(C, V) head with cross-entropy on the last virtual stage. Stages
// take token ids in (i32) and pass C-wide activations on; microbatches are whole
// sequences, unevenly many of them (2m + 1 sequences in m microbatches).
//
// For every schedule (naive, gpipe, 1f1b, zb1 with B and W split, interleaved with v = 2
// and 3) on 1 to 4 ranks:
//   - every stage's gradients equal, bit for bit, those of one device running the same
//     microbatches one after the other through the whole model (every parameter gets its
//     microbatches' contributions in the same order), and the loss too;
//   - the same within 1e-5 of the largest gradient of one device running the whole batch
//     at once (there the rows are summed in one matmul: another order);
//   - before_last_backward fires once per stage per step, just before the stage's last op
//     that adds weight gradients (its last W in zb1, else its last B), and after_backward
//     after each of those ops, saying when a chunk's gradients are final;
// and, on a (dp = 2, pp = 2) mesh, the runtime on the pp axis with a data-parallel sync
// switched on by the hook (or started per chunk when after_backward says it is done)
// gives the sum of the two replicas' one-device gradients, bit for bit.
//
// Wrong versions these tests were checked against (each a change to pipeline.cpp; each
// fails with the message quoted):
//   the hook after the last backward instead of before it
//     -> "the hook's moment, stage 0 of naive, step 0: chunk 0's gradients were already
//        final (the hook ran after the last backward)"
//   the hook before the last B instead of the last W (the backward split)
//     -> "hook order, stage 1 of zb1, step 0: W0.0 W1.0 hook W2.0 W3.0*; want W0.0 W1.0
//        W2.0 hook W3.0*"
//   the hook before every backward
//     -> "hook order, stage 0 of gpipe, step 0: hook W0.0 hook W1.0 hook W2.0*; want ..."
//   after_backward's chunk_done at a chunk's first backward instead of its last
//     -> "hook order, stage 0 of gpipe, step 0: W0.0* W1.0 hook W2.0; ..." and "per-chunk
//        sync, stage 0 of gpipe, replica 0: embed.weight differs: 82 of 88 elements ..."
//   after_backward after B instead of after W (zb1)
//     -> "hook order, stage 0 of zb1, step 0: W0.0 W1.0 W2.0* hook; ..." and "per-chunk
//        sync, stage 0 of zb1, replica 0: embed.weight differs: ..."
//   the boundary of microbatch 0 for every microbatch
//     -> "stage 1, op F1 of the gpipe schedule: rank 1: rank 1 posted a recv of 384 bytes
//        from rank 0 (tag 1), but rank 0 sent 256 bytes", and on one stage "stage 0, op
//        F1.1 of the interleaved schedule: chunk 1 gets a 8x8 tensor, its boundary says 12x8"
//   the loss gradient scaled by 1 / m in the runtime too (the microbatch count twice)
//     -> "stage 0 of gpipe, against one device's microbatches in the same order:
//        embed.weight differs: 80 of 88 elements differ ..."
//   microbatch 0's input for every microbatch
//     -> "stage 0, op B1 of the gpipe schedule: cross_entropy: targets are i32 [8] on host,
//        expected 12 class ids" (and the receive's size mismatch on 2 stages)
//   the loss at every chunk of the last stage, not only the last virtual stage
//     -> "stage 0, op B0.0 of the interleaved schedule: cross_entropy: target[3] = 8 is
//        outside 0..7"
//   a chunk's input gradient sent to chunk (k + 1) / p instead of (k - 1) / p
//     -> "stage 0, op B0.0 of the interleaved schedule: a message to this stage went
//        missing", "stage 0, op B0 of the naive schedule: ... met rank 1's send with tag 1"
#include <doctest/doctest.h>

#include <map>
#include <memory>
#include <sstream>

#include "pipeline.hpp"
#include "schedule.hpp"
#include "shardlab/testing.hpp"
#include "shardlab/toy.hpp"

using namespace shardlab;
using ch04::OpKind;
using ch04::Schedule;
using shardlab::testing::on_ranks;

namespace {

struct Gpt {
  std::int64_t vocab = 11, channels = 8, heads = 2, sequence = 4;
  int blocks = 1;
  std::uint64_t seed = 3;
};

/// Virtual stage k of `pieces`: the blocks shard_range(blocks, pieces, k), the embedding
/// in front of piece 0, the head after the last piece.
nn::Sequential piece(nn::ParameterStore& store, const Gpt& g, int k, int pieces) {
  const std::int64_t C = g.channels;
  nn::Sequential seq;
  if (k == 0) seq.add<nn::Embedding>(store, "embed", g.vocab, C, g.seed, 0.5f);
  const ShardRange r = shard_range(g.blocks, pieces, k);
  for (auto l = static_cast<int>(r.offset); l < r.offset + r.length; ++l) {
    const std::string name = "block" + std::to_string(l);
    nn::Sequential inner;
    inner.add<nn::LayerNorm>(store, name + ".ln", C);
    inner.add<nn::Linear>(store, name + ".qkv", C, 3 * C, toy::layer_seed(g.seed, 2 * l + 1));
    inner.add<nn::CausalSelfAttention>(g.heads, g.sequence);
    inner.add<nn::Linear>(store, name + ".proj", C, C, toy::layer_seed(g.seed, 2 * l + 2));
    seq.add<nn::Residual>(std::move(inner));
  }
  if (k == pieces - 1) {
    seq.add<nn::LayerNorm>(store, "head.ln", C);
    seq.add<nn::Linear>(store, "head.out", C, g.vocab, toy::layer_seed(g.seed, 0));
  }
  return seq;
}

/// Token ids and next-token targets (i32) of `sequences` sequences, from `salt`.
struct Data {
  Tensor tokens, targets;
  std::int64_t sequences = 0;
};
Data make_data(const Gpt& g, std::int64_t sequences, std::uint64_t salt) {
  const Tensor noise = randn(Shape{sequences * g.sequence + 1}, g.seed * 7 + salt);
  std::vector<std::int32_t> ids;
  for (float x : noise.span<float>())
    ids.push_back(
        static_cast<std::int32_t>(static_cast<std::int64_t>(std::fabs(x) * 1000) % g.vocab));
  const std::vector<std::int32_t> in(ids.begin(), ids.end() - 1), next(ids.begin() + 1, ids.end());
  return {Tensor::from_vector(in), Tensor::from_vector(next), sequences};
}

/// A step on `data` cut into m microbatches of whole sequences; each microbatch's loss is
/// its rows' share of the mean over `rows_in_all` rows (the data-parallel batch: 2 replicas'
/// rows when there are 2).
ch04::Stage stage_of(std::vector<nn::Sequential>& chunks, const Gpt& g, const Data& data, int m,
                     std::int64_t rows_in_all) {
  ch04::Stage st;
  for (nn::Sequential& c : chunks) st.chunks.push_back(&c);
  const std::int64_t T = g.sequence, C = g.channels, n = data.sequences;
  auto rows = [=](int j) {
    const ShardRange r = shard_range(n, m, j);
    return ShardRange{r.offset * T, r.length * T};
  };
  st.input = [&data, rows](int j) { return data.tokens.slice(rows(j).offset, rows(j).length); };
  st.boundary = [rows, C](int j, int) { return ch04::Boundary{{rows(j).length, C}}; };
  st.loss = [&data, rows, rows_in_all](const Tensor& out, int j) {
    const nn::Loss loss =
        nn::cross_entropy(out, data.targets.slice(rows(j).offset, rows(j).length));
    const double share = static_cast<double>(rows(j).length) / static_cast<double>(rows_in_all);
    return ch04::MicrobatchLoss{loss.value * share, scale(nn::cross_entropy_backward(loss.saved),
                                                          static_cast<float>(share))};
  };
  return st;
}

/// The whole model on one device.
struct OneDevice {
  nn::ParameterStore store;
  nn::Sequential model;
  double loss = 0;
  std::map<std::string, Tensor> grads() {
    std::map<std::string, Tensor> by_name;
    for (nn::Parameter* p : store.parameters()) by_name[p->name] = p->grad;
    return by_name;
  }
};
void build(OneDevice& d, const Gpt& g, int pieces) {
  for (int k = 0; k < pieces; ++k) d.model.add<nn::Sequential>(piece(d.store, g, k, pieces));
  d.store.allocate();
}
/// The same microbatches through the whole model, one after the other.
void one_device_microbatches(OneDevice& d, const Gpt& g, const Data& data, int m,
                             std::int64_t rows_in_all) {
  std::vector<nn::Sequential> none;
  const ch04::Stage st = stage_of(none, g, data, m, rows_in_all);
  for (int j = 0; j < m; ++j) {
    nn::Forward f = d.model.forward(st.input(j));
    ch04::MicrobatchLoss loss = st.loss(f.out, j);
    d.loss += loss.value;
    d.model.backward(loss.grad, f.saved);
  }
}
/// The whole batch at once.
void one_device_batch(OneDevice& d, const Data& data) {
  nn::Forward f = d.model.forward(data.tokens);
  const nn::Loss loss = nn::cross_entropy(f.out, data.targets);
  d.loss = loss.value;
  d.model.backward(nn::cross_entropy_backward(loss.saved), f.saved);
}

/// This rank's chunks: chunk c is virtual stage c p + s.
struct MyChunks {
  nn::ParameterStore store;
  std::vector<nn::Sequential> chunks;
  MyChunks(const Gpt& g, int stage, int stages, int v) {
    for (int c = 0; c < v; ++c)
      chunks.push_back(piece(store, g, ch04::virtual_stage(stage, c, stages), stages * v));
    store.allocate();
  }
};

/// "" when every parameter's gradient agrees with `want`'s (within atol + rtol |want|;
/// 0, 0: bit for bit), else the first that does not and how.
std::string compare_grads(nn::ParameterStore& store, std::map<std::string, Tensor>& want,
                          float atol, float rtol) {
  for (nn::Parameter* p : store.parameters()) {
    const std::string report = shardlab::testing::compare(p->grad, want.at(p->name), atol, rtol);
    if (!report.empty()) return p->name + " differs: " + report;
  }
  return "";
}

/// Every gradient of a chunk, one after the other (a copy).
Tensor concat_grads(nn::Sequential& chunk) {
  std::vector<Tensor> grads;
  for (nn::Parameter* q : chunk.parameters())
    grads.push_back(q->grad.reshape(Shape{q->grad.size()}));
  return concat(grads, 0);
}

/// The schedules every test runs, for p stages.
std::vector<Schedule> schedules(int p) {
  return {ch04::naive(p),
          ch04::gpipe(p, 3),
          ch04::one_f_one_b(p, 5),
          ch04::zb_h1(p, p + 2),
          ch04::interleaved(p, 2 * p, 2),
          ch04::interleaved(p, p, 3)};
}

std::string where(const Schedule& s, int stage) {
  return "stage " + std::to_string(stage) + " of " + s.name +
         (s.chunks > 1 ? " (v = " + std::to_string(s.chunks) + ")" : "");
}

}  // namespace

TEST_SUITE("ch04.runtime") {
  TEST_CASE("a GPT's stages: the gradients and loss of one device, for every schedule") {
    for (int p = 1; p <= 4; ++p)
      for (const Schedule& s : schedules(p)) {
        CAPTURE(p);
        CAPTURE(s.name);
        REQUIRE(ch04::validate(s).empty());
        const int v = s.chunks, m = s.microbatches;
        const Gpt g{.blocks = p * v};
        const Data data = make_data(g, 2 * m + 1, 1);
        const std::int64_t rows = data.tokens.size();
        OneDevice same_order, whole;
        build(same_order, g, p * v);
        build(whole, g, p * v);
        one_device_microbatches(same_order, g, data, m, rows);
        one_device_batch(whole, data);
        auto want = same_order.grads();
        auto near = whole.grads();
        const float atol = static_cast<float>(1e-5 * max_abs(whole.store.grads()));
        double loss = 0;
        on_ranks(p, [&](Communicator& comm) {
          MyChunks mine(g, comm.rank(), p, v);
          ch04::Pipeline pipeline(comm);
          const ch04::StageRun run = pipeline.run(s, stage_of(mine.chunks, g, data, m, rows));
          const std::string at = where(s, comm.rank());
          if (const std::string d = compare_grads(mine.store, want, 0, 0); !d.empty())
            throw Error(at + ", against one device's microbatches in the same order: " + d);
          if (const std::string d = compare_grads(mine.store, near, atol, 0); !d.empty())
            throw Error(at + ", against one device's whole batch: " + d);
          const double total = comm.agree(run.loss, ReduceOp::sum);
          if (comm.rank() == 0) loss = total;
        });
        CHECK_MESSAGE(loss == same_order.loss, "the loss of " << s.name << ": " << loss
                                                              << ", one device's microbatches "
                                                              << same_order.loss);
        CHECK_MESSAGE(std::fabs(loss - whole.loss) <= 1e-6 * whole.loss,
                      "the loss of " << s.name << ": " << loss << ", one device's whole batch "
                                     << whole.loss);
      }
  }

  TEST_CASE("the hooks: before the last backward once per stage, after every backward") {
    for (int p = 1; p <= 4; ++p)
      for (const Schedule& s : schedules(p)) {
        CAPTURE(p);
        CAPTURE(s.name);
        const int v = s.chunks, m = s.microbatches;
        const Gpt g{.blocks = p * v};
        const Data data = make_data(g, 2 * m + 1, 2);
        on_ranks(p, [&](Communicator& comm) {
          // What must happen, from the schedule alone: the ops that add weight gradients in
          // order ('*' on each chunk's last), with "hook" just before the last of them.
          const OpKind adds = s.split_backward() ? OpKind::weight : OpKind::backward;
          const auto& ops = s.ops[static_cast<std::size_t>(comm.rank())];
          std::vector<std::string> want;
          for (std::size_t i = 0; i < ops.size(); ++i) {
            if (ops[i].kind != adds) continue;
            bool last_of_chunk = true;
            for (std::size_t later = i + 1; later < ops.size(); ++later)
              if (ops[later].kind == adds && ops[later].chunk == ops[i].chunk)
                last_of_chunk = false;
            want.push_back("W" + std::to_string(ops[i].microbatch) + "." +
                           std::to_string(ops[i].chunk) + (last_of_chunk ? "*" : ""));
          }
          want.insert(want.end() - 1, "hook");
          std::vector<std::string> got;
          MyChunks mine(g, comm.rank(), p, v);
          // The moment: when the hook runs, every gradient of the step is in but the last
          // op's, which adds to its chunk's (the others' are final already).
          const int last_chunk = [&] {
            int c = 0;
            for (const ch04::Op& op : ops)
              if (op.kind == adds) c = op.chunk;
            return c;
          }();
          std::vector<Tensor> at_hook;
          ch04::Hooks hooks;
          hooks.before_last_backward = [&] {
            got.push_back("hook");
            at_hook.clear();
            for (nn::Sequential& chunk : mine.chunks) at_hook.push_back(concat_grads(chunk));
          };
          hooks.after_backward = [&](int j, int c, bool chunk_done) {
            got.push_back("W" + std::to_string(j) + "." + std::to_string(c) +
                          (chunk_done ? "*" : ""));
          };
          ch04::Pipeline pipeline(comm);
          const std::int64_t rows = data.tokens.size();
          for (int step = 0; step < 2; ++step) {  // once per step, every step
            got.clear();
            mine.store.zero_grad();
            (void)pipeline.run(s, stage_of(mine.chunks, g, data, m, rows), hooks);
            const std::string at = where(s, comm.rank()) + ", step " + std::to_string(step);
            if (got != want) {
              std::ostringstream out;
              out << "hook order, " << at << ":";
              for (const std::string& e : got) out << " " << e;
              out << "; want";
              for (const std::string& e : want) out << " " << e;
              throw Error(out.str());
            }
            for (int c = 0; c < v; ++c) {
              const Tensor final_grads = concat_grads(mine.chunks[static_cast<std::size_t>(c)]);
              const double moved = max_abs_diff(at_hook[static_cast<std::size_t>(c)], final_grads);
              if (c == last_chunk && moved == 0)
                throw Error("the hook's moment, " + at + ": chunk " + std::to_string(c) +
                            "'s gradients were already final (the hook ran after the last "
                            "backward)");
              if (c != last_chunk && moved != 0)
                throw Error("the hook's moment, " + at + ": chunk " + std::to_string(c) +
                            "'s gradients changed after the hook by " + std::to_string(moved));
            }
          }
        });
      }
  }

  TEST_CASE("on a (dp, pp) = (2, 2) mesh: a data-parallel sync switched on by the hooks") {
    const int p = 2;
    for (const Schedule& s : schedules(p))
      for (const bool per_chunk : {false, true}) {
        CAPTURE(s.name);
        CAPTURE(per_chunk);
        const int v = s.chunks, m = s.microbatches;
        const Gpt g{.blocks = p * v};
        // Replica r's data; each microbatch's loss its share of the mean over both.
        const Data data[] = {make_data(g, 2 * m + 1, 10), make_data(g, 2 * m + 1, 11)};
        const std::int64_t rows = 2 * data[0].tokens.size();
        OneDevice replica[2];
        for (int r = 0; r < 2; ++r) {
          build(replica[r], g, p * v);
          one_device_microbatches(replica[r], g, data[r], m, rows);
        }
        std::map<std::string, Tensor> want;  // the allreduce's sum of the two
        for (auto& [name, grad] : replica[0].grads())
          want[name] = add(grad, replica[1].grads()[name]);
        on_ranks(4, [&](Communicator& world) {
          // A (dp 2, pp p) mesh: world rank d p + s is replica d's stage s.
          const int stage = world.rank() % p, me_replica = world.rank() / p;
          const std::unique_ptr<Communicator> dp_group = world.split(stage, me_replica);
          const std::unique_ptr<Communicator> pp_group = world.split(me_replica, stage);
          Communicator& dp = *dp_group;
          MyChunks mine(g, stage, p, v);
          ch04::Pipeline pipeline(*pp_group);
          // Chapter 02's no-sync pattern: off for the step, on before its last backward;
          // or each chunk's gradients allreduced as soon as they are final.
          bool sync = false;
          ch04::Hooks hooks;
          if (per_chunk)
            hooks.after_backward = [&](int, int c, bool chunk_done) {
              if (!chunk_done) return;
              for (nn::Parameter* q : mine.chunks[static_cast<std::size_t>(c)].parameters())
                dp.allreduce(q->grad);
            };
          else
            hooks.before_last_backward = [&] { sync = true; };
          (void)pipeline.run(s, stage_of(mine.chunks, g, data[me_replica], m, rows), hooks);
          if (sync) dp.allreduce(mine.store.grads());
          if (const std::string d = compare_grads(mine.store, want, 0, 0); !d.empty())
            throw Error(std::string(per_chunk ? "per-chunk sync, " : "sync after the hook, ") +
                        where(s, stage) + ", replica " + std::to_string(me_replica) + ": " + d);
        });
      }
  }
}
