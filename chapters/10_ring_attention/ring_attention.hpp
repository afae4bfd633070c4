// Chapter 10 API: causal attention over a sequence split into cp chunks, the keys and
// values passed around a ring of the cp ranks (Liu et al. 2023, "Ring Attention with
// Blockwise Transformers"; Megatron-LM's context parallelism).
//
// Each rank keeps the queries of its own rows. In cp steps, it meets every rank's keys and
// values once: it computes its queries against the block it holds, merges the result into
// what it has (the online softmax: a running maximum and denominator per row and head, as
// FlashAttention does), and passes the block on to the next rank while it computes.
//
// Causal attention does more work for late tokens than for early ones. Cut the sequence
// into 2 cp chunks and give rank i chunks i and 2 cp - 1 - i (Megatron-LM's load-balanced
// split, the "zigzag"): every rank gets one early and one late chunk, the same work.
//
// The learner writes merge() and zigzag_chunks() in exercises/10_ring_attention/
// online_softmax.cpp; the reference is solutions/10_ring_attention/.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "shardlab/comm.hpp"
#include "shardlab/tensor.hpp"

namespace ch10 {

using shardlab::Communicator;

/// Attention for some query rows over some of the keys, not yet normalised: per row and
/// head, the largest score seen (max), the sum of exp(score - max) (sum), and the sum of
/// exp(score - max) v over those keys (out). A row that has seen no key: max -inf, sum 0,
/// out 0. The attention itself is out / sum.
struct Partial {
  std::int64_t rows = 0;      ///< query rows
  std::int64_t heads = 0;     ///< attention heads
  std::int64_t head_dim = 0;  ///< a head's width
  std::vector<float> out;     ///< rows x heads x head_dim
  std::vector<float> max;     ///< rows x heads
  std::vector<float> sum;     ///< rows x heads
  /// A partial that has seen nothing.
  static Partial empty(std::int64_t rows, std::int64_t heads, std::int64_t head_dim);
};

// [exercise]
/// Folds `other` (the same rows, other keys) into `into`: afterwards `into` is what one
/// pass over both sets of keys would have given, to rounding.
void merge(Partial& into, const Partial& other);

/// The chunks of a sequence cut into 2 cp equal chunks that `rank` of cp holds under the
/// zigzag assignment, in increasing order: every rank the same amount of causal work.
std::vector<int> zigzag_chunks(int cp, int rank);
// [exercise]

/// The sequence's positions (0 .. T-1) of the rows a rank holds when the T tokens are cut
/// into `chunk_count` equal chunks and it holds `chunks` of them, in that order.
std::vector<std::int64_t> positions(std::int64_t T, int chunk_count,
                                    const std::vector<int>& chunks);

/// The rows at `pos` of a whole sequence's values (rows of `width`, row-major): what a
/// rank holds of it.
template <class T>
std::vector<T> rows_at(const std::vector<T>& whole, const std::vector<std::int64_t>& pos,
                       std::int64_t width) {
  std::vector<T> out;
  for (std::int64_t p : pos)
    out.insert(out.end(), whole.begin() + p * width, whole.begin() + (p + 1) * width);
  return out;
}

/// `rows` x `width` standard normal values from `seed` (shardlab::randn's generator: the
/// same on every platform), row-major: q, k, v and dL/dout for the program and the tests.
std::vector<float> random_rows(std::int64_t rows, std::int64_t width, std::uint64_t seed);

/// How the sequence is split over the ring: zigzag (2 cp chunks, zigzag_chunks) or plain
/// (cp chunks, rank i the i-th).
enum class Split { zigzag, plain };

/// The chunks rank `rank` of cp holds under `split`: zigzag_chunks(cp, rank), checked
/// (shardlab::Error, one line naming the function and what it returned, unless they are
/// two chunks of the 2 cp, in increasing order), or the plain split's {rank}.
std::vector<int> rank_chunks(int cp, int rank, Split split);

/// The positions rank `rank` of cp holds under `split` (T must split evenly): those of its
/// rank_chunks.
std::vector<std::int64_t> rank_positions(std::int64_t T, int cp, int rank, Split split);

/// q against the keys k and values v (all rows x heads x head_dim, row-major), causal by
/// the positions: row i sees key j when key_pos[j] <= query_pos[i]; scores scaled by
/// 1/sqrt(head_dim). `work`, if given, is increased by the score entries computed (the
/// pairs not masked).
Partial attend(std::span<const float> q, std::span<const float> k, std::span<const float> v,
               const std::vector<std::int64_t>& query_pos, const std::vector<std::int64_t>& key_pos,
               std::int64_t heads, std::int64_t head_dim, std::int64_t* work = nullptr);

/// What the forward keeps for the backward, as tensors the memory ledger counts (under
/// Category::activations): the rank's q, k, v, the output and the log-sum-exp of each
/// row and head (of every sequence); and the rows' positions in a sequence.
struct RingSaved {
  shardlab::Tensor q;             ///< the rank's queries, rows x heads x head_dim
  shardlab::Tensor k;             ///< its keys
  shardlab::Tensor v;             ///< its values
  shardlab::Tensor out;           ///< the attention of its rows
  shardlab::Tensor lse;           ///< max + log(sum) of each row and head
  std::vector<std::int64_t> pos;  ///< the rows' positions in the sequence
  /// The bytes of the tensors.
  std::uint64_t bytes() const;
};

/// What the ring attends over: sequences of T tokens, cut over the ring as `split` says,
/// `heads` heads of `head_dim` channels. A rank holds its rows of each of `sequences`
/// sequences, one sequence's after another (a microbatch), and passes them all at once.
struct RingShape {
  std::int64_t T = 0;           ///< tokens of a sequence
  Split split = Split::zigzag;  ///< how each sequence is cut over the ring
  std::int64_t heads = 1;       ///< attention heads
  std::int64_t head_dim = 1;    ///< a head's width
  std::int64_t sequences = 1;   ///< sequences side by side
  /// Each block passed on while this rank computes with the one it holds; false: the
  /// pass waited for first (the same messages and sums, nothing hidden).
  bool overlap = true;
};

/// The forward on every rank of `cp` (the ring): this rank's rows of q, k and v (its
/// positions, rank_positions, of each sequence in turn; each row heads x head_dim).
/// Returns the rank's rows of the attention, alike; `saved` for the backward; `work`: the
/// score entries this rank computed.
std::vector<float> ring_attention(Communicator& cp, const std::vector<float>& q,
                                  const std::vector<float>& k, const std::vector<float>& v,
                                  const RingShape& shape, RingSaved* saved = nullptr,
                                  std::int64_t* work = nullptr);

/// The gradients of this rank's q, k and v from dL/d out of its rows.
struct RingGrads {
  std::vector<float> dq;  ///< dL/dq of the rank's rows
  std::vector<float> dk;  ///< dL/dk of its keys, summed over every rank's queries
  std::vector<float> dv;  ///< dL/dv of its values, the same
};
/// The backward, on every rank of the ring: the keys and values travel again, with the
/// gradients of them accumulated on the way, which end where they started.
RingGrads ring_attention_backward(Communicator& cp, const RingSaved& saved,
                                  const std::vector<float>& dout, const RingShape& shape);

/// Causal attention over a whole sequence of T rows and its gradients from dL/d out, in
/// double, by the textbook formulas (P = softmax(q k^T / sqrt(D)), dP = dout v^T,
/// dS = P (dP - rowsum(dout out)) / sqrt(D)): the yardstick for the ring and for one
/// device's float result alike.
struct Exact {
  std::vector<double> out;  ///< T x H x D
  std::vector<double> dq;   ///< dL/dq
  std::vector<double> dk;   ///< dL/dk
  std::vector<double> dv;   ///< dL/dv
};
Exact exact_attention(const std::vector<float>& q, const std::vector<float>& k,
                      const std::vector<float>& v, const std::vector<float>& dout, std::int64_t T,
                      std::int64_t H, std::int64_t D);

/// Bytes a rank sends: the forward passes its k and v block on cp - 1 times; the
/// backward passes k, v and their gradients cp - 1 times, and the gradients once more
/// home. `block_bytes`: one of k or v of a rank's rows (of every sequence it holds).
std::uint64_t ring_forward_bytes(int cp, std::uint64_t block_bytes);
/// The backward's bytes (ring_forward_bytes says what travels).
std::uint64_t ring_backward_bytes(int cp, std::uint64_t block_bytes);

}  // namespace ch10
