/* A native backtrace on SIGSEGV/SIGBUS/SIGABRT (a C++ terminate included), for crashes inside libraries that Python's
 * faulthandler shows only as a Python frame (issue 36: SIGSEGV inside torch.cuda.empty_cache()
 * under expandable segments). Built and preloaded on the GPU machine:
 *   gcc -shared -fPIC -O1 -o /tmp/segv_backtrace.so scripts/segv_backtrace.c
 *   LD_PRELOAD=/tmp/segv_backtrace.so python -m pytest -p no:faulthandler ...
 * Prints the faulting address and the frames (with exported symbol names) to stderr, then dies
 * of the same signal (backtrace() is not async-signal-safe: good enough for a process that is
 * dying anyway). Not part of the library. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* Where the frames go: the process's stderr as it was at start (a duplicate taken by the
 * constructor). pytest's fd capture points fd 2 at a temporary file during each test, and a
 * process that dies there takes that file's text with it: the runs of 2026-12-06f and the
 * first of 2026-12-06g printed nothing from this handler for that reason. */
static int out_fd = 2;

static void on_fatal(int sig, siginfo_t* info, void* context) {
  (void)context;
  char line[128];
  int n = snprintf(line, sizeof(line), "\n=== segv_backtrace: pid %d signal %d at address %p\n", (int)getpid(), sig,
                   info != NULL ? info->si_addr : NULL);
  if (n > 0) (void)!write(out_fd, line, (size_t)n);
  void* frames[64];
  const int count = backtrace(frames, 64);
  backtrace_symbols_fd(frames, count, out_fd);
  signal(sig, SIG_DFL);
  raise(sig);
}

/* Exported: the GPU tests' conftest calls it again before each test (PYDATACOPY_SEGV_BACKTRACE_SO),
 * since a library loaded later may install its own handler over this one. On an alternate stack,
 * so that a stack overflow still prints. */
void pydatacopy_segv_install(void) {
  static char alternate[1 << 16];
  stack_t stack;
  memset(&stack, 0, sizeof(stack));
  stack.ss_sp = alternate;
  stack.ss_size = sizeof(alternate);
  sigaltstack(&stack, NULL);
  struct sigaction action;
  memset(&action, 0, sizeof(action));
  action.sa_sigaction = on_fatal;
  action.sa_flags = SA_SIGINFO | SA_RESETHAND | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  sigaction(SIGSEGV, &action, NULL);
  sigaction(SIGBUS, &action, NULL);
  sigaction(SIGABRT, &action, NULL);
}

__attribute__((constructor)) static void install(void) {
  const int saved = fcntl(2, F_DUPFD_CLOEXEC, 200);
  if (saved >= 0) out_fd = saved;
  pydatacopy_segv_install();
}

/* Interposed: no library takes SIGSEGV/SIGBUS from this handler, and no thread blocks them (a
 * synchronous SIGSEGV in a thread that blocks it kills the process without any handler: what the
 * runs of 2026-12-06f looked like). Each attempt is logged with its caller's frames. */
static int is_fatal(int sig) { return sig == SIGSEGV || sig == SIGBUS; }

static void log_attempt(const char* what, int sig) {
  char line[96];
  int n = snprintf(line, sizeof(line), "\n=== segv_backtrace: pid %d refused %s(%d)\n", (int)getpid(), what, sig);
  if (n > 0) (void)!write(out_fd, line, (size_t)n);
  void* frames[16];
  backtrace_symbols_fd(frames, backtrace(frames, 16), out_fd);
}

int sigaction(int sig, const struct sigaction* act, struct sigaction* old) {
  static int (*real)(int, const struct sigaction*, struct sigaction*) = NULL;
  if (real == NULL) real = (int (*)(int, const struct sigaction*, struct sigaction*))dlsym(RTLD_NEXT, "sigaction");
  if (act != NULL && is_fatal(sig) && act->sa_sigaction != on_fatal) {
    log_attempt("sigaction", sig);
    return real(sig, NULL, old);
  }
  return real(sig, act, old);
}

static void keep_fatal_unblocked(int how, const sigset_t* set, sigset_t* copy, const sigset_t** use) {
  *use = set;
  if (set != NULL && how != SIG_UNBLOCK && (sigismember(set, SIGSEGV) == 1 || sigismember(set, SIGBUS) == 1)) {
    *copy = *set;
    sigdelset(copy, SIGSEGV);
    sigdelset(copy, SIGBUS);
    *use = copy;
  }
}

int pthread_sigmask(int how, const sigset_t* set, sigset_t* old) {
  static int (*real)(int, const sigset_t*, sigset_t*) = NULL;
  if (real == NULL) real = (int (*)(int, const sigset_t*, sigset_t*))dlsym(RTLD_NEXT, "pthread_sigmask");
  sigset_t copy;
  const sigset_t* use;
  keep_fatal_unblocked(how, set, &copy, &use);
  return real(how, use, old);
}

int sigprocmask(int how, const sigset_t* set, sigset_t* old) {
  static int (*real)(int, const sigset_t*, sigset_t*) = NULL;
  if (real == NULL) real = (int (*)(int, const sigset_t*, sigset_t*))dlsym(RTLD_NEXT, "sigprocmask");
  sigset_t copy;
  const sigset_t* use;
  keep_fatal_unblocked(how, set, &copy, &use);
  return real(how, use, old);
}
