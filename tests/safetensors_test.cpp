// Tests of src/model/safetensors: writer/reader round trips for every dtype, hand-made files read
// byte for byte, sharded checkpoints, atomic writes, and every malformed-input case (each must give
// a dflash::Error whose message names the file and, where one is at fault, the tensor).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstring>
#include <random>

#include "core/error.hpp"
#include "model/safetensors.hpp"
#include "util/test_util.hpp"

using namespace dflash;
using dflash::test::TempDir;
using dflash::test::read_file;
using dflash::test::write_file;
using ::testing::HasSubstr;
using nlohmann::json;

namespace {

/// The 8-byte little-endian length prefix, written by hand (independent of the writer).
std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

/// A safetensors file from a header text and a data buffer.
std::string make_file(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

/// Expects constructing a SafetensorsFile on `path` to throw dflash::Error containing every
/// string of `parts`.
void expect_open_error(const std::filesystem::path& path, const std::vector<std::string>& parts) {
  try {
    SafetensorsFile f(path);
    ADD_FAILURE() << "no error opening " << path;
  } catch (const Error& e) {
    for (const auto& p : parts) EXPECT_THAT(e.what(), HasSubstr(p));
  }
}

void expect_ckpt_error(const std::filesystem::path& path, const std::vector<std::string>& parts) {
  try {
    SafetensorsCheckpoint c(path);
    ADD_FAILURE() << "no error opening checkpoint " << path;
  } catch (const Error& e) {
    for (const auto& p : parts) EXPECT_THAT(e.what(), HasSubstr(p));
  }
}

/// A tensor of `dtype` and `shape` filled with random valid values (bool: 0/1; floats: finite).
Tensor random_tensor(DType dtype, const Shape& shape, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, dtype);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  auto* b = static_cast<uint8_t*>(t.raw());
  for (int64_t i = 0; i < t.numel(); ++i) {
    switch (dtype) {
      case DType::f32: reinterpret_cast<float*>(b)[i] = u(rng); break;
      case DType::bf16: reinterpret_cast<uint16_t*>(b)[i] = f32_to_bf16_bits(u(rng)); break;
      case DType::f16: reinterpret_cast<uint16_t*>(b)[i] = f32_to_f16_bits(u(rng)); break;
      case DType::i32: reinterpret_cast<int32_t*>(b)[i] = static_cast<int32_t>(rng()); break;
      case DType::i64:
        reinterpret_cast<int64_t*>(b)[i] = (static_cast<int64_t>(rng()) << 32) ^ rng();
        break;
      case DType::boolean: b[i] = static_cast<uint8_t>(rng() & 1); break;
      case DType::u8: b[i] = static_cast<uint8_t>(rng()); break;
    }
  }
  return t;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && a.nbytes() == b.nbytes() &&
         (a.nbytes() == 0 || std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0);
}

const std::vector<DType> kAllDtypes = {DType::f32, DType::bf16, DType::f16,
                                       DType::i32, DType::i64,  DType::boolean, DType::u8};

}  // namespace

// ------------------------------------------------------------------ round trips

TEST(SafetensorsWrite, RoundTripEveryDtypeAndOddShapes) {
  TempDir dir;
  std::mt19937 rng(7);
  const std::vector<Shape> shapes = {{}, {1}, {7}, {17, 3}, {3, 5, 7}, {0, 4}, {129}};
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (DType dt : kAllDtypes) {
    for (size_t s = 0; s < shapes.size(); ++s) {
      tensors.emplace_back(fmt::format("t.{}.{}", dtype_name(dt), s),
                           random_tensor(dt, shapes[s], rng));
    }
  }
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "dflash test ✓"}};
  auto path = dir / "all.safetensors";
  safetensors_write(path, tensors, meta);

  SafetensorsFile f(path);
  EXPECT_EQ(f.metadata(), meta);
  ASSERT_EQ(f.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(f.contains(name)) << name;
    Tensor r = f.get(name);
    EXPECT_TRUE(same_bytes(r, t)) << name << " " << r.str() << " vs " << t.str();
    EXPECT_EQ(f.info(name).dtype, t.dtype());
    EXPECT_EQ(f.info(name).shape, t.shape());
  }
  EXPECT_FALSE(f.contains("nope"));
}

