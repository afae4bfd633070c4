// results: CSV tables written atomically.
#include "shardlab/results.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "shardlab/check.hpp"

namespace shardlab {

namespace {
std::string reason() { return std::strerror(errno); }
}  // namespace

void write_file_atomic(const std::filesystem::path& path, const std::string& content) {
  std::error_code error;
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path(), error);
  if (error)
    throw Error("cannot create the folder " + path.parent_path().string() + ": " + error.message());
  // A name no other writer uses (another run, another thread), written in full and synced
  // before it replaces the file: a crash leaves the old file or the new one, never half.
  static std::atomic<int> serial{0};
  const std::filesystem::path tmp =
      path.string() + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(serial++);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) throw Error("cannot write " + path.string() + ": " + reason());
  std::size_t done = 0;
  std::string failed;
  while (done < content.size()) {
    const ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      failed = reason();
      break;
    }
    done += static_cast<std::size_t>(n);
  }
  if (failed.empty() && ::fsync(fd) != 0) failed = reason();
  if (::close(fd) != 0 && failed.empty()) failed = reason();
  if (failed.empty() && std::rename(tmp.c_str(), path.c_str()) != 0) failed = reason();
  if (!failed.empty()) {
    ::unlink(tmp.c_str());
    throw Error("cannot write " + path.string() + ": " + failed);
  }
}

void check_writable_folder(const std::filesystem::path& folder, const std::string& flag) {
  if (folder.empty()) throw UsageError(flag + " is empty: name a folder (. for this one)");
  std::error_code error;
  std::filesystem::create_directories(folder, error);
  if (error || !std::filesystem::is_directory(folder))
    throw UsageError(flag + " " + folder.string() + ": cannot make it a folder (" +
                     (error ? error.message() : "it is a file") + ")");
  const std::filesystem::path probe =
      folder / (".shardlab-write-test." + std::to_string(::getpid()));
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) throw UsageError(flag + " " + folder.string() + " is not writable: " + reason());
  const bool wrote = ::write(fd, "x", 1) == 1 && ::fsync(fd) == 0;
  const std::string why = reason();
  ::close(fd);
  ::unlink(probe.c_str());
  if (!wrote) throw UsageError(flag + " " + folder.string() + " is not writable: " + why);
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
