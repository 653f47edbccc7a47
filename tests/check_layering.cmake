# Layering, three floors:
#   1. the rules and everything below them (every header but those of 2 and
#      3): they include nothing of floors 2 and 3, so a rule knows no batch;
#   2. the batched API and the CUDA backend (batch/, cuda/): they include
#      nothing of floor 3;
#   3. the per-sequence policies, a facade over the batched host backend
#      (sequence/, the policy classes and policy_base.hpp under policy/),
#      and the umbrellas kvevict.hpp and cuda/kvevict_cuda.cuh.
#   cmake -DROOT=<source dir> -P check_layering.cmake
file(GLOB_RECURSE headers RELATIVE ${ROOT}/include ${ROOT}/include/kvevict/*.hpp ${ROOT}/include/kvevict/*.cuh)
set(api "^kvevict/(batch|cuda)/")
set(facade "^kvevict/(sequence/|policy/(policy_base|h2o|recent_window|random|exact_greedy)\\.hpp$|kvevict\\.hpp$|cuda/kvevict_cuda\\.cuh$)")
set(bad 0)
foreach(h ${headers})
  if(h MATCHES "${facade}")
    continue()
  endif()
  file(STRINGS ${ROOT}/include/${h} lines REGEX "#include \"kvevict/")
  foreach(line ${lines})
    string(REGEX REPLACE ".*#include \"([^\"]+)\".*" "\\1" target "${line}")
    if(target MATCHES "${facade}")
      message(SEND_ERROR "${h} reaches up into the per-sequence policies: ${line}")
      set(bad 1)
    elseif(NOT h MATCHES "${api}" AND target MATCHES "${api}")
      message(SEND_ERROR "${h} (a rule) reaches up into an API: ${line}")
      set(bad 1)
    endif()
  endforeach()
endforeach()
if(bad)
  message(FATAL_ERROR "layering broken (see above)")
endif()
message(STATUS "layering: rules < batched API and CUDA backend < per-sequence policies")
