// Names of FFI handlers built once per instruction set (native_build.Isa): the build passes
// -DJAXINFER_ISA_SUFFIX=_avx2 (or _avx512_vnni), and JAXINFER_SYMBOL(jaxinfer_x) names the handler
// jaxinfer_x_avx2, so the variants of one source can all be registered in one process.
#ifndef JAXINFER_CPU_KERNELS_ISA_H_
#define JAXINFER_CPU_KERNELS_ISA_H_

#ifndef JAXINFER_ISA_SUFFIX
#error "build through jaxinfer.cpu_kernels.native_build.register_isa_kernels (it defines JAXINFER_ISA_SUFFIX)"
#endif

#define JAXINFER_CAT_(a, b) a##b
#define JAXINFER_CAT(a, b) JAXINFER_CAT_(a, b)
#define JAXINFER_SYMBOL(name) JAXINFER_CAT(name, JAXINFER_ISA_SUFFIX)

#endif  // JAXINFER_CPU_KERNELS_ISA_H_
