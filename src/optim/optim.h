/* optim/optim.h: AdamW (and Adam), the learning-rate schedule, gradient clipping.
 *
 * AdamW follows torch.optim.AdamW step for step (decoupled weight decay
 * applied first, bias-corrected moments, eps added after the sqrt), so the
 * same hyperparameters give the same weights as a PyTorch loop. Adam
 * (torch.optim.Adam, optimizer.name = "Adam") is the same step after its
 * weight decay is added to the gradient (adam_l2_grad): the kernels run it
 * with a decoupled decay of 0. The schedule
 * is torchtitan's linear warmup -> optional stable phase -> decay. The
 * optimizer works on one flat buffer: the model keeps params, grads and both
 * moments in the same layout. */
#ifndef CT_OPTIM_OPTIM_H
#define CT_OPTIM_OPTIM_H

#include <stddef.h>

typedef struct {
    double lr, beta1, beta2, eps, weight_decay;
    int l2; /* Adam: weight_decay is added to the gradient (L2), not to the weights */
} adamw_hparams;

typedef struct {
    size_t n;
    float *m;   /* [n] first moment */
    float *v;   /* [n] second moment */
    long step;  /* optimizer steps taken */
    int lazy;   /* m, v from ct_alloc_lazy: pages only where written (frozen tensors never are) */
} adamw_state;

void adamw_init(adamw_state *s, size_t n);
/* The same over memory that gets pages only where written. */
void adamw_init_lazy(adamw_state *s, size_t n);
void adamw_free(adamw_state *s);
/* The per-step scalars of an AdamW step, in double as torch computes them on
 * the Python side, then rounded to fp32 for the element-wise update. */
typedef struct {
    float decay;     /* 1 - lr * weight_decay */
    float b1, b2;    /* betas */
    float step_size; /* lr / (1 - beta1^step) */
    float bc2_sqrt;  /* sqrt(1 - beta2^step) */
    float eps;
} adamw_scalars;
/* Increments s->step and returns that step's scalars: every AdamW kernel starts
 * here, so all of them agree to the bit on these. */
adamw_scalars adamw_begin_step(adamw_state *s, double lr, const adamw_hparams *h);
/* One step at learning rate lr (the schedule's value): increments s->step.
 * The gradient it uses is grads[i] * gscale, the clipping coefficient of
 * optim_clip_scale (1 when not clipping), formed as the same fp32 product
 * that clip_grad_norm_'s in-place scaling stores, so folding the scale into
 * the step changes no bit; and it leaves grads[i] = 0 for the next step's
 * accumulation. Both save a pass over every gradient (the separate scaling
 * pass read and wrote them, the memset after the step wrote them again). */
void adamw_step(adamw_state *s, float *params, float *grads, float gscale, double lr, const adamw_hparams *h);
/* Elements below which every AdamW implementation steps on the calling
 * thread alone (the step is elementwise: the same bits either way). A LoRA
 * run steps each run of adapters between frozen tensors apart, one call per
 * layer: W1's (Qwen3-0.6B shapes, r 16) are ~330K elements, ~0.35 ms on one
 * Zen 5 core. Traced on 2 cores shared with other work (load 3.2-4.3, 3
 * interleaved rounds of 6 steps): parallel 3.9 / 12.1 / 10.7 ms of AdamW
 * spans per step (median call 0.36-0.94 ms, up to 16 ms when the second
 * thread waited for a time slice), one thread 2.7 / 4.7 / 4.9 ms (median
 * 0.35-0.38 ms); in the quietest earlier round the parallel call's median
 * was 0.27 ms, so an idle machine loses < 0.1 ms per call. Larger ranges
 * (Qwen3-4B's ~0.9M per layer) and whole models keep both threads. */
#define ADAMW_PARALLEL_MIN (1L << 19)

/* Adam's weight decay (torch.optim.Adam: grad = grad + weight_decay param,
 * after clipping): grads[i] = grads[i] gscale + wd params[i], the clipped
 * gradient as the clipping pass stores it. The step then runs with gscale 1
 * and no decoupled decay. */
void adam_l2_grad(float *grads, const float *params, float gscale, double wd, size_t n);

/* Global L2 norm of g[n] (double accumulation, fixed order). */
double optim_grad_norm(const float *g, size_t n);
/* torch.nn.utils.clip_grad_norm_'s coefficient for a global norm: the fp32
 * max_norm / (norm + 1e-6) when that is below 1, else 1 (no scaling);
 * max_norm <= 0 disables. AdamW applies it (adamw_step's gscale). */
float optim_clip_scale(double norm, double max_norm);

typedef enum { LR_DECAY_LINEAR, LR_DECAY_SQRT, LR_DECAY_COSINE } lr_decay_type;

typedef struct {
    int warmup_steps, stable_steps, decay_steps;
    lr_decay_type type;
    double min_lr_factor;
} lr_schedule;

/* decay_ratio < 0 means unset: decay over every step after warmup. */
void lr_schedule_init(lr_schedule *s, int training_steps, int warmup_steps, double decay_ratio,
                      lr_decay_type type, double min_lr_factor);
/* Multiplier for 0-based optimizer step `step` (torchtitan's LambdaLR index). */
double lr_schedule_factor(const lr_schedule *s, int step);
/* "linear" | "sqrt" | "cosine"; returns -1 if unknown. */
int lr_decay_type_from_name(const char *name);

#endif
