// fuyou._fuyou: the pybind11 binding of clientlib (fuyou::Session, fuyou::AdminClient).
//
// A thin layer: it converts arguments, releases the GIL around every call that can
// block (network, waits on the daemon), and turns a non-OK absl::Status into a
// Python exception of fuyou.FuyouError's family (see fuyou/_errors.py), carrying
// the gRPC code name and the daemon's message. The PyTorch integration lives in
// Python (fuyou/optimizer.py).
//
// Slot regions are returned as writable memoryviews over the mapped shared-memory
// segment, so `torch.frombuffer(region, dtype=...)` views them without a copy. Each
// view keeps the Python Session object alive; it must not be used after close().
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fuyou/admin_client.h"
#include "fuyou/client.h"
#include "fuyou/daemon_trust.h"
#include "fuyou/defaults.h"
#include "fuyou/dtype.h"
#include "fuyou/segment_layout.h"
#include "grad_fingerprint.h"

namespace py = pybind11;

namespace fuyou::python {
namespace {

// Thrown by the helpers below, translated to fuyou._errors.FuyouError & co.
// `untrusted_daemon`: IsUntrustedDaemon(status), raised as fuyou.UntrustedDaemon.
struct StatusError : std::exception {
  StatusError(std::string code_name, std::string message, bool untrusted_daemon = false)
      : code_name(std::move(code_name)), message(std::move(message)), untrusted_daemon(untrusted_daemon) {}
  const char* what() const noexcept override { return message.c_str(); }
  std::string code_name;
  std::string message;
  bool untrusted_daemon;
};

[[noreturn]] void ThrowStatus(const absl::Status& status) {
  throw StatusError(absl::StatusCodeToString(status.code()), std::string(status.message()),
                    IsUntrustedDaemon(status));
}

void Check(const absl::Status& status) {
  if (!status.ok()) ThrowStatus(status);
}

template <typename T>
T Check(absl::StatusOr<T> result) {
  if (!result.ok()) ThrowStatus(result.status());
  return *std::move(result);
}

std::chrono::milliseconds ToMillis(double seconds) {
  if (seconds < 0) seconds = 0;
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0 + 0.5));
}

ClientOptions MakeClientOptions(const std::string& address, double rpc_timeout,
                                double connect_timeout) {
  ClientOptions options;
  options.address = address;
  options.rpc_timeout = ToMillis(rpc_timeout);
  options.connect_timeout = ToMillis(connect_timeout);
  return options;
}

DType ToDType(int value) {
  const auto dtype = static_cast<DType>(value);
  if (value < 0 || value > 255 || !IsValidDType(dtype)) {
    throw StatusError("INVALID_ARGUMENT", "unknown dtype value " + std::to_string(value) +
                                              " (expected 1=float32, 2=bfloat16, 3=float16)");
  }
  return dtype;
}

// A contiguous byte view of a Python buffer (bytearray, memoryview, numpy array,
// a torch tensor's numpy view, ...). `writable` asks for a writable buffer.
std::span<std::byte> BytesOf(const py::buffer& buffer, bool writable, py::buffer_info& keep) {
  keep = buffer.request(writable);
  // A C-contiguous buffer: strides equal to the packed strides.
  py::ssize_t expected = keep.itemsize;
  for (py::ssize_t d = keep.ndim - 1; d >= 0; --d) {
    if (keep.shape[d] != 1 && keep.strides[d] != expected) {
      throw StatusError("INVALID_ARGUMENT", "buffer is not C-contiguous");
    }
    expected *= keep.shape[d];
  }
  return {static_cast<std::byte*>(keep.ptr),
          static_cast<size_t>(keep.size) * static_cast<size_t>(keep.itemsize)};
}

// The Python-side owner of a clientlib Session.
class PySession : public std::enable_shared_from_this<PySession> {
 public:
  explicit PySession(std::unique_ptr<Session> session) : session_(std::move(session)) {}

  Session& get() const {
    if (session_ == nullptr) throw StatusError("FAILED_PRECONDITION", "the session is closed");
    return *session_;
  }
  bool closed() const { return session_ == nullptr || closed_; }

