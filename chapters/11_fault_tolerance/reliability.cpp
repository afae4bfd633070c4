// Chapter 11's planner (reliability.hpp).
#include "reliability.hpp"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "shardlab/format.hpp"
#include "shardlab/launch.hpp"
#include "shardlab/results.hpp"

namespace ch11 {

const std::vector<Interruption>& llama3_interruptions() {
  // Dubey et al. 2024, "The Llama 3 Herd of Models", Table 5: root-cause categorization
  // of unexpected interruptions during a 54-day period of Llama 3 405B pre-training.
  static const std::vector<Interruption> rows = {
      {"Faulty GPU", "GPU", 148, 30.1},
      {"GPU HBM3 Memory", "GPU", 72, 17.2},
      {"Software Bug", "Dependency", 54, 12.9},
      {"Network Switch/Cable", "Network", 35, 8.4},
      {"Host Maintenance", "Unplanned Maintenance", 32, 7.6},
      {"GPU SRAM Memory", "GPU", 19, 4.5},
      {"GPU System Processor", "GPU", 17, 4.1},
      {"NIC", "Host", 7, 1.7},
      {"NCCL Watchdog Timeouts", "Unknown", 7, 1.7},
      {"Silent Data Corruption", "GPU", 6, 1.4},
      {"GPU Thermal Interface + Sensor", "GPU", 6, 1.4},
      {"SSD", "Host", 3, 0.7},
      {"Power Supply", "Host", 3, 0.7},
      {"Server Chassis", "Host", 2, 0.5},
      {"IO Expansion Board", "Host", 2, 0.5},
      {"Dependency", "Dependency", 2, 0.5},
      {"CPU", "Host", 2, 0.5},
      {"System Memory", "Host", 2, 0.5},
  };
  return rows;
}

double job_mtbf(double device_mtbf, double devices) { return device_mtbf / devices; }

double waste_at_young(double checkpoint, double restart, double mtbf) {
  return std::sqrt(2 * checkpoint / mtbf) + restart / mtbf;
}

double longest_checkpoint(double goodput, double restart, double mtbf) {
  const double left = 1 - goodput - restart / mtbf;  // what the checkpoints may waste
  return left > 0 ? mtbf * left * left / 2 : 0.0;
}

double longest_restart(double goodput, double checkpoint, double mtbf) {
  return std::max(0.0, mtbf * (1 - goodput) - std::sqrt(2 * checkpoint * mtbf));
}

void report_plan(shardlab::Context& ctx) {
  using shardlab::format_number;
  const Llama3Snapshot llama;
  const double job = llama.job_mtbf_hours(), gpu = llama.gpu_mtbf_hours();
  ctx.say("Chapter 11 - the planner: Llama 3's 54-day snapshot (Dubey et al. 2024, §3.3.4): " +
          std::to_string(std::lround(llama.gpus)) + " GPUs, " + std::to_string(llama.unexpected) +
          " unexpected interruptions (and " + std::to_string(llama.planned) +
          " planned): the job failed every " + format_number(job, 3) + " h, one GPU every " +
          std::to_string(std::lround(gpu)) + " h (" + format_number(gpu / (24 * 365.25), 3) +
          " years)");
  ctx.json()["job_mtbf_hours"] = job;
  ctx.json()["gpu_mtbf_hours"] = gpu;

  // Table 5, each printed share against count / 419.
  shardlab::Table table({"component", "category", "count", "printed_%", "counted_%", "agrees"});
  int all = 0, gpus = 0, disagree = 0;
  double printed = 0, printed_gpus = 0;
  for (const Interruption& row : llama3_interruptions()) {
    const double counted = 100.0 * row.count / llama.unexpected;
    const bool agrees = std::abs(std::round(counted * 10) / 10 - row.printed) < 0.05;
    disagree += !agrees;
    table.add(
        {row.component, row.category, row.count, row.printed, counted, agrees ? "yes" : "no"});
    all += row.count;
    printed += row.printed;
    if (row.category == "GPU") {
      gpus += row.count;
      printed_gpus += row.printed;
    }
  }
  const double counted_gpus = 100.0 * gpus / llama.unexpected;
  table.add({"the GPU rows (the text's 58.7 %)", "GPU", gpus, printed_gpus, counted_gpus,
             std::abs(printed_gpus - counted_gpus) < 0.05 ? "yes" : "no"});
  table.add({"all", "", all, printed, 100.0 * all / llama.unexpected, ""});
  ctx.report(table, "table5",
             "\nTable 5 against its own counts (" + std::to_string(all) +
                 " in all): " + std::to_string(disagree) +
                 " printed share(s) differ from count / " + std::to_string(llama.unexpected));
  ctx.json()["table5_disagreements"] = disagree;

  // At Llama 3's rate per GPU: a 1-minute checkpoint and a 10-minute restart as the
  // example, and the longest of each that keeps 90 % and 95 %.
  const double delta = 1, restart = 10;  // minutes (stated assumptions)
  shardlab::Table scale({"gpus", "job_mtbf_h", "young_min", "waste", "ckpt_90_s", "ckpt_90_R_s",
                         "ckpt_95_s", "ckpt_95_R_s", "restart_95_min"});
  for (int n = 1024; n <= 131072; n *= 2) {
    const double m = job_mtbf(gpu, n) * 60;  // minutes
    scale.add({n, m / 60, std::sqrt(2 * delta * m), waste_at_young(delta, restart, m),
               60 * longest_checkpoint(0.90, 0, m), 60 * longest_checkpoint(0.90, restart, m),
               60 * longest_checkpoint(0.95, 0, m), 60 * longest_checkpoint(0.95, restart, m),
               longest_restart(0.95, delta, m)});
  }
  ctx.report(scale, "scale",
             "\nat Llama 3's rate per GPU, checkpointing at Young's interval (first order: waste "
             "= sqrt(2 d / M) + R / M): the job's MTBF; Young's interval and the waste for a "
             "1-minute checkpoint d and a 10-minute restart R; the longest checkpoint that keeps "
             "90 % and 95 % without restart time and with R; the longest restart for 95 % "
             "with d");
}

}  // namespace ch11
