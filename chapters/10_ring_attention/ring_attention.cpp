// Chapter 10: ring attention, forward and backward (ring_attention.hpp).
#include "ring_attention.hpp"

#include <cmath>
#include <string>

#include "ring_allreduce.hpp"
#include "shardlab/check.hpp"
#include "shardlab/memory.hpp"

namespace ch10 {

using shardlab::require_usage;

Partial Partial::empty(std::int64_t rows, std::int64_t heads, std::int64_t head_dim) {
  Partial p{rows, heads, head_dim, {}, {}, {}};
  p.out.assign(static_cast<std::size_t>(rows * heads * head_dim), 0.0f);
  p.max.assign(static_cast<std::size_t>(rows * heads), -INFINITY);
  p.sum.assign(static_cast<std::size_t>(rows * heads), 0.0f);
  return p;
}

std::vector<std::int64_t> positions(std::int64_t T, int chunk_count,
                                    const std::vector<int>& chunks) {
  const std::int64_t size = T / chunk_count;
  std::vector<std::int64_t> out;
  for (int c : chunks)
    for (std::int64_t t = 0; t < size; ++t) out.push_back(c * size + t);
  return out;
}

std::vector<float> random_rows(std::int64_t rows, std::int64_t width, std::uint64_t seed) {
  const shardlab::Tensor t = shardlab::randn(rows, width, seed);
  return {t.data(), t.data() + t.size()};
}

std::vector<int> rank_chunks(int cp, int rank, Split split) {
  if (split == Split::plain) return {rank};
  // The exercise's answer, checked before anything is indexed by it: a chunk outside the
  // sequence would read past the end of every rank's rows.
  const std::vector<int> chunks = zigzag_chunks(cp, rank);
  std::string listed;
  for (int c : chunks) listed += (listed.empty() ? "" : ", ") + std::to_string(c);
  const std::string call = "zigzag_chunks(" + std::to_string(cp) + ", " + std::to_string(rank) +
                           ") returned {" + listed + "}: ";
  shardlab::require(chunks.size() == 2, [&] { return call + "a rank holds two chunks"; });
  for (int c : chunks)
    shardlab::require(c >= 0 && c < 2 * cp, [&] {
      return call + "chunk " + std::to_string(c) + " is outside the sequence's chunks 0 to " +
             std::to_string(2 * cp - 1);
    });
  shardlab::require(chunks[0] < chunks[1],
                    [&] { return call + "the header promises the chunks in increasing order"; });
  return chunks;
}

std::vector<std::int64_t> rank_positions(std::int64_t T, int cp, int rank, Split split) {
  const int chunks = split == Split::zigzag ? 2 * cp : cp;
  require_usage(T % chunks == 0, "the sequence of " + std::to_string(T) + " tokens must cut into " +
                                     std::to_string(chunks) + " equal chunks");
  return positions(T, chunks, rank_chunks(cp, rank, split));
}

namespace {

using shardlab::idx;

shardlab::Tensor tensor_of(const std::vector<float>& v) {
  shardlab::Tensor t(shardlab::Shape{static_cast<std::int64_t>(v.size())}, shardlab::DType::f32);
  std::copy(v.begin(), v.end(), t.data());
  return t;
}

}  // namespace

Partial attend(std::span<const float> q, std::span<const float> k, std::span<const float> v,
               const std::vector<std::int64_t>& query_pos, const std::vector<std::int64_t>& key_pos,
               std::int64_t heads, std::int64_t head_dim, std::int64_t* work) {
  const auto n = static_cast<std::int64_t>(query_pos.size());
  const auto m = static_cast<std::int64_t>(key_pos.size());
  const std::int64_t H = heads, D = head_dim, C = H * D;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  Partial p = Partial::empty(n, H, D);
  std::vector<float> s(idx(m));
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::size_t r = idx(i * H + h);
      float top = -INFINITY;
      for (std::int64_t j = 0; j < m; ++j) {
        if (key_pos[idx(j)] > query_pos[idx(i)]) continue;
        float dot = 0;
        for (std::int64_t d = 0; d < D; ++d)
          dot += q[idx(i * C + h * D + d)] * k[idx(j * C + h * D + d)];
        s[idx(j)] = dot * scale;
        top = std::max(top, s[idx(j)]);
        if (work) ++*work;
      }
      if (top == -INFINITY) continue;  // every key lies after this query
      p.max[r] = top;
      float sum = 0;
      for (std::int64_t j = 0; j < m; ++j) {
        if (key_pos[idx(j)] > query_pos[idx(i)]) continue;
        const float e = std::exp(s[idx(j)] - top);
        sum += e;
        for (std::int64_t d = 0; d < D; ++d)
          p.out[idx(r * idx(D) + idx(d))] += e * v[idx(j * C + h * D + d)];
      }
      p.sum[r] = sum;
    }
  return p;
}

