# Layering: the rules and everything below them (every header outside
# batch/ and cuda/, the umbrella kvevict.hpp aside) include nothing of the
# batched API or the CUDA backend, so a rule knows no batch.
#   cmake -DROOT=<source dir> -P check_layering.cmake
file(GLOB_RECURSE headers RELATIVE ${ROOT}/include ${ROOT}/include/kvevict/*.hpp)
set(bad 0)
foreach(h ${headers})
  if(h MATCHES "^kvevict/(batch|cuda)/" OR h STREQUAL "kvevict/kvevict.hpp")
    continue()
  endif()
  file(STRINGS ${ROOT}/include/${h} lines REGEX "#include \"kvevict/(batch|cuda)/")
  foreach(line ${lines})
    message(SEND_ERROR "${h} reaches up into an API: ${line}")
    set(bad 1)
  endforeach()
endforeach()
if(bad)
  message(FATAL_ERROR "layering broken (see above)")
endif()
message(STATUS "layering: no header below the APIs includes batch/ or cuda/")
