/* distributed/ep.h: expert parallel over data-parallel ranks (expert_parallel_degree).
 *
 * EP rank p of a group of ep runs experts [p E/ep, (p+1) E/ep) for the whole
 * group: each MoE layer routes its own tokens, sends every (token, choice)
 * row to the rank running its expert (all-to-allv), that rank runs the
 * grouped experts kernel on what it received (one choice per row, with its
 * routing weight), and the weighted outputs come back to be summed as on
 * one rank.
 * The backward mirrors it. A rank stores only its experts' weights,
 * gradients and moments (lm_config.expert_rows, set by distributed/tp.h's local
 * config), and their LoRA adapters' rows and columns; their gradients are
 * summed over the ranks that hold the same experts only (mesh.edp), and a
 * checkpoint gathers them (tp_gather_range). The experts run on what the
 * model hands over: the adapted copy W + scale B A, or the base read from
 * its bf16 store when it is frozen there. */
#ifndef CT_DISTRIBUTED_EP_H
#define CT_DISTRIBUTED_EP_H

#include "distributed/comm.h"
#include "model/lm.h"

typedef struct ep_layer ep_layer;
typedef struct ep_scratch ep_scratch;

typedef struct {
    lm_model *m;
    ct_comm *c;        /* the EP group */
    int El;            /* experts per rank */
    int Nmax;          /* tokens of the largest forward (B x T) */
    size_t Rmax;       /* rows a rank can receive in one layer: ep x Nmax x top_k */
    /* what a MoE layer's backward needs (ep.c's note): per bank in flight
     * (the model's act.bank, NULL outside a pipeline) and layer, or one set
     * for all LM_AC_FULL layers */
    int n_banks;
    const void **bank_key; /* [n_banks] */
    ep_layer **bank_sets;  /* [n_banks][L], made on first use */
    ep_layer *full;        /* the LM_AC_FULL layers' shared set; NULL: none */
    ep_scratch *s;     /* buffers used within one call */
    float *h_op;       /* [Rmax, Im] h of the LM_AC_OP layers, rebuilt before each backward */
    float *work;       /* experts kernel scratch for the largest receive */
    lm_moe_dispatch d;
} ep_layout;

int ep_init(ep_layout *p, lm_model *m, ct_comm *c, ct_err *e);
void ep_free(ep_layout *p);

#endif
