// Bindings of the settings table (settings.hpp): its parsers, its rows, and the limits and codes
// the Python layer takes from the core rather than restating (UPPER_CASE ints, dict enums).
#include "bindings.hpp"

#include <string>

#include "pydatacopy/double_buffer_manager.hpp"
#include "pydatacopy/settings.hpp"

namespace pydatacopy::bindings {

namespace {
py::object as_python(const settings::Value& v) {
  switch (v.kind) {
    case settings::Kind::kSwitch: return py::bool_(v.on);
    case settings::Kind::kInt: return py::int_(v.integer);
    case settings::Kind::kNvshmemSize: return py::int_(v.bytes);
    case settings::Kind::kSeconds:
    case settings::Kind::kPercentage: return py::float_(v.number);
  }
  return py::none();
}
}  // namespace

void bind_settings(py::module_& m) {
  namespace s = settings;
  m.attr("MAX_TIMEOUT_S") = s::kMaxTimeoutSeconds;
  m.attr("MAX_CHUNK_BYTES") = s::kMaxChunkBytes;
  m.attr("MAX_SEND_BLOCKS") = s::kMaxSendBlocks;
  m.attr("MAX_RANKS_PER_GPU") = s::kMaxRanksPerGpu;
  m.attr("MAX_GROUP_OPS") = s::kMaxGroupOps;
  m.attr("DEFAULT_CHUNK_BYTES") = s::kDefaultChunkBytes;
  m.attr("DEFAULT_NUM_CHUNKS") = s::kDefaultNumChunks;
  m.attr("DEFAULT_SEND_BLOCKS") = s::kDefaultSendBlocks;
  m.attr("NARROW_MESSAGE_BYTES") = s::kNarrowMessageBytes;
  m.attr("DEFAULT_NARROW_SEND_BLOCKS") = s::kDefaultNarrowSendBlocks;
  m.attr("DEFAULT_ZERO_COPY_MIN_BYTES") = s::kDefaultZeroCopyMinBytes;
  m.attr("DEFAULT_COPY_ENGINE_MIN_BYTES") = s::kDefaultCopyEngineMinBytes;
  m.attr("ZERO_COPY_FALLBACK_WAIT_NS") = s::kZeroCopyFallbackWaitNs;
  m.attr("ZERO_COPY_FALLBACK_LONG_WAIT_NS") = s::kZeroCopyFallbackLongWaitNs;
  m.attr("LATE_POST_NS") = s::kLatePostNs;
  m.attr("LOW_LATENCY_CAPACITY_BYTES") = s::kLowLatencyCapacityBytes;
  m.attr("DEFAULT_LOW_LATENCY_MAX_BYTES") = s::kDefaultLowLatencyMaxBytes;
  m.attr("NVSHMEM_DEFAULT_SYMMETRIC_SIZE") = s::kNvshmemDefaultSymmetricSize;
  m.attr("MAX_TOKEN_BUFFER_BYTES") = DoubleBufferManager::kMaxBufferBytes;
  py::dict paths, batch_paths;
  for (Path p : {Path::kAuto, Path::kCopyEngine, Path::kSM, Path::kRMA}) {
    paths[path_name(p)] = static_cast<int>(p);
    if (p != Path::kCopyEngine) batch_paths[path_name(p)] = static_cast<int>(p);  // one kernel: no copy engine
  }
  m.attr("PATHS") = paths;
  m.attr("BATCH_PATHS") = batch_paths;

  m.def("parse_seconds", [](const std::string& text, const std::string& name, double fallback) {
    return s::parse_seconds(text, name, fallback);
  }, py::arg("text"), py::arg("name"), py::arg("default"));
  m.def("parse_switch", [](const std::string& text, const std::string& name, const std::string& meaning) {
    return s::parse_switch(text, name, meaning);
  }, py::arg("text"), py::arg("name"), py::arg("meaning"));
  m.def("parse_int", [](const std::string& text, const std::string& name, int64_t minimum, int64_t maximum,
                        const std::string& example, const std::string& meaning) {
    return s::parse_int(text, name, minimum, maximum, example, meaning);
  }, py::arg("text"), py::arg("name"), py::arg("minimum"), py::arg("maximum"), py::arg("example"),
     py::arg("meaning"));
  m.def("parse_percentage", [](const std::string& text, const std::string& name) {
    return s::parse_percentage(text, name);
  }, py::arg("text"), py::arg("name"));
  m.def("parse_nvshmem_size", [](const std::string& text, const std::string& name, bool allow_zero) {
    return s::parse_nvshmem_size(text, name, allow_zero);
  }, py::arg("text"), py::arg("name"), py::arg("allow_zero") = false);
  m.def("parse_setting", [](const std::string& name, const std::string& text) {
    return as_python(s::parse(name, text));
  }, py::arg("name"), py::arg("text"), "`text` as the settings table's row of `name` reads it");
  m.def("settings_table", [] {
    py::list rows;
    for (const s::Setting& row : s::table()) {
      py::dict d;
      d["name"] = row.name;
      d["kind"] = s::kind_name(row.kind);
      d["default"] = row.default_text.empty() ? py::object(py::none()) : py::object(py::str(row.default_text));
      d["minimum"] = row.minimum;
      d["maximum"] = row.maximum;
      d["meaning"] = row.meaning;
      d["example"] = row.example;
      rows.append(d);
    }
    return rows;
  }, "the settings table's rows: name, kind, default (None: unset), minimum, maximum, meaning, example");
}

}  // namespace pydatacopy::bindings
