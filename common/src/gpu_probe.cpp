// When "CUDA found no device" means there is no GPU, and when it means a GPU that CUDA
// cannot start (cuda.hpp, start_failure). Host code, in every build.
#include <cstdlib>
#include <filesystem>
#include <regex>
#include <string>

#include "shardlab/cuda.hpp"

namespace shardlab::cuda {

std::string gpu_device_node(const std::string& dev) {
  std::error_code ec;
  const std::regex node("nvidia[0-9]+");
  for (const auto& entry : std::filesystem::directory_iterator(dev, ec))
    if (std::regex_match(entry.path().filename().string(), node)) return entry.path().string();
  return "";
}

std::string start_failure(int error, const std::string& error_text, const std::string& dev) {
  constexpr int no_device = 100;           // cudaErrorNoDevice
  constexpr int insufficient_driver = 35;  // cudaErrorInsufficientDriver
  const std::string node = gpu_device_node(dev);
  if (error == no_device || node.empty()) return "";
  std::string what = "an NVIDIA GPU is present (" + node +
                     ") but CUDA cannot start: " + error_text + " (CUDA error " +
                     std::to_string(error) + "). ";
  if (error == insufficient_driver)
    what +=
        "The driver is older than this build's CUDA runtime needs (CUDA 13: driver r580 or "
        "newer; nvidia-smi shows the driver's version): update the driver, or build with the "
        "toolkit the driver supports.";
  else
    what +=
        "Does nvidia-smi list the GPU? Under AddressSanitizer (the debug preset) CUDA starts "
        "only with ASAN_OPTIONS=protect_shadow_gap=0.";
  return what;
}

int local_rank(int rank) {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
    const char* value = std::getenv(name);
    if (value == nullptr || *value == '\0') continue;
    char* end = nullptr;
    const long local = std::strtol(value, &end, 10);
    if (*end == '\0' && local >= 0 && local <= rank) return static_cast<int>(local);
  }
  return rank;
}

}  // namespace shardlab::cuda
