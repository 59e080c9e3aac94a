// dflash.cpp — safetensors files and checkpoints (reader and atomic writer).
//
// Format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N, N bytes
// of JSON header `{"name": {"dtype": "BF16", "shape": [..], "data_offsets": [b, e]}, ...,
// "__metadata__": {str: str}}`, then the byte buffer; offsets are relative to the buffer start.
//
// Invariants of a SafetensorsFile once constructed (all checked at open, errors name the file and
// the tensor): N <= 100 MB and N <= file size - 8; the header is a JSON object without duplicate
// keys; every dtype is one dflash reads (F32, BF16, F16, I32, I64, BOOL); every dimension is
// non-negative; e - b == numel * dtype size (no overflow); [b, e) lies inside the buffer; no two
// tensors' byte ranges overlap. The file is memory-mapped privately (copy-on-write: writing through a
// returned view never changes the file) and stays mapped while any returned Tensor lives. Reading is
// lazy: pages are touched only when a tensor's bytes are read. A file is immutable after open and
// safe to read from many threads.
#pragma once

#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.hpp"

namespace dflash {

/// One tensor's entry in a safetensors header. `data_offsets` are byte offsets [begin, end) from the
/// start of the data buffer (which follows the header).
struct TensorInfo {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  std::pair<uint64_t, uint64_t> data_offsets{0, 0};

  int64_t numel() const { return shape_numel(shape); }
  uint64_t nbytes() const { return data_offsets.second - data_offsets.first; }
};

/// Largest header accepted (the reference implementation's limit), in bytes.
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

/// One .safetensors file, opened, validated and memory-mapped.
class SafetensorsFile {
 public:
  /// Opens, maps and validates `path`. Throws dflash::Error naming the file (and the tensor, when
  /// one is at fault) for a missing/unreadable file, a truncated file, a header length that is
  /// insane or larger than the file, malformed JSON, an unsupported dtype, a negative or non-integer
  /// dimension, a byte size that contradicts shape and dtype, offsets past the end of the buffer, or
  /// overlapping tensors.
  explicit SafetensorsFile(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  /// Size of the whole file in bytes.
  uint64_t file_size() const { return file_size_; }
  /// Header length N (bytes of JSON, excluding the 8-byte length prefix).
  uint64_t header_size() const { return header_size_; }

  /// Tensor names, sorted.
  std::vector<std::string> names() const;
  /// All entries, sorted by name.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  size_t size() const { return tensors_.size(); }
  bool contains(const std::string& name) const;
  /// The entry of `name`; throws dflash::Error naming the file and tensor when absent.
  const TensorInfo& info(const std::string& name) const;
  /// The `__metadata__` map (empty when the header has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  /// A zero-copy CPU view of tensor `name` that keeps the mapping alive. If the tensor's bytes are
  /// not aligned to its element size in the file (legal but rare), an aligned owning copy is
  /// returned instead. Throws dflash::Error naming the file and tensor when absent.
  Tensor get(const std::string& name) const;
  /// Tensor `name` converted to `dtype` on load (a new owning CPU tensor; the zero-copy view of
  /// get() when the dtype already matches). Conversion rules: convert_elements (core/dtype.hpp).
  Tensor get_as(const std::string& name, DType dtype) const;

 private:
  struct Mapping;
  std::filesystem::path path_;
  uint64_t file_size_ = 0, header_size_ = 0;
  std::shared_ptr<Mapping> map_;
  std::vector<TensorInfo> tensors_;  // sorted by name
  std::map<std::string, std::string> metadata_;
  const uint8_t* buffer() const;
};

/// A model's weights in one folder: either a single `model.safetensors` or shards listed by
/// `model.safetensors.index.json` (`{"metadata": {...}, "weight_map": {tensor: shard file}}`).
/// Lookups are the same whichever layout. Invariants (checked at open): each tensor name lives in
/// exactly one shard; every shard named by the index exists and holds the tensors the index assigns
/// to it; no shard holds a tensor the index does not list.
class SafetensorsCheckpoint {
 public:
  /// Opens `path`: a folder (model.safetensors is used when present, as HF does, else
  /// model.safetensors.index.json), or a single .safetensors file, or an index .json file.
  /// Throws dflash::Error naming the folder/index/shard for: nothing to load, malformed index JSON,
  /// a shard that is missing or outside the folder, a tensor in two shards (or listed twice), a
  /// tensor the index names but its shard lacks, a tensor a shard holds but the index omits, and
  /// any error of SafetensorsFile.
  explicit SafetensorsCheckpoint(const std::filesystem::path& path);

  /// The folder holding the files.
  const std::filesystem::path& dir() const { return dir_; }
  /// The index file, or empty for a single-file checkpoint.
  const std::filesystem::path& index_path() const { return index_path_; }
  /// Number of .safetensors files (1 for a single file).
  size_t num_shards() const { return shards_.size(); }
  const std::vector<std::shared_ptr<const SafetensorsFile>>& shards() const { return shards_; }
  /// The index's "metadata" object as strings (numbers are printed as JSON), empty without index.
  const std::map<std::string, std::string>& index_metadata() const { return index_metadata_; }

  /// All tensor names, sorted.
  std::vector<std::string> names() const;
  size_t size() const { return where_.size(); }
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  /// The entry of `name`; throws dflash::Error naming the checkpoint and tensor when absent.
  const TensorInfo& info(const std::string& name) const;
  /// The shard holding `name` (throws like info()).
  const SafetensorsFile& shard_of(const std::string& name) const;
  /// Zero-copy view of `name` (see SafetensorsFile::get).
  Tensor get(const std::string& name) const;
  /// `name` converted to `dtype` (see SafetensorsFile::get_as).
  Tensor get_as(const std::string& name, DType dtype) const;

 private:
  std::filesystem::path dir_, index_path_;
  std::vector<std::shared_ptr<const SafetensorsFile>> shards_;
  std::map<std::string, size_t> where_;  // tensor -> shard index
  std::map<std::string, std::string> index_metadata_;
};

/// Writes `tensors` to `path` in the safetensors format with `metadata` as `__metadata__`.
/// Atomic: the bytes go to a temporary file in the same folder, which is fsynced, renamed over
/// `path`, and the folder is fsynced; on any failure the temporary file is removed and `path` is
/// untouched. Tensors may be strided or on a CUDA device (copied to the host first). Data are laid
/// out by decreasing element size, then name, so every tensor is naturally aligned and the buffer
/// has no holes (the layout of the reference writer). Throws dflash::Error naming the file for I/O
/// errors, and the tensor for an empty/duplicate/reserved name or an undefined tensor.
void safetensors_write(const std::filesystem::path& path,
                       const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});
/// Same, from a name-ordered map.
void safetensors_write(const std::filesystem::path& path, const std::map<std::string, Tensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});
/// Same, from a braced list: `safetensors_write(p, {{"w", w}, {"b", b}})`.
void safetensors_write(const std::filesystem::path& path,
                       std::initializer_list<std::pair<std::string, Tensor>> tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace dflash