namespace {

constexpr int kTag = 10'000;
/// The tags of the ring's messages at step `step`: the forward's blocks, the backward's
/// blocks, and the backward's gradients going on with them (never the same two).
int forward_tag(int step) { return kTag + step; }
int backward_tag(int step) { return kTag + 100 + 2 * step; }
int gradients_tag(int step) { return kTag + 101 + 2 * step; }

/// The rank whose block this rank holds at step s of the ring: r - s mod cp. The blocks
/// travel as chapter 03's ring all-gather moves its chunks (ch03::wrap: a ring index).
int source(int rank, int step, int cp) { return ch03::wrap(rank - step, cp); }

/// Sends `out` to the next rank and receives the previous rank's into `in`, started now
/// and finished by the caller's wait: the transfer runs while the block is computed.
struct Pass {
  shardlab::Request send, recv;
};
Pass start_pass(Communicator& cp, const std::vector<float>& out, std::vector<float>& in, int tag) {
  const int next = ch03::wrap(cp.rank() + 1, cp.size()),
            previous = ch03::wrap(cp.rank() - 1, cp.size());
  in.resize(out.size());
  Pass p;
  p.recv = cp.irecv(in, previous, tag);
  p.send = cp.isend(out, next, tag);
  return p;
}
void finish(Communicator& cp, Pass& p) {
  cp.wait(p.send);
  cp.wait(p.recv);
}

}  // namespace

std::vector<float> ring_attention(Communicator& cp, const std::vector<float>& q,
                                  const std::vector<float>& k, const std::vector<float>& v,
                                  const RingShape& shape, RingSaved* saved, std::int64_t* work) {
  const int P = cp.size(), r = cp.rank();
  const std::int64_t T = shape.T, H = shape.heads, D = shape.head_dim, C = H * D,
                     S = shape.sequences;
  const std::vector<std::int64_t> mine = rank_positions(T, P, r, shape.split);
  const auto n = static_cast<std::int64_t>(mine.size());
  shardlab::require(q.size() == idx(S * n * C) && k.size() == q.size() && v.size() == q.size(),
                    "ring_attention: q, k and v must be the rank's rows (of each sequence) x "
                    "heads x head_dim");
  // The block in hand, k and v side by side (every sequence's), and the one arriving.
  std::vector<float> held(k), arriving;
  held.insert(held.end(), v.begin(), v.end());
  std::vector<Partial> acc(idx(S), Partial::empty(n, H, D));
  for (int step = 0; step < P; ++step) {
    Pass pass;
    const bool more = step + 1 < P;
    if (more) pass = start_pass(cp, held, arriving, forward_tag(step));
    if (more && !shape.overlap) finish(cp, pass);
    const std::vector<std::int64_t> keys = rank_positions(T, P, source(r, step, P), shape.split);
    const std::span<const float> block(held), queries(q);  // block: every k, then every v
    for (std::int64_t s = 0; s < S; ++s) {
      const std::size_t rows = idx(s * n * C), size = idx(n * C);
      merge(acc[idx(s)],
            attend(queries.subspan(rows, size), block.subspan(rows, size),
                   block.subspan(idx(S * n * C) + rows, size), mine, keys, H, D, work));
    }
    if (more) {
      finish(cp, pass);
      held.swap(arriving);
    }
  }
  std::vector<float> out(idx(S * n * C));
  std::vector<float> lse(idx(S * n * H));
  for (std::int64_t s = 0; s < S; ++s)
    for (std::int64_t i = 0; i < n * H; ++i) {
      const Partial& a = acc[idx(s)];
      const float l = a.sum[idx(i)];
      lse[idx(s * n * H + i)] = a.max[idx(i)] + std::log(l);
      for (std::int64_t d = 0; d < D; ++d)
        out[idx((s * n * H + i) * D + d)] = a.out[idx(i * D + d)] / l;
    }
  if (saved) {
    shardlab::memory::Scope kept(shardlab::memory::Category::activations);
    *saved = {tensor_of(q), tensor_of(k), tensor_of(v), tensor_of(out), tensor_of(lse), mine};
  }
  return out;
}

