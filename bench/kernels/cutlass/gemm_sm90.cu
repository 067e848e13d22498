#include <cuda_runtime.h>
#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;
#ifndef TN
#define TN 128
#endif
#ifndef TM
#define TM 128
#endif
using Bf = cutlass::bfloat16_t;
using TileShape = Shape<Int<TM>, Int<TN>, _64>;
using ClusterShape = Shape<_1, _1, _1>;
#if TM == 64
using MainSched = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using EpiSched = cutlass::epilogue::TmaWarpSpecialized;
#else
using MainSched = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using EpiSched = cutlass::epilogue::TmaWarpSpecializedCooperative;
#endif
#ifdef STREAMK
using Sched = cutlass::gemm::StreamKScheduler;
#else
using Sched = cutlass::gemm::PersistentScheduler;
#endif
using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    Bf, cutlass::layout::ColumnMajor, 8, Bf, cutlass::layout::ColumnMajor, 8,
    EpiSched>::CollectiveOp;
using Main = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    Bf, cutlass::layout::RowMajor, 8, Bf, cutlass::layout::ColumnMajor, 8, float,
    TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename Epi::SharedStorage))>,
    MainSched>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Main, Epi, Sched>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

static typename Gemm::Arguments make_args(const void* w, const void* x, const void* c, void* y,
                                          int t, int n, int k, float beta) {
  static int sms = 0;
  if (!sms) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cutlass::KernelHardwareInfo hw;
  hw.device_id = 0;
  hw.sm_count = sms;
  auto sa = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, make_shape(n, k, 1));
  auto sb = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, make_shape(t, k, 1));
  auto sc = cutlass::make_cute_packed_stride(typename Kernel::StrideC{}, make_shape(n, t, 1));
  auto sd = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, make_shape(n, t, 1));
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm, {n, t, k, 1},
                                {static_cast<const Bf*>(w), sa, static_cast<const Bf*>(x), sb},
                                {{1.0f, beta}, static_cast<const Bf*>(c), sc, static_cast<Bf*>(y), sd},
                                hw};
  return args;
}

extern "C" size_t NAME_ws(int t, int n, int k) {
  return Gemm::get_workspace_size(make_args(nullptr, nullptr, nullptr, nullptr, t, n, k, 0.f));
}

extern "C" int NAME_run(const void* w, const void* x, const void* c, void* y, int t, int n, int k,
                        float beta, void* ws, cudaStream_t stream) {
  Gemm gemm;
  auto args = make_args(w, x, c, y, t, n, k, beta);
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 1;
  if (gemm.initialize(args, ws, stream) != cutlass::Status::kSuccess) return 2;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return 3;
  return 0;
}
