// results: benchmark rows as CSV for the notebooks, written so a crash never leaves
// half a file (everything goes to a temporary name that is renamed at the end).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace shardlab {

/// Writes `content` to `path` through a temporary file of its own, synced, then renamed
/// over `path`: a reader sees the old file or the whole new one. Error (with the
/// system's reason) if it cannot; the temporary file is removed then.
void write_file_atomic(const std::filesystem::path& path, const std::string& content);
/// Makes `folder` if needed and checks that a file can be written there: UsageError
/// (naming `flag`, the folder and the reason) if not.
void check_writable_folder(const std::filesystem::path& folder,
                           const std::string& flag = "--csv-dir");

/// A CSV table: header first, then rows; save() writes it atomically.
class CsvTable {
 public:
  explicit CsvTable(std::vector<std::string> columns);
  /// Adds a row; it must have one value per column.
  void add(std::vector<std::string> row);
  std::string str() const;
  void save(const std::filesystem::path& path) const;
  std::size_t rows() const { return rows_.size(); }

 private:
  std::vector<std::string> columns_;
  std::vector<std::vector<std::string>> rows_;
};

/// `value` with `digits` significant digits, the way CSV and tables print numbers.
std::string format_number(double value, int digits = 6);

/// "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz, 2 logical CPUs": what a benchmark ran
/// on, for its CSV and its plot's title.
std::string machine_description();

}  // namespace shardlab
