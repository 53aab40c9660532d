/* api/ctitan.h: libctitan's narrow public API.
 *
 * The CLI is one user of the library; the Python parity tests (ctypes) are
 * another. A session is one model with its optimizer, built from the same
 * arguments `ctitan train` takes, so tests exercise the real config path.
 * Tensors are addressed by their Hugging Face names and exchanged as fp32.
 * Every function returns 0 on success; on failure the message is available
 * from ctitan_last_error(s) (NULL session: the error went to `err` of open). */
#ifndef CTITAN_H
#define CTITAN_H

#include <stdint.h>

typedef struct ct_session ct_session;

/* argv: the options of `ctitan train` ("--config", "f.toml", "--model.spec=hf", ...).
 * Builds the model (random init from training.seed, or HF weights if
 * checkpoint.initial_load_path is set) and the optimizer. Activations are
 * planned for training.local_batch_size x training.seq_len.
 * Sessions share the process's thread settings: training.threads is set for
 * OpenMP on the calling thread but for OpenBLAS process-wide, so the last
 * session opened sets OpenBLAS's thread count for every session
 * (docs/design.md, "State outside a run context"). */
ct_session *ctitan_open(int argc, const char **argv, char *err, int errlen);
void ctitan_close(ct_session *s);
const char *ctitan_last_error(const ct_session *s);

int ctitan_vocab_size(const ct_session *s);
int ctitan_num_tensors(const ct_session *s);
const char *ctitan_tensor_name(const ct_session *s, int i);
/* Writes up to 8 dims into shape, returns ndim (or -1 for a bad index). */
int ctitan_tensor_shape(const ct_session *s, int i, int64_t *shape);
int ctitan_get_param(ct_session *s, const char *name, float *out);
int ctitan_set_param(ct_session *s, const char *name, const float *in);
int ctitan_get_grad(ct_session *s, const char *name, float *out);

/* logits[B,T,V] for tokens[B,T]; B <= local_batch_size, T <= seq_len. */
int ctitan_logits(ct_session *s, const int32_t *tokens, int B, int T, float *logits);

int ctitan_zero_grad(ct_session *s);
/* Forward and backward of one micro-batch. labels == -100 are ignored. Gradients
 * of (sum of CE over valid labels) / n_valid_total are ADDED to the gradient
 * buffers, so calling it per micro-batch with the step's total count gives
 * gradient accumulation. *loss_sum receives the micro-batch's CE sum. LoRA
 * dropout: the calls since the last zero_grad or optimizer_step hold the step's
 * sequences in order, and each draws the masks the trainer draws for those
 * sequences, so any split of a batch into calls gives the same gradients. */
int ctitan_forward_backward(ct_session *s, const int32_t *tokens, const int32_t *labels, int B, int T,
                            long n_valid_total, double *loss_sum);
/* MoE models: transformers' load-balancing loss (load_balancing_loss_func, without
 * router_aux_loss_coef) of the last forward; 0 for a dense model. With
 * output_router_logits on, forward_backward also adds the gradient of
 * router_aux_loss_coef * aux / (training.global_batch_size / local_batch_size). */
int ctitan_aux_loss(const ct_session *s, double *aux);
/* Clip by training.max_norm, AdamW with the scheduled lr, advance the step.
 * Outputs (may be NULL): the pre-clip global grad norm and the lr used. */
int ctitan_optimizer_step(ct_session *s, double *grad_norm, double *lr);

/* Writes a Hugging Face model directory (config.json + safetensors): the
 * base model alone; a LoRA session's adapters are not in it (merge first). */
int ctitan_save_hf(ct_session *s, const char *dir, const char *dtype);
/* LoRA sessions: writes a PEFT adapter directory (adapter_config.json +
 * adapter_model.safetensors) that peft.PeftModel.from_pretrained loads. */
int ctitan_save_adapter(ct_session *s, const char *dir);
/* LoRA sessions: folds the adapters into the base weights (W += scale B A)
 * and zeroes B, as PEFT's merge_and_unload; save_hf then writes the merged model. */
int ctitan_merge_adapter(ct_session *s);

#endif
