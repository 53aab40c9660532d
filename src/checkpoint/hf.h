/* checkpoint/hf.h: Hugging Face model directories in and out.
 *
 * The model's tensor table already uses HF names, so loading is: open the
 * safetensors set, check that the file holds exactly the model's tensors
 * (missing, unexpected or mis-shaped ones are errors naming the tensor and
 * the file), and convert each to fp32. A tied model accepts a file with or
 * without lm_head.weight, as transformers does, and never writes it. */
#ifndef CT_CHECKPOINT_HF_H
#define CT_CHECKPOINT_HF_H

#include <stdio.h>

#include "core/dtype.h"
#include "core/err.h"
#include "core/progress.h"
#include "formats/safetensors.h"
#include "model/generate.h"
#include "model/lm.h"

int hf_load(lm_model *m, const char *dir, ct_err *e);
/* The same checks, each tensor converted to fp32 in turn and handed to sink
 * (m's buffers untouched: m may be a bare lm_layout). router_bias [L, E] (NULL:
 * not kept) receives the sparse layers' router selection biases (ERNIE 4.5 MoE's
 * e_score_correction_bias, lm_router_bias_name), zeros where the files hold none. */
int hf_load_each(const lm_model *m, const char *dir, const lm_sink *sink, float *router_bias, ct_err *e);
/* A training checkpoint DIR's router selection biases of a family whose files hold
 * them (lm_router_bias_name): its state.json's "moe_expert_bias" [L, E] into bias,
 * which stays as it is where DIR has no state.json or the state no bias. */
int hf_ckpt_router_bias(const lm_model *m, const char *dir, float *bias, ct_err *e);
/* Writes DIR/config.json and DIR/model.safetensors (sharded with an index
 * above max_shard_bytes; 0 = default 5 GB). dtype: CT_F32, CT_BF16 or CT_F16. */
int hf_save(const lm_model *m, const char *dir, ct_dtype dtype, size_t max_shard_bytes, ct_err *e);
/* GraniteMoE's files fuse what the table holds apart (model/lm.h:
 * LM_MOE_KEYS_GRANITE): block_sparse_moe.input_linear [E, 2 Im, H] holds each
 * expert's gate rows then its up rows, output_linear [E, H, Im] each expert's
 * down_proj, and GraniteMoeShared's shared_mlp.input_linear [2 S, H] the shared
 * MLP's gate rows then its up rows. Each table piece is one run of elements of
 * the file's tensor. Returns 1 for such a piece with the file tensor's name,
 * shape and the element where the piece starts; 0 for a tensor stored whole
 * under its own name. */
typedef struct {
    char name[LM_NAME_MAX];
    int ndim;
    int64_t shape[3];
    size_t off;
    int first; /* the piece that starts the file tensor */
} hf_fused;
int hf_fused_piece(const lm_config *c, const lm_tensor *t, hf_fused *f);
/* 1 when the HF files of c's model fuse tensors its table holds apart
 * (GraniteMoE's block_sparse_moe.input_linear / output_linear, GraniteMoeShared's
 * shared_mlp.input_linear): writers go through hf_file_tensors / hf_write_unit;
 * hf_load_each reads both the fused files and ctitan's checkpoints. */
int hf_fuses_tensors(const lm_config *c);
/* The tensors of m's HF files, in the order hf_write_unit writes them, into
 * ts[hf_file_tensor_cap(m)] (adapters left out; a fused tensor once, named in
 * names[m->n_tensors]); returns how many. */
int hf_file_tensors(const lm_model *m, ct_dtype dtype, st_wtensor *ts, char (*names)[LM_NAME_MAX]);
/* Entries ts and names need for hf_file_tensors (beside the table's tensors, ERNIE 4.5
 * MoE's router bias of each sparse layer, lm_router_bias_name). */
size_t hf_file_tensor_cap(const lm_model *m);
/* Writes the file tensors that start among m's tensors [i0, i1) to d, from x
 * (their floats, tensors[i0] first, as the table lays them out): a fused
 * tensor's pieces in the file's order, so they must be in the same range (a
 * layer's are). es: bytes per written element, for bar (NULL: none). router_bias
 * [L, E]: the router selection biases written after each router that has one
 * (lm_router_bias_name; NULL: zeros). */
int hf_write_unit(const lm_model *m, const float *router_bias, int i0, int i1, const float *x, st_dir_stream *d,
                  size_t es, prog_bar *bar, ct_err *e);
/* A saved model is used as transformers' save_pretrained leaves it: with its
 * tokenizer and generation settings beside the weights (AutoTokenizer, and
 * model.generate stopping at the end token). These two complete a directory
 * hf_save (or the trainer's final save) wrote; `ctitan export` and the
 * final save share them. */
/* Copies the tokenizer and generation files transformers looks for
 * (tokenizer.json, tokenizer_config.json, vocab.json, merges.txt,
 * generation_config.json, special_tokens_map.json, added_tokens.json,
 * chat_template.jinja) that exist in SRC to OUT, each through a temporary
 * name; "  copied NAME" lines go to log unless it is NULL. Returns how many,
 * or -1 (e says why). */
int hf_copy_assets(const char *src, const char *out, FILE *log, ct_err *e);
/* config.json as ctitan writes it holds the architecture only: the model's
 * bos_token_id and eos_token_id, which transformers' generate stops on (and
 * GenerationConfig takes when there is no generation_config.json), come
 * from the config.json of the model it was made from. Adds those of the
 * first of src[0..n) whose config.json has either (an integer, a list of
 * integers or null; any other value is ignored) to the config.json at PATH,
 * unless PATH has them already; the rest of PATH stays byte for byte, and
 * it is rewritten through a temporary name. No source with them: nothing to
 * do, 0. */
int hf_keep_token_ids(const char *path, const char *const *src, int n, ct_err *e);
/* "float32" | "bfloat16" | "float16" -> dtype; -1 if unknown. */
int hf_dtype_from_name(const char *name);

/* DIR (config.json and its safetensors) as an inference model for max_len
 * positions (model/generate.h), with the PEFT LoRA adapter directory
 * (model/lora.h) applied beside the base weights, unmerged, as PeftModel runs
 * it; adapter NULL: none. The file side of generation lives here, so
 * model/generate.c reads no checkpoint. */
int hf_gen_open(gen_model **out, const char *dir, const char *adapter, int max_len, ct_err *e);

#endif
