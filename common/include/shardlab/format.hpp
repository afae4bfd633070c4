// format: numbers as the programs print them, in one place.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace shardlab {

/// `value` with `digits` significant digits, the way CSV and tables print numbers.
std::string format_number(double value, int digits = 6);
/// A duration as the communicators' messages give it: "2.5 s" (3 significant digits).
std::string format_seconds(std::chrono::milliseconds t);
/// Ranks as messages name them: "rank 3", "ranks 0 and 2", "ranks 0, 1 and 3".
std::string format_ranks(const std::vector<int>& ranks);

}  // namespace shardlab
