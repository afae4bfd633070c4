// Chapter 11: the supervisor of a run of processes (supervisor.hpp).
#include "supervisor.hpp"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "shardlab/check.hpp"

namespace ch11 {

namespace fs = std::filesystem;

namespace {

/// The flags this program's children must not get again (the supervisor's own), each with
/// its value.
bool supervisor_flag(const std::string& word) {
  for (const char* flag :
       {"--processes", "--mpirun", "--checkpoint-dir", "--attempt", "--first-ranks"})
    if (word == flag || word.rfind(std::string(flag) + "=", 0) == 0) return true;
  return false;
}

/// Runs `command` and waits; its standard output to `out` when given. The exit code (128 +
/// the signal for one that ended it).
int run_and_wait(const std::vector<std::string>& command, const std::string& out) {
  std::vector<char*> argv;
  for (const std::string& word : command) argv.push_back(const_cast<char*>(word.c_str()));
  argv.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("could not start " + command.front());
  if (pid == 0) {
    if (!out.empty()) {
      const int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) ::dup2(fd, 1);
    }
    ::execvp(argv.front(), argv.data());
    std::fprintf(stderr, "ch11_fault_tolerance: could not run %s\n", argv.front());
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace

int supervise(Settings11 s, const std::vector<std::string>& args, bool json) {
  fs::path temporary;  // the checkpoints' folder when --checkpoint-dir is not given
  if (s.dir.empty()) {
    temporary = fs::temp_directory_path() / ("shardlab_ch11_" + std::to_string(::getpid()));
    s.dir = (temporary / "checkpoint").string();
  }
  fs::remove_all(s.dir);
  fs::remove_all(run_folder(s));
  fs::create_directories(run_folder(s));
  std::vector<std::string> launcher;  // --mpirun, word by word
  std::istringstream words(s.mpirun);
  for (std::string w; words >> w;) launcher.push_back(w);
  std::vector<std::string> child;  // this program's flags, less the supervisor's
  for (std::size_t i = 1; i < args.size(); ++i) {
    if (supervisor_flag(args[i])) {
      if (args[i].find('=') == std::string::npos) ++i;  // and its value
      continue;
    }
    child.push_back(args[i]);
  }
  // Each attempt's processes write their flight records as they fail (--flight-dir), for
  // the supervisor to compare, unless the command line keeps them somewhere itself.
  bool own_flights = false;
  for (const std::string& a : args) own_flights = own_flights || a.rfind("--flight-dir", 0) == 0;
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  const std::string captured = run_folder(s) + "/stdout.json";
  std::vector<char> seen;  // the faults already reported
  int processes = s.processes, code = 1;
  for (int attempt = 0;; ++attempt) {
    std::vector<std::string> command = launcher;
    for (const std::string& w : {std::string("-np"), std::to_string(processes), self})
      command.push_back(w);
    command.insert(command.end(), child.begin(), child.end());
    for (const std::string& w :
         {std::string("--checkpoint-dir"), s.dir, std::string("--attempt"), std::to_string(attempt),
          std::string("--first-ranks"), std::to_string(s.processes)})
      command.push_back(w);
    const std::string flights = run_folder(s) + "/flights-" + std::to_string(attempt);
    if (!own_flights) {
      command.push_back("--flight-dir");
      command.push_back(flights);
    }
    code = run_and_wait(command, json ? captured : "");
    if (code == 0 || code == 2) break;  // finished, or a usage error (the job said which)
    if (!own_flights && fs::exists(flights)) try {
        for (const std::string& line : compare_flight_dir(flights).lines)
          std::fprintf(stderr, "ch11_fault_tolerance: flight recorder: %s\n", line.c_str());
      } catch (const shardlab::UsageError&) {  // no process wrote one (killed before it could)
      }
    std::string failure = last_struck(s, seen);
    if (failure.empty()) failure = "the job ended with exit code " + std::to_string(code);
    s.attempt = attempt;
    note_supervised_failure(s, failure);
    if (std::size_t(attempt) >= s.faults.size()) {
      std::fprintf(stderr, "ch11_fault_tolerance: not restarting after: %s\n", failure.c_str());
      break;
    }
    std::string on;
    if (s.elastic) {
      const int fewer = fewer_ranks(s, processes);
      if (fewer == 0) {
        std::fprintf(stderr,
                     "ch11_fault_tolerance: no smaller mesh fits (--elastic keeps every axis "
                     "but dp): not restarting\n");
        break;
      }
      processes = fewer;
      on = " on " + std::to_string(fewer) + " processes";
    }
    std::fprintf(stderr, "ch11_fault_tolerance: restart %d%s after: %s\n", attempt + 1, on.c_str(),
                 failure.c_str());
  }
  if (json && code == 0) {
    std::ifstream in(captured);
    std::cout << in.rdbuf() << std::flush;
  }
  std::error_code ignored;
  fs::remove_all(run_folder(s), ignored);
  if (!temporary.empty()) fs::remove_all(temporary, ignored);
  return code == 0 ? 0 : code == 2 ? 2 : 1;
}

}  // namespace ch11
