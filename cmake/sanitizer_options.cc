// Default options of the sanitizers, compiled into every executable of a
// FUYOU_SANITIZE build (cmake/FuyouSanitize.cmake adds this file to each), so that
// a test run by hand behaves as in CI. ASAN_OPTIONS, UBSAN_OPTIONS and
// LSAN_OPTIONS in the environment still override them.
//
// - halt_on_error: the first report ends the process with a non-zero status, so
//   a daemon with a memory error fails the test that drove it.
// - detect_leaks: LeakSanitizer runs at exit (a daemon stopped with SIGTERM
//   exits through main and is checked too). Debian 12's gRPC 1.51 and protobuf
//   3.21 free what they allocate once grpc shuts down; nothing is suppressed.
// - print_stacktrace: UBSan reports say where, not only what.
extern "C" {

__attribute__((visibility("default"), used)) const char* __asan_default_options() {
  return "halt_on_error=1:detect_leaks=1:check_initialization_order=1:strict_init_order=1";
}

__attribute__((visibility("default"), used)) const char* __ubsan_default_options() {
  return "halt_on_error=1:print_stacktrace=1";
}

}  // extern "C"
