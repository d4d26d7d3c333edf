// fusion_perf: one data-parallel training step's gradient reduction, as a framework does it,
// with tensor fusion on and off.
//
// The gradients are those of real models, generated here from their layer definitions: ResNet-50
// and ResNet-101 (bottleneck blocks of 1x1, 3x3 and 1x1 convolutions without bias, batch norm
// scale and shift after each, a projection shortcut in the first block of each stage, a 1000-way
// classifier), VGG-16 (thirteen 3x3 convolutions with bias, three fully connected layers) and
// BERT-base (token, position and segment embeddings and their LayerNorm, twelve encoder layers of
// query, key, value, attention output, two LayerNorms and the 3072-wide feed-forward, a pooler).
// Each step submits every gradient with kolo_allreduce_async (in place, float32, average) in
// backward order, last layer first, as soon as "backward" reaches it (at once: no compute is
// simulated), then waits for them all. Buffers are allocated and touched once, before timing.
//
// For each model the step is timed with fusion on (the threshold given, KOLO_FUSION_THRESHOLD by
// default), with fusion off (threshold 0: one collective per tensor, still negotiated by the
// engine), and, for reference, with ordered calls (one blocking kolo_allreduce per tensor, no
// engine). The modes take turns step by step. A step's time is the slowest rank's; the table
// shows the median over the measured steps, the effective bus bandwidth (gradient bytes / time *
// 2(N-1)/N, as nccl-tests computes it for allreduce) and the speedup of fusion. Run it with
// kolorun:
//
//   kolorun -np 4 build/bench/fusion_perf [--model resnet50,vgg16] [--steps 5] [--warmup 2]
//
// --autotune (with KOLO_AUTOTUNE=1) measures what the autotuner settles on instead: fused steps
// only, the threshold left to the tuner, run until every rank has the tuner's final settings
// (at most --max-tuning-steps), then the measured steps; the table shows the settled step time and
// the settings. --fused-only leaves out the unfused and ordered columns, for a sweep of fixed
// settings (bench/autotune_sweep.sh runs both and compares).
//
// --bound adds a fourth mode, taking its turn with the others: one in-place kolo_allreduce of a
// buffer as large as all of the model's gradients together, the bound a fused step is measured
// against (bench/fusion_bound.sh). Its median goes in a last column, "bound".
//
// --breakdown adds, for each model, where each mode's step went on the ranks' own clocks: inside
// collectives, copying into and out of the fusion buffer, in negotiation cycles (the engine's
// counters, kolo_fusion_stats_t), and the rest (submitting, the engine's own work between
// collectives, threads waking and waiting for a CPU, the requests' waits); for ordered calls the
// time inside kolo_allreduce and the rest. A last column shows the part of the step the application
// spent in the submitting calls (kolo_allreduce_async), which the engine's thread may overlap with
// its own work (so it is a part of the step, not of "other" alone). Each rank's step time and parts
// are averaged over the ranks, then the median over the steps is shown for each column.
//
// --skew-ms D makes the last rank start every step D ms after the others (in every mode: its
// backward pass ends later, as one rank's often does), so that the step shows what waiting for a
// late rank costs beyond the wait itself.
//
// --list-gradients prints the chosen models' gradients instead (model, name and float32 element
// count, tab-separated, in forward order) and exits without joining a job, so that other tools
// (bench/scaling_model.py) read the same shapes rather than defining the layers again.
#include <fmt/format.h>
#include <kolo.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "perf_common.hpp"

