// Chapter 09's data: a text as bytes, cut into training and validation text, and the
// batches each step draws from it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardlab/tensor.hpp"

namespace ch09 {

using shardlab::Tensor;

/// The text the model learns: bytes, the first 90 % for training, the rest for validation.
class Corpus {
 public:
  /// UsageError when `path` cannot be read or holds less than 4 sequences of each part.
  static Corpus load(const std::string& path, std::int64_t context);
  /// The text's length, bytes.
  std::int64_t size() const { return static_cast<std::int64_t>(bytes_.size()); }
  /// The training text's length, bytes: the first 90 %; the rest is the validation text.
  std::int64_t train_size() const { return split_; }
  /// Where step `step`'s B sequences start in the training text (T + 1 bytes each): a
  /// function of the seed and the step alone, so every rank, mesh and resumed run draws
  /// the same.
  std::vector<std::int64_t> batch(int step, std::int64_t sequences, std::uint64_t seed) const;
  /// Up to `count` sequences of the validation text, back to back from its start.
  std::vector<std::int64_t> validation(std::int64_t count) const;
  /// The bytes [start + shift, start + shift + T) of each sequence, as i32 ids: shift 0
  /// the inputs, shift 1 the targets. `positions`: only the bytes at those positions of
  /// each sequence, in that order (a cp rank's tokens); empty: all T.
  Tensor ids(const std::vector<std::int64_t>& starts, int shift,
             const std::vector<std::int64_t>& positions = {}) const;
  /// T, the bytes of a sequence: load()'s `context`.
  std::int64_t context() const { return context_; }

 private:
  std::vector<std::uint8_t> bytes_;
  std::int64_t split_ = 0, context_ = 0;
};

}  // namespace ch09
