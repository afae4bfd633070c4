// results: CSV tables written atomically.
#include "shardlab/results.hpp"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

#include "shardlab/check.hpp"

namespace shardlab {

void write_file_atomic(const std::filesystem::path& path, const std::string& content) {
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
  const std::filesystem::path tmp = path.string() + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary);
    out << content;
    out.flush();
    if (!out) throw std::runtime_error("cannot write " + tmp.string());
  }
  std::filesystem::rename(tmp, path);
}

CsvTable::CsvTable(std::vector<std::string> columns) : columns_(std::move(columns)) {}

void CsvTable::add(std::vector<std::string> row) {
  if (row.size() != columns_.size())
    throw std::logic_error("CsvTable: a row of " + std::to_string(row.size()) + " values for " +
                           std::to_string(columns_.size()) + " columns");
  rows_.push_back(std::move(row));
}

namespace {
void write_row(std::ostringstream& os, const std::vector<std::string>& row) {
  for (std::size_t i = 0; i < row.size(); ++i) {
    if (i) os << ',';
    const bool quote = row[i].find_first_of(",\"\n") != std::string::npos;
    if (!quote) {
      os << row[i];
      continue;
    }
    os << '"';
    for (char c : row[i]) os << (c == '"' ? "\"\"" : std::string(1, c));
    os << '"';
  }
  os << '\n';
}
}  // namespace

std::string CsvTable::str() const {
  std::ostringstream os;
  write_row(os, columns_);
  for (const auto& row : rows_) write_row(os, row);
  return os.str();
}

void CsvTable::save(const std::filesystem::path& path) const { write_file_atomic(path, str()); }

std::string machine_description() {
  std::string model = "unknown CPU";
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) != 0) continue;
    const std::size_t colon = line.find(':');
    if (colon != std::string::npos) model = line.substr(line.find_first_not_of(" \t", colon + 1));
    break;
  }
  return model + ", " + std::to_string(std::thread::hardware_concurrency()) + " logical CPUs";
}

std::string format_number(double value, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*g", digits, value);
  return buf;
}

}  // namespace shardlab