TEST(SafetensorsWrite, LayoutFollowsTheFormatByteForByte) {
  // Parse the written file by hand: length prefix, JSON, 8-aligned buffer start, contiguous and
  // naturally aligned tensors, larger elements first.
  TempDir dir;
  std::mt19937 rng(1);
  std::vector<std::pair<std::string, Tensor>> tensors = {
      {"b", random_tensor(DType::boolean, {3}, rng)},
      {"a", random_tensor(DType::bf16, {5}, rng)},
      {"c", random_tensor(DType::i64, {2}, rng)},
      {"d", random_tensor(DType::f32, {3}, rng)}};
  auto path = dir / "x.safetensors";
  safetensors_write(path, tensors, {{"k", "v"}});
  std::string bytes = read_file(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  EXPECT_EQ((8 + n) % 8, 0u);
  json h = json::parse(bytes.substr(8, n));
  EXPECT_EQ(h["__metadata__"]["k"], "v");
  EXPECT_EQ(h["c"]["dtype"], "I64");
  EXPECT_EQ(h["c"]["data_offsets"], json::array({0, 16}));
  EXPECT_EQ(h["d"]["dtype"], "F32");
  EXPECT_EQ(h["d"]["data_offsets"], json::array({16, 28}));
  EXPECT_EQ(h["a"]["dtype"], "BF16");
  EXPECT_EQ(h["a"]["data_offsets"], json::array({28, 38}));
  EXPECT_EQ(h["b"]["dtype"], "BOOL");
  EXPECT_EQ(h["b"]["data_offsets"], json::array({38, 41}));
  EXPECT_EQ(h["a"]["shape"], json::array({5}));
  EXPECT_EQ(bytes.size(), 8 + n + 41);
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + n + 16, tensors[3].second.raw(), 12), 0);
}

TEST(SafetensorsRead, HandMadeFileWithUnalignedTensorAndViewsOutliveTheFile) {
  // Header length 61 is not a multiple of 8, so the F32 tensor is unaligned in memory: get() must
  // still give the right values.
  const float vals[3] = {1.5f, -2.25f, 1e-3f};
  std::string data(reinterpret_cast<const char*>(vals), 12);
  std::string bf(2, '\0');
  uint16_t one = f32_to_bf16_bits(3.0f);
  std::memcpy(bf.data(), &one, 2);
  data += bf;
  std::string header =
      R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},"h":{"dtype":"BF16","shape":[1,1],"data_offsets":[12,14]}})";
  TempDir dir;
  write_file(dir / "m.safetensors", make_file(header, data));
  Tensor w, h, w16;
  {
    SafetensorsFile f(dir / "m.safetensors");
    EXPECT_EQ(f.header_size(), header.size());
    EXPECT_TRUE(f.metadata().empty());
    EXPECT_EQ(f.names(), (std::vector<std::string>{"h", "w"}));
    w = f.get("w");
    h = f.get("h");
    w16 = f.get_as("w", DType::bf16);
    Tensor h32 = f.get_as("h", DType::f32);
    EXPECT_EQ(h32.dtype(), DType::f32);
    EXPECT_EQ(h32.item_f64(0), 3.0);
  }  // the file object is gone; the views keep the mapping alive
  ASSERT_EQ(w.numel(), 3);
  EXPECT_EQ(w.item_f64(0), 1.5);
  EXPECT_EQ(w.item_f64(1), -2.25);
  EXPECT_EQ(w.item_f64(2), static_cast<double>(1e-3f));
  EXPECT_EQ(h.shape(), (Shape{1, 1}));
  EXPECT_EQ(h.item_f64(0), 3.0);
  EXPECT_EQ(w16.dtype(), DType::bf16);
  EXPECT_EQ(w16.data<uint16_t>()[2], f32_to_bf16_bits(1e-3f));
}

TEST(SafetensorsRead, ZeroCopyViewPointsIntoTheMappingAndWritesStayPrivate) {
  TempDir dir;
  std::mt19937 rng(3);
  Tensor t = random_tensor(DType::f32, {17, 7}, rng);
  auto path = dir / "z.safetensors";
  safetensors_write(path, {{"t", t}});
  const std::string before = read_file(path);
  SafetensorsFile f(path);
  Tensor a = f.get("t"), b = f.get("t");
  EXPECT_EQ(a.raw(), b.raw());  // same mapped bytes, no copy
  EXPECT_FALSE(a.storage()->owning());
  a.data<float>()[0] = 42.0f;  // copy-on-write mapping: allowed, never reaches the file
  EXPECT_EQ(read_file(path), before);
}

