// Chapter 09's text generation: bytes sampled from the model, on the whole mesh.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "train.hpp"

namespace ch09 {

/// `count` bytes generated after `prompt` (its last T bytes are the window): greedy
/// (temperature 0), or drawn from softmax(logits / temperature) over the top_k most
/// likely bytes (0: all), seeded. Every rank calls it; every rank gets the text.
/// `progress`, if given, is called with the bytes done after each one.
std::string sample(Trainer& trainer, const std::string& prompt, int count, float temperature,
                   int top_k, std::uint64_t seed, const std::function<void(int)>& progress = {});
/// sample()'s progress for a run of `total` bytes: every 5 s, "sampling: N of M bytes,
/// R bytes/s, S s to go" on stderr (the text itself goes to stdout); silent unless `speak`.
std::function<void(int)> sample_progress(int total, bool speak);

}  // namespace ch09
