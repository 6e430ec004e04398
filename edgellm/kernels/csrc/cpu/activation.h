// SiLU-and-mul (activation.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace edgellm::cpu {

at::Tensor silu_mul(at::Tensor gu);
at::Tensor silu_mul_f32(at::Tensor gu);

}  // namespace edgellm::cpu
