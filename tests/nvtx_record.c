/* An NVTX tool in miniature, loaded the way nsys is: NVTX_INJECTION64_PATH names this
 * library and the first NVTX call in each module that uses NVTX calls its
 * InitializeInjectionNvtx2, which points the domain range calls here. Every push and pop
 * becomes one line of $NVTX_RECORD_LOG: "push|pop <TAB> thread <TAB> domain <TAB> name". */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <nvtx3/nvToolsExt.h>

static FILE* out;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static void record(const char* what, nvtxDomainHandle_t domain, const char* name) {
  pthread_mutex_lock(&lock);
  fprintf(out, "%s\t%ld\t%s\t%s\n", what, (long)syscall(SYS_gettid), domain ? (const char*)domain : "-",
          name ? name : "");
  fflush(out); /* the process may end without closing it */
  pthread_mutex_unlock(&lock);
}

/* A domain's handle is its name, so each record can say which domain it is in. */
static nvtxDomainHandle_t domain_create(const char* name) { return (nvtxDomainHandle_t)strdup(name); }

static int range_push(nvtxDomainHandle_t domain, const nvtxEventAttributes_t* a) {
  record("push", domain, a != NULL && a->messageType == NVTX_MESSAGE_TYPE_ASCII ? a->message.ascii : "?");
  return 0;
}

static int range_pop(nvtxDomainHandle_t domain) {
  record("pop", domain, NULL);
  return 0;
}

int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_table) {
  const NvtxExportTableCallbacks* callbacks = (const NvtxExportTableCallbacks*)get_table(NVTX_ETID_CALLBACKS);
  NvtxFunctionTable table = NULL;
  unsigned int size = 0;
  if (callbacks == NULL || !callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &table, &size) ||
      size <= NVTX_CBID_CORE2_DomainCreateA) {
    return 0;
  }
  const char* path = getenv("NVTX_RECORD_LOG");
  if (path == NULL) return 0;
  pthread_mutex_lock(&lock);
  if (out == NULL) out = fopen(path, "a");
  pthread_mutex_unlock(&lock);
  if (out == NULL) return 0;
  *table[NVTX_CBID_CORE2_DomainCreateA] = (NvtxFunctionPointer)domain_create;
  *table[NVTX_CBID_CORE2_DomainRangePushEx] = (NvtxFunctionPointer)range_push;
  *table[NVTX_CBID_CORE2_DomainRangePop] = (NvtxFunctionPointer)range_pop;
  return 1;
}
