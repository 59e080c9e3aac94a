#include "model/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

#include "core/error.hpp"
#include "core/json_util.hpp"
#include "core/log.hpp"

namespace dflash {

namespace fs = std::filesystem;
using nlohmann::json;

// ------------------------------------------------------------------ mapping

struct SafetensorsFile::Mapping {
  void* addr = nullptr;
  size_t len = 0;
  ~Mapping() {
    if (addr != nullptr && addr != MAP_FAILED) munmap(addr, len);
  }
};

namespace {

std::string errno_str() { return std::strerror(errno); }

uint64_t read_le_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

/// Parses one header entry into `info`; `where` prefixes errors ("FILE: tensor 'x'").
TensorInfo parse_entry(const std::string& name, const json& e, const std::string& where) {
  DFLASH_CHECK(e.is_object(), "{}: header entry is a JSON {}, expected an object", where,
               json_type(e));
  TensorInfo info;
  info.name = name;

  auto dt = e.find("dtype");
  DFLASH_CHECK(dt != e.end(), "{}: header entry has no 'dtype'", where);
  DFLASH_CHECK(dt->is_string(), "{}: 'dtype' is a JSON {}, expected a string", where,
               json_type(*dt));
  const std::string dname = dt->get<std::string>();
  DFLASH_CHECK(dtype_from_safetensors_name(dname, &info.dtype),
               "{}: unknown or unsupported dtype '{}' (dflash reads F32, BF16, F16, I32, I64, "
               "BOOL, U8)",
               where, dname);

  auto sh = e.find("shape");
  DFLASH_CHECK(sh != e.end(), "{}: header entry has no 'shape'", where);
  DFLASH_CHECK(sh->is_array(), "{}: 'shape' is a JSON {}, expected an array", where,
               json_type(*sh));
  for (const json& d : *sh) {
    DFLASH_CHECK(d.is_number_integer(), "{}: shape {} has a non-integer dimension", where,
                 sh->dump());
    DFLASH_CHECK(d.is_number_unsigned(), "{}: shape {} has a negative dimension", where,
                 sh->dump());
    uint64_t v = d.get<uint64_t>();
    DFLASH_CHECK(v <= static_cast<uint64_t>(INT64_MAX), "{}: shape {} has a dimension too large",
                 where, sh->dump());
    info.shape.push_back(static_cast<int64_t>(v));
  }

  auto off = e.find("data_offsets");
  DFLASH_CHECK(off != e.end(), "{}: header entry has no 'data_offsets'", where);
  DFLASH_CHECK(off->is_array() && off->size() == 2 && (*off)[0].is_number_unsigned() &&
                   (*off)[1].is_number_unsigned(),
               "{}: 'data_offsets' must be two non-negative integers, got {}", where, off->dump());
  info.data_offsets = {(*off)[0].get<uint64_t>(), (*off)[1].get<uint64_t>()};
  DFLASH_CHECK(info.data_offsets.first <= info.data_offsets.second,
               "{}: data_offsets [{}, {}] end before they begin", where, info.data_offsets.first,
               info.data_offsets.second);

  // numel * dtype size, with overflow checks.
  uint64_t bytes = dtype_size(info.dtype);
  for (int64_t d : info.shape) {
    DFLASH_CHECK(!__builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes),
                 "{}: shape {} is too large (byte size overflows)", where, sh->dump());
  }
  DFLASH_CHECK(info.nbytes() == bytes,
               "{}: data_offsets [{}, {}] hold {} bytes, but shape {} of {} needs {} bytes", where,
               info.data_offsets.first, info.data_offsets.second, info.nbytes(),
               shape_str(info.shape), dname, bytes);
  return info;
}

}  // namespace

// ------------------------------------------------------------------ SafetensorsFile

