// dflash.cpp — the CUDA stages of one pipeline worker each (placeholder until the split stages
// land).
#include "core/error.hpp"
#include "train/train_backend.hpp"

namespace dflash {

std::unique_ptr<TargetStage> cuda_target_stage_create(const TrainBackendOptions&, int,
                                                      const TargetModel&, const DrafterConfig&) {
  fail("runtime.backend 'cuda' is not available in the pipeline yet");
}

std::unique_ptr<DrafterStage> cuda_drafter_stage_create(const TrainBackendOptions&, int,
                                                        const TargetModel&, const DrafterConfig&,
                                                        const DrafterLayout&,
                                                        const std::shared_ptr<CollectiveGroup>&,
                                                        int) {
  fail("runtime.backend 'cuda' is not available in the pipeline yet");
}

std::shared_ptr<CollectiveGroup> cuda_collective_group_create(const std::vector<int>&) {
  fail("runtime.backend 'cuda' is not available in the pipeline yet");
}

std::unique_ptr<Collective> cuda_collective_member(CollectiveGroup&, int, void*) {
  fail("runtime.backend 'cuda' is not available in the pipeline yet");
}

}  // namespace dflash
