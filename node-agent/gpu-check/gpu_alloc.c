/*
 * gpu-alloc: allocate GPU memory in steps through the CUDA driver API, up to and past a share,
 * and say where the allocations stopped. Loads libcuda.so.1 with dlopen, so it builds with gcc
 * alone (no CUDA toolkit); the few prototypes it calls are declared here as cuda.h has them.
 *
 *   gpu-alloc <share MiB> [step MiB] [hold seconds]
 *
 * Allocates `step` MiB at a time until 1.5 x share or the first failure, prints one line per
 * step, then holds what it got for `hold` seconds (for the NVML backstop to find it).
 * Exit status: 0 when an allocation past the share failed (the first layer held the share),
 * 3 when every allocation past the share succeeded (nothing held it in the process), 4 when
 * one within the share failed (the GPU is short), 2 when CUDA could not start (no GPU, no
 * driver), 1 on bad arguments.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef unsigned long long CUdeviceptr;

typedef CUresult (*cuInit_t)(unsigned int);
typedef CUresult (*cuDriverGetVersion_t)(int *);
typedef CUresult (*cuDeviceGet_t)(CUdevice *, int);
typedef CUresult (*cuDeviceGetName_t)(char *, int, CUdevice);
typedef CUresult (*cuDevicePrimaryCtxRetain_t)(CUcontext *, CUdevice);
typedef CUresult (*cuCtxSetCurrent_t)(CUcontext);
typedef CUresult (*cuMemAlloc_t)(CUdeviceptr *, size_t);
typedef CUresult (*cuMemGetInfo_t)(size_t *, size_t *);
typedef CUresult (*cuGetErrorName_t)(CUresult, const char **);

static void *sym(void *lib, const char *name) {
    void *f = dlsym(lib, name);
    if (!f) {
        fprintf(stderr, "gpu-alloc: libcuda.so.1 has no %s\n", name);
        exit(2);
    }
    return f;
}

static const char *err_name(cuGetErrorName_t f, CUresult r) {
    const char *s = "?";
    if (f) f(r, &s);
    return s;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: gpu-alloc <share MiB> [step MiB] [hold seconds]\n");
        return 1;
    }
    long share = strtol(argv[1], NULL, 10);
    long step = argc > 2 ? strtol(argv[2], NULL, 10) : 256;
    long hold = argc > 3 ? strtol(argv[3], NULL, 10) : 0;
    if (share <= 0 || step <= 0 || hold < 0) {
        fprintf(stderr, "gpu-alloc: share and step must be positive MiB, hold seconds >= 0\n");
        return 1;
    }
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "gpu-alloc: no CUDA driver on this machine: %s\n", dlerror());
        return 2;
    }
    cuInit_t cuInit = (cuInit_t)sym(lib, "cuInit");
    cuDriverGetVersion_t cuDriverGetVersion = (cuDriverGetVersion_t)sym(lib, "cuDriverGetVersion");
    cuDeviceGet_t cuDeviceGet = (cuDeviceGet_t)sym(lib, "cuDeviceGet");
    cuDeviceGetName_t cuDeviceGetName = (cuDeviceGetName_t)sym(lib, "cuDeviceGetName");
    cuDevicePrimaryCtxRetain_t retain = (cuDevicePrimaryCtxRetain_t)sym(lib, "cuDevicePrimaryCtxRetain");
    cuCtxSetCurrent_t cuCtxSetCurrent = (cuCtxSetCurrent_t)sym(lib, "cuCtxSetCurrent");
    cuMemAlloc_t cuMemAlloc = (cuMemAlloc_t)sym(lib, "cuMemAlloc_v2");
    cuMemGetInfo_t cuMemGetInfo = (cuMemGetInfo_t)sym(lib, "cuMemGetInfo_v2");
    cuGetErrorName_t cuGetErrorName = (cuGetErrorName_t)dlsym(lib, "cuGetErrorName");

    CUresult r = cuInit(0);
    if (r != 0) {
        fprintf(stderr, "gpu-alloc: cuInit: %s (%d)\n", err_name(cuGetErrorName, r), r);
        return 2;
    }
    int version = 0;
    cuDriverGetVersion(&version);
    CUdevice dev;
    char name[128] = "?";
    CUcontext ctx;
    if ((r = cuDeviceGet(&dev, 0)) != 0 || (r = retain(&ctx, dev)) != 0 ||
        (r = cuCtxSetCurrent(ctx)) != 0) {
        fprintf(stderr, "gpu-alloc: no context on device 0: %s (%d)\n", err_name(cuGetErrorName, r), r);
        return 2;
    }
    cuDeviceGetName(name, sizeof name, dev);
    size_t free_b = 0, total_b = 0;
    cuMemGetInfo(&free_b, &total_b);
    printf("device=%s cuda_driver=%d.%d total_mib=%zu free_mib=%zu share_mib=%ld\n", name,
           version / 1000, (version % 1000) / 10, total_b >> 20, free_b >> 20, share);
    long got = 0, limit = share + share / 2;
    int failed_past_share = 0;
    while (got + step <= limit) {
        CUdeviceptr p;
        r = cuMemAlloc(&p, (size_t)step << 20);
        if (r != 0) {
            printf("alloc %ld MiB at %ld MiB: FAILED %s\n", step, got, err_name(cuGetErrorName, r));
            failed_past_share = got + step > share;
            break;
        }
        got += step;
        printf("alloc %ld MiB: ok, holding %ld MiB%s\n", step, got, got > share ? " (past the share)" : "");
        fflush(stdout);
    }
    printf("result: held %ld MiB of a %ld MiB share; %s\n", got, share,
           failed_past_share ? "the allocation past the share failed"
           : got > share      ? "allocations past the share succeeded"
                              : "an allocation within the share failed");
    fflush(stdout);
    if (hold > 0) sleep((unsigned)hold);
    if (failed_past_share) return 0;
    return got > share ? 3 : 4;
}
