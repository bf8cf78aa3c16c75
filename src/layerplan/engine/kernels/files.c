/* Reading kept files into memory in one call: the packed panels a GGUF's matrices were kept as
 * (engine/panel_cache.py), read back by the light front end (layerplan/lite/model.py) from a thread
 * of its own. A ctypes call runs without the interpreter's lock, so a list of files read here goes
 * on while the interpreter does other work (parsing the tokenizer, which holds the lock for tens of
 * milliseconds); read one file a call from Python, the reads would wait for the lock between files. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include "common.h"

/* Reads file i (paths[i], its first sizes[i] bytes) into outs[i], for i in [0, count), one after
 * another in this thread; whole[i] = 1 where all sizes[i] bytes were read, else 0 (a file missing,
 * unreadable or shorter than sizes[i]: what was read of it is left in outs[i]). Returns the number
 * of files read whole. */
LP_API long lp_read_files(const char *const *paths, const long *sizes, void *const *outs, unsigned char *whole,
                          long count) {
    long read_whole = 0;
    for (long i = 0; i < count; i++) {
        whole[i] = 0;
        int fd = open(paths[i], O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        long done = 0;
        while (done < sizes[i]) {
            ssize_t got = pread(fd, (char *)outs[i] + done, (size_t)(sizes[i] - done), (off_t)done);
            if (got < 0 && errno == EINTR) continue;
            if (got <= 0) break;
            done += got;
        }
        close(fd);
        if (done == sizes[i]) {
            whole[i] = 1;
            read_whole++;
        }
    }
    return read_whole;
}
