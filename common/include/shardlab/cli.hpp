// cli: checks for the chapters' own flags, on top of CLI11 (which this header includes:
// only programs include it, never the library's public headers).
//
//   program.cli().add_option("--lr", lr, "learning rate")->check(cli::between(0.0, 10.0));
//
// CLI11's own Range lets NaN through (every comparison with NaN is false): between()
// does not, and says what it wanted in one line.
#pragma once

#include <CLI/CLI.hpp>
#include <cmath>
#include <string>

#include "shardlab/results.hpp"

namespace shardlab::cli {

/// A finite number in [lo, hi]: NaN, infinity and anything outside are refused.
inline CLI::Validator between(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        double value = 0;
        std::size_t used = 0;
        try {
          value = std::stod(text, &used);
        } catch (const std::exception&) {
          return "'" + text + "' is not a number";
        }
        if (used != text.size()) return "'" + text + "' is not a number";
        if (!std::isfinite(value)) return "'" + text + "' is not a finite number";
        if (value < lo || value > hi)
          return text + " is outside [" + format_number(lo) + ", " + format_number(hi) + "]";
        return "";
      },
      "[" + format_number(lo) + ", " + format_number(hi) + "]");
}

}  // namespace shardlab::cli
