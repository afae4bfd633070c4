// format: numbers as the programs print them, in one place.
#pragma once

#include <string>

namespace shardlab {

/// `value` with `digits` significant digits, the way CSV and tables print numbers.
std::string format_number(double value, int digits = 6);

}  // namespace shardlab
