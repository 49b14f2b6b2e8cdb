// Compiled launcher of prepared decode calls (flashquant_hf/kernels/decode_launcher.py builds it with
// torch.utils.cpp_extension). The Python wrappers prepare a call the first time they see its signature (shapes,
// strides, dtypes and devices of the tensors, and the other arguments) and register it here: its kernel launches
// with every parameter but the pointers written. A later call of the same signature then costs one pass over the
// tensors' metadata, the output allocations and the launches, without the Python work in between.
#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/utils/pybind.h>

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

// The few driver API types the launches use (the driver is opened at run time, so cuda.h is not needed to build).
using CUresult = int;
using CUfunction = void*;
using CUstream = void*;
struct LaunchAttribute {  // CUlaunchAttribute
  int id;
  char pad[4];
  union {
    char bytes[64];
    int flag;
  } value;
};
struct LaunchConfig {  // CUlaunchConfig
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_mem;
  CUstream stream;
  LaunchAttribute* attrs;
  unsigned num_attrs;
};
constexpr int kProgrammaticStreamSerialization = 6;  // CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION

struct Driver {
  CUresult (*launch_ex)(const LaunchConfig*, CUfunction, void**, void**) = nullptr;
  CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                     void**, void**) = nullptr;
  CUresult (*is_capturing)(CUstream, int*) = nullptr;

  Driver() {
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) return;
    launch_ex = reinterpret_cast<decltype(launch_ex)>(dlsym(library, "cuLaunchKernelEx"));
    launch = reinterpret_cast<decltype(launch)>(dlsym(library, "cuLaunchKernel"));
    is_capturing = reinterpret_cast<decltype(is_capturing)>(dlsym(library, "cuStreamIsCapturing"));
  }
};

const Driver& driver() {
  static const Driver instance;
  return instance;
}

// One kernel launch: its parameter array (one 8-byte slot per argument, as flashquant_hf.kernels.loader.ArgBlock
// lays it out) and the slots a call rewrites with its pointers, in order.
struct KernelLaunch {
  CUfunction function = nullptr;
  unsigned grid[3] = {1, 1, 1};
  unsigned block = 1;
  unsigned shared_mem = 0;
  std::vector<uint64_t> words;
  std::vector<void*> params;
  std::vector<int> slots;

  KernelLaunch(const py::tuple& spec) {
    function = reinterpret_cast<CUfunction>(spec[0].cast<uintptr_t>());
    const auto grid_spec = spec[1].cast<std::vector<unsigned>>();
    if (grid_spec.size() != 3) throw std::invalid_argument("a launch's grid must have three dimensions");
    std::memcpy(grid, grid_spec.data(), sizeof(grid));
    block = spec[2].cast<unsigned>();
    shared_mem = spec[3].cast<unsigned>();
    const std::string bytes = spec[4].cast<std::string>();
    if (bytes.size() % 8) throw std::invalid_argument("a parameter array holds 8-byte slots");
    words.resize(bytes.size() / 8);
    std::memcpy(words.data(), bytes.data(), bytes.size());
    for (auto& word : words) params.push_back(&word);
    slots = spec[5].cast<std::vector<int>>();
    for (int slot : slots) {
      if (slot < 0 || slot >= static_cast<int>(words.size())) throw std::invalid_argument("pointer slot out of range");
    }
  }

  void launch(CUstream stream, bool programmatic) {
    const Driver& d = driver();
    if (programmatic && d.launch_ex != nullptr) {
      LaunchAttribute attribute{};
      attribute.id = kProgrammaticStreamSerialization;
      attribute.value.flag = 1;
      const LaunchConfig config{grid[0], grid[1], grid[2], block, 1, 1, shared_mem, stream, &attribute, 1};
      if (d.launch_ex(&config, function, params.data(), nullptr) == 0) return;
    }
    if (d.launch == nullptr) throw std::runtime_error("flashquant-hf: the CUDA driver has no cuLaunchKernel");
    const CUresult status =
        d.launch(function, grid[0], grid[1], grid[2], block, 1, 1, shared_mem, stream, params.data(), nullptr);
    if (status != 0) {
      throw std::runtime_error("flashquant-hf: cuLaunchKernel failed with CUresult " + std::to_string(status));
    }
  }
};

