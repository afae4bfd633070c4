// Chapter 09's data (corpus.hpp).
#include "corpus.hpp"

#include "shardlab/check.hpp"
#include "shardlab/format.hpp"
#include "shardlab/results.hpp"

namespace ch09 {

using shardlab::require_usage;
using shardlab::Shape;

namespace {

/// One draw of shardlab::splitmix64 from the state `x` (a hash of it).
std::uint64_t mix(std::uint64_t x) { return shardlab::splitmix64(x); }

}  // namespace

Corpus Corpus::load(const std::string& path, std::int64_t context) {
  const std::string text = shardlab::read_file(path, "--data " + path);
  Corpus c;
  c.bytes_.assign(text.begin(), text.end());
  c.context_ = context;
  c.split_ = c.size() * 9 / 10;
  require_usage(c.size() - c.split_ >= 4 * (context + 1),
                "--data " + path + ": " + std::to_string(c.size()) +
                    " bytes is too little text for --context " + std::to_string(context) +
                    " (validation needs 4 sequences, 10 % of the text)");
  return c;
}

std::vector<std::int64_t> Corpus::batch(int step, std::int64_t sequences,
                                        std::uint64_t seed) const {
  const auto places = static_cast<std::uint64_t>(split_ - context_);  // T + 1 bytes fit
  std::vector<std::int64_t> out;
  for (std::int64_t b = 0; b < sequences; ++b)
    out.push_back(static_cast<std::int64_t>(
        mix(mix(seed * 0x2545F4914F6CDD1DULL + static_cast<std::uint64_t>(step)) +
            static_cast<std::uint64_t>(b)) %
        places));
  return out;
}

std::vector<std::int64_t> Corpus::validation(std::int64_t count) const {
  std::vector<std::int64_t> out;
  for (std::int64_t s = split_; s + context_ + 1 <= size() && count-- > 0; s += context_)
    out.push_back(s);
  return out;
}

Tensor Corpus::ids(const std::vector<std::int64_t>& starts, int shift,
                   const std::vector<std::int64_t>& positions) const {
  std::vector<std::int64_t> all;
  if (positions.empty())
    for (std::int64_t t = 0; t < context_; ++t) all.push_back(t);
  const std::vector<std::int64_t>& at = positions.empty() ? all : positions;
  Tensor out(Shape{static_cast<std::int64_t>(starts.size() * at.size())}, shardlab::DType::i32);
  std::int32_t* p = out.data<std::int32_t>();
  for (std::int64_t start : starts)
    for (std::int64_t t : at) *p++ = bytes_[static_cast<std::size_t>(start + shift + t)];
  return out;
}

}  // namespace ch09