SafetensorsFile::SafetensorsFile(const fs::path& path) : path_(path) {
  const std::string file = path.string();
  int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  DFLASH_CHECK(fd >= 0, "cannot open safetensors file {}: {}", file, errno_str());
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    std::string err = errno_str();
    ::close(fd);
    fail("cannot stat {}: {}", file, err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("{} is not a regular file", file);
  }
  file_size_ = static_cast<uint64_t>(st.st_size);
  if (file_size_ < 8) {
    ::close(fd);
    fail("{}: truncated safetensors file ({} bytes, less than the 8-byte header length)", file,
         file_size_);
  }
  map_ = std::make_shared<Mapping>();
  map_->len = static_cast<size_t>(file_size_);
  // Private, writable copy-on-write mapping: views may be written by callers without touching the
  // file. Pages are read lazily on first access.
  map_->addr = mmap(nullptr, map_->len, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  std::string map_err = map_->addr == MAP_FAILED ? errno_str() : "";
  ::close(fd);
  DFLASH_CHECK(map_->addr != MAP_FAILED, "cannot mmap {}: {}", file, map_err);

  const auto* base = static_cast<const uint8_t*>(map_->addr);
  header_size_ = read_le_u64(base);
  DFLASH_CHECK(header_size_ <= kSafetensorsMaxHeaderBytes,
               "{}: header length {} is larger than the {} byte limit (corrupt or not a "
               "safetensors file)",
               file, header_size_, kSafetensorsMaxHeaderBytes);
  DFLASH_CHECK(header_size_ <= file_size_ - 8,
               "{}: header length {} is larger than the file allows ({} bytes after the length "
               "prefix): truncated file",
               file, header_size_, file_size_ - 8);
  DFLASH_CHECK(header_size_ >= 2, "{}: header length {} is too small for a JSON object", file,
               header_size_);

  std::string_view text(reinterpret_cast<const char*>(base + 8), header_size_);
  json header = json_parse_strict(text, file + " (header)");
  DFLASH_CHECK(header.is_object(), "{}: header is a JSON {}, expected an object", file,
               json_type(header));

  const uint64_t buffer_size = file_size_ - 8 - header_size_;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      const json& m = it.value();
      if (m.is_null()) continue;
      DFLASH_CHECK(m.is_object(), "{}: __metadata__ is a JSON {}, expected an object", file,
                   json_type(m));
      for (auto mi = m.begin(); mi != m.end(); ++mi) {
        DFLASH_CHECK(mi.value().is_string(),
                     "{}: __metadata__ value of '{}' is a JSON {}, expected a string", file,
                     mi.key(), json_type(mi.value()));
        metadata_[mi.key()] = mi.value().get<std::string>();
      }
      continue;
    }
    const std::string where = fmt::format("{}: tensor '{}'", file, it.key());
    DFLASH_CHECK(!it.key().empty(), "{}: header has a tensor with an empty name", file);
    TensorInfo info = parse_entry(it.key(), it.value(), where);
    DFLASH_CHECK(info.data_offsets.second <= buffer_size,
                 "{}: data_offsets [{}, {}] reach past the end of the data buffer ({} bytes): "
                 "truncated or corrupt file",
                 where, info.data_offsets.first, info.data_offsets.second, buffer_size);
    tensors_.push_back(std::move(info));
  }
  // nlohmann::json objects iterate in key order, so tensors_ is sorted by name already; keep the
  // invariant explicit.
  std::sort(tensors_.begin(), tensors_.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });

  // No overlap: sort by begin offset; each non-empty range must start at or after the previous
  // non-empty range's end.
  std::vector<const TensorInfo*> by_offset;
  for (const auto& t : tensors_) {
    if (t.nbytes() > 0) by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->data_offsets.first < b->data_offsets.first;
  });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const TensorInfo* p = by_offset[i - 1];
    const TensorInfo* q = by_offset[i];
    DFLASH_CHECK(q->data_offsets.first >= p->data_offsets.second,
                 "{}: tensors '{}' [{}, {}] and '{}' [{}, {}] overlap in the data buffer", file,
                 p->name, p->data_offsets.first, p->data_offsets.second, q->name,
                 q->data_offsets.first, q->data_offsets.second);
  }
}

SafetensorsFile::~SafetensorsFile() = default;

