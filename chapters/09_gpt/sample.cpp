// Chapter 09's text generation (sample.hpp).
#include "sample.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <vector>

namespace ch09 {

using shardlab::Shape;

namespace {

/// The next byte from `row`, the whole vocabulary's logits: the most likely (temperature 0),
/// or drawn from softmax(logits / temperature) over the top_k most likely (0: all), by a
/// generator seeded with (seed, i), the same on every platform.
int draw(const Tensor& row, float temperature, int top_k, std::uint64_t seed, int i) {
  std::vector<int> order(static_cast<std::size_t>(row.size()));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return row[a] > row[b]; });
  if (temperature <= 0) return order[0];
  const std::size_t k = top_k > 0
                            ? std::min<std::size_t>(static_cast<std::size_t>(top_k), order.size())
                            : order.size();
  std::vector<double> w(k);
  for (std::size_t q = 0; q < k; ++q)
    w[q] = std::exp((row[order[q]] - row[order[0]]) / static_cast<double>(temperature));
  std::uint64_t state = seed * 0x9E3779B97F4A7C15ULL + static_cast<std::uint64_t>(i);
  double u = static_cast<double>(shardlab::splitmix64(state) >> 11) * 0x1.0p-53 *
             std::accumulate(w.begin(), w.end(), 0.0);
  std::size_t q = 0;
  while (q + 1 < k && u >= w[q]) u -= w[q++];
  return order[q];
}

}  // namespace

std::string sample(Trainer& trainer, const std::string& prompt, int count, float temperature,
                   int top_k, std::uint64_t seed, const std::function<void(int)>& progress) {
  Mesh& mesh = trainer.mesh_;
  GptModel& model = trainer.model_;
  const std::int64_t T = model.shape().context, V = model.shape().vocab;
  std::string text = prompt.empty() ? std::string("\n") : prompt;
  const MeshShape& shape = mesh.shape();
  const std::vector<std::int64_t>& mine = model.positions();  // of the window, this rank's
  for (int i = 0; i < count; ++i) {
    // The window: the last T bytes, padded at the end (causal attention: what follows
    // the last byte does not change its logits); this rank's positions of it.
    const auto len = std::min<std::int64_t>(static_cast<std::int64_t>(text.size()), T);
    Tensor ids(Shape{static_cast<std::int64_t>(mine.size())}, shardlab::DType::i32);
    for (std::size_t k = 0; k < mine.size(); ++k)
      ids.data<std::int32_t>()[k] =
          mine[k] < len ? static_cast<unsigned char>(
                              text[text.size() - static_cast<std::size_t>(len - mine[k])])
                        : 0;
    const Tensor out = trainer.forward_only(ids);
    // The last byte's logits come from the cp rank that holds its position, at its row
    // there, on the last stage (dp, ep and tp rank 0 speaks for the job).
    Coords speaker{.pp = shape.pp - 1};
    std::int64_t at_row = len - 1;
    for (int r = 0; r < shape.cp; ++r) {
      const std::vector<std::int64_t> held =
          shape.cp > 1 ? trainer.c_.context->positions(T, shape.cp, r) : mine;
      const auto at = std::find(held.begin(), held.end(), len - 1);
      if (at != held.end()) speaker.cp = r, at_row = at - held.begin();
    }
    Tensor next(Shape{1}, shardlab::DType::f32);
    if (model.last() && mesh.coords().cp == speaker.cp) {
      // That row's logits (sequence parallel: the head gathers the rows first).
      const Tensor logits = model.sequence_parallel()
                                ? model.head()->forward(out).out.slice(at_row, 1)
                                : model.head()->forward(out.slice(at_row, 1)).out;
      Tensor row(Shape{V}, shardlab::DType::f32);
      mesh.tp().allgatherv(logits.to(Memory::host).flat(), row,
                           shardlab::shard_counts(V, mesh.shape().tp));
      next[0] = static_cast<float>(draw(row, temperature, top_k, seed, i));
    }
    mesh.world().broadcast(next, ch08::rank_of(shape, speaker));
    text.push_back(static_cast<char>(static_cast<int>(next[0])));
    if (progress) progress(i + 1);
  }
  return text.substr(prompt.empty() ? 1 : prompt.size());
}

std::function<void(int)> sample_progress(int total, bool speak) {
  if (!speak) return {};
  const auto start = std::chrono::steady_clock::now();
  return [=, last = start](int done) mutable {
    const auto now = std::chrono::steady_clock::now();
    if (now - last < std::chrono::seconds(5)) return;
    last = now;
    const double rate = done / std::chrono::duration<double>(now - start).count();
    std::fprintf(stderr, "sampling: %d of %d bytes, %.0f bytes/s, %.0f s to go\n", done, total,
                 rate, (total - done) / rate);
  };
}

}  // namespace ch09
