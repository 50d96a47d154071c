#include "cuda_host_memory.h"

#include <cuda_runtime.h>

#include <string>

namespace fuyou::cuda {
namespace {

absl::Status CudaError(cudaError_t error, const std::string& what) {
  return absl::UnavailableError(what + ": " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) + ")");
}

}  // namespace

absl::Status DeviceAvailable() {
  int count = 0;
  cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) return CudaError(error, "no usable CUDA device");
  if (count == 0) return absl::UnavailableError("no CUDA device is present");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<HostRegistration>> HostRegistration::Register(std::byte* data, size_t bytes) {
  if (absl::Status available = DeviceAvailable(); !available.ok()) return available;
  cudaError_t error = cudaHostRegister(data, bytes, cudaHostRegisterPortable);
  if (error != cudaSuccess) {
    return CudaError(error, "cudaHostRegister of " + std::to_string(bytes) + " bytes failed");
  }
  return std::unique_ptr<HostRegistration>(new HostRegistration(data, bytes));
}

HostRegistration::~HostRegistration() { cudaHostUnregister(data_); }

absl::Status CopyDeviceToHost(std::byte* host, const void* device, size_t bytes) {
  cudaError_t error = cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, cudaStreamDefault);
  if (error == cudaSuccess) error = cudaStreamSynchronize(cudaStreamDefault);
  if (error != cudaSuccess) return CudaError(error, "device-to-host copy failed");
  return absl::OkStatus();
}

}  // namespace fuyou::cuda
