// A data-parallel step in miniature with kolo.hpp: every rank averages a gradient vector with
// the others (allreduce) and takes the model's weights from rank 0 (broadcast), then checks both
// against what they must be. Run it with any launcher, e.g. `kolorun -np 4 ./allreduce_broadcast`.
#include <kolo.hpp>

#include <cstdio>
#include <vector>

int main() {
  try {
    kolo::Comm world;  // joins the job from the environment that the launcher set
    const int rank = world.rank();
    const int size = world.size();

    // Rank r's gradient is r + i at element i; the average over ranks is (size - 1) / 2 + i.
    std::vector<double> gradient(1000);
    for (size_t i = 0; i < gradient.size(); ++i) gradient[i] = rank + static_cast<double>(i);
    world.allreduce(gradient, KOLO_AVG);  // in place; the dtype (float64) comes from the type

    // Rank 0's weights go to every rank.
    std::vector<float> weights(256, rank == 0 ? 0.5f : -1.0f);
    world.broadcast(weights, 0);

    int wrong = 0;
    for (size_t i = 0; i < gradient.size(); ++i) {
      wrong += gradient[i] != (size - 1) / 2.0 + static_cast<double>(i);
    }
    for (float weight : weights) wrong += weight != 0.5f;
    std::printf("rank %d of %d: %s\n", rank, size, wrong == 0 ? "ok" : "WRONG");
    return wrong == 0 ? 0 : 1;
  } catch (const kolo::Exception& error) {  // the status and kolo's message
    std::fprintf(stderr, "allreduce_broadcast: %s\n", error.what());
    return 1;
  }
}
