#include "core/fs.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/error.hpp"

namespace dflash {

void fsync_path(const std::filesystem::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  DFLASH_CHECK(fd >= 0, "cannot open '{}' to fsync: {}", path.string(), std::strerror(errno));
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  DFLASH_CHECK(rc == 0, "fsync of '{}' failed: {}", path.string(), std::strerror(err));
}

void write_file_atomic(const std::filesystem::path& path, std::string_view bytes) {
  const std::filesystem::path dir = path.has_parent_path() ? path.parent_path() : ".";
  std::string name = path.filename().string();
  name.insert(0, 1, '.');
  name.append(".tmp-XXXXXX");
  std::string buf = (dir / name).string();
  int fd = ::mkstemp(buf.data());
  DFLASH_CHECK(fd >= 0, "cannot create a temporary file next to '{}': {}", path.string(),
               std::strerror(errno));
  ::fchmod(fd, 0644);  // mkstemp creates 0600; written files are ordinary readable files
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int err = errno;
      ::close(fd);
      ::unlink(buf.c_str());
      fail("writing '{}' failed: {}", path.string(), std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    int err = errno;
    ::unlink(buf.c_str());
    fail("flushing '{}' failed: {}", path.string(), std::strerror(err));
  }
  if (::rename(buf.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(buf.c_str());
    fail("renaming '{}' to '{}' failed: {}", buf, path.string(), std::strerror(err));
  }
  fsync_path(dir);
}

void check_file_writable(const std::filesystem::path& path, std::string_view what) {
  std::error_code ec;
  DFLASH_CHECK(!std::filesystem::is_directory(path, ec), "{} '{}' is a folder, not a file", what,
               path.string());
  const std::filesystem::path dir = path.has_parent_path() ? path.parent_path() : ".";
  std::string name = path.filename().string();
  name.insert(0, 1, '.');
  name.append(".probe-XXXXXX");
  std::string probe = (dir / name).string();
  const int fd = ::mkstemp(probe.data());
  DFLASH_CHECK(fd >= 0, "{} '{}' cannot be written: {} (folder '{}')", what, path.string(),
               std::strerror(errno), dir.string());
  ::close(fd);
  ::unlink(probe.c_str());
}

std::string read_file_text(const std::filesystem::path& path) {
  std::ifstream f(path, std::ios::binary);
  DFLASH_CHECK(f.good(), "cannot read '{}'", path.string());
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace dflash