namespace {

struct Gradient {
  std::string name;
  uint64_t count;
};

struct Model {
  std::string name;
  std::vector<Gradient> gradients;  // in forward (definition) order
};

void add(Model& model, std::string name, uint64_t count) {
  model.gradients.push_back({std::move(name), count});
}

void add_batch_norm(Model& model, const std::string& name, uint64_t channels) {
  add(model, name + ".weight", channels);
  add(model, name + ".bias", channels);
}

// torchvision's ResNet with Bottleneck blocks (expansion 4).
Model resnet(const std::string& name, const std::vector<int>& blocks_per_stage) {
  Model model{name, {}};
  add(model, "conv1.weight", 64ull * 3 * 7 * 7);
  add_batch_norm(model, "bn1", 64);
  uint64_t in = 64;
  for (size_t stage = 0; stage < blocks_per_stage.size(); ++stage) {
    const uint64_t planes = 64ull << stage;
    const uint64_t out = planes * 4;
    for (int block = 0; block < blocks_per_stage[stage]; ++block) {
      const std::string prefix = fmt::format("layer{}.{}", stage + 1, block);
      add(model, prefix + ".conv1.weight", planes * in);
      add_batch_norm(model, prefix + ".bn1", planes);
      add(model, prefix + ".conv2.weight", planes * planes * 3 * 3);
      add_batch_norm(model, prefix + ".bn2", planes);
      add(model, prefix + ".conv3.weight", out * planes);
      add_batch_norm(model, prefix + ".bn3", out);
      if (block == 0) {
        add(model, prefix + ".downsample.0.weight", out * in);
        add_batch_norm(model, prefix + ".downsample.1", out);
      }
      in = out;
    }
  }
  add(model, "fc.weight", 1000 * in);
  add(model, "fc.bias", 1000);
  return model;
}

// torchvision's VGG-16 (configuration D, without batch norm).
Model vgg16() {
  Model model{"vgg16", {}};
  const int layers[] = {64, 64,  0,   128, 128, 0,   256, 256, 256,
                        0,  512, 512, 512, 0,   512, 512, 512, 0};
  uint64_t in = 3;
  int index = 0;
  for (int out : layers) {
    if (out != 0) {
      add(model, fmt::format("features.{}.weight", index), static_cast<uint64_t>(out) * in * 9);
      add(model, fmt::format("features.{}.bias", index), static_cast<uint64_t>(out));
      in = static_cast<uint64_t>(out);
      index += 2;  // each convolution is followed by a ReLU
    } else {
      index += 1;  // max pooling
    }
  }
  const uint64_t widths[] = {512 * 7 * 7, 4096, 4096, 1000};
  for (int i = 0; i < 3; ++i) {
    add(model, fmt::format("classifier.{}.weight", 3 * i), widths[i + 1] * widths[i]);
    add(model, fmt::format("classifier.{}.bias", 3 * i), widths[i + 1]);
  }
  return model;
}

// Hugging Face's BertModel, bert-base-uncased sizes.
Model bert_base() {
  Model model{"bert-base", {}};
  const uint64_t hidden = 768, intermediate = 3072, vocabulary = 30522, positions = 512;
  auto dense = [&](const std::string& name, uint64_t in, uint64_t out) {
    add(model, name + ".weight", out * in);
    add(model, name + ".bias", out);
  };
  auto layer_norm = [&](const std::string& name) {
    add(model, name + ".weight", hidden);
    add(model, name + ".bias", hidden);
  };
  add(model, "embeddings.word_embeddings.weight", vocabulary * hidden);
  add(model, "embeddings.position_embeddings.weight", positions * hidden);
  add(model, "embeddings.token_type_embeddings.weight", 2 * hidden);
  layer_norm("embeddings.LayerNorm");
  for (int layer = 0; layer < 12; ++layer) {
    const std::string prefix = fmt::format("encoder.layer.{}", layer);
    dense(prefix + ".attention.self.query", hidden, hidden);
    dense(prefix + ".attention.self.key", hidden, hidden);
    dense(prefix + ".attention.self.value", hidden, hidden);
    dense(prefix + ".attention.output.dense", hidden, hidden);
    layer_norm(prefix + ".attention.output.LayerNorm");
    dense(prefix + ".intermediate.dense", hidden, intermediate);
    dense(prefix + ".output.dense", intermediate, hidden);
    layer_norm(prefix + ".output.LayerNorm");
  }
  dense("pooler.dense", hidden, hidden);
  return model;
}

Model model_named(const std::string& name) {
  if (name == "resnet50") return resnet("resnet50", {3, 4, 6, 3});
  if (name == "resnet101") return resnet("resnet101", {3, 4, 23, 3});
  if (name == "vgg16") return vgg16();
  if (name == "bert-base") return bert_base();
  std::fprintf(stderr, "fusion_perf: unknown model %s (resnet50, resnet101, vgg16, bert-base)\n",
               name.c_str());
  std::exit(2);
}

void check(kolo_comm_t comm, kolo_status_t status, const char* what) {
  if (status != KOLO_SUCCESS) {
    std::fprintf(stderr, "fusion_perf: %s: %s: %s\n", what, kolo_status_string(status),
                 kolo_comm_last_error(comm));
    std::exit(1);
  }
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// kTuned: fused, with the threshold left to the autotuner. kBound: one allreduce of every
// gradient's bytes at once.
enum class Mode { kFused, kUnfused, kOrdered, kTuned, kBound };

kolo_fusion_stats_t fusion_stats(kolo_comm_t comm) {
  kolo_fusion_stats_t stats{};  // every counter zero
  stats.struct_size = sizeof(stats);
  check(comm, kolo_comm_fusion_stats(comm, &stats), "kolo_comm_fusion_stats");
  return stats;
}

struct StepResult {
  double seconds = 0;        // the slowest rank's
  uint64_t collectives = 0;  // the engine ran on this rank
  // --breakdown: this rank's own step and its parts (fusion_stats' times, or for ordered calls
  // the time inside kolo_allreduce), then averaged over the ranks.
  double own = 0, in_collectives = 0, copying = 0, negotiating = 0;
  double submitting = 0;  // in kolo_allreduce_async (fused and unfused)
};

double seconds_of(uint64_t nanoseconds) {
  return static_cast<double>(nanoseconds) / 1e9;
}

// One step: every gradient submitted in backward order, then all waited for; for kBound, `whole`
// reduced in one call instead. This rank starts `late_s` after the others (--skew-ms).
StepResult run_step(kolo_comm_t comm, const Model& model, std::vector<std::vector<float>>& buffers,
                    std::vector<float>& whole, std::vector<kolo_request_t>& requests, Mode mode,
                    uint64_t threshold, bool breakdown, double late_s) {
  if (mode != Mode::kTuned && mode != Mode::kBound) {
    check(comm, kolo_comm_set_fusion_threshold(comm, mode == Mode::kFused ? threshold : 0),
          "kolo_comm_set_fusion_threshold");
  }
  const kolo_fusion_stats_t before = fusion_stats(comm);
  check(comm, kolo_barrier(comm), "kolo_barrier");
  StepResult result;
  auto start = std::chrono::steady_clock::now();
  if (late_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(late_s));
  if (mode == Mode::kBound) {
    check(comm,
          kolo_allreduce(comm, whole.data(), whole.data(), whole.size(), KOLO_FLOAT32, KOLO_AVG),
          "kolo_allreduce");
  }
  // Backward order: the last layer's gradients are ready first.
  const auto submitting = std::chrono::steady_clock::now();
  for (size_t i = mode == Mode::kBound ? 0 : model.gradients.size(); i-- > 0;) {
    const Gradient& gradient = model.gradients[i];
    float* data = buffers[i].data();
    if (mode == Mode::kOrdered) {
      const auto call = breakdown ? std::chrono::steady_clock::now() : start;
      check(comm, kolo_allreduce(comm, data, data, gradient.count, KOLO_FLOAT32, KOLO_AVG),
            "kolo_allreduce");
      if (breakdown) result.in_collectives += seconds_since(call);
    } else {
      check(comm,
            kolo_allreduce_async(comm, gradient.name.c_str(), data, data, gradient.count,
                                 KOLO_FLOAT32, KOLO_AVG, nullptr, &requests[i]),
            "kolo_allreduce_async");
    }
  }
  if (mode != Mode::kOrdered && mode != Mode::kBound) {
    if (breakdown) result.submitting = seconds_since(submitting);
    for (kolo_request_t& request : requests) {
      kolo_status_t status = kolo_request_wait(request);
      if (status != KOLO_SUCCESS) {
        std::fprintf(stderr, "fusion_perf: a request failed: %s\n",
                     kolo_request_last_error(request));
        std::exit(1);
      }
      kolo_request_free(request);
    }
  }
  result.seconds = seconds_since(start);
  result.own = result.seconds;
  check(comm, kolo_allreduce(comm, &result.seconds, &result.seconds, 1, KOLO_FLOAT64, KOLO_MAX),
        "kolo_allreduce");
  const kolo_fusion_stats_t after = fusion_stats(comm);
  result.collectives = after.collectives - before.collectives;
  if (breakdown) {
    if (mode != Mode::kOrdered && mode != Mode::kBound) {
      result.in_collectives = seconds_of(after.collective_ns - before.collective_ns);
      result.copying = seconds_of(after.copy_ns - before.copy_ns);
      result.negotiating = seconds_of(after.negotiation_ns - before.negotiation_ns);
    }
    double parts[5] = {result.own, result.in_collectives, result.copying, result.negotiating,
                       result.submitting};
    check(comm, kolo_allreduce(comm, parts, parts, 5, KOLO_FLOAT64, KOLO_AVG), "kolo_allreduce");
    result.own = parts[0];
    result.in_collectives = parts[1];
    result.copying = parts[2];
    result.negotiating = parts[3];
    result.submitting = parts[4];
  }
  return result;
}

// NaN for a mode that did not run (--fused-only), printed as such.
double median(std::vector<double> values) {
  if (values.empty()) return std::nan("");
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// --breakdown's rows: per mode the medians over the steps of each rank-averaged part, in ms, and
// of what the parts leave of the step.
void print_breakdown(const std::string& model, const std::vector<std::vector<StepResult>>& parts) {
  fmt::print(
      "# {:<10} where a step went, ms: each rank's own clock, mean over the ranks, median "
      "over the steps\n",
      model);
  fmt::print("# {:<10} {:>9} {:>11} {:>9} {:>11} {:>9} {:>10}\n", "mode", "step", "collectives",
             "copying", "negotiating", "other", "submitting");
  const char* names[] = {"fused", "unfused", "ordered"};
  for (int mode = 0; mode < 3; ++mode) {
    const std::vector<StepResult>& steps = parts[mode];
    if (steps.empty()) continue;
    auto column = [&](auto part) {
      std::vector<double> values;
      for (const StepResult& step : steps) values.push_back(part(step) * 1e3);
      return median(values);
    };
    const bool engine = mode != 2;
    auto shown = [&](double ms) { return engine ? fmt::format("{:.2f}", ms) : std::string("-"); };
    fmt::print("# {:<10} {:>9.2f} {:>11.2f} {:>9} {:>11} {:>9.2f} {:>10}\n", names[mode],
               column([](const StepResult& step) { return step.own; }),
               column([](const StepResult& step) { return step.in_collectives; }),
               shown(column([](const StepResult& step) { return step.copying; })),
               shown(column([](const StepResult& step) { return step.negotiating; })),
               column([](const StepResult& step) {
                 return step.own - step.in_collectives - step.copying - step.negotiating;
               }),
               shown(column([](const StepResult& step) { return step.submitting; })));
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fusion_perf: a training step's gradient allreduce, with tensor fusion on and off"};
  std::string models = "resnet50,resnet101,vgg16,bert-base";
  int steps = 5, warmup = 2;
  std::string threshold_text;
  bool skip_ordered = false;
  bool verify = false;
  bool list_gradients = false;
  std::string max_tensor_text;
  bool autotune = false, fused_only = false, bound = false, breakdown = false;
  int max_tuning_steps = 2000;
  double skew_ms = 0;
  app.add_option("-m,--model", models,
                 "models, comma-separated: resnet50, resnet101, vgg16, "
                 "bert-base")
      ->capture_default_str();
  app.add_option("-n,--steps", steps, "measured steps per mode")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("-w,--warmup", warmup, "warm-up steps per mode")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("-t,--threshold", threshold_text,
                 "fusion threshold in bytes when fused (default: KOLO_FUSION_THRESHOLD or 64M)")
      ->check(kolo::bench::size_error);
  app.add_flag("--no-ordered", skip_ordered, "skip the ordered-calls column");
  CLI::Option* autotune_flag = app.add_flag(
      "--autotune", autotune,
      "with KOLO_AUTOTUNE=1: fused steps until the autotuner settles, then the measured "
      "steps under its settings");
  app.add_option("--max-tuning-steps", max_tuning_steps,
                 "--autotune: give up when the tuner has not settled after this many steps")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_flag("--fused-only", fused_only, "fused steps only (for a sweep of fixed settings)");
  app.add_flag("--bound", bound,
               "also time one in-place allreduce of all the gradients' bytes, in turn with the "
               "other modes (last column)")
      ->excludes(autotune_flag);  // --autotune times only tuned steps
  app.add_flag("--breakdown", breakdown,
               "also print where each mode's step went: inside collectives, copying, "
               "negotiating, the rest, and the part spent submitting (each rank's own clock, mean "
               "over the ranks)")
      ->excludes(autotune_flag);
  app.add_option("--max-tensor-bytes", max_tensor_text,
                 "keep only the gradients smaller than this (K/M/G suffixes): the latency-bound "
                 "part of a model")
      ->check(kolo::bench::size_error);
  app.add_option("--skew-ms", skew_ms,
                 "the last rank starts every step this many ms after the others, in every mode")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("-c,--check", verify,
               "check every element after each mode (every rank starts with rank + 1, so the "
               "average is (N + 1) / 2 whatever the number of steps)");
  app.add_flag("--list-gradients", list_gradients,
               "print each model's gradients (model, name, elements; tab-separated, forward "
               "order) and exit without joining a job");
  CLI11_PARSE(app, argc, argv);
  if (fused_only) skip_ordered = true;

  uint64_t threshold = 64ull << 20;
  std::string threshold_source = threshold_text;
  if (threshold_source.empty() && std::getenv("KOLO_FUSION_THRESHOLD")) {
    threshold_source = std::getenv("KOLO_FUSION_THRESHOLD");
  }
  if (!threshold_source.empty()) {
    auto parsed = kolo::bench::parse_size(threshold_source);
    if (!parsed) {
      std::fprintf(stderr, "fusion_perf: KOLO_FUSION_THRESHOLD: %s\n",
                   kolo::bench::size_error(threshold_source).c_str());
      return 2;
    }
    threshold = *parsed;
  }
  const uint64_t max_tensor_bytes =
      max_tensor_text.empty() ? ~uint64_t{0} : *kolo::bench::parse_size(max_tensor_text);

  std::vector<std::string> names;
  for (size_t at = 0; at <= models.size();) {
    size_t comma = models.find(',', at);
    if (comma == std::string::npos) comma = models.size();
    if (comma > at) names.push_back(models.substr(at, comma - at));
    at = comma + 1;
  }
  if (list_gradients) {
    for (const std::string& name : names) {
      for (const Gradient& gradient : model_named(name).gradients) {
        fmt::print("{}\t{}\t{}\n", name, gradient.name, gradient.count);
      }
    }
    return 0;
  }

  kolo_comm_t comm;
  check(nullptr, kolo_comm_init(nullptr, &comm), "kolo_comm_init");
  int rank = 0, size = 1;
  kolo_comm_rank(comm, &rank);
  kolo_comm_size(comm, &size);
  const double late_s = rank == size - 1 ? skew_ms / 1e3 : 0.0;

  const char* cycle = std::getenv("KOLO_CYCLE_TIME_MS");
  const char* timeline = std::getenv("KOLO_TIMELINE");
  const char* tuning = std::getenv("KOLO_AUTOTUNE");
  if (autotune && (tuning == nullptr || std::string(tuning) != "1")) {
    std::fprintf(stderr, "fusion_perf: --autotune needs KOLO_AUTOTUNE=1\n");
    return 2;
  }
  if (autotune && rank == 0) {
    fmt::print(
        "# fusion_perf --autotune: {} ranks, {} steps after the tuner settles, float32 "
        "average\n",
        size, steps);
    fmt::print(
        "# time: the slowest rank's step, median; tuning: steps and seconds until every "
        "rank had the final settings\n#\n");
    fmt::print("# {:<10} {:>7} {:>9} | {:>9} {:>7} {:>6} | {:>6} {:>8} | {:>10} {:>8} {:>9}\n",
               "model", "tensors", "MB", "tuned ms", "busbw", "colls", "steps", "tuning s",
               "threshold", "cycle ms", "segment");
  } else if (rank == 0) {
    fmt::print(
        "# fusion_perf: {} ranks, fusion threshold {} MiB, cycle {} ms, {} steps after {} "
        "warm-up, float32 average{}{}\n",
        size, threshold / double(1 << 20), cycle ? cycle : "5", steps, warmup,
        timeline ? ", timeline on" : "",
        skew_ms > 0 ? fmt::format(", rank {} {} ms late each step", size - 1, skew_ms) : "");
    fmt::print(
        "# time: the slowest rank's step, median; busbw: gradient bytes / time * 2(N-1)/N\n");
    fmt::print("#\n");
    fmt::print(
        "# {:<10} {:>7} {:>9} | {:>9} {:>7} {:>6} | {:>9} {:>7} {:>6} | {:>7} | {:>9} "
        "{:>7}{}\n",
        "model", "tensors", "MB", "fused ms", "busbw", "colls", "unfused", "busbw", "colls",
        "speedup", "ordered", "busbw", bound ? fmt::format(" | {:>9}", "bound ms") : "");
  }
  const double bus_factor = size > 1 ? 2.0 * (size - 1) / size : 1.0;
  for (const std::string& name : names) {
    Model model = model_named(name);
    if (max_tensor_bytes != ~uint64_t{0}) {
      std::erase_if(model.gradients, [&](const Gradient& gradient) {
        return gradient.count * 4 >= max_tensor_bytes;
      });
      model.name += "<" + max_tensor_text;
    }
    uint64_t elements = 0;
    std::vector<std::vector<float>> buffers;
    for (const Gradient& gradient : model.gradients) {
      buffers.emplace_back(gradient.count, 1.0f + rank);  // allocated and touched once
      elements += gradient.count;
    }
    const double bytes = elements * 4.0;
    std::vector<float> whole(bound ? elements : 0, 1.0f + rank);  // allocated and touched once
    auto busbw = [&](double seconds) { return bytes / seconds * bus_factor / 1e9; };
    auto check_values = [&](const char* mode) {
      if (!verify) return;
      const float expected = (size + 1) / 2.0f;
      for (size_t i = 0; i < buffers.size(); ++i) {
        for (float value : buffers[i]) {
          if (value != expected) {
            std::fprintf(stderr, "fusion_perf: rank %d: %s %s: %s holds %g instead of %g\n", rank,
                         model.name.c_str(), mode, model.gradients[i].name.c_str(), value,
                         expected);
            std::exit(1);
          }
        }
      }
      for (size_t i = 0; i < whole.size(); ++i) {
        if (whole[i] != expected) {
          std::fprintf(stderr,
                       "fusion_perf: rank %d: %s bound: element %zu of the one allreduce holds %g "
                       "instead of %g\n",
                       rank, model.name.c_str(), i, whole[i], expected);
          std::exit(1);
        }
      }
    };
    // The modes take turns step by step, so that a machine whose load changes treats them alike.
    std::vector<Mode> modes = {Mode::kFused, Mode::kUnfused};
    if (!skip_ordered) modes.push_back(Mode::kOrdered);
    if (fused_only) modes = {Mode::kFused};
    if (bound) modes.push_back(Mode::kBound);
    std::vector<std::vector<double>> times(5);
    std::vector<std::vector<StepResult>> parts(5);
    std::vector<double> collectives(5, 0);
    std::vector<kolo_request_t> requests(model.gradients.size());
    if (autotune) {
      // Until every rank has the final settings (the tuner on rank 0 sends them to all).
      int tuning_steps = 0;
      const auto tuning_start = std::chrono::steady_clock::now();
      for (int64_t settled = 0; !settled; ++tuning_steps) {
        if (tuning_steps == max_tuning_steps) {
          std::fprintf(stderr, "fusion_perf: the autotuner did not settle in %d steps\n",
                       max_tuning_steps);
          return 1;
        }
        run_step(comm, model, buffers, whole, requests, Mode::kTuned, threshold, false, late_s);
        int64_t mine = fusion_stats(comm).autotune_settled ? 1 : 0;
        check(comm, kolo_allreduce(comm, &mine, &settled, 1, KOLO_INT64, KOLO_MIN),
              "kolo_allreduce");
      }
      const double tuning_seconds = seconds_since(tuning_start);
      std::vector<double> tuned;
      double tuned_collectives = 0;
      for (int step = 0; step < steps; ++step) {
        StepResult result =
            run_step(comm, model, buffers, whole, requests, Mode::kTuned, threshold, false, late_s);
        tuned.push_back(result.seconds);
        tuned_collectives += static_cast<double>(result.collectives) / steps;
      }
      check_values("autotuned");
      const kolo_fusion_stats_t stats = fusion_stats(comm);
      if (rank == 0) {
        const double time = median(tuned);
        fmt::print(
            "  {:<10} {:>7} {:>9.1f} | {:>9.1f} {:>7.2f} {:>6.1f} | {:>6} {:>8.1f} | {:>10} "
            "{:>8} {:>9}\n",
            model.name, model.gradients.size(), bytes / 1e6, time * 1e3, busbw(time),
            tuned_collectives, tuning_steps, tuning_seconds, stats.fusion_threshold,
            stats.cycle_time_ms, stats.segment_bytes);
        std::fflush(stdout);
      }
      continue;
    }
    for (int step = 0; step < warmup + steps; ++step) {
      for (Mode mode : modes) {
        StepResult result =
            run_step(comm, model, buffers, whole, requests, mode, threshold, breakdown, late_s);
        if (step < warmup) continue;
        times[static_cast<int>(mode)].push_back(result.seconds);
        parts[static_cast<int>(mode)].push_back(result);
        collectives[static_cast<int>(mode)] += static_cast<double>(result.collectives) / steps;
      }
    }
    check_values(skip_ordered ? "fused and unfused" : "fused, unfused and ordered");  // and bound
    if (verify && breakdown) {
      // Collectives and copies lie inside the step on every rank; fused steps copy, unfused never;
      // the engine's modes spend some of the step submitting, ordered calls none.
      for (int mode = 0; mode < 3; ++mode) {
        for (const StepResult& step : parts[mode]) {
          const bool fused = mode == 0 && step.collectives < model.gradients.size();
          if (step.in_collectives + step.copying > step.own || (fused && step.copying <= 0) ||
              (mode != 0 && step.copying != 0) || step.submitting > step.own ||
              (mode == 2) != (step.submitting == 0)) {
            std::fprintf(stderr,
                         "fusion_perf: rank %d: %s: a step's breakdown does not add up (mode %d, "
                         "step %g s, collectives %g s, copying %g s, submitting %g s, %llu "
                         "collectives)\n",
                         rank, model.name.c_str(), mode, step.own, step.in_collectives,
                         step.copying, step.submitting,
                         static_cast<unsigned long long>(step.collectives));
            std::exit(1);
          }
        }
      }
    }
    const double fused = median(times[0]), unfused = median(times[1]);
    const double ordered = skip_ordered ? 0 : median(times[2]);
    if (rank == 0) {
      fmt::print(
          "  {:<10} {:>7} {:>9.1f} | {:>9.1f} {:>7.2f} {:>6.1f} | {:>9.1f} {:>7.2f} {:>6.1f} "
          "| {:>6.2f}x | {:>9} {:>7}{}\n",
          model.name, model.gradients.size(), bytes / 1e6, fused * 1e3, busbw(fused),
          collectives[0], unfused * 1e3, busbw(unfused), collectives[1], unfused / fused,
          skip_ordered ? "-" : fmt::format("{:.1f}", ordered * 1e3),
          skip_ordered ? "-" : fmt::format("{:.2f}", busbw(ordered)),
          bound ? fmt::format(" | {:>9.1f}", median(times[4]) * 1e3) : "");
      if (breakdown) print_breakdown(model.name, parts);
      std::fflush(stdout);
    }
  }
  check(comm, kolo_comm_destroy(comm), "kolo_comm_destroy");
  return 0;
}
