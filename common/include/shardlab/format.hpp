// format: numbers as the programs print them, in one place.
#pragma once

#include <chrono>
#include <string>

namespace shardlab {

/// `value` with `digits` significant digits, the way CSV and tables print numbers.
std::string format_number(double value, int digits = 6);
/// A duration as the communicators' messages give it: "2.5 s" (3 significant digits).
std::string format_seconds(std::chrono::milliseconds t);

}  // namespace shardlab
