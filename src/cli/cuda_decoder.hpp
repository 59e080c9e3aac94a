// dflash.cpp — `--backend cuda` of the decoding commands (internal to src/cli): the CUDA decoder
// (infer/decoder_cuda.hpp) with a context of its own on device 0, planned for the requests of
// one command. Builds without CUDA, where it refuses with a clear error.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "infer/decoder.hpp"

namespace dflash::cli {

/// Throws dflash::Error when `--backend cuda` cannot run here: this dflash was built without
/// CUDA, or no CUDA device is visible. For the commands' checks before any weight is loaded.
void check_cuda_backend();

/// A Decoder on GPU 0 for `prompts` decoded with up to `max_new_tokens` tokens, at most
/// `batch_size` in flight (memory planned for exactly that; the objects must outlive it). Throws
/// dflash::Error when this dflash was built without CUDA, when no CUDA device is visible, and the
/// decoder's own errors (e.g. the device's free memory falls short of the plan).
std::unique_ptr<Decoder> make_cuda_decoder(const TargetModel& target, const LoadedDrafter& drafter,
                                           std::span<const std::vector<int32_t>> prompts,
                                           int64_t max_new_tokens, int batch_size);

/// A Decoder on GPU 0 planned for prompts of up to `max_prompt` tokens decoded with up to
/// `max_new_tokens` tokens, `batch_size` in flight (context per request: max_prompt +
/// max_new_tokens + the drafter's trained block size, 1 without). `drafter` null: target-only
/// (target_generate; generate throws). Errors as above.
std::unique_ptr<Decoder> make_cuda_decoder(const TargetModel& target, const LoadedDrafter* drafter,
                                           int64_t max_prompt, int64_t max_new_tokens,
                                           int batch_size);

}  // namespace dflash::cli
