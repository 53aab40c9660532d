/* metrics/tb.h: TensorBoard event files, written without TensorFlow.
 *
 * A file is a sequence of tfevents records (u64 length, masked CRC-32C of
 * the length, the bytes, masked CRC-32C of the bytes), each an Event
 * protobuf that this module encodes by hand: the few fields TensorBoard's
 * scalar view reads (wall_time, step, file_version, summary.value{tag,
 * simple_value}, session_log.status). Every open starts a new file whose
 * name sorts after the folder's existing ones (TensorBoard reads a folder's
 * files in name order) and whose first event after the version is a
 * SessionLog START at the first step this session writes: TensorBoard's
 * EventAccumulator then drops the events of earlier files at that step or
 * later, so a resumed run shows each step once, with the resumed values. */
#ifndef CT_METRICS_TB_H
#define CT_METRICS_TB_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"

typedef struct tb_writer tb_writer;

/* Creates DIR if needed and a new events file in it; first_step is the first
 * step the caller will log (the resumed step + 1). NULL with e set on failure. */
tb_writer *tb_open(const char *dir, int64_t first_step, ct_err *e);
/* One scalar event; written to the file's buffer (tb_flush writes it out). */
void tb_scalar(tb_writer *w, int64_t step, const char *tag, double value);
/* Pushes the buffered events to the file; -1 once any write has failed. */
int tb_flush(tb_writer *w);
/* Flushes, closes, frees; -1 when a write failed. NULL is fine. */
int tb_close(tb_writer *w);
/* The file's path (for messages). */
const char *tb_path(const tb_writer *w);

/* The pieces, for the tests: CRC-32C (Castagnoli, reflected 0x82F63B78) of
 * N bytes, the tfevents mask of a CRC, and the framing of one record (writes
 * n + 16 bytes to out). */
uint32_t tb_crc32c(const void *data, size_t n);
uint32_t tb_mask_crc(uint32_t crc);
void tb_frame(const void *data, size_t n, uint8_t *out);

#endif
