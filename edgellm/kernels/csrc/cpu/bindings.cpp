// The Python module: the ops below and nothing else (torch::wrap_pybind_function turns c10 errors,
// e.g. a failed TORCH_CHECK, into Python exceptions).
#include <torch/extension.h>

#include "activation.h"
#include "attention.h"
#include "cascade_attention.h"
#include "decode_layers.h"
#include "logits_head.h"
#include "norm.h"
#include "prefill_attention.h"
#include "qgemm.h"
#include "qgemm_n16.h"
#include "rotary.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", torch::wrap_pybind_function(edgellm::cpu::decode_attention), "decode_attention");
  m.def("decode_layers", torch::wrap_pybind_function(edgellm::cpu::decode_layers), "decode_layers");
  m.def("prefill_attention", torch::wrap_pybind_function(edgellm::cpu::prefill_attention), "prefill_attention");
  m.def("prefill_attention_many", torch::wrap_pybind_function(edgellm::cpu::prefill_attention_many),
        "prefill_attention_many");
  m.def("cascade_attention", torch::wrap_pybind_function(edgellm::cpu::cascade_attention), "cascade_attention");
  m.def("rotate_", torch::wrap_pybind_function(edgellm::cpu::rotate_), "rotate_");
  m.def("silu_mul", torch::wrap_pybind_function(edgellm::cpu::silu_mul), "silu_mul");
  m.def("silu_mul_f32", torch::wrap_pybind_function(edgellm::cpu::silu_mul_f32), "silu_mul_f32");
  m.def("rms_norm", torch::wrap_pybind_function(edgellm::cpu::rms_norm), "rms_norm");
  m.def("layout", &edgellm::cpu::layout, "the fused decode's per-layer layout (decode_layers.h)");
  m.def("int_linear", torch::wrap_pybind_function(edgellm::cpu::int_linear_op), "int_linear");
  m.def("int_linear_n16", torch::wrap_pybind_function(edgellm::cpu::int_linear_n16_op), "int_linear_n16",
        pybind11::arg("x"), pybind11::arg("qweight"), pybind11::arg("scale"), pybind11::arg("offset"),
        pybind11::arg("bits"), pybind11::arg("group"), pybind11::arg("bias"), pybind11::arg("n"),
        pybind11::arg("amx_rows"), pybind11::arg("zero") = -1);
  m.def("n16_variant", []() { return std::string(edgellm::cpu::n16_variant()); },
        "which vpdpbusd the n16 tiles run: avx512-vnni, avx-vnni or scalar");
  m.def("amx_ready", &edgellm::cpu::amx_ready, "whether AMX tiles run in this process");
  m.def("quantize_rows", torch::wrap_pybind_function(edgellm::cpu::quantize_rows), "quantize_rows");
  m.def("int8_argmax_logits", torch::wrap_pybind_function(edgellm::cpu::int8_argmax_logits), "int8_argmax_logits");
}