namespace {

/// One sequence's rows of the backward against one block of keys: this rank's n queries
/// and the block's n keys and values, every row and head. The pointers are to the
/// sequence's rows (n x C, heads side by side; lse and delta n x H).
struct BlockRows {
  const float *q, *lse, *k, *v, *dy, *delta;
  float *dq, *dk, *dv;
};

/// The backward from the log-sum-exp (FlashAttention-2, Dao 2023 §3.1.1): each allowed pair
/// (a key at or before the query's position) has p = exp(q.k scale - lse) and
/// ds = p (dy.v - delta) scale, and adds p dy into dv, ds k into dq and ds q into dk.
void block_backward(const BlockRows& b, const std::vector<std::int64_t>& queries,
                    const std::vector<std::int64_t>& keys, std::int64_t H, std::int64_t D) {
  const auto n = static_cast<std::int64_t>(queries.size());
  const std::int64_t C = H * D;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t row = i * H + h;
      for (std::int64_t j = 0; j < n; ++j) {
        if (keys[idx(j)] > queries[idx(i)]) continue;
        float sc = 0, dp = 0;
        for (std::int64_t d = 0; d < D; ++d) {
          sc += b.q[i * C + h * D + d] * b.k[j * C + h * D + d];
          dp += b.dy[i * C + h * D + d] * b.v[j * C + h * D + d];
        }
        const float p = std::exp(sc * scale - b.lse[row]);
        const float ds = p * (dp - b.delta[row]) * scale;
        for (std::int64_t d = 0; d < D; ++d) {
          b.dv[j * C + h * D + d] += p * b.dy[i * C + h * D + d];
          b.dq[i * C + h * D + d] += ds * b.k[j * C + h * D + d];
          b.dk[j * C + h * D + d] += ds * b.q[i * C + h * D + d];
        }
      }
    }
}

}  // namespace

RingGrads ring_attention_backward(Communicator& cp, const RingSaved& saved,
                                  const std::vector<float>& dout, const RingShape& shape) {
  const int P = cp.size(), r = cp.rank();
  const auto n = static_cast<std::int64_t>(saved.pos.size());
  const std::int64_t H = shape.heads, D = shape.head_dim, C = H * D, S = shape.sequences;
  shardlab::require(dout.size() == idx(S * n * C) && saved.q.size() == S * n * C,
                    "ring_attention_backward: dL/dout must be the rank's rows x heads x head_dim, "
                    "as the forward's");
  // delta = rowsum(dout * out) per row and head: the softmax's backward needs it.
  const float* o = saved.out.data();
  std::vector<float> delta(idx(S * n * H), 0.0f);
  for (std::int64_t i = 0; i < S * n * H; ++i)
    for (std::int64_t d = 0; d < D; ++d) delta[idx(i)] += dout[idx(i * D + d)] * o[i * D + d];
  RingGrads g;
  g.dq.assign(idx(S * n * C), 0.0f);
  // What travels: k and v side by side, passed on while this rank computes with them;
  // then the gradients of them gathered so far, once the rank has added its part.
  std::vector<float> kv(saved.k.data(), saved.k.data() + S * n * C), kv_next;
  kv.insert(kv.end(), saved.v.data(), saved.v.data() + S * n * C);
  std::vector<float> grads(idx(2 * S * n * C), 0.0f), grads_next;
  for (int step = 0; step < P; ++step) {
    Pass pass;
    const bool more = step + 1 < P;
    if (more) pass = start_pass(cp, kv, kv_next, backward_tag(step));
    if (more && !shape.overlap) finish(cp, pass);
    const std::vector<std::int64_t> keys =
        rank_positions(shape.T, P, source(r, step, P), shape.split);
    for (std::int64_t s = 0; s < S; ++s) {
      const std::int64_t first = s * n * C;  // this sequence's rows, in every array
      block_backward({.q = saved.q.data() + first,
                      .lse = saved.lse.data() + s * n * H,
                      .k = kv.data() + first,
                      .v = kv.data() + S * n * C + first,
                      .dy = dout.data() + first,
                      .delta = delta.data() + s * n * H,
                      .dq = g.dq.data() + first,
                      .dk = grads.data() + first,
                      .dv = grads.data() + S * n * C + first},
                     saved.pos, keys, H, D);
    }
    if (more) {
      finish(cp, pass);
      kv.swap(kv_next);
    }
    // The gradients go on with the block: after the last step, home to the rank whose
    // keys they are (the next one).
    if (P > 1) {
      Pass home = start_pass(cp, grads, grads_next, gradients_tag(step));
      finish(cp, home);
      grads.swap(grads_next);
    }
  }
  g.dk.assign(grads.begin(), grads.begin() + S * n * C);
  g.dv.assign(grads.begin() + S * n * C, grads.end());
  return g;
}