const uint8_t* SafetensorsFile::buffer() const {
  return static_cast<const uint8_t*>(map_->addr) + 8 + header_size_;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> r;
  r.reserve(tensors_.size());
  for (const auto& t : tensors_) r.push_back(t.name);
  return r;
}

bool SafetensorsFile::contains(const std::string& name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const TensorInfo& t, const std::string& n) { return t.name < n; });
  return it != tensors_.end() && it->name == name;
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const TensorInfo& t, const std::string& n) { return t.name < n; });
  DFLASH_CHECK(it != tensors_.end() && it->name == name, "{}: no tensor named '{}'",
               path_.string(), name);
  return *it;
}

Tensor SafetensorsFile::get(const std::string& name) const {
  const TensorInfo& ti = info(name);
  // Storage::wrap wants a mutable pointer; the mapping is private copy-on-write, so writes through
  // it stay in this process.
  auto* p = const_cast<uint8_t*>(buffer() + ti.data_offsets.first);
  if (reinterpret_cast<uintptr_t>(p) % dtype_size(ti.dtype) != 0) {
    Tensor t = Tensor::empty(ti.shape, ti.dtype);
    if (ti.nbytes() > 0) std::memcpy(t.raw(), p, ti.nbytes());
    return t;
  }
  return Tensor::from_blob(p, ti.shape, ti.dtype, Device::cpu(), map_);
}

Tensor SafetensorsFile::get_as(const std::string& name, DType dtype) const {
  const TensorInfo& ti = info(name);
  if (ti.dtype == dtype) return get(name);
  Tensor out = Tensor::empty(ti.shape, dtype);
  const uint8_t* src = buffer() + ti.data_offsets.first;
  // convert_elements reads typed elements; go through an aligned copy when the file is unaligned.
  Tensor aligned;
  if (reinterpret_cast<uintptr_t>(src) % dtype_size(ti.dtype) != 0) {
    aligned = get(name);
    src = static_cast<const uint8_t*>(aligned.raw());
  }
  try {
    convert_elements(out.raw(), dtype, src, ti.dtype, static_cast<size_t>(ti.numel()));
  } catch (const Error& e) {
    throw e.with_context(fmt::format("{}: tensor '{}' ({} -> {})", path_.string(), name,
                                     dtype_name(ti.dtype), dtype_name(dtype)));
  }
  return out;
}

// ------------------------------------------------------------------ SafetensorsCheckpoint

namespace {
constexpr const char* kSingleName = "model.safetensors";
constexpr const char* kIndexName = "model.safetensors.index.json";
}  // namespace