  // Close, then keep the object (and its mapping) until Python drops the last view:
  // a stale tensor over a region reads freed-but-mapped memory, never unmapped memory.
  void Close() {
    if (session_ == nullptr || closed_) return;
    closed_ = true;
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = session_->Close();
    }
    Check(status);
  }

  std::span<std::byte> Region(uint32_t slot, bool grad) const {
    Session& s = get();
    if (closed_) throw StatusError("FAILED_PRECONDITION", "the session is closed");
    if (slot >= s.num_slots()) {
      throw StatusError("INVALID_ARGUMENT", "slot " + std::to_string(slot) + " out of range (" +
                                                std::to_string(s.num_slots()) + " slots)");
    }
    return grad ? s.GradRegion(slot) : s.ParamRegion(slot);
  }

 private:
  std::unique_ptr<Session> session_;
  bool closed_ = false;
};

// A slot region exported through the buffer protocol; holds its session alive.
struct PyRegion {
  std::shared_ptr<PySession> owner;
  std::byte* data = nullptr;
  size_t size = 0;
};

py::memoryview MakeRegionView(const std::shared_ptr<PySession>& session, uint32_t slot, bool grad) {
  std::span<std::byte> bytes = session->Region(slot, grad);
  py::object region = py::cast(PyRegion{session, bytes.data(), bytes.size()});
  return py::memoryview(region);
}

// The floats of a C-contiguous float32 buffer (a float32 tensor's numpy view).
std::span<float> FloatsOf(const py::buffer& buffer, bool writable, py::buffer_info& keep) {
  std::span<std::byte> bytes = BytesOf(buffer, writable, keep);
  if (keep.itemsize != sizeof(float) || keep.format != py::format_descriptor<float>::format()) {
    throw StatusError("INVALID_ARGUMENT", "expected a float32 buffer, got format '" + keep.format + "'");
  }
  return {reinterpret_cast<float*>(bytes.data()), bytes.size() / sizeof(float)};
}

StateKind ToStateKind(int value) {
  if (value < static_cast<int>(StateKind::kMaster) || value > static_cast<int>(StateKind::kExpAvgSq)) {
    throw StatusError("INVALID_ARGUMENT", "unknown state kind " + std::to_string(value) +
                                              " (expected 1=master, 2=exp_avg, 3=exp_avg_sq)");
  }
  return static_cast<StateKind>(value);
}

// The one conversion of Python's hyper-parameters (fuyou._protocol.Hyper, or any
// object with float attributes lr, beta1, beta2, eps and weight_decay) into
// clientlib's AdamWHyper, with the update's `grad_scale`. A missing attribute is
// AttributeError, one that is not a number TypeError (pybind11's cast).
AdamWHyper HyperOf(const py::handle& hyper, float grad_scale) {
  AdamWHyper h;
  h.lr = hyper.attr("lr").cast<float>();
  h.beta1 = hyper.attr("beta1").cast<float>();
  h.beta2 = hyper.attr("beta2").cast<float>();
  h.eps = hyper.attr("eps").cast<float>();
  h.weight_decay = hyper.attr("weight_decay").cast<float>();
  h.grad_scale = grad_scale;
  return h;
}

// Every field of `message` under its proto name, from the descriptor (so a new
// GetStatsResponse field needs no line here): scalars as Python numbers, bools
// and strings, enums as their number, repeated messages as lists of dicts.
py::dict FieldsToDict(const google::protobuf::Message& message) {
  using google::protobuf::FieldDescriptor;
  const google::protobuf::Descriptor* descriptor = message.GetDescriptor();
  const google::protobuf::Reflection* reflection = message.GetReflection();
  py::dict d;
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const FieldDescriptor* field = descriptor->field(i);
    const char* name = field->name().c_str();
    if (field->is_repeated()) {
      py::list items;
      if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
        for (int j = 0; j < reflection->FieldSize(message, field); ++j) {
          items.append(FieldsToDict(reflection->GetRepeatedMessage(message, field, j)));
        }
      }
      d[name] = items;
      continue;
    }
    switch (field->cpp_type()) {
      case FieldDescriptor::CPPTYPE_UINT64: d[name] = reflection->GetUInt64(message, field); break;
      case FieldDescriptor::CPPTYPE_UINT32: d[name] = reflection->GetUInt32(message, field); break;
      case FieldDescriptor::CPPTYPE_INT64: d[name] = reflection->GetInt64(message, field); break;
      case FieldDescriptor::CPPTYPE_INT32: d[name] = reflection->GetInt32(message, field); break;
      case FieldDescriptor::CPPTYPE_DOUBLE: d[name] = reflection->GetDouble(message, field); break;
      case FieldDescriptor::CPPTYPE_FLOAT: d[name] = reflection->GetFloat(message, field); break;
      case FieldDescriptor::CPPTYPE_BOOL: d[name] = reflection->GetBool(message, field); break;
      case FieldDescriptor::CPPTYPE_STRING: d[name] = reflection->GetString(message, field); break;
      case FieldDescriptor::CPPTYPE_ENUM: d[name] = reflection->GetEnumValue(message, field); break;
      case FieldDescriptor::CPPTYPE_MESSAGE: d[name] = FieldsToDict(reflection->GetMessage(message, field)); break;
    }
  }
  return d;
}