Exact exact_attention(const std::vector<float>& q, const std::vector<float>& k,
                      const std::vector<float>& v, const std::vector<float>& dout, std::int64_t T,
                      std::int64_t H, std::int64_t D) {
  const std::int64_t C = H * D;
  const auto n = static_cast<std::size_t>(T * C);
  Exact w;
  w.out.assign(n, 0);
  w.dq.assign(n, 0);
  w.dk.assign(n, 0);
  w.dv.assign(n, 0);
  const double scale = 1 / std::sqrt(double(D));
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t i = 0; i < T; ++i) {
      std::vector<double> p(static_cast<std::size_t>(i + 1));
      double top = -INFINITY, sum = 0;
      for (std::int64_t j = 0; j <= i; ++j) {
        double s = 0;
        for (std::int64_t d = 0; d < D; ++d)
          s += double(q[i * C + h * D + d]) * k[j * C + h * D + d];
        top = std::max(top, p[j] = s * scale);
      }
      for (double& x : p) sum += x = std::exp(x - top);
      for (double& x : p) x /= sum;
      for (std::int64_t j = 0; j <= i; ++j)
        for (std::int64_t d = 0; d < D; ++d)
          w.out[i * C + h * D + d] += p[j] * v[j * C + h * D + d];
      double delta = 0;
      for (std::int64_t d = 0; d < D; ++d)
        delta += dout[i * C + h * D + d] * w.out[i * C + h * D + d];
      for (std::int64_t j = 0; j <= i; ++j) {
        double dp = 0;
        for (std::int64_t d = 0; d < D; ++d)
          dp += double(dout[i * C + h * D + d]) * v[j * C + h * D + d];
        const double ds = p[j] * (dp - delta) * scale;
        for (std::int64_t d = 0; d < D; ++d) {
          w.dv[j * C + h * D + d] += p[j] * dout[i * C + h * D + d];
          w.dq[i * C + h * D + d] += ds * k[j * C + h * D + d];
          w.dk[j * C + h * D + d] += ds * q[i * C + h * D + d];
        }
      }
    }
  return w;
}

std::uint64_t RingSaved::bytes() const {
  std::uint64_t total = 0;
  for (const shardlab::Tensor* t : {&q, &k, &v, &out, &lse})
    total += static_cast<std::uint64_t>(t->size()) * sizeof(float);
  return total;
}

std::uint64_t ring_forward_bytes(int cp, std::uint64_t block_bytes) {
  return static_cast<std::uint64_t>(cp - 1) * 2 * block_bytes;
}

std::uint64_t ring_backward_bytes(int cp, std::uint64_t block_bytes) {
  return cp == 1 ? 0 : static_cast<std::uint64_t>(cp - 1) * 4 * block_bytes + 2 * block_bytes;
}

}  // namespace ch10
