// llvm-symbolizer for TSan runs whose binaries are started with LD_PRELOAD (scripts/sanitize.sh):
// TSan starts its symbolizer with the test's environment, and the preloaded libraries need the
// TSan runtime, so the real symbolizer would fail to start and reports would name no function,
// which the suppressions (scripts/tsan_suppressions.txt) need. Linked statically, this program
// has no loader to preload anything; it drops LD_PRELOAD and runs the real one.
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char** argv) {
  (void)argc;
  char real[] = "/usr/lib/llvm-14/bin/llvm-symbolizer";
  unsetenv("LD_PRELOAD");
  argv[0] = real;
  execv(real, argv);
  return 127;
}
