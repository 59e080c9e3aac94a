// dflash.cpp — the `dflash` binary: parses the command line and runs one subcommand.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <exception>

#include "backend/cpu/blas_core.hpp"
#include "cli/cli_util.hpp"
#include "cli/commands.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

int main(int argc, char** argv) {
  // Before anything else: OpenBLAS chose its kernels when it was loaded; repair a known generic
  // fallback by running again with OPENBLAS_CORETYPE (backend/cpu/blas_core.hpp).
  if (const auto why = dflash::cpu::blas_repair_core_detection(argv)) {
    std::fprintf(stderr, "dflash: warning: %s\n", why->c_str());
  }
  CLI::App app{"dflash: train DFlash block-diffusion drafters and run speculative decoding"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("dflash ") + DFLASH_VERSION +
                                        " (CPU GEMM: OpenBLAS " + dflash::cpu::blas_core_name() +
                                        " kernels)");
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error or off")
      ->capture_default_str();
  app.parse_complete_callback([&] { dflash::log_init(log_level); });

  dflash::cli::add_inspect_command(app);
  dflash::cli::add_data_command(app);
  dflash::cli::add_status_command(app);
  dflash::cli::add_tokenize_command(app);
  dflash::cli::add_dev_command(app);
  dflash::cli::add_train_command(app);
  dflash::cli::add_generate_command(app);
  dflash::cli::add_eval_command(app);
  dflash::cli::add_regenerate_command(app);
  dflash::cli::add_bench_command(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (const auto msg = dflash::cli::unknown_command_message(app)) {
      std::fprintf(stderr, "dflash: error: %s\nRun with --help for more information.\n",
                   msg->c_str());
      return static_cast<int>(CLI::ExitCodes::ExtrasError);
    }
    return app.exit(e);
  } catch (const dflash::Error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "dflash: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "dflash: internal error: %s\n", e.what());
    return 2;
  }
  return 0;
}
