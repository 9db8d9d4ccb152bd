// One layer of a weight operand that may stack every layer's along a leading axis
// (jaxinfer/layer_stack.py): a program then passes one buffer per weight instead of one per layer, and
// each call reads its layer in place.
#ifndef JAXINFER_CPU_KERNELS_LAYER_SLICE_H_
#define JAXINFER_CPU_KERNELS_LAYER_SLICE_H_

#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxinfer {

struct LayerSlice {
  const void* data = nullptr;  // the layer's first element
  std::vector<int64_t> dims;   // one layer's dimensions
  bool ok = false;             // rank `rank` with layer 0, or rank + 1 holding `layer`
};

inline LayerSlice SliceLayer(const xla::ffi::AnyBuffer& buffer, size_t rank, int64_t layer) {
  const auto d = buffer.dimensions();
  LayerSlice s;
  const bool stacked = d.size() == rank + 1;
  if ((d.size() != rank && !stacked) || layer < 0 || layer >= (stacked ? d[0] : 1)) return s;
  s.dims.assign(d.begin() + (stacked ? 1 : 0), d.end());
  int64_t elements = 1;
  for (int64_t n : s.dims) elements *= n;
  s.data = static_cast<const char*>(buffer.untyped_data()) +
           layer * elements * static_cast<int64_t>(xla::ffi::ByteWidth(buffer.element_type()));
  s.ok = true;
  return s;
}

}  // namespace jaxinfer

#endif  // JAXINFER_CPU_KERNELS_LAYER_SLICE_H_