// A registered decode call: the decode launch, the merge launch of several splits, and what a call must still check.
struct PreparedCall {
  c10::DeviceIndex device = 0;
  std::vector<int64_t> alignment;  // per tensor of the call: the byte alignment its address needs (1: any)
  std::vector<int64_t> out_shape, lse_shape;
  bool programmatic = false;  // the GPU takes programmatic dependent launches
  std::optional<KernelLaunch> decode, merge;
  uint64_t partials[2] = {0, 0};  // the merge's inputs
  std::vector<at::Tensor> workspace;  // kept alive while the call is registered
  std::mutex lock;                // fill + launch of the shared parameter arrays stay together
};

// The signature of a call as bytes: every tensor's rank, sizes, strides, dtype and device (a marker for None), then
// each other argument with its type (True is not 1).
void append(std::string& key, int64_t value) { key.append(reinterpret_cast<const char*>(&value), sizeof(value)); }

std::string signature(const std::vector<std::optional<at::Tensor>>& tensors, const py::tuple& values) {
  std::string key;
  key.reserve(64 * tensors.size() + 16 * values.size());
  for (const auto& maybe : tensors) {
    if (!maybe.has_value()) {
      append(key, -1);
      continue;
    }
    const at::Tensor& t = *maybe;
    append(key, t.dim());
    for (int64_t size : t.sizes()) append(key, size);
    for (int64_t stride : t.strides()) append(key, stride);
    append(key, static_cast<int64_t>(t.scalar_type()));
    append(key, static_cast<int64_t>(t.device().type()));
    append(key, t.device().index());
  }
  for (const auto& value : values) {
    if (py::isinstance<py::bool_>(value)) {
      append(key, 1);
      append(key, value.cast<bool>());
    } else if (py::isinstance<py::int_>(value)) {
      append(key, 2);
      append(key, value.cast<int64_t>());
    } else if (py::isinstance<py::float_>(value)) {
      append(key, 3);
      const double x = value.cast<double>();
      int64_t bits;
      std::memcpy(&bits, &x, sizeof(bits));
      append(key, bits);
    } else {
      throw std::invalid_argument("decode call values must be bools, ints or floats");
    }
  }
  return key;
}

constexpr size_t kRegistryLimit = 256;
std::mutex registry_lock;
std::unordered_map<std::string, std::shared_ptr<PreparedCall>> registry;

std::shared_ptr<PreparedCall> find(const std::string& key) {
  std::lock_guard<std::mutex> guard(registry_lock);
  const auto found = registry.find(key);
  return found == registry.end() ? nullptr : found->second;
}

// Launch the call registered under the signature of (tensors, values): returns (out, lse), or None when no call is
// registered under it, torch's current device is another one, or an address lacks the alignment the build assumed
// (the Python wrapper then checks everything and reports the problem).
py::object run(const std::vector<std::optional<at::Tensor>>& tensors, const py::tuple& values) {
  const std::shared_ptr<PreparedCall> call = find(signature(tensors, values));
  if (!call) return py::none();
  const c10::impl::DeviceGuardImplInterface* cuda = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  const c10::Device device = cuda->getDevice();
  if (device.index() != call->device) return py::none();
  std::vector<uint64_t> pointers;
  pointers.reserve(tensors.size() + 2);
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].has_value()) continue;
    const auto address = reinterpret_cast<uintptr_t>(tensors[i]->data_ptr());
    if (address % call->alignment[i]) return py::none();
    pointers.push_back(address);
  }
  const auto options = at::TensorOptions().dtype(at::kFloat).device(device);
  at::Tensor out = at::empty(call->out_shape, options);
  at::Tensor lse = at::empty(call->lse_shape, options);
  const auto stream = static_cast<CUstream>(cuda->getStream(device).native_handle());
  bool programmatic = call->programmatic;
  if (programmatic) {  // inside a CUDA-graph capture the launches are ordinary ones: the graph orders its kernels
    int capturing = 1;
    const Driver& d = driver();
    programmatic = d.is_capturing != nullptr && d.is_capturing(stream, &capturing) == 0 && capturing == 0;
  }
  {
    std::lock_guard<std::mutex> guard(call->lock);
    KernelLaunch& decode = *call->decode;
    if (call->merge) {
      pointers.push_back(call->partials[0]);
      pointers.push_back(call->partials[1]);
    } else {
      pointers.push_back(reinterpret_cast<uintptr_t>(out.data_ptr()));
      pointers.push_back(reinterpret_cast<uintptr_t>(lse.data_ptr()));
    }
    for (size_t i = 0; i < pointers.size(); ++i) decode.words[decode.slots[i]] = pointers[i];
    decode.launch(stream, programmatic);
    if (call->merge) {
      KernelLaunch& merge = *call->merge;
      const uint64_t merged[4] = {call->partials[0], call->partials[1],
                                  reinterpret_cast<uintptr_t>(out.data_ptr()),
                                  reinterpret_cast<uintptr_t>(lse.data_ptr())};
      for (size_t i = 0; i < 4; ++i) merge.words[merge.slots[i]] = merged[i];
      merge.launch(stream, programmatic);
    }
  }
  return py::make_tuple(out, lse);
}