SafetensorsCheckpoint::SafetensorsCheckpoint(const fs::path& path) {
  std::error_code ec;
  fs::path single;
  if (fs::is_directory(path, ec)) {
    dir_ = path;
    if (fs::exists(path / kSingleName, ec)) {
      single = path / kSingleName;
    } else if (fs::exists(path / kIndexName, ec)) {
      index_path_ = path / kIndexName;
    } else {
      fail("{}: no {} or {} in this folder", path.string(), kSingleName, kIndexName);
    }
  } else if (fs::is_regular_file(path, ec)) {
    dir_ = path.parent_path().empty() ? fs::path(".") : path.parent_path();
    if (path.extension() == ".json") index_path_ = path;
    else single = path;
  } else {
    fail("{}: no such file or folder", path.string());
  }

  if (!single.empty()) {
    auto f = std::make_shared<const SafetensorsFile>(single);
    for (const auto& t : f->tensors()) where_[t.name] = 0;
    shards_.push_back(std::move(f));
    return;
  }

  const std::string idx = index_path_.string();
  json j = json_load_file(index_path_);
  DFLASH_CHECK(j.is_object(), "{}: top level is a JSON {}, expected an object", idx, json_type(j));
  if (auto m = j.find("metadata"); m != j.end() && !m->is_null()) {
    DFLASH_CHECK(m->is_object(), "{}: 'metadata' is a JSON {}, expected an object", idx,
                 json_type(*m));
    for (auto it = m->begin(); it != m->end(); ++it) {
      index_metadata_[it.key()] =
          it.value().is_string() ? it.value().get<std::string>() : it.value().dump();
    }
  }
  auto wm = j.find("weight_map");
  DFLASH_CHECK(wm != j.end(), "{}: missing key 'weight_map'", idx);
  DFLASH_CHECK(wm->is_object(), "{}: 'weight_map' is a JSON {}, expected an object", idx,
               json_type(*wm));
  DFLASH_CHECK(!wm->empty(), "{}: 'weight_map' is empty", idx);

  // Open each distinct shard once, in sorted order.
  std::map<std::string, size_t> shard_index;
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    DFLASH_CHECK(it.value().is_string(),
                 "{}: weight_map entry of tensor '{}' is a JSON {}, expected a file name", idx,
                 it.key(), json_type(it.value()));
    shard_index.emplace(it.value().get<std::string>(), 0);
  }
  for (auto& [shard, i] : shard_index) {
    fs::path rel(shard);
    bool inside = !shard.empty() && rel.is_relative();
    for (const auto& part : rel) inside = inside && part != "..";
    DFLASH_CHECK(inside, "{}: shard name '{}' is not a file inside {}", idx, shard,
                 dir_.string());
    fs::path p = dir_ / rel;
    if (!fs::exists(p, ec)) {
      std::string example;
      for (auto it = wm->begin(); it != wm->end(); ++it) {
        if (it.value() == shard) {
          example = it.key();
          break;
        }
      }
      fail("{}: shard '{}' (holding e.g. tensor '{}') does not exist in {}", idx, shard, example,
           dir_.string());
    }
    i = shards_.size();
    shards_.push_back(std::make_shared<const SafetensorsFile>(p));
  }

  // No tensor in two shards.
  for (const auto& [shard, i] : shard_index) {
    for (const auto& t : shards_[i]->tensors()) {
      auto [it, fresh] = where_.emplace(t.name, i);
      DFLASH_CHECK(fresh, "{}: tensor '{}' is in two shards, '{}' and '{}'", idx, t.name,
                   shards_[it->second]->path().filename().string(), shard);
    }
  }
  // Each shard holds only tensors the index assigns to it.
  for (const auto& [shard, i] : shard_index) {
    for (const auto& t : shards_[i]->tensors()) {
      auto listed = wm->find(t.name);
      DFLASH_CHECK(listed != wm->end(),
                   "{}: shard '{}' holds tensor '{}', which the index does not list", idx, shard,
                   t.name);
      DFLASH_CHECK(listed->get<std::string>() == shard,
                   "{}: tensor '{}' is listed in shard '{}' but found in shard '{}'", idx, t.name,
                   listed->get<std::string>(), shard);
    }
  }
  // Every listed tensor exists in its shard.
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    DFLASH_CHECK(where_.count(it.key()) != 0,
                 "{}: tensor '{}' is listed in shard '{}', which does not contain it", idx,
                 it.key(), it.value().get<std::string>());
  }
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> r;
  r.reserve(where_.size());
  for (const auto& [n, i] : where_) r.push_back(n);
  return r;
}

const SafetensorsFile& SafetensorsCheckpoint::shard_of(const std::string& name) const {
  auto it = where_.find(name);
  DFLASH_CHECK(it != where_.end(), "checkpoint {}: no tensor named '{}'", dir_.string(), name);
  return *shards_[it->second];
}

const TensorInfo& SafetensorsCheckpoint::info(const std::string& name) const {
  return shard_of(name).info(name);
}

Tensor SafetensorsCheckpoint::get(const std::string& name) const { return shard_of(name).get(name); }

Tensor SafetensorsCheckpoint::get_as(const std::string& name, DType dtype) const {
  return shard_of(name).get_as(name, dtype);
}

// ------------------------------------------------------------------ writer

namespace {

/// An fd that closes itself and a temporary path that removes itself unless released.
struct TempFile {
  int fd = -1;
  std::string path;
  bool keep = false;
  ~TempFile() {
    if (fd >= 0) ::close(fd);
    if (!keep && !path.empty()) ::unlink(path.c_str());
  }
};

void write_all(int fd, const void* data, size_t n, const std::string& file) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t{1} << 30));
    if (w < 0 && errno == EINTR) continue;
    DFLASH_CHECK(w > 0, "writing {}: {}", file, w < 0 ? errno_str() : "short write");
    p += w;
    n -= static_cast<size_t>(w);
  }
}

}  // namespace

