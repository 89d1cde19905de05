// Fibers for the emulated device (emulated_device.h): a context per GPU thread, switched by hand.
//
// The emulation switches twice per lane at every barrier and warp-collective operation, tens of
// thousands of times per kernel. swapcontext saves and restores the signal mask with a system call
// (about half a microsecond per switch here), so on x86-64 a switch is a few instructions instead:
// push the callee-saved registers and the floating-point control words, swap stack pointers, pop.
// Other hosts keep ucontext.
#pragma once
#include <cstddef>
#include <cstdint>

#if defined(__x86_64__)

namespace hipattn_emulation {

struct Context {
  void* stack_pointer = nullptr;
};

// Saves the caller's registers on its stack and its stack pointer in *save, then resumes the
// context whose stack pointer is `resume` (pushed by an earlier call, or laid out by start_context).
// System V: callee-saved rbx, rbp, r12-r15, MXCSR's and the x87 control word's settings.
__attribute__((naked, noinline)) static void switch_stacks(void** /*save*/, void* /*resume*/) {
  asm("pushq %rbp\n\t"
      "pushq %rbx\n\t"
      "pushq %r12\n\t"
      "pushq %r13\n\t"
      "pushq %r14\n\t"
      "pushq %r15\n\t"
      "subq $8, %rsp\n\t"
      "stmxcsr (%rsp)\n\t"
      "fnstcw 4(%rsp)\n\t"
      "movq %rsp, (%rdi)\n\t"
      "movq %rsi, %rsp\n\t"
      "ldmxcsr (%rsp)\n\t"
      "fldcw 4(%rsp)\n\t"
      "addq $8, %rsp\n\t"
      "popq %r15\n\t"
      "popq %r14\n\t"
      "popq %r13\n\t"
      "popq %r12\n\t"
      "popq %rbx\n\t"
      "popq %rbp\n\t"
      "ret");
}

inline void switch_context(Context& from, const Context& to) { switch_stacks(&from.stack_pointer, to.stack_pointer); }

// A context that, when first switched to, calls `entry` (which must never return) on `stack`: the
// stack holds what switch_stacks pops, with `entry` as the return address.
inline void start_context(Context& context, unsigned char* stack, size_t bytes, void (*entry)()) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + bytes) & ~static_cast<uintptr_t>(15);
  uint64_t* slot = reinterpret_cast<uint64_t*>(top);
  *--slot = 0;  // entry's own return address (it never returns): entry starts 8 bytes off alignment
  *--slot = reinterpret_cast<uint64_t>(entry);
  for (int r = 0; r < 6; ++r) *--slot = 0;  // rbp, rbx, r12-r15
  uint32_t mxcsr;
  uint16_t control_word;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(control_word));
  *--slot = static_cast<uint64_t>(mxcsr) | static_cast<uint64_t>(control_word) << 32;
  context.stack_pointer = slot;
}

}  // namespace hipattn_emulation

#else  // other hosts: ucontext

#include <ucontext.h>

namespace hipattn_emulation {

struct Context {
  ucontext_t context;
};

inline void switch_context(Context& from, const Context& to) { swapcontext(&from.context, &to.context); }

inline void start_context(Context& context, unsigned char* stack, size_t bytes, void (*entry)()) {
  getcontext(&context.context);
  context.context.uc_stack.ss_sp = stack;
  context.context.uc_stack.ss_size = bytes;
  context.context.uc_link = nullptr;
  makecontext(&context.context, entry, 0);
}

}  // namespace hipattn_emulation

#endif
