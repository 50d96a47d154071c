// Runs on a GPU machine; elsewhere every test skips and says why.
#include "cuda_host_memory.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstring>
#include <vector>

namespace fuyou::cuda {
namespace {

class CudaHostMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (absl::Status available = DeviceAvailable(); !available.ok()) {
      GTEST_SKIP() << "skipped, needs a GPU: " << available.message();
    }
  }
};

TEST_F(CudaHostMemoryTest, GradientsCopiedFromTheDeviceLandInSharedMemory) {
  constexpr size_t kBytes = 8 << 20;
  // A shared mapping, as a session's segment is.
  void* mapping = ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mapping, MAP_FAILED);
  auto* memory = static_cast<std::byte*>(mapping);
  {
    auto registration = HostRegistration::Register(memory, kBytes);
    ASSERT_TRUE(registration.ok()) << registration.status().message();
    std::vector<float> values(kBytes / 4);
    for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i) * 0.5f;
    void* device = nullptr;
    ASSERT_EQ(cudaMalloc(&device, kBytes), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(device, values.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_TRUE(CopyDeviceToHost(memory, device, kBytes).ok());
    EXPECT_EQ(std::memcmp(memory, values.data(), kBytes), 0);
    cudaFree(device);
  }
  ::munmap(mapping, kBytes);
}

}  // namespace
}  // namespace fuyou::cuda