TEST(SafetensorsWrite, AtomicReplaceLeavesNoTemporaryFiles) {
  TempDir dir;
  std::mt19937 rng(5);
  auto path = dir / "w.safetensors";
  safetensors_write(path, {{"x", random_tensor(DType::f32, {4}, rng)}});
  Tensor y = random_tensor(DType::bf16, {2, 3}, rng);
  safetensors_write(path, std::map<std::string, Tensor>{{"y", y}});
  SafetensorsFile f(path);
  EXPECT_FALSE(f.contains("x"));
  EXPECT_TRUE(same_bytes(f.get("y"), y));
  int entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    ++entries;
    EXPECT_EQ(e.path().filename(), "w.safetensors");
  }
  EXPECT_EQ(entries, 1);
}

TEST(SafetensorsWrite, StridedTensorIsWrittenInLogicalOrder) {
  TempDir dir;
  Tensor t = Tensor::from_f32({0, 1, 2, 3, 4, 5}, {2, 3});
  Tensor col = t.slice(1, 1, 3);  // [[1,2],[4,5]], non-contiguous
  ASSERT_FALSE(col.is_contiguous());
  safetensors_write(dir / "s.safetensors", {{"c", col}});
  SafetensorsFile f(dir / "s.safetensors");
  EXPECT_EQ(f.get("c").to_f32_vector(), (std::vector<float>{1, 2, 4, 5}));
}

TEST(SafetensorsWrite, BadArgumentsFailAndLeaveTheOldFile) {
  TempDir dir;
  auto path = dir / "keep.safetensors";
  Tensor x = Tensor::from_f32({1, 2}, {2});
  safetensors_write(path, {{"x", x}});
  const std::string before = read_file(path);
  auto expect_fail = [&](const std::vector<std::pair<std::string, Tensor>>& ts,
                         const std::string& what) {
    try {
      safetensors_write(path, ts);
      ADD_FAILURE() << "no error for " << what;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("keep.safetensors")) << what;
      EXPECT_THAT(e.what(), HasSubstr(what));
    }
  };
  expect_fail({{"a", x}, {"a", x}}, "'a' given twice");
  expect_fail({{"__metadata__", x}}, "reserved");
  expect_fail({{"", x}}, "empty name");
  expect_fail({{"u", Tensor()}}, "'u' is undefined");
  EXPECT_EQ(read_file(path), before);
  try {
    safetensors_write(dir / "no" / "such" / "dir.safetensors", {{"x", x}});
    ADD_FAILURE() << "no error writing into a missing folder";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("dir.safetensors"));
  }
}

// ------------------------------------------------------------------ bad single files

class SafetensorsBad : public ::testing::Test {
 protected:
  TempDir dir;
  std::filesystem::path put(const std::string& bytes, const std::string& name = "bad.safetensors") {
    auto p = dir / name;
    write_file(p, bytes);
    return p;
  }
};

TEST_F(SafetensorsBad, MissingFile) {
  expect_open_error(dir / "absent.safetensors", {"absent.safetensors"});
}

TEST_F(SafetensorsBad, TruncatedBeforeTheLengthPrefix) {
  expect_open_error(put(std::string(5, '\0')), {"bad.safetensors", "truncated"});
  expect_open_error(put(""), {"bad.safetensors", "truncated"});
}

TEST_F(SafetensorsBad, TruncatedInsideTheData) {
  TempDir d2;
  safetensors_write(d2 / "ok.safetensors", {{"big", Tensor::zeros({129}, DType::f32)}});
  std::string bytes = read_file(d2 / "ok.safetensors");
  expect_open_error(put(bytes.substr(0, bytes.size() - 10)),
                    {"bad.safetensors", "'big'", "past the end"});
}

TEST_F(SafetensorsBad, HeaderLengthLargerThanTheFile) {
  std::string h = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  std::string bytes = le64(h.size() + 100) + h + std::string(4, '\0');
  expect_open_error(put(bytes), {"bad.safetensors", "header length", "larger than the file"});
}

TEST_F(SafetensorsBad, InsaneHeaderLength) {
  expect_open_error(put(le64(uint64_t{1} << 62) + "{}"), {"bad.safetensors", "limit"});
  expect_open_error(put(le64(~uint64_t{0}) + "{}"), {"bad.safetensors", "limit"});
}

