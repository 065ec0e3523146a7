// Where the calling thread's OpenMP team runs: one team thread bound to each given core (vLLM's
// VLLM_CPU_OMP_THREADS_BIND does the same). Under libgomp the team belongs to the thread that starts the
// parallel region, and the same pool threads serve its later regions of that size, so binding them once
// here holds for every op the calling thread runs afterwards (torch's and these kernels' alike: one libgomp).

#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace shardserve {

// Binds team thread i (the caller is thread 0) to cpus[i]; returns the core each thread runs on afterwards.
std::vector<int64_t> bind_omp_threads(const std::vector<int64_t>& cpus) {
  const int n = static_cast<int>(cpus.size());
  TORCH_CHECK(n > 0, "bind_omp_threads: no cores given");
  for (const int64_t cpu : cpus) {
    TORCH_CHECK(cpu >= 0 && cpu < CPU_SETSIZE, "bind_omp_threads: core ", cpu, " is not a core number");
  }
  omp_set_num_threads(n);
  std::vector<int64_t> running_on(n, -1);
  std::vector<int> errors(n, 0);
#pragma omp parallel num_threads(n)
  {
    const int t = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[t]), &set);
    errors[t] = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    running_on[t] = sched_getcpu();
  }
  for (int t = 0; t < n; ++t) {
    TORCH_CHECK(errors[t] == 0, "bind_omp_threads: core ", cpus[t], " refused (errno ", errors[t],
                "): is it outside this process's cpuset?");
  }
  return running_on;
}

}  // namespace shardserve
