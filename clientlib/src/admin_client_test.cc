// AdminClient against a fake Admin service on a Unix socket in a temporary dir.
#include "fuyou/admin_client.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>

#include "fuyou/v1/admin.grpc.pb.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "test_support/temp_dir.h"

namespace fuyou {
namespace {

class FakeAdmin final : public v1::Admin::Service {
 public:
  grpc::Status Health(grpc::ServerContext*, const v1::HealthRequest*, v1::HealthResponse* response) override {
    response->set_status("SERVING");
    response->set_version("0.1.0-fake");
    response->set_kernel_isa("scalar");
    return grpc::Status::OK;
  }
  grpc::Status GetStats(grpc::ServerContext*, const v1::GetStatsRequest*,
                        v1::GetStatsResponse* response) override {
    v1::StoragePathStats* path = response->add_storage();
    path->set_path("/mnt/nvme0/fuyou");
    path->set_bytes_read(1 << 30);
    response->set_live_sessions(2);
    response->set_dram_budget_bytes(uint64_t{8} << 30);
    return grpc::Status::OK;
  }
  grpc::Status ListSessions(grpc::ServerContext*, const v1::ListSessionsRequest*,
                            v1::ListSessionsResponse* response) override {
    response->add_sessions()->set_job("gpt");
    return grpc::Status::OK;
  }
  grpc::Status ListJobs(grpc::ServerContext*, const v1::ListJobsRequest*, v1::ListJobsResponse* response) override {
    response->add_jobs()->set_name("gpt");
    response->add_jobs()->set_name("llama");
    return grpc::Status::OK;
  }
  grpc::Status DeleteJob(grpc::ServerContext*, const v1::DeleteJobRequest* request,
                         v1::DeleteJobResponse* response) override {
    if (request->name() == "busy") {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "job 'busy' has a live session");
    }
    if (request->name() == "slow") {
      std::this_thread::sleep_for(std::chrono::seconds(3));
    }
    response->set_bytes_freed(4096);
    return grpc::Status::OK;
  }
};

class AdminClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    address_ = "unix:" + dir_ + "/fuyoud.sock";
    grpc::ServerBuilder builder;
    builder.AddListeningPort(address_, grpc::InsecureServerCredentials());
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }
  ClientOptions Options() const {
    ClientOptions options;
    options.address = address_;
    options.rpc_timeout = std::chrono::milliseconds(5000);
    options.connect_timeout = std::chrono::milliseconds(2000);
    return options;
  }

  const TempDir temp_dir_{"fuyou-admin-test"};
  const std::string dir_ = temp_dir_.path().string();
  std::string address_;
  FakeAdmin service_;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(AdminClientTest, CallsEveryMethod) {
  absl::StatusOr<std::unique_ptr<AdminClient>> admin = AdminClient::Connect(Options());
  ASSERT_TRUE(admin.ok()) << admin.status();
  absl::StatusOr<v1::HealthResponse> health = (*admin)->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(health->status(), "SERVING");
  absl::StatusOr<v1::GetStatsResponse> stats = (*admin)->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->live_sessions(), 2u);
  EXPECT_EQ(stats->storage(0).bytes_read(), uint64_t{1} << 30);
  EXPECT_EQ((*admin)->ListSessions()->sessions(0).job(), "gpt");
  EXPECT_EQ((*admin)->ListJobs()->jobs_size(), 2);
  EXPECT_EQ((*admin)->DeleteJob("gpt")->bytes_freed(), 4096u);
}

TEST_F(AdminClientTest, RefusalKeepsCodeAndMessage) {
  absl::StatusOr<std::unique_ptr<AdminClient>> admin = AdminClient::Connect(Options());
  ASSERT_TRUE(admin.ok()) << admin.status();
  absl::StatusOr<v1::DeleteJobResponse> deleted = (*admin)->DeleteJob("busy");
  EXPECT_EQ(deleted.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(deleted.status().message().find("job 'busy' has a live session"), absl::string_view::npos)
      << deleted.status();
}

TEST_F(AdminClientTest, EveryCallHasTheDeadline) {
  ClientOptions options = Options();
  options.rpc_timeout = std::chrono::milliseconds(300);
  absl::StatusOr<std::unique_ptr<AdminClient>> admin = AdminClient::Connect(options);
  ASSERT_TRUE(admin.ok()) << admin.status();
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<v1::DeleteJobResponse> deleted = (*admin)->DeleteJob("slow");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  EXPECT_EQ(deleted.status().code(), absl::StatusCode::kDeadlineExceeded) << deleted.status();
}

TEST(AdminClientConnectTest, NoDaemonIsUnavailableAndNamesTheSocket) {
  ClientOptions options;
  options.address = "unix:/tmp/fuyou-admin-test-nonexistent/fuyoud.sock";
  options.connect_timeout = std::chrono::milliseconds(500);
  absl::StatusOr<std::unique_ptr<AdminClient>> admin = AdminClient::Connect(options);
  EXPECT_EQ(admin.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(admin.status().message().find("/tmp/fuyou-admin-test-nonexistent/fuyoud.sock"),
            absl::string_view::npos)
      << admin.status();
}

}  // namespace
}  // namespace fuyou
