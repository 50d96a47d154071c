// CudaHostMemory: pins a range of host memory (a session's shared-memory segment)
// with cudaHostRegister, so that a device-to-host copy of gradients lands in the
// segment the daemon reads in one DMA, and a host-to-device copy of new weights
// reads it directly: no bounce buffer. Built only when nvcc is found
// (target fuyou_cuda); unregisters on destruction.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace fuyou::cuda {

// OK when a CUDA device can be used; otherwise UNAVAILABLE saying why
// (no driver, no device, ...).
absl::Status DeviceAvailable();

class HostRegistration {
 public:
  // Registers [data, data + bytes) (page-aligned) with CUDA. UNAVAILABLE without
  // a device. (Pointer and size, not std::span: nvcc compiles this as C++17.)
  static absl::StatusOr<std::unique_ptr<HostRegistration>> Register(std::byte* data, size_t bytes);
  ~HostRegistration();
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;

  std::byte* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  HostRegistration(std::byte* data, size_t bytes) : data_(data), bytes_(bytes) {}
  std::byte* data_;
  size_t bytes_;
};

// Copies `bytes` from device memory to registered host memory on the default
// stream and waits: the path a gradient takes into a slot.
absl::Status CopyDeviceToHost(std::byte* host, const void* device, size_t bytes);

}  // namespace fuyou::cuda
