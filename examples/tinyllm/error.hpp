#pragma once
// The one exception type of tinyllm's file readers: the input (a GGUF file, a
// tensor, a tokenizer table) is malformed or uses something we do not support.
// Messages name the offending key, tensor or byte offset.
#include <stdexcept>

namespace tinyllm {

class format_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace tinyllm
