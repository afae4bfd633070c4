// results: CSV tables written atomically.
#include "shardlab/results.hpp"

#include <fcntl.h>
#ifdef __APPLE__
#include <mach-o/dyld.h>

#include <cstdint>
#endif
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "shardlab/check.hpp"

namespace shardlab {

namespace {
std::string reason() { return std::strerror(errno); }

/// Something other than a regular file (a device, a folder, a pipe, a socket) at `path`.
bool taken_by_other_than_a_file(const std::filesystem::path& path) {
  std::error_code error;
  const auto status = std::filesystem::status(path, error);
  return std::filesystem::exists(status) && !std::filesystem::is_regular_file(status);
}
}  // namespace

void write_file_atomic(const std::filesystem::path& path, const std::string& content) {
  if (taken_by_other_than_a_file(path))
    throw UsageError("will not write " + path.string() +
                     ": it is there and is not a regular file (a folder, a device or a pipe)");
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

std::uint64_t fnv1a64(const void* bytes, std::size_t n, std::uint64_t hash) {
  const auto* p = static_cast<const unsigned char*>(bytes);
  for (std::size_t i = 0; i < n; ++i) hash = (hash ^ p[i]) * 1099511628211ULL;
  return hash;
}

std::string bar(double n, double most, int width) {
  const double cells = most > 0 ? std::ceil(width * n / most) : 0.0;
  return std::string(static_cast<std::size_t>(std::clamp(cells, 0.0, double(width))), '#');
}

std::filesystem::path beside_program(const std::string& name) {
  std::error_code error;
#ifdef __APPLE__
  char buffer[4096];
  std::uint32_t size = sizeof buffer;
  const std::filesystem::path self =
      _NSGetExecutablePath(buffer, &size) == 0 ? std::filesystem::canonical(buffer, error) : "";
#else
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
#endif
  if (error || self.empty()) return name;
  return self.parent_path() / name;
}

std::string read_file(const std::filesystem::path& path, const std::string& what) {
  std::error_code error;
  const auto status = std::filesystem::status(path, error);
  if (!std::filesystem::exists(status)) throw UsageError(what + ": no such file");
  if (!std::filesystem::is_regular_file(status))
    throw UsageError(what + ": not a regular file (a folder, a device or a pipe)");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError(what + ": cannot read it (" + reason() + ")");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw UsageError(what + ": cannot read it (" + reason() + ")");
  return std::move(text).str();
}

void check_writable_folder(const std::filesystem::path& folder, const std::string& flag) {
  if (folder.empty()) throw UsageError(flag + " is empty: name a folder (. for this one)");
  std::error_code error;
  const std::filesystem::path where = std::filesystem::weakly_canonical(folder, error);
  if (!error && where == where.root_path())
    throw UsageError(flag + " " + folder.string() +
                     ": that is the filesystem's root; name a folder of its own");
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

void check_writable_file(const std::filesystem::path& file, const std::string& flag) {
  if (file.empty()) throw UsageError(flag + " is empty: name a file");
  if (taken_by_other_than_a_file(file))
    throw UsageError(flag + " " + file.string() +
                     ": it is there and is not a regular file (a folder, a device or a pipe)");
  check_writable_folder(std::filesystem::absolute(file).parent_path(),
                        flag + " " + file.string() + ": its folder");
}

std::string Cell::str(int digits) const {
  switch (type_) {
    case Type::number:
      return format_number(number_, digits);
    case Type::integer:
      return std::to_string(integer_);
    case Type::flag:
      return integer_ ? "true" : "false";
    case Type::text:
      break;
  }
  return text_;
}

Table::Table(std::vector<std::string> columns) : columns_(std::move(columns)) {}

Table& Table::add(std::vector<Cell> row) {
  if (row.size() != columns_.size())
    throw std::logic_error("Table: a row of " + std::to_string(row.size()) + " values for " +
                           std::to_string(columns_.size()) + " columns");
  rows_.push_back(std::move(row));
  return *this;
}

namespace {
void write_csv_row(std::ostringstream& os, const std::vector<std::string>& row) {
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

std::string Table::csv() const {
  std::ostringstream os;
  write_csv_row(os, columns_);
  std::vector<std::string> line;
  for (const auto& row : rows_) {
    line.clear();
    for (const Cell& cell : row) line.push_back(cell.str(10));
    write_csv_row(os, line);
  }
  return os.str();
}

std::string Table::text(int digits, const std::string& indent) const {
  std::vector<std::vector<std::string>> shown{columns_};
  for (const auto& row : rows_) {
    shown.emplace_back();
    for (const Cell& cell : row) shown.back().push_back(cell.str(digits));
  }
  std::vector<std::size_t> width(columns_.size(), 0);
  for (const auto& line : shown)
    for (std::size_t c = 0; c < line.size(); ++c) width[c] = std::max(width[c], line[c].size());
  std::string out;
  for (std::size_t r = 0; r < shown.size(); ++r) {
    std::string line = indent;
    for (std::size_t c = 0; c < columns_.size(); ++c) {
      const std::string& s = shown[r][c];
      const std::string pad(width[c] - s.size(), ' ');
      // Words to the left, numbers to the right (the header follows its column).
      const bool right = (r == 0 ? !rows_.empty() && rows_[0][c].type() != Cell::Type::text
                                 : rows_[r - 1][c].type() != Cell::Type::text);
      if (c) line += "  ";
      line += right ? pad + s : (c + 1 < columns_.size() ? s + pad : s);
    }
    out += line + "\n";
  }
  return out;
}

nlohmann::json Table::json() const {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& row : rows_) {
    nlohmann::json object = nlohmann::json::object();
    for (std::size_t c = 0; c < columns_.size(); ++c) {
      const Cell& cell = row[c];
      switch (cell.type()) {
        case Cell::Type::number:
          object[columns_[c]] = cell.number();
          break;
        case Cell::Type::integer:
          object[columns_[c]] = cell.integer();
          break;
        case Cell::Type::flag:
          object[columns_[c]] = cell.integer() != 0;
          break;
        case Cell::Type::text:
          object[columns_[c]] = cell.text();
          break;
      }
    }
    out.push_back(std::move(object));
  }
  return out;
}

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

std::string format_seconds(std::chrono::milliseconds t) {
  return format_number(static_cast<double>(t.count()) / 1000.0, 3) + " s";
}

std::string format_ranks(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i)
    out += (i == 0 ? "" : i + 1 == ranks.size() ? " and " : ", ") + std::to_string(ranks[i]);
  return out;
}

}  // namespace shardlab