// GetStats as a dict: every field by its name (admin.proto), `storage` a list
// of dicts, and `scope` "daemon" (the whole daemon: root, the daemon's user) or
// "user" (the caller's own activity only, with no storage paths or DRAM).
py::dict StatsToDict(const v1::GetStatsResponse& r) {
  py::dict d = FieldsToDict(r);
  d["scope"] = r.scope() == v1::STATS_SCOPE_USER ? "user" : "daemon";
  return d;
}

template <typename T, typename F>
T Blocking(F&& f) {
  absl::StatusOr<T> result = [&] {
    py::gil_scoped_release release;
    return f();
  }();
  return Check(std::move(result));
}

void BlockingStatus(const std::function<absl::Status()>& f) {
  absl::Status status;
  {
    py::gil_scoped_release release;
    status = f();
  }
  Check(status);
}

}  // namespace
}  // namespace fuyou::python

PYBIND11_MODULE(_fuyou, m) {
  using namespace fuyou;
  using namespace fuyou::python;
  m.doc() = "Binding of fuyou's clientlib (see fuyou.AdamW for the PyTorch API).";

  // Status errors become fuyou._errors.from_status(code_name, message), a subclass
  // of fuyou.FuyouError; RuntimeError if that module cannot be imported.
  // from_status is looked up once, now, while imports work: an optimizer's __del__
  // at interpreter exit (its daemon gone) raises through the translator after
  // sys.meta_path is None, when an import would fail and print "Exception
  // ignored". Deliberately never freed (it must outlive the interpreter's teardown).
  static py::object* from_status = []() -> py::object* {
    try {
      return new py::object(py::module_::import("fuyou._errors").attr("from_status"));
    } catch (py::error_already_set&) {
      return nullptr;  // imported lazily below (and reported there if it still fails)
    }
  }();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      try {
        py::object make = from_status != nullptr ? *from_status
                                                 : py::module_::import("fuyou._errors").attr("from_status");
        py::object exc = e.untrusted_daemon ? make(e.code_name, e.message, true) : make(e.code_name, e.message);
        PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
      } catch (py::error_already_set& inner) {
        inner.discard_as_unraisable("fuyou._fuyou error translation");
        PyErr_SetString(PyExc_RuntimeError, (e.code_name + ": " + e.message).c_str());
      }
    }
  });

  m.def(
      "check_trusted_daemon",
      [](const std::string& path, double timeout) {
        BlockingStatus([&] { return CheckTrustedDaemon(path, ToMillis(timeout)); });
      },
      py::arg("path"), py::arg("timeout") = 1.0,
      "Checks the daemon at the Unix socket `path` as a default address is checked (its directory, the "
      "links on the way, the uid of the process that accepts) and closes the connection unused; raises "
      "fuyou.UntrustedDaemon, or the error of a socket nothing accepts on.");

  m.attr("DTYPE_FLOAT32") = static_cast<int>(DType::kFloat32);
  m.attr("DTYPE_BFLOAT16") = static_cast<int>(DType::kBFloat16);
  m.attr("DTYPE_FLOAT16") = static_cast<int>(DType::kFloat16);
  m.attr("DTYPE_BLOCK8") = static_cast<int>(DType::kBlock8);  // moments only (state_dtype "8bit")
  m.attr("MAX_SLOTS") = kMaxSlots;
  m.attr("MAX_CHUNK_SEGMENTS") = kMaxChunkSegments;
  m.attr("JOURNAL_NONE") = static_cast<int>(JournalUse::kNone);
  m.attr("JOURNAL_KEEP") = static_cast<int>(JournalUse::kKeep);
  m.attr("JOURNAL_ADD") = static_cast<int>(JournalUse::kAdd);
  m.attr("JOURNAL_REPLAY") = static_cast<int>(JournalUse::kReplay);
  m.attr("GRAD_OP_MUL") = static_cast<int>(GradOp::Kind::kMul);
  m.attr("GRAD_OP_DIV") = static_cast<int>(GradOp::Kind::kDiv);
  m.attr("STATE_MASTER") = static_cast<int>(StateKind::kMaster);
  m.attr("STATE_EXP_AVG") = static_cast<int>(StateKind::kExpAvg);
  m.attr("STATE_EXP_AVG_SQ") = static_cast<int>(StateKind::kExpAvgSq);
  m.attr("REDO_GRADIENTS_CHANGED") = static_cast<int>(RedoReason::kGradientsChanged);
  m.attr("REDO_CLIPPED") = static_cast<int>(RedoReason::kClipped);
  m.attr("ABORT_SKIPPED_STEP") = static_cast<int>(AbortReason::kSkippedStep);
  m.attr("ABORT_OVERFLOW") = static_cast<int>(AbortReason::kOverflow);
  m.attr("SEGMENT_ALIGNMENT") = kSegmentAlignment;

  m.def(
      "sum_and_squares",
      [](const std::vector<std::pair<uintptr_t, size_t>>& pieces, bool portable) {
        SumAndSquares total;
        {
          py::gil_scoped_release release;
          for (const auto& [address, count] : pieces) {
            AccumulateSumAndSquares({reinterpret_cast<const float*>(address), count}, total, portable);
          }
        }
        return std::pair(total.sum, total.squares);
      },
      py::arg("pieces"), py::arg("portable") = false,
      "(sum, sum of squares) in double of float32 pieces given as (data_ptr, numel) of "
      "contiguous CPU tensors the caller keeps alive, read once in a fixed order "
      "(grad_fingerprint.h); the GIL is released meanwhile. `portable`: without AVX2 (tests).");

  m.def("default_address", &DefaultAddress,
        "gRPC target clientlib uses when no address is given.");
  m.def("default_socket_path", [] { return DefaultSocketPath().string(); },
        "Socket a client connects to by default (defaults.h DefaultSocketPath).");
  m.def("default_data_dir", [] { return DefaultDataDir().string(); });

  py::class_<PyRegion>(m, "_Region", py::buffer_protocol())
      .def_buffer([](PyRegion& r) {
        return py::buffer_info(r.data, 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(r.size)}, {py::ssize_t{1}},
                               /*readonly=*/false);
      });

  py::class_<PySession, std::shared_ptr<PySession>>(m, "Session")
      .def_static(
          "open",
          [](const std::string& job, uint32_t num_slots, uint64_t slot_bytes,
             const std::string& client_info, const std::string& address, double rpc_timeout,
             double connect_timeout, std::optional<int64_t> resume_at_step) {
            SessionOptions options;
            options.job = job;
            options.num_slots = num_slots;
            options.slot_bytes = slot_bytes;
            options.client_info = client_info;
            options.resume_at_step = resume_at_step;
            const ClientOptions client = MakeClientOptions(address, rpc_timeout, connect_timeout);
            auto session = Blocking<std::unique_ptr<Session>>(
                [&] { return Session::Open(options, client); });
            return std::make_shared<PySession>(std::move(session));
          },
          py::arg("job"), py::arg("num_slots"), py::arg("slot_bytes"),
          py::arg("client_info") = "", py::arg("address") = "", py::arg("rpc_timeout") = 30.0,
          py::arg("connect_timeout") = 5.0, py::arg("resume_at_step") = py::none(),
          "Connects to fuyoud, opens a session on `job` and maps its segment; `resume_at_step`: "
          "resume at exactly that committed step (the job's, or the one before its last commit).")
      .def_property_readonly("committed_step",
                             [](const PySession& s) { return s.get().committed_step(); })
      .def_property_readonly("num_slots", [](const PySession& s) { return s.get().num_slots(); })
      .def_property_readonly("slot_bytes",
                             [](const PySession& s) { return s.get().slot_bytes(); })
      .def_property_readonly("session_id",
                             [](const PySession& s) { return s.get().session_id(); })
      .def_property_readonly("closed", &PySession::closed)
      .def(
          "register_chunk",
          [](PySession& s, uint32_t chunk_id, uint64_t num_elements, int param_dtype,
             int grad_dtype, const py::buffer& weights, uint64_t layout_fingerprint,
             std::vector<uint64_t> segment_elements, bool store_weights, int moments_dtype) {
            ChunkSpec spec;
            spec.chunk_id = chunk_id;
            spec.num_elements = num_elements;
            spec.param_dtype = ToDType(param_dtype);
            spec.grad_dtype = ToDType(grad_dtype);
            spec.layout_fingerprint = layout_fingerprint;
            spec.segment_elements = std::move(segment_elements);
            spec.store_weights = store_weights;
            // 4 (8-bit blocks) names only moments, never weights or gradients.
            spec.moments_dtype = moments_dtype == static_cast<int>(DType::kBlock8) ? DType::kBlock8
                                                                                   : ToDType(moments_dtype);
            py::buffer_info keep;
            std::span<std::byte> bytes = BytesOf(weights, /*writable=*/true, keep);
            Session& session = s.get();
            const RegisterResult r = Blocking<RegisterResult>(
                [&] { return session.RegisterChunk(spec, bytes); });
            return py::make_tuple(r.resumed, r.update_count, r.segment_update_counts);
          },
          py::arg("chunk_id"), py::arg("num_elements"), py::arg("param_dtype"),
          py::arg("grad_dtype"), py::arg("weights"), py::arg("layout_fingerprint") = 0,
          py::arg("segment_elements") = std::vector<uint64_t>{}, py::arg("store_weights") = false,
          py::arg("moments_dtype") = 1,
          "Registers a chunk; `weights` (writable) gives a new chunk's initial weights or "
          "receives a resumed chunk's. `layout_fingerprint` (0: none) identifies the chunk's "
          "parameter layout; a resume with another is FailedPrecondition. "
          "`segment_elements`: element counts of the chunk's segments (empty: one). "
          "`store_weights`: the daemon keeps the chunk's working weights (fetched with "
          "send_fetch_weights); fixed at creation, a resume with the other value is "
          "FailedPrecondition. `moments_dtype` (a DType code: 1 float32, 2 bfloat16, 4 8-bit blocks): the dtype "
          "the daemon keeps m and v in; fixed at creation, a resume with another is "
          "FailedPrecondition. Returns (resumed, update_count, segment_update_counts); the last "
          "is empty when every segment has update_count.")
      .def(
          "push_gradients",
          [](PySession& s, uint32_t chunk_id, int64_t step, const py::buffer& grads,
             const py::object& hyper_params, float grad_scale) {
            const AdamWHyper hyper = HyperOf(hyper_params, grad_scale);
            py::buffer_info keep;
            std::span<std::byte> bytes = BytesOf(grads, /*writable=*/false, keep);
            Session& session = s.get();
            BlockingStatus([&] { return session.PushGradients(chunk_id, step, hyper, bytes); });
          },
          py::arg("chunk_id"), py::arg("step"), py::arg("grads"), py::arg("hyper"),
          py::arg("grad_scale") = 1.0f,
          "`hyper`: fuyou._protocol.Hyper (lr, beta1, beta2, eps, weight_decay).")
      .def(
          "pull_params",
          [](PySession& s, uint32_t chunk_id, const py::buffer& weights) {
            py::buffer_info keep;
            std::span<std::byte> bytes = BytesOf(weights, /*writable=*/true, keep);
            Session& session = s.get();
            BlockingStatus([&] { return session.PullParams(chunk_id, bytes); });
          },
          py::arg("chunk_id"), py::arg("weights"))
      .def(
          "spill_activation",
          [](PySession& s, uint64_t key, const py::buffer& data) {
            py::buffer_info keep;
            std::span<std::byte> bytes = BytesOf(data, /*writable=*/false, keep);
            Session& session = s.get();
            BlockingStatus([&] { return session.SpillActivation(key, bytes); });
          },
          py::arg("key"), py::arg("data"),
          "Copies the buffer's bytes to the daemon's activation scratch under `key` (below 2**40, "
          "not spilled yet); returns once written. The GIL is released meanwhile.")
      .def(
          "recall_activation",
          [](PySession& s, uint64_t key, const py::buffer& out) {
            py::buffer_info keep;
            std::span<std::byte> bytes = BytesOf(out, /*writable=*/true, keep);
            Session& session = s.get();
            BlockingStatus([&] { return session.RecallActivation(key, bytes); });
          },
          py::arg("key"), py::arg("out"),
          "Copies activation `key` back into the writable buffer `out` (exactly its size) and "
          "forgets it; DATA_LOSS when the daemon's copy fails its checksum.")
      .def(
          "drop_activations",
          [](PySession& s) {
            Session& session = s.get();
            BlockingStatus([&] { return session.DropActivations(); });
          },
          "Forgets every spilled activation of the session and frees its scratch.")
      .def(
          "acquire_slot",
          [](PySession& s, double timeout) {
            Session& session = s.get();
            return Blocking<uint32_t>([&] { return session.AcquireSlot(ToMillis(timeout)); });
          },
          py::arg("timeout"), "Takes a free slot, waiting up to `timeout` seconds.")
      .def(
          "grad_region",
          [](PySession& s, uint32_t slot) {
            return MakeRegionView(s.shared_from_this(), slot, /*grad=*/true);
          },
          py::arg("slot"), "Writable memoryview of the slot's gradient region.")
      .def(
          "param_region",
          [](PySession& s, uint32_t slot) {
            return MakeRegionView(s.shared_from_this(), slot, /*grad=*/false);
          },
          py::arg("slot"), "Writable memoryview of the slot's parameter region.")
      .def(
          "send_grad_ready",
          [](PySession& s, uint32_t chunk_id, uint32_t slot, int64_t step, const py::object& hyper_params,
             float grad_scale, std::vector<uint32_t> segments_without_grad, bool speculative, int redo, int journal,
             std::vector<std::pair<int, float>> grad_ops) {
            if (redo < 0 || redo > static_cast<int>(RedoReason::kClipped)) {
              throw py::value_error("redo must be 0 (none), 1 (gradients changed) or 2 (clipped)");
            }
            if (journal < 0 || journal > static_cast<int>(JournalUse::kReplay)) {
              throw py::value_error(
                  "journal must be 0 (none), JOURNAL_KEEP (1), JOURNAL_ADD (2) or JOURNAL_REPLAY (3)");
            }
            std::vector<GradOp> ops;
            for (const auto& [kind, operand] : grad_ops) {
              if (kind != static_cast<int>(GradOp::Kind::kMul) && kind != static_cast<int>(GradOp::Kind::kDiv)) {
                throw py::value_error("a grad_ops kind must be GRAD_OP_MUL (1) or GRAD_OP_DIV (2)");
              }
              ops.push_back(GradOp{static_cast<GradOp::Kind>(kind), operand});
            }
            const AdamWHyper hyper = HyperOf(hyper_params, grad_scale);
            Session& session = s.get();
            GradReadyOptions options;
            options.segments_without_grad = std::move(segments_without_grad);
            options.speculative = speculative;
            options.redo = static_cast<RedoReason>(redo);
            options.journal = static_cast<JournalUse>(journal);
            options.grad_ops = std::move(ops);
            BlockingStatus(
                [&] { return session.SendGradReady(chunk_id, slot, step, hyper, options); });
          },
          py::arg("chunk_id"), py::arg("slot"), py::arg("step"), py::arg("hyper"),
          py::arg("grad_scale") = 1.0f, py::kw_only(),
          py::arg("segments_without_grad") = std::vector<uint32_t>{},
          py::arg("speculative") = false, py::arg("redo") = 0, py::arg("journal") = 0,
          py::arg("grad_ops") = std::vector<std::pair<int, float>>{},
          "Sends GradReady for gradients written into the slot's gradient region, with `hyper` "
          "(fuyou._protocol.Hyper: lr, beta1, beta2, eps, weight_decay) and `grad_scale`. "
          "`segments_without_grad`: the chunk's segments whose parameters have no gradient; "
          "`speculative`: sent during backward; `redo` (fuyou.v1.RedoReason): replaces the "
          "chunk's update of the step, whose parameters were taken with wait_params; "
          "`journal` (JOURNAL_KEEP, JOURNAL_ADD, JOURNAL_REPLAY): the daemon's copy of the chunk's "
          "gradients of the step (REPLAY does not read the slot's gradient region); `grad_ops`: "
          "[(GRAD_OP_MUL or GRAD_OP_DIV, operand)] applied to the journal first (ADD, REPLAY only).")
      .def(
          "journal_stats",
          [](PySession& s, uint32_t chunk_id) -> py::object {
            std::optional<JournalStats> stats = s.get().GetJournalStats(chunk_id);
            if (!stats) return py::none();
            std::vector<double> max_abs(stats->max_abs.begin(), stats->max_abs.end());
            return py::make_tuple(stats->sum_squares, max_abs);
          },
          py::arg("chunk_id"),
          "(sum_squares, max_abs) per segment of the chunk's journaled gradients after its latest "
          "update that used a journal (before grad_scale), or None; valid once wait_params returned "
          "for that update.")
      .def(
          "wait_params",
          [](PySession& s, uint32_t chunk_id, double timeout) {
            Session& session = s.get();
            return Blocking<uint32_t>(
                [&] { return session.WaitParams(chunk_id, ToMillis(timeout)); });
          },
          py::arg("chunk_id"), py::arg("timeout"),
          "Waits for ParamsReady of the chunk; returns the slot holding its new weights.")
      .def(
          "send_fetch_weights",
          [](PySession& s, uint32_t chunk_id, uint32_t slot) {
            Session& session = s.get();
            BlockingStatus([&] { return session.SendFetchWeights(chunk_id, slot); });
          },
          py::arg("chunk_id"), py::arg("slot"),
          "Asks the daemon to copy the chunk's committed working weights (registered with "
          "store_weights) into the slot's parameter region; `slot` must be held (acquire_slot) "
          "and is in flight until wait_weights returns it.")
      .def(
          "wait_weights",
          [](PySession& s, uint32_t chunk_id, double timeout) {
            Session& session = s.get();
            return Blocking<uint32_t>(
                [&] { return session.WaitWeights(chunk_id, ToMillis(timeout)); });
          },
          py::arg("chunk_id"), py::arg("timeout"),
          "Waits (up to `timeout` seconds) for the chunk's oldest weights fetch; returns the "
          "slot whose parameter region holds the weights (param dtype). Release it with "
          "release_slot. A refusal comes back as the exception, the slot already freed.")
      .def(
          "release_slot",
          [](PySession& s, uint32_t slot) {
            Session& session = s.get();
            py::gil_scoped_release release;
            session.ReleaseSlot(slot);
          },
          py::arg("slot"))
      .def(
          "end_step",
          [](PySession& s, int64_t step) {
            Session& session = s.get();
            const StepResult r = Blocking<StepResult>([&] { return session.EndStep(step); });
            return py::make_tuple(r.step, r.chunks_updated, r.durable_step);
          },
          py::arg("step"),
          "Applies the step (its durable commit runs on in the daemon); returns (step, chunks_updated, "
          "durable_step): durable_step is the last step a crash keeps, step - 1 while this one's commit runs.")
      .def(
          "wait_durable",
          [](PySession& s, int64_t step) {
            Session& session = s.get();
            return Blocking<int64_t>([&] { return session.WaitDurable(step); });
          },
          py::arg("step"),
          "Waits (the GIL released) until `step` (0 .. committed_step) is durable, what a crash of "
          "fuyoud or the machine keeps; returns the job's durable step (>= step). Usually at once: "
          "a step's durable commit ends during the next step's forward. FailedPrecondition for a "
          "step not committed; the commit's own error when it failed.")
      .def(
          "abort_step",
          [](PySession& s, int64_t step, int reason) {
            if (reason < 0 || reason > static_cast<int>(AbortReason::kOverflow)) {
              throw py::value_error("reason must be 0 (unspecified), 1 (skipped step) or 2 (overflow)");
            }
            Session& session = s.get();
            BlockingStatus([&] { return session.AbortStep(step, static_cast<AbortReason>(reason)); });
          },
          py::arg("step"), py::arg("reason") = 0,
          "Abandons the step; `reason` is a fuyou.v1.AbortReason (counted by the daemon).")
      .def(
          "read_state",
          [](PySession& s, uint32_t chunk_id, int which, uint64_t first, const py::buffer& out) {
            py::buffer_info keep;
            std::span<float> floats = FloatsOf(out, /*writable=*/true, keep);
            Session& session = s.get();
            const StateKind kind = ToStateKind(which);
            return Blocking<int64_t>([&] { return session.ReadState(chunk_id, kind, first, floats); });
          },
          py::arg("chunk_id"), py::arg("which"), py::arg("first"), py::arg("out"),
          "Reads len(out) fp32 values of a committed state from element `first` into the "
          "writable float32 buffer `out`; returns the chunk's update count.")
      .def(
          "write_state",
          [](PySession& s, uint32_t chunk_id, int which, uint64_t first, const py::buffer& values) {
            py::buffer_info keep;
            std::span<float> floats = FloatsOf(values, /*writable=*/false, keep);
            Session& session = s.get();
            const StateKind kind = ToStateKind(which);
            BlockingStatus([&] { return session.WriteState(chunk_id, kind, first, floats); });
          },
          py::arg("chunk_id"), py::arg("which"), py::arg("first"), py::arg("values"),
          "Replaces fp32 values of a state from element `first`, as part of the pending import.")
      .def(
          "set_update_count",
          [](PySession& s, uint32_t chunk_id, int64_t update_count, std::vector<int64_t> segment_update_counts) {
            Session& session = s.get();
            BlockingStatus([&] { return session.SetUpdateCount(chunk_id, update_count, segment_update_counts); });
          },
          py::arg("chunk_id"), py::arg("update_count"), py::arg("segment_update_counts") = std::vector<int64_t>{},
          "Sets a chunk's update count (Adam's t), as part of the pending import; with "
          "segment_update_counts (one per segment, the largest equal to update_count) each segment's own.")
      .def(
          "commit_import",
          [](PySession& s, int64_t resume_step) {
            Session& session = s.get();
            return Blocking<uint32_t>([&] { return session.CommitImport(resume_step); });
          },
          py::arg("resume_step") = 0,
          "Commits the pending import atomically; returns the number of chunks changed. resume_step > 0: "
          "a job that committed no step yet is at that step after the commit (a reshard).")
      .def("close", &PySession::Close, "Ends the session (idempotent).");

  py::class_<AdminClient, std::shared_ptr<AdminClient>>(m, "AdminClient")
      .def_static(
          "connect",
          [](const std::string& address, double timeout) {
            const ClientOptions client = MakeClientOptions(address, timeout, timeout);
            std::unique_ptr<AdminClient> admin = Blocking<std::unique_ptr<AdminClient>>(
                [&] { return AdminClient::Connect(client); });
            return std::shared_ptr<AdminClient>(std::move(admin));
          },
          py::arg("address") = "", py::arg("timeout") = 10.0)
      .def("health",
           [](AdminClient& a) {
             const auto r = Blocking<v1::HealthResponse>([&] { return a.Health(); });
             py::dict d;
             d["status"] = r.status();
             d["version"] = r.version();
             d["uptime_seconds"] = r.uptime_seconds();
             d["kernel_isa"] = r.kernel_isa();
             return d;
           })
      .def("get_stats",
           [](AdminClient& a) {
             return StatsToDict(Blocking<v1::GetStatsResponse>([&] { return a.GetStats(); }));
           })
      .def("list_sessions",
           [](AdminClient& a) {
             const auto r = Blocking<v1::ListSessionsResponse>([&] { return a.ListSessions(); });
             py::list out;
             for (const auto& s : r.sessions()) {
               py::dict d;
               d["session_id"] = s.session_id();
               d["job"] = s.job();
               d["uid"] = s.uid();
               d["pid"] = s.pid();
               d["client_info"] = s.client_info();
               d["chunks"] = s.chunks();
               d["committed_step"] = s.committed_step();
               d["segment_bytes"] = s.segment_bytes();
               d["age_seconds"] = s.age_seconds();
               // A rank of a data-parallel job (<job>.rank<r>-of<w>): "", 0, 0 otherwise.
               d["data_parallel_job"] = s.data_parallel_job();
               d["rank"] = s.rank();
               d["world_size"] = s.world_size();
               out.append(d);
             }
             return out;
           })
      .def("list_jobs",
           [](AdminClient& a, bool all_users) {
             const auto r = Blocking<v1::ListJobsResponse>([&] { return a.ListJobs(all_users); });
             py::list out;
             for (const auto& j : r.jobs()) {
               py::dict d;
               d["name"] = j.name();
               d["owner_uid"] = j.owner_uid();
               d["chunks"] = j.chunks();
               d["parameters"] = j.parameters();
               d["bytes_on_storage"] = j.bytes_on_storage();
               d["committed_step"] = j.committed_step();
               d["last_used_unix"] = j.last_used_unix();
               d["open"] = j.open();
               d["damaged"] = j.damaged();  // "" unless the job cannot be used
               // A rank of a data-parallel job (<job>.rank<r>-of<w>): "", 0, 0 otherwise.
               d["data_parallel_job"] = j.data_parallel_job();
               d["rank"] = j.rank();
               d["world_size"] = j.world_size();
               out.append(d);
             }
             return out;
           },
           py::arg("all_users") = false,
           "The caller's jobs; all users' with all_users=True (administrators only: "
           "PERMISSION_DENIED otherwise).")
      .def(
          "delete_job",
          [](AdminClient& a, const std::string& name) {
            return Blocking<v1::DeleteJobResponse>([&] { return a.DeleteJob(name); })
                .bytes_freed();
          },
          py::arg("name"), "Deletes a job; returns the bytes freed.")
      .def(
          "copy_job",
          [](AdminClient& a, const std::string& src, const std::string& dst) {
            v1::CopyJobResponse r = Blocking<v1::CopyJobResponse>([&] { return a.CopyJob(src, dst); });
            py::dict out;
            out["bytes_copied"] = r.bytes_copied();
            out["committed_step"] = r.committed_step();
            return out;
          },
          py::arg("src"), py::arg("dst"),
          "Forks job `src` into a new job `dst` inside the daemon; returns {bytes_copied, committed_step}.");
}