void safetensors_write(const fs::path& path,
                       const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  const std::string file = path.string();
  // Host-side contiguous copies where needed.
  struct Item {
    std::string name;
    Tensor t;
  };
  std::vector<Item> items;
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    DFLASH_CHECK(!name.empty(), "{}: cannot write a tensor with an empty name", file);
    DFLASH_CHECK(name != "__metadata__", "{}: '__metadata__' is reserved, not a tensor name",
                 file);
    DFLASH_CHECK(seen.insert(name).second, "{}: tensor '{}' given twice", file, name);
    DFLASH_CHECK(t.defined(), "{}: tensor '{}' is undefined", file, name);
    Tensor h = t;
    if (!h.device().is_cpu()) {
      Tensor c = Tensor::empty(h.shape(), h.dtype());
      c.copy_from(h.is_contiguous() ? h : h.contiguous());
      h = c;
    } else if (!h.is_contiguous()) {
      h = h.contiguous();
    }
    items.push_back({name, h});
  }
  // Layout of the reference writer: larger elements first, then by name.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    size_t sa = dtype_size(a.t.dtype()), sb = dtype_size(b.t.dtype());
    return sa != sb ? sa > sb : a.name < b.name;
  });

  json header = json::object();
  uint64_t offset = 0;
  for (const auto& it : items) {
    uint64_t n = it.t.nbytes();
    header[it.name] = {{"dtype", std::string(dtype_safetensors_name(it.t.dtype()))},
                       {"shape", it.t.shape()},
                       {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  // Pad with spaces so the buffer starts 8-byte aligned.
  while ((text.size() + 8) % 8 != 0) text.push_back(' ');
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>((uint64_t{text.size()} >> (8 * i)) & 0xff);

  fs::path dir = path.parent_path().empty() ? fs::path(".") : path.parent_path();
  TempFile tmp;
  std::string tmpl = (dir / (path.filename().string() + ".tmp.XXXXXX")).string();
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  tmp.fd = mkstemp(buf.data());
  DFLASH_CHECK(tmp.fd >= 0, "cannot create a temporary file next to {}: {}", file, errno_str());
  tmp.path = buf.data();
  fchmod(tmp.fd, 0644);

  write_all(tmp.fd, len, 8, file);
  write_all(tmp.fd, text.data(), text.size(), file);
  for (const auto& it : items) {
    if (it.t.nbytes() > 0) write_all(tmp.fd, it.t.raw(), it.t.nbytes(), file);
  }
  DFLASH_CHECK(fsync(tmp.fd) == 0, "fsync of {}: {}", tmp.path, errno_str());
  int rc = ::close(tmp.fd);
  tmp.fd = -1;
  DFLASH_CHECK(rc == 0, "closing {}: {}", tmp.path, errno_str());
  DFLASH_CHECK(std::rename(tmp.path.c_str(), file.c_str()) == 0, "renaming {} to {}: {}", tmp.path,
               file, errno_str());
  tmp.keep = true;
  int dfd = ::open(dir.string().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DFLASH_CHECK(dfd >= 0, "opening folder {} to fsync it: {}", dir.string(), errno_str());
  rc = fsync(dfd);
  std::string err = rc != 0 ? errno_str() : "";
  ::close(dfd);
  DFLASH_CHECK(rc == 0, "fsync of folder {}: {}", dir.string(), err);
}

void safetensors_write(const fs::path& path, const std::map<std::string, Tensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<std::pair<std::string, Tensor>> v(tensors.begin(), tensors.end());
  safetensors_write(path, v, metadata);
}

void safetensors_write(const fs::path& path,
                       std::initializer_list<std::pair<std::string, Tensor>> tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<std::pair<std::string, Tensor>> v(tensors.begin(), tensors.end());
  safetensors_write(path, v, metadata);
}

}  // namespace dflash
