// dflash.cpp — file digests (see digest.hpp). xxHash is used header-only (XXH_INLINE_ALL), so the
// binary does not link libxxhash and static builds need only the header.
#include "core/digest.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <memory>
#include <vector>

#include "core/error.hpp"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace dflash {

namespace {

// Closes a file descriptor and frees an XXH3 state when a read fails half way.
struct DigestResources {
  int fd = -1;
  XXH3_state_t* state = nullptr;
  ~DigestResources() {
    if (fd >= 0) ::close(fd);
    if (state) XXH3_freeState(state);
  }
};

}  // namespace

FileDigest file_digest(const std::filesystem::path& path) {
  constexpr size_t kChunk = size_t{4} << 20;
  DigestResources r;
  r.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DFLASH_CHECK(r.fd >= 0, "cannot open '{}': {}", path.string(), std::strerror(errno));
  r.state = XXH3_createState();
  DFLASH_CHECK(r.state != nullptr && XXH3_64bits_reset(r.state) == XXH_OK,
               "cannot start a hash of '{}' (out of memory)", path.string());
  std::vector<char> buf(kChunk);
  FileDigest d;
  for (;;) {
    const ssize_t n = ::read(r.fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    DFLASH_CHECK(n >= 0, "reading '{}' failed: {}", path.string(), std::strerror(errno));
    if (n == 0) break;
    XXH3_64bits_update(r.state, buf.data(), static_cast<size_t>(n));
    d.bytes += n;
  }
  d.xxh3 = XXH3_64bits_digest(r.state);
  return d;
}

std::string digest_hex(uint64_t h) {
  return fmt::format("{:016x}", h);
}

uint64_t digest_hex_parse(std::string_view text) {
  uint64_t h = 0;
  const char* end = text.data() + text.size();
  const bool hex_only = text.find_first_not_of("0123456789abcdef") == std::string_view::npos;
  const auto [ptr, ec] = std::from_chars(text.data(), end, h, 16);
  DFLASH_CHECK(text.size() == 16 && hex_only && ec == std::errc() && ptr == end,
               "'{}' is not a digest (16 lowercase hex digits)", text);
  return h;
}

}  // namespace dflash