// Register a checked call: the launches of flashquant_hf.kernels.decode_launch.PreparedDecode as specs
// (function, grid, block, shared_mem, parameter bytes, pointer slots), the workspace addresses the merge reads,
// the alignment per tensor and the output shapes.
void remember(const std::vector<std::optional<at::Tensor>>& tensors, const py::tuple& values, int64_t device,
              const py::tuple& decode, const py::object& merge, const std::vector<at::Tensor>& partials,
              const std::vector<int64_t>& alignment, const std::vector<int64_t>& out_shape,
              const std::vector<int64_t>& lse_shape, bool programmatic) {
  if (alignment.size() != tensors.size()) throw std::invalid_argument("one alignment per tensor");
  for (int64_t a : alignment) {
    if (a < 1) throw std::invalid_argument("alignments are positive");
  }
  size_t present = 0;
  for (const auto& maybe : tensors) present += maybe.has_value();
  auto call = std::make_shared<PreparedCall>();
  call->device = static_cast<c10::DeviceIndex>(device);
  call->alignment = alignment;
  call->out_shape = out_shape;
  call->lse_shape = lse_shape;
  call->programmatic = programmatic;
  call->decode.emplace(decode);
  // run() writes the slots unchecked: a mismatch is a wrapper bug (RuntimeError), not a value it cannot key on
  if (call->decode->slots.size() != present + 2) {
    throw std::logic_error("the decode launch needs a pointer slot per tensor and two for its outputs");
  }
  if (!merge.is_none()) {
    if (partials.size() != 2) throw std::invalid_argument("a merged call names its two partial buffers");
    call->merge.emplace(merge.cast<py::tuple>());
    if (call->merge->slots.size() != 4) throw std::logic_error("the merge launch takes four pointers");
    call->workspace = partials;
    call->partials[0] = reinterpret_cast<uintptr_t>(partials[0].data_ptr());
    call->partials[1] = reinterpret_cast<uintptr_t>(partials[1].data_ptr());
  }
  const std::string key = signature(tensors, values);
  std::lock_guard<std::mutex> guard(registry_lock);
  if (registry.size() >= kRegistryLimit) registry.clear();
  registry[key] = std::move(call);
}

void clear() {
  std::lock_guard<std::mutex> guard(registry_lock);
  registry.clear();
}

size_t size() {
  std::lock_guard<std::mutex> guard(registry_lock);
  return registry.size();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flashquant-hf: compiled launcher of prepared decode calls";
  m.def("run", &run, py::arg("tensors"), py::arg("values"));
  m.def("remember", &remember, py::arg("tensors"), py::arg("values"), py::arg("device"), py::arg("decode"),
        py::arg("merge"), py::arg("partials"), py::arg("alignment"), py::arg("out_shape"), py::arg("lse_shape"),
        py::arg("programmatic"));
  m.def("clear", &clear);
  m.def("size", &size);
}
