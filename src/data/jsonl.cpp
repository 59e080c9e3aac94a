// dflash.cpp — line reader over plain / xz / zstd files (see jsonl.hpp for the invariants).
#include "data/jsonl.hpp"

#include <lzma.h>
#include <zstd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "core/error.hpp"

namespace dflash {

namespace {
constexpr size_t kChunk = 1 << 20;
}  // namespace

/// A source of decompressed bytes. read() returns the number of bytes written (0 = end).
struct LineReader::Source {
  explicit Source(std::FILE* f, std::filesystem::path p) : file(f), path(std::move(p)) {}
  virtual ~Source() {
    if (file) std::fclose(file);
  }
  virtual size_t read(char* out, size_t cap) = 0;
  virtual const char* name() const = 0;

  // Raw bytes of the file; returns 0 at EOF, throws on an I/O error.
  size_t read_raw(char* out, size_t cap) {
    size_t n = std::fread(out, 1, cap, file);
    if (n == 0 && std::ferror(file))
      fail("{}: read error: {}", path.string(), std::strerror(errno));
    return n;
  }
  std::FILE* file;
  std::filesystem::path path;
};

namespace {

struct PlainSource final : LineReader::Source {
  using Source::Source;
  size_t read(char* out, size_t cap) override { return read_raw(out, cap); }
  const char* name() const override { return "plain"; }
};

struct XzSource final : LineReader::Source {
  XzSource(std::FILE* f, std::filesystem::path p) : Source(f, std::move(p)), in(kChunk) {
    lzma_ret r = lzma_stream_decoder(&strm, UINT64_MAX, LZMA_CONCATENATED);
    if (r != LZMA_OK)
      fail("{}: cannot start the xz decoder (lzma error {})", path.string(), static_cast<int>(r));
  }
  ~XzSource() override { lzma_end(&strm); }
  size_t read(char* out, size_t cap) override {
    if (done) return 0;
    strm.next_out = reinterpret_cast<uint8_t*>(out);
    strm.avail_out = cap;
    while (strm.avail_out == cap) {
      lzma_action action = LZMA_RUN;
      if (strm.avail_in == 0) {
        if (!in_eof) {
          size_t n = read_raw(reinterpret_cast<char*>(in.data()), in.size());
          strm.next_in = in.data();
          strm.avail_in = n;
          if (n == 0) in_eof = true;
        }
      }
      if (in_eof && strm.avail_in == 0) action = LZMA_FINISH;
      lzma_ret r = lzma_code(&strm, action);
      if (r == LZMA_STREAM_END) {
        done = true;
        break;
      }
      if (r != LZMA_OK) {
        if (r == LZMA_BUF_ERROR) fail("{}: truncated xz stream", path.string());
        fail("{}: corrupt xz data (lzma error {})", path.string(), static_cast<int>(r));
      }
    }
    return cap - strm.avail_out;
  }
  const char* name() const override { return "xz"; }
  lzma_stream strm = LZMA_STREAM_INIT;
  std::vector<uint8_t> in;
  bool in_eof = false, done = false;
};

struct ZstdSource final : LineReader::Source {
  ZstdSource(std::FILE* f, std::filesystem::path p) : Source(f, std::move(p)), in(kChunk) {
    ds = ZSTD_createDStream();
    if (!ds) fail("{}: cannot create the zstd decoder", path.string());
  }
  ~ZstdSource() override { ZSTD_freeDStream(ds); }
  size_t read(char* out, size_t cap) override {
    ZSTD_outBuffer ob{out, cap, 0};
    while (ob.pos == 0) {
      if (ib.pos == ib.size) {
        size_t n = read_raw(in.data(), in.size());
        if (n == 0) {
          // A frame still open (last_ret != 0) at the end of the file means truncation.
          if (last_ret != 0) fail("{}: truncated zstd stream", path.string());
          return 0;
        }
        ib = ZSTD_inBuffer{in.data(), n, 0};
      }
      last_ret = ZSTD_decompressStream(ds, &ob, &ib);
      if (ZSTD_isError(last_ret)) {
        fail("{}: corrupt zstd data ({})", path.string(), ZSTD_getErrorName(last_ret));
      }
    }
    return ob.pos;
  }
  const char* name() const override { return "zstd"; }
  ZSTD_DStream* ds = nullptr;
  std::vector<char> in;
  ZSTD_inBuffer ib{nullptr, 0, 0};
  size_t last_ret = 0;
};

}  // namespace

LineReader::LineReader(const std::filesystem::path& path) : path_(path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) fail("{}: cannot open: {}", path.string(), std::strerror(errno));
  unsigned char magic[6] = {0, 0, 0, 0, 0, 0};
  size_t n = std::fread(magic, 1, sizeof magic, f);
  std::rewind(f);
  static const unsigned char kXz[6] = {0xFD, '7', 'z', 'X', 'Z', 0x00};
  static const unsigned char kZstd[4] = {0x28, 0xB5, 0x2F, 0xFD};
  if (n >= 6 && std::memcmp(magic, kXz, 6) == 0) {
    src_ = std::make_unique<XzSource>(f, path);
  } else if (n >= 4 && std::memcmp(magic, kZstd, 4) == 0) {
    src_ = std::make_unique<ZstdSource>(f, path);
  } else {
    src_ = std::make_unique<PlainSource>(f, path);
  }
}

LineReader::~LineReader() = default;

const char* LineReader::compression() const {
  return src_->name();
}

bool LineReader::fill() {
  if (eof_) return false;
  if (pos_ > 0) {
    buf_.erase(0, pos_);
    pos_ = 0;
  }
  size_t old = buf_.size();
  buf_.resize(old + kChunk);
  size_t n = src_->read(buf_.data() + old, kChunk);
  buf_.resize(old + n);
  if (n == 0) eof_ = true;
  return n > 0;
}

bool LineReader::next(std::string& line) {
  size_t scan = pos_;  // bytes before `scan` (from pos_) hold no '\n'
  for (;;) {
    size_t nl = buf_.find('\n', scan);
    if (nl != std::string::npos) {
      size_t end = nl;
      if (end > pos_ && buf_[end - 1] == '\r') --end;
      line.assign(buf_, pos_, end - pos_);
      pos_ = nl + 1;
      ++line_no_;
      return true;
    }
    size_t scanned = buf_.size() - pos_;
    if (!fill()) {
      if (pos_ >= buf_.size()) return false;
      // Last line without a terminator.
      size_t end = buf_.size();
      if (end > pos_ && buf_[end - 1] == '\r') --end;
      line.assign(buf_, pos_, end - pos_);
      pos_ = buf_.size();
      ++line_no_;
      return true;
    }
    scan = pos_ + scanned;  // fill() moved the unread bytes to the front (pos_ == 0)
  }
}

}  // namespace dflash
