// results: a program's results as one table rendered three ways (text, CSV, JSON), and
// files written so a crash never leaves half a file (everything goes to a temporary name
// that is renamed at the end).
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <type_traits>
#include <vector>

#include "shardlab/format.hpp"

namespace shardlab {

/// Writes `content` to `path` through a temporary file of its own, synced, then renamed
/// over `path`: a reader sees the old file or the whole new one. Error (with the
/// system's reason) if it cannot, or if `path` is there and is not a regular file (a
/// rename would replace a device, a folder's link or a pipe); the temporary file is
/// removed then.
void write_file_atomic(const std::filesystem::path& path, const std::string& content);
/// Makes `folder` if needed and checks that a file can be written there: UsageError
/// (naming `flag`, the folder and the reason) if not, and for the filesystem's root.
void check_writable_folder(const std::filesystem::path& folder,
                           const std::string& flag = "--csv-dir");
/// The same for a file a flag names (`--trace run.json`): not empty, not something other
/// than a regular file where it already is, in a folder where a file can be written.
void check_writable_file(const std::filesystem::path& file, const std::string& flag);

/// The whole of the regular file at `path`, which a flag or a checkpoint names (`what`,
/// e.g. "--data corpus.txt"): UsageError naming `what` if it is missing, unreadable, or
/// not a regular file. A pipe or a device is refused before it is opened, where reading
/// it would wait for a writer, or never end.
std::string read_file(const std::filesystem::path& path, const std::string& what);

/// FNV-1a, 64 bits, of `n` bytes (continuing from `hash`): a fingerprint that any change
/// of the bytes or of their order changes (a checkpoint's tensors, a machine's name).
std::uint64_t fnv1a64(const void* bytes, std::size_t n,
                      std::uint64_t hash = 14695981039346656037ULL);

/// A table cell's bar: `n` of `most` as up to `width` '#', rounded up (any n > 0 shows).
std::string bar(double n, double most, int width = 32);

/// The file `name` in the running program's own folder, where the build puts what a
/// program ships with (ch09_gpt.txt beside ch09_gpt): found from the program's path, so a
/// build folder or a program moved with its files still finds them; `name` alone (the
/// working folder) where the program's path cannot be read.
std::filesystem::path beside_program(const std::string& name);

/// One value of a Table: a number, a whole number, a word or a flag.
class Cell {
 public:
  /// What a cell holds.
  enum class Type {
    number,   ///< A floating-point number (a double).
    integer,  ///< A whole number (an int64).
    text,     ///< A string.
    flag      ///< A bool: "true" or "false".
  };
  /// A text cell.
  Cell(const char* text) : type_(Type::text), text_(text) {}
  /// A text cell.
  Cell(std::string text) : type_(Type::text), text_(std::move(text)) {}
  /// A flag cell.
  Cell(bool flag) : type_(Type::flag), integer_(flag) {}
  /// An integer cell, from any integral type but bool.
  template <class T>
  requires(std::is_integral_v<T> && !std::is_same_v<T, bool>) Cell(T value)
      : type_(Type::integer), integer_(static_cast<std::int64_t>(value)) {}
  /// A number cell, from any floating-point type.
  template <class T>
  requires std::is_floating_point_v<T> Cell(T value)
      : type_(Type::number), number_(static_cast<double>(value)) {}

  /// What the cell holds.
  Type type() const { return type_; }
  /// The value as a double: a number's, an integer's, a flag's 0 or 1; 0 for text.
  double number() const { return type_ == Type::number ? number_ : static_cast<double>(integer_); }
  /// An integer's value, a flag's 0 or 1; 0 for a number or text.
  std::int64_t integer() const { return integer_; }
  /// A text cell's string; empty for the other kinds.
  const std::string& text() const { return text_; }
  /// As a table shows it: numbers with `digits` significant digits.
  std::string str(int digits = 6) const;

 private:
  Type type_;
  double number_ = 0;
  std::int64_t integer_ = 0;
  std::string text_;
};

/// One result, written once: rows of cells under named columns, rendered as aligned text
/// (for the reader), CSV (for the notebooks) and JSON (for scripts and tests) from the
/// same rows — nccl-tests' one row per size, three outputs.
///
///   Table t({"stage", "bytes", "formula"});
///   t.add({1, measured, formula});
///   ctx.report(t, "stages");     // text on rank 0, and json["stages"] = [{...}, ...]
///   ctx.save_csv(t, "05_adam");  // benchmark modes: CSV_DIR/05_adam.csv
class Table {
 public:
  /// An empty table with these column names, in order.
  explicit Table(std::vector<std::string> columns);
  /// Adds a row; it must have one cell per column (std::logic_error if not).
  Table& add(std::vector<Cell> row);
  /// The number of rows added.
  std::size_t rows() const { return rows_.size(); }
  /// The column names, in order.
  const std::vector<std::string>& columns() const { return columns_; }
  /// The cell at `row` and `column` (std::out_of_range past the end).
  const Cell& at(std::size_t row, std::size_t column) const { return rows_.at(row).at(column); }

  /// Aligned columns under a header line, each line starting with `indent`; numbers with
  /// `digits` significant digits, right-aligned.
  std::string text(int digits = 4, const std::string& indent = "  ") const;
  /// Header first, then the rows; numbers with 10 significant digits; quoted as RFC 4180.
  std::string csv() const;
  /// An array with one object per row, keyed by column (numbers in full).
  nlohmann::json json() const;
  /// The same as csv() (the name CSV writers used).
  std::string str() const { return csv(); }

 private:
  std::vector<std::string> columns_;
  std::vector<std::vector<Cell>> rows_;
};

/// "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz, 2 logical CPUs": what a benchmark ran
/// on, for its CSV and its plot's title.
std::string machine_description();

}  // namespace shardlab