TEST_F(SafetensorsBad, MalformedHeaderJson) {
  expect_open_error(put(make_file(R"({"a": {"dtype": "F32", "sha)", "")),
                    {"bad.safetensors", "malformed JSON"});
  expect_open_error(put(make_file("[1, 2, 3]", "")), {"bad.safetensors", "expected an object"});
  expect_open_error(put(make_file(R"({"a": 5})", "")),
                    {"bad.safetensors", "tensor 'a'", "expected an object"});
}

TEST_F(SafetensorsBad, DuplicateTensorInHeader) {
  std::string h =
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  expect_open_error(put(make_file(h, std::string(8, '\0'))), {"bad.safetensors", "duplicate key 'a'"});
}

TEST_F(SafetensorsBad, UnknownDtype) {
  for (const char* dt : {"F64", "Q4_K", "f32", "FP8"}) {
    std::string h = fmt::format(R"({{"w":{{"dtype":"{}","shape":[1],"data_offsets":[0,4]}}}})", dt);
    expect_open_error(put(make_file(h, std::string(4, '\0'))),
                      {"bad.safetensors", "tensor 'w'", std::string("'") + dt + "'"});
  }
  expect_open_error(
      put(make_file(R"({"w":{"dtype":7,"shape":[1],"data_offsets":[0,4]}})", std::string(4, '\0'))),
      {"bad.safetensors", "tensor 'w'", "dtype"});
}

TEST_F(SafetensorsBad, BadShapes) {
  expect_open_error(
      put(make_file(R"({"w":{"dtype":"F32","shape":[-1,4],"data_offsets":[0,0]}})", "")),
      {"bad.safetensors", "tensor 'w'", "negative dimension"});
  expect_open_error(
      put(make_file(R"({"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", std::string(4, 'x'))),
      {"bad.safetensors", "tensor 'w'", "non-integer"});
  expect_open_error(
      put(make_file(
          R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,4],"data_offsets":[0,4]}})",
          std::string(4, 'x'))),
      {"bad.safetensors", "tensor 'w'", "overflow"});
  expect_open_error(put(make_file(R"({"w":{"dtype":"F32","data_offsets":[0,4]}})", "xxxx")),
                    {"bad.safetensors", "tensor 'w'", "'shape'"});
}

TEST_F(SafetensorsBad, ByteSizeContradictsShape) {
  expect_open_error(
      put(make_file(R"({"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,8]}})",
                    std::string(8, '\0'))),
      {"bad.safetensors", "tensor 'w'", "8 bytes", "needs 12 bytes"});
}

TEST_F(SafetensorsBad, OffsetsPastTheEnd) {
  expect_open_error(
      put(make_file(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[16,32]}})",
                    std::string(20, '\0'))),
      {"bad.safetensors", "tensor 'w'", "past the end"});
}

TEST_F(SafetensorsBad, OffsetsReversedOrMalformed) {
  expect_open_error(
      put(make_file(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})", std::string(8, 'x'))),
      {"bad.safetensors", "tensor 'w'", "end before"});
  expect_open_error(
      put(make_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", "xxxx")),
      {"bad.safetensors", "tensor 'w'", "data_offsets"});
  expect_open_error(
      put(make_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", "xxxx")),
      {"bad.safetensors", "tensor 'w'", "data_offsets"});
}

TEST_F(SafetensorsBad, OverlappingTensors) {
  std::string h =
      R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})";
  expect_open_error(put(make_file(h, std::string(16, '\0'))),
                    {"bad.safetensors", "'a'", "'b'", "overlap"});
}

TEST_F(SafetensorsBad, MetadataMustBeStrings) {
  expect_open_error(put(make_file(R"({"__metadata__":{"step":5}})", "")),
                    {"bad.safetensors", "__metadata__", "'step'"});
}

TEST_F(SafetensorsBad, GetUnknownName) {
  TempDir d2;
  safetensors_write(d2 / "ok.safetensors", {{"x", Tensor::zeros({1}, DType::f32)}});
  SafetensorsFile f(d2 / "ok.safetensors");
  try {
    f.get("y");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("ok.safetensors"));
    EXPECT_THAT(e.what(), HasSubstr("'y'"));
  }
}

