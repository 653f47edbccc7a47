#pragma once
// Everything kvevict offers on CUDA (needs nvcc; host-only code includes
// kvevict/kvevict.hpp instead). Link the CMake target kvevict::cuda.
#include "kvevict/kvevict.hpp"

#include "kvevict/cuda/append.cuh"
#include "kvevict/cuda/batched_policy.cuh"
#include "kvevict/cuda/device_helpers.cuh"
#include "kvevict/cuda/error.cuh"
#include "kvevict/cuda/evict_to.cuh"
#include "kvevict/cuda/exact_greedy.cuh"
#include "kvevict/cuda/leave_one_out.cuh"
#include "kvevict/cuda/multi_token.cuh"
#include "kvevict/cuda/observe_evict.cuh"
#include "kvevict/cuda/prefill.cuh"
#include "kvevict/cuda/prefill_compact.cuh"
#include "kvevict/cuda/prefill_key_diff.cuh"
#include "kvevict/cuda/prefill_scores.cuh"
#include "kvevict/cuda/prefill_window.cuh"
#include "kvevict/cuda/prefill_workspace.cuh"
#include "kvevict/cuda/query_tile.cuh"
#include "kvevict/cuda/radix_select.cuh"
#include "kvevict/cuda/segmented_select.cuh"
#include "kvevict/cuda/state.cuh"
