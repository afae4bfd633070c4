// cli: checks for the chapters' own flags, on top of CLI11 (which this header includes:
// only programs include it, never the library's public headers).
//
//   program.cli().add_option("--lr", lr, "learning rate")->check(cli::between(0.0, 10.0));
//
// CLI11's own Range lets NaN through (every comparison with NaN is false): between()
// does not, and says what it wanted in one line.
//
// Numbers with units, for sizes and counts a reader writes the way papers do:
//   program.cli().add_option("--params", psi)->transform(cli::quantity(cli::Units::decimal));
//   7.5B, 350M, 1T, 64K, 1.5e9, 2^16     decimal: K = 1e3, M = 1e6, B = G = 1e9, T = 1e12
//   64M, 4K, 1G, 2^20                    binary (bytes): K = 2^10, M = 2^20, G = 2^30, T = 2^40
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "shardlab/format.hpp"

namespace shardlab::cli {

/// A finite number in [lo, hi]: NaN, infinity and anything outside are refused.
CLI::Validator between(double lo, double hi);
/// A whole number in [lo, hi]: "2.0" is "not a whole number" (CLI11's Range would call it
/// out of range), "1e3" too. Every integer flag of the chapters takes it.
CLI::Validator whole(long long lo, long long hi);

/// A flag the chapters declare: `flag` sets `value`, `what` says how (--help shows its
/// default), `check` refuses what it cannot take.
///   cli::option(app, "--steps", s.steps, "training steps", cli::whole(1, 100000));
template <class T>
CLI::Option* option(CLI::App& app, const std::string& flag, T& value, const std::string& what,
                    const CLI::Validator& check) {
  return app.add_option(flag, value, what)->check(check)->capture_default_str();
}

/// What the suffixes of a quantity (K, M, ...) mean.
enum class Units {
  decimal,  ///< K = 1e3, M = 1e6, B = G = 1e9, T = 1e12.
  binary    ///< Bytes: K = 2^10, M = 2^20, G = 2^30, T = 2^40.
};

/// "7.5B" -> 7.5e9 (decimal), "64M" -> 67108864 (binary), "2^16" -> 65536, "1e-3" ->
/// 0.001: a finite number, or std::invalid_argument saying in one line what is wrong
/// (not a number, an unknown suffix, too large for a double). Subnormal values are
/// numbers like any other.
double parse_quantity(const std::string& text, Units units = Units::decimal);

/// A CLI11 transform: the flag's text becomes the plain number parse_quantity reads
/// (checks such as between() then see that number).
CLI::Validator quantity(Units units = Units::decimal);

}  // namespace shardlab::cli
