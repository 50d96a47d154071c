// clientlib's public enums mirror offload.proto's so that client.h needs no
// protobuf header; this file is where the two are held equal. A proto value that
// changes (or an enum here that drifts) fails the build, not a training run.
// The Python client takes these values from the binding (fuyou._fuyou), never
// from literals of its own.
#include "fuyou/client.h"
#include "fuyou/dtype.h"
#include "fuyou/v1/offload.pb.h"

namespace fuyou {
namespace {

template <typename Mirror, typename Proto>
constexpr bool Same(Mirror mirror, Proto proto) {
  return static_cast<int>(mirror) == static_cast<int>(proto);
}

static_assert(Same(DType::kFloat32, v1::DTYPE_FLOAT32));
static_assert(Same(DType::kBFloat16, v1::DTYPE_BFLOAT16));
static_assert(Same(DType::kFloat16, v1::DTYPE_FLOAT16));

static_assert(Same(StateKind::kMaster, v1::STATE_MASTER));
static_assert(Same(StateKind::kExpAvg, v1::STATE_EXP_AVG));
static_assert(Same(StateKind::kExpAvgSq, v1::STATE_EXP_AVG_SQ));

static_assert(Same(RedoReason::kNone, v1::REDO_REASON_UNSPECIFIED));
static_assert(Same(RedoReason::kGradientsChanged, v1::REDO_REASON_GRADIENTS_CHANGED));
static_assert(Same(RedoReason::kClipped, v1::REDO_REASON_CLIPPED));

static_assert(Same(AbortReason::kUnspecified, v1::ABORT_REASON_UNSPECIFIED));
static_assert(Same(AbortReason::kSkippedStep, v1::ABORT_REASON_SKIPPED_STEP));
static_assert(Same(AbortReason::kOverflow, v1::ABORT_REASON_OVERFLOW));

static_assert(Same(JournalUse::kNone, v1::JOURNAL_USE_UNSPECIFIED));
static_assert(Same(JournalUse::kKeep, v1::JOURNAL_USE_KEEP));
static_assert(Same(JournalUse::kAdd, v1::JOURNAL_USE_ADD));
static_assert(Same(JournalUse::kReplay, v1::JOURNAL_USE_REPLAY));

static_assert(Same(GradOp::Kind::kMul, v1::GradOp::KIND_MUL));
static_assert(Same(GradOp::Kind::kDiv, v1::GradOp::KIND_DIV));

}  // namespace
}  // namespace fuyou