TEST_F(SafetensorsBad, ConversionOverflowNamesTheTensor) {
  TempDir d2;
  Tensor big = Tensor::empty({1}, DType::i64);
  big.data<int64_t>()[0] = int64_t{1} << 40;
  safetensors_write(d2 / "i.safetensors", {{"ids", big}});
  SafetensorsFile f(d2 / "i.safetensors");
  try {
    f.get_as("ids", DType::i32);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("i.safetensors"));
    EXPECT_THAT(e.what(), HasSubstr("'ids'"));
  }
}

// ------------------------------------------------------------------ checkpoints

namespace {
/// Writes shards and an index mapping each tensor name to its shard.
void write_sharded(const std::filesystem::path& dir,
                   const std::vector<std::vector<std::pair<std::string, Tensor>>>& shards,
                   const json& weight_map) {
  for (size_t i = 0; i < shards.size(); ++i) {
    safetensors_write(dir / fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size()),
                      shards[i]);
  }
  json idx = {{"metadata", {{"total_size", 123}}}, {"weight_map", weight_map}};
  write_file(dir / "model.safetensors.index.json", idx.dump(2));
}
}  // namespace

TEST(SafetensorsCheckpoint, ShardedLookupAcrossShards) {
  TempDir dir;
  std::mt19937 rng(11);
  Tensor a = random_tensor(DType::bf16, {7, 3}, rng), b = random_tensor(DType::f32, {17}, rng),
         c = random_tensor(DType::bf16, {1}, rng);
  write_sharded(dir.path(), {{{"a", a}, {"b", b}}, {{"c", c}}},
                {{"a", "model-00001-of-00002.safetensors"},
                 {"b", "model-00001-of-00002.safetensors"},
                 {"c", "model-00002-of-00002.safetensors"}});
  for (const auto& open_path : {dir.path(), dir / "model.safetensors.index.json"}) {
    SafetensorsCheckpoint ck(open_path);
    EXPECT_EQ(ck.num_shards(), 2u);
    EXPECT_EQ(ck.names(), (std::vector<std::string>{"a", "b", "c"}));
    EXPECT_TRUE(same_bytes(ck.get("a"), a));
    EXPECT_TRUE(same_bytes(ck.get("b"), b));
    EXPECT_TRUE(same_bytes(ck.get("c"), c));
    EXPECT_EQ(ck.shard_of("c").path().filename(), "model-00002-of-00002.safetensors");
    EXPECT_EQ(ck.info("a").shape, (Shape{7, 3}));
    EXPECT_EQ(ck.index_metadata().at("total_size"), "123");
    Tensor a32 = ck.get_as("a", DType::f32);
    EXPECT_EQ(a32.to_f32_vector(), a.to_f32_vector());
    try {
      ck.get("zz");
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("'zz'"));
      EXPECT_THAT(e.what(), HasSubstr(dir.path().string()));
    }
  }
}

TEST(SafetensorsCheckpoint, SingleFileFolderAndFile) {
  TempDir dir;
  Tensor x = Tensor::from_f32({1, 2, 3}, {3});
  safetensors_write(dir / "model.safetensors", {{"x", x}});
  SafetensorsCheckpoint a(dir.path()), b(dir / "model.safetensors");
  EXPECT_EQ(a.num_shards(), 1u);
  EXPECT_TRUE(a.index_path().empty());
  EXPECT_EQ(a.get("x").to_f32_vector(), x.to_f32_vector());
  EXPECT_EQ(b.get("x").to_f32_vector(), x.to_f32_vector());
}

TEST(SafetensorsCheckpoint, EmbeddedTinyModelOpens) {
  SafetensorsCheckpoint ck(dflash::test::assets_dir() / "tiny-qwen3");
  EXPECT_EQ(ck.num_shards(), 4u);
  EXPECT_TRUE(ck.contains("model.embed_tokens.weight"));
  EXPECT_EQ(ck.info("model.embed_tokens.weight").shape, (Shape{8192, 384}));
  EXPECT_EQ(ck.info("model.embed_tokens.weight").dtype, DType::bf16);
}

TEST(SafetensorsCheckpointBad, EmptyFolderAndMissingPath) {
  TempDir dir;
  expect_ckpt_error(dir.path(), {dir.path().string(), "model.safetensors"});
  expect_ckpt_error(dir / "nothing", {"nothing", "no such"});
}

TEST(SafetensorsCheckpointBad, IndexNamesAMissingShard) {
  TempDir dir;
  write_sharded(dir.path(), {{{"a", Tensor::zeros({2}, DType::f32)}}},
                {{"a", "model-00001-of-00001.safetensors"}, {"b", "model-00002-of-00002.safetensors"}});
  expect_ckpt_error(dir.path(), {"model.safetensors.index.json", "model-00002-of-00002.safetensors",
                                 "'b'", "does not exist"});
}

