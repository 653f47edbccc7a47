# Runs COMMAND (a ;-list) and fails unless it exits with EXPECT_RC and its
# output (stdout and stderr) contains EXPECT_TEXT. For command-line tests
# that must check both the exit status and the message.
execute_process(COMMAND ${COMMAND} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(all "${out}${err}")
if(NOT rc STREQUAL EXPECT_RC)
  message(FATAL_ERROR "exit status ${rc}, expected ${EXPECT_RC}; output:\n${all}")
endif()
string(FIND "${all}" "${EXPECT_TEXT}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "the output does not contain \"${EXPECT_TEXT}\":\n${all}")
endif()
message(STATUS "exit ${rc}, found \"${EXPECT_TEXT}\"")