TEST(SafetensorsCheckpointBad, TensorInTwoShards) {
  TempDir dir;
  Tensor z = Tensor::zeros({2}, DType::f32);
  write_sharded(dir.path(), {{{"a", z}, {"w", z}}, {{"b", z}, {"w", z}}},
                {{"a", "model-00001-of-00002.safetensors"},
                 {"b", "model-00002-of-00002.safetensors"},
                 {"w", "model-00002-of-00002.safetensors"}});
  expect_ckpt_error(dir.path(), {"model.safetensors.index.json", "'w'", "two shards",
                                 "model-00001-of-00002.safetensors",
                                 "model-00002-of-00002.safetensors"});
}

TEST(SafetensorsCheckpointBad, TensorListedTwiceInTheIndex) {
  TempDir dir;
  safetensors_write(dir / "s1.safetensors", {{"w", Tensor::zeros({2}, DType::f32)}});
  safetensors_write(dir / "s2.safetensors", {{"v", Tensor::zeros({2}, DType::f32)}});
  write_file(dir / "model.safetensors.index.json",
             R"({"weight_map": {"w": "s1.safetensors", "v": "s2.safetensors", "w": "s2.safetensors"}})");
  expect_ckpt_error(dir.path(), {"model.safetensors.index.json", "duplicate key 'w'"});
}

TEST(SafetensorsCheckpointBad, IndexAndShardDisagree) {
  TempDir dir;
  Tensor z = Tensor::zeros({2}, DType::f32);
  // Listed but absent from its shard.
  write_sharded(dir.path(), {{{"a", z}}}, {{"a", "model-00001-of-00001.safetensors"},
                                          {"ghost", "model-00001-of-00001.safetensors"}});
  expect_ckpt_error(dir.path(), {"model.safetensors.index.json", "'ghost'", "does not contain"});
  // In a shard but not listed.
  TempDir d2;
  write_sharded(d2.path(), {{{"a", z}, {"extra", z}}}, {{"a", "model-00001-of-00001.safetensors"}});
  expect_ckpt_error(d2.path(), {"model.safetensors.index.json", "'extra'", "does not list"});
  // Listed in the wrong shard.
  TempDir d3;
  write_sharded(d3.path(), {{{"a", z}, {"c", z}}, {{"b", z}}},
                {{"a", "model-00002-of-00002.safetensors"},
                 {"b", "model-00002-of-00002.safetensors"},
                 {"c", "model-00001-of-00002.safetensors"}});
  expect_ckpt_error(d3.path(), {"model.safetensors.index.json", "'a'", "found in shard"});
}

TEST(SafetensorsCheckpointBad, MalformedIndex) {
  TempDir dir;
  write_file(dir / "model.safetensors.index.json", R"({"weight_map": {"a": )");
  expect_ckpt_error(dir.path(), {"model.safetensors.index.json", "malformed JSON"});
  write_file(dir / "model.safetensors.index.json", R"({"metadata": {}})");
  expect_ckpt_error(dir.path(), {"model.safetensors.index.json", "'weight_map'"});
  write_file(dir / "model.safetensors.index.json", R"({"weight_map": {"a": 3}})");
  expect_ckpt_error(dir.path(), {"model.safetensors.index.json", "'a'"});
  write_file(dir / "model.safetensors.index.json", R"({"weight_map": {"a": "../x.safetensors"}})");
  expect_ckpt_error(dir.path(), {"model.safetensors.index.json", "../x.safetensors", "not a file inside"});
}

TEST(SafetensorsCheckpointBad, CorruptShardIsNamed) {
  TempDir dir;
  Tensor z = Tensor::zeros({64}, DType::f32);
  write_sharded(dir.path(), {{{"a", z}}, {{"b", z}}},
                {{"a", "model-00001-of-00002.safetensors"}, {"b", "model-00002-of-00002.safetensors"}});
  auto shard = dir / "model-00002-of-00002.safetensors";
  std::string bytes = read_file(shard);
  write_file(shard, bytes.substr(0, bytes.size() / 2));
  expect_ckpt_error(dir.path(), {"model-00002-of-00002.safetensors", "'b'", "past the end"});
}
